"""What every kernel module shares: device facts and the MX decode steps, each written once.

- ``INTERPRET``: the Triton CPU interpreter runs the kernels (tests); it computes bf16 dots
  wrongly and runs no PTX, so kernels take the dot dtype as a constexpr and use fp32 there.
- ``capability(device)``, ``sm_count(device)``: cached per device index (no sync after the first call).
- ``e8m0_to_f32`` (Triton) and ``gl_e8m0_to_f32`` (Gluon): biased E8M0 bytes -> fp32
  2**(byte - 127), byte 0 -> 2**-127, byte 255 -> NaN, as ``mxq.formats`` decodes them.
- ``gl_gdc_wait`` (Gluon): wait for the kernel launched ahead under programmatic dependent launch.
- ``fp8_bits_asm``: PTX that moves two fp8 codes into two bf16 bit patterns (no conversion
  instruction); the caller multiplies by the power of two that the move leaves out.
- ``TL_DTYPE``: torch float dtypes -> Triton's.
- the GEMM host side every MX GEMM shares: ``check_gemm_args``, ``operands_and_output``,
  ``tma_or_pointer`` and split-K (``split_k_sizes``, ``split_k_plan``, ``split_k_finish``: fp32
  partials [splits, M, N] summed, with the bias and the cast, by one reduction launch).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from mxq.kernels import gluon_api, toolchain
from mxq.kernels.launch import cdiv

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # older triton: pointer loads only
    TensorDescriptor = None

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
if not INTERPRET:
    toolchain.prefer_fixed_ptxas()  # a ptxas >= 13.3 where installed (kernels/toolchain.py)
TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}

_CAPABILITY: dict[int, tuple[int, int]] = {}
_SM_COUNT: dict[int, int] = {}


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def capability(device: torch.device) -> tuple[int, int]:
    """CUDA compute capability of ``device``; (0, 0) for a non-CUDA device."""
    if device.type != "cuda":
        return (0, 0)
    idx = _index(device)
    if idx not in _CAPABILITY:
        _CAPABILITY[idx] = torch.cuda.get_device_capability(idx)
    return _CAPABILITY[idx]


def sm_count(device: torch.device) -> int:
    idx = _index(device)
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


@triton.jit
def e8m0_to_f32(s):
    """Biased E8M0 bytes (any integer type) -> fp32 2**(s-127); 0 -> 2**-127, 255 -> NaN."""
    si = s.to(tl.int32)
    f = (si << 23).to(tl.float32, bitcast=True)
    f = tl.where(si == 0, 5.877471754111438e-39, f)  # 2**-127, an fp32 subnormal
    return tl.where(si == 255, float("nan"), f)


def fp8_bits_asm(shift: int, mask: int) -> str:
    """PTX: two fp8 codes (bits 0-15 of $1, element 0 in the low byte) -> two bf16 patterns in $0.
    Each byte moves to the top of its 16-bit half (PRMT), the sign stays, the other 7 bits shift
    right by ``shift`` into bf16's exponent and mantissa fields (``mask``). E4M3: shift 4, mask
    0x07F007F0, a bf16 worth the fp8 value times 2**-120; E5M2: 3, 0x0FE00FE0, times 2**-112."""
    return f"""{{
    .reg .b32 t, u;
    prmt.b32 t, $1, 0, 0x1404;
    shr.b32 u, t, {shift};
    and.b32 u, u, {mask:#010x};
    and.b32 t, t, 0x80008000;
    or.b32 $0, t, u;
    }}"""



def check_gemm_args(x, weight, weight_scale, bias, block_size):
    """(M, K) of an MX GEMM call Y = X·dequant(W)ᵀ; a ValueError/TypeError naming what is wrong."""
    if x.dim() != 2:
        raise ValueError(f"mx_gemm takes X as [M, K], got shape {tuple(x.shape)}")
    if x.dtype not in TL_DTYPE:
        raise TypeError(f"X must be bfloat16, float16 or float32, got {x.dtype}")
    if weight.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"MX weight must be float8_e4m3fn or float8_e5m2, got {weight.dtype}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight must be [N, K={x.shape[1]}], got {tuple(weight.shape)}")
    m, k = x.shape
    n = weight.shape[0]
    if k % block_size:
        raise ValueError(f"K={k} must be a multiple of block_size={block_size}")
    if weight_scale.dtype != torch.uint8 or tuple(weight_scale.shape) != (n, k // block_size):
        raise ValueError(
            f"weight_scale must be uint8 [{n}, {k // block_size}], got {weight_scale.dtype} {tuple(weight_scale.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    return m, k


def operands_and_output(x, weight, weight_scale, bias, out_dtype, n):
    """Unit-stride operands and the [M, N] output; ``done`` when M, N or K is 0 (the output is
    then final: empty, or the bias / zeros)."""
    x, weight, weight_scale = (t if t.stride(1) == 1 else t.contiguous() for t in (x, weight, weight_scale))
    m, k = x.shape
    y = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m and n and not k:
        y.zero_() if bias is None else y.copy_(bias.to(y.dtype).expand(m, n))
    return x, weight, weight_scale, y, not (m and n and k)


@triton.jit
def _splitk_reduce_kernel(
    p_ptr, b_ptr, y_ptr, MN, N,
    SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in tl.static_range(SPLIT_K):
        acc += tl.load(p_ptr + i * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def split_k_sizes(k: int, split_k: int, block_k: int) -> tuple[int, int, bool]:
    """(splits, K per split (a multiple of block_k), whether no K tile is partial) for at most
    ``split_k`` splits of K."""
    split = max(1, min(split_k, cdiv(k, block_k)))
    k_split = cdiv(cdiv(k, split), block_k) * block_k
    return cdiv(k, k_split), k_split, k % block_k == 0 and k_split % block_k == 0


def split_k_plan(y: torch.Tensor, k: int, split_k: int, block_k: int):
    """``split_k_sizes`` and where the kernel writes: y itself, or float32 partials
    [splits, M, N] for ``split_k_finish``."""
    split, k_split, even_k = split_k_sizes(k, split_k, block_k)
    target = y if split == 1 else torch.empty((split, *y.shape), dtype=torch.float32, device=y.device)
    return split, k_split, even_k, target


def tma_or_pointer(t: torch.Tensor, block: list[int], wanted: bool):
    """(used, kernel argument): a host TMA descriptor of ``t`` where asked for and possible
    (16-byte aligned base and row stride, not the interpreter), else ``t`` for pointer loads."""
    ok = (
        wanted and TensorDescriptor is not None and not INTERPRET
        and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
    )  # fmt: skip
    return ok, (TensorDescriptor.from_tensor(t, block) if ok else t)


def split_k_finish(target: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None, split: int) -> torch.Tensor:
    """Sum the split-K partials (+ bias) into y; nothing to do without a split."""
    if split > 1:
        block, mn = 1024, y.numel()
        _splitk_reduce_kernel[(triton.cdiv(mn, block),)](
            target, bias if bias is not None else target, y, mn, y.shape[1],
            SPLIT_K=split, BLOCK=block, HAS_BIAS=bias is not None, num_warps=4,
        )  # fmt: skip
    return y


if gluon_api.PROBLEM is None:
    from mxq.kernels.gluon_api import gl, gluon

    @gluon.jit
    def gl_e8m0_to_f32(si):
        """``e8m0_to_f32`` for Gluon tensors of int32 bytes (0..255)."""
        f = (si << 23).to(gl.float32, bitcast=True)
        f = gl.where(si == 0, 5.877471754111438e-39, f)  # 2**-127, an fp32 subnormal
        return gl.where(si == 255, float("nan"), f)

    @gluon.jit
    def gl_gdc_wait():
        """Wait for the kernel this one was launched behind (programmatic dependent launch, e.g.
        the X quantizer) to finish and its writes to be visible; a no-op without PDL."""
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
