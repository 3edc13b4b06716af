"""Activation quantization fused into its producer: RMSNorm -> MX X, SiLU(gate)·up -> MX X.

A W8A8 projection rounds its input X to MXFP8 (1x32 blocks along K, RCEIL). In a Llama-family
block X is made by one of two producers: the RMSNorm before q/k/v and before gate/up, and
SiLU(gate)·up before down_proj. These kernels compute the producer and round its output in the
same pass, writing

* ``y``: the MX-rounded values in the producer's dtype (exact: an fp8 value times 2**e has at most
  four significant bits), which every GEMM path can take as W8A16 input, the same product as W8A8;
* ``q``, ``s``: the fp8 codes [M, K] and E8M0 scale bytes [M, K/32], which the fp8 tensor-core
  decode GEMM (``gemm_decode_ws``) reads instead of quantizing X again.

So the bf16 producer output is written once (already rounded), read once, and the separate
quantizer launch is gone. RCEIL only: it is idempotent (re-rounding y gives y), so any path that
does round X again computes the same function; FLOOR and EVEN can move a block one binade down
and clip on a second rounding, and those recipes keep the unfused path.

The producers compute what transformers' modules compute, step for step in the same dtypes:
RMSNorm (Llama, Mistral, Qwen2, Qwen3): ``w * (x.float() * rsqrt(mean(x²) + eps)).to(dtype)``;
SiLU·up: ``silu(gate) * up``, each op rounded to the input dtype. The reductions and the
exponential are Triton's, so a value can differ from torch's by an ulp before rounding (then,
rarely, by one fp8 step): tests bound that. References: ``reference.rmsnorm_mx_reference``,
``reference.silu_mul_mx_reference``.

``PDL``: the kernels let a programmatic-dependent-launch consumer (``gemm_decode_ws``) start and
stream its weights while they run (sm_90+, not in the interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mxq.formats import ElemFormat, ScaleRule
from mxq.kernels.common import (
    RULE_ID,
    SCALE_BIAS,
    SCALE_NAN,
    elem_bits,
    fp8_dtype,
    gdc_launch_dependents,
    hw_cvt,
    mx_round_codes,
    pdl_ok,
    pow2_f32,
)
from mxq.kernels.launch import call, cdiv, next_pow2

_RCEIL = tl.constexpr(RULE_ID[ScaleRule.RCEIL])


@triton.jit
def _store_mx(v, row64, cols, K, y_ptr, q_ptr, s_ptr, stride_y, stride_q, stride_s,
              BLOCK: tl.constexpr, BS: tl.constexpr, EMAX: tl.constexpr, MBITS: tl.constexpr,
              MAXN: tl.constexpr, EMIN: tl.constexpr, EBIAS: tl.constexpr, NAN_BYTE: tl.constexpr,
              HW_CVT: tl.constexpr, FP8: tl.constexpr):  # fmt: skip
    """Round v (fp32 [BLOCK], the producer's values, ``cols`` its columns) to MX in 1x32 blocks and
    store the rounded values, the fp8 codes and the scale bytes of its row."""
    NB: tl.constexpr = BLOCK // BS
    vf = tl.reshape(v, (1, NB, BS))
    r, e, nonfinite = mx_round_codes(vf, EMAX, MBITS, MAXN, EMIN, _RCEIL, HW_CVT, FP8)
    d = tl.where(nonfinite[:, :, None], float("nan"), r * pow2_f32(e)[:, :, None])
    qb = tl.where(nonfinite[:, :, None], NAN_BYTE, elem_bits(r, MBITS, EMIN, EBIAS)).to(tl.uint8)
    cmask = cols < K
    tl.store(y_ptr + row64 * stride_y + cols, tl.reshape(d, (BLOCK,)).to(y_ptr.dtype.element_ty), mask=cmask)
    tl.store(q_ptr + row64 * stride_q + cols, tl.reshape(qb, (BLOCK,)), mask=cmask)
    sb = tl.where(nonfinite, SCALE_NAN, e + SCALE_BIAS).to(tl.uint8)
    blks = (tl.program_id(1) * BLOCK) // BS + tl.arange(0, NB)
    tl.store(s_ptr + row64 * stride_s + blks, tl.reshape(sb, (NB,)), mask=blks < K // BS)


@triton.jit
def _start_row(PDL: tl.constexpr):
    """This program's row; first, with PDL, the consumer launched behind this kernel may start."""
    if PDL:
        gdc_launch_dependents()
    return tl.program_id(0).to(tl.int64)


@triton.jit
def _rmsnorm_mx_kernel(
    x_ptr, w_ptr, y_ptr, q_ptr, s_ptr,
    K, eps, stride_x, stride_y, stride_q, stride_s,
    BLOCK: tl.constexpr, BS: tl.constexpr, EMAX: tl.constexpr, MBITS: tl.constexpr, MAXN: tl.constexpr,
    EMIN: tl.constexpr, EBIAS: tl.constexpr, NAN_BYTE: tl.constexpr, HW_CVT: tl.constexpr, FP8: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    row64 = _start_row(PDL)
    cols = tl.arange(0, BLOCK)
    cmask = cols < K
    x = tl.load(x_ptr + row64 * stride_x + cols, mask=cmask, other=0.0)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / K
    h = (xf * (1.0 / tl.sqrt_rn(var + eps))).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    v = (w * h).to(x.dtype).to(tl.float32)
    _store_mx(v, row64, cols, K, y_ptr, q_ptr, s_ptr, stride_y, stride_q, stride_s,
              BLOCK, BS, EMAX, MBITS, MAXN, EMIN, EBIAS, NAN_BYTE, HW_CVT, FP8)  # fmt: skip


@triton.jit
def _silu_mul_mx_kernel(
    g_ptr, y_ptr, q_ptr, s_ptr,
    K, stride_g, stride_y, stride_q, stride_s,
    BLOCK: tl.constexpr, BS: tl.constexpr, EMAX: tl.constexpr, MBITS: tl.constexpr, MAXN: tl.constexpr,
    EMIN: tl.constexpr, EBIAS: tl.constexpr, NAN_BYTE: tl.constexpr, HW_CVT: tl.constexpr, FP8: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    row64 = _start_row(PDL)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cmask = cols < K
    g = tl.load(g_ptr + row64 * stride_g + cols, mask=cmask, other=0.0)
    u = tl.load(g_ptr + row64 * stride_g + K + cols, mask=cmask, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    v = (act * u.to(tl.float32)).to(g.dtype).to(tl.float32)
    _store_mx(v, row64, cols, K, y_ptr, q_ptr, s_ptr, stride_y, stride_q, stride_s,
              BLOCK, BS, EMAX, MBITS, MAXN, EMIN, EBIAS, NAN_BYTE, HW_CVT, FP8)  # fmt: skip


# Columns per program of the SiLU·up kernel (a multiple of every block size).
SILU_BLOCK = 1024
# Widest row the RMSNorm kernel takes in one program.
RMSNORM_MAX_K = 32768


def _consts(elem: ElemFormat, block_size: int, device: torch.device, block: int, pdl: bool) -> dict:
    return dict(
        BLOCK=block, BS=block_size, EMAX=elem.emax, MBITS=elem.mbits, MAXN=elem.max_normal, EMIN=1 - elem.bias,
        EBIAS=elem.bias, NAN_BYTE=elem.nan_byte, HW_CVT=hw_cvt(device), FP8=fp8_dtype(elem), PDL=pdl and pdl_ok(device),
    )  # fmt: skip


def _rows_and_outputs(x: torch.Tensor, width: int, k: int, elem: ElemFormat, block_size: int):
    """x as unit-stride rows [M, width], and the outputs: rounded values [..., K] (x's dtype), fp8
    codes [M, K] and scales [M, K/bs], fresh tensors, none a view (custom ops return them)."""
    x2 = x.reshape(-1, width)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty((*x.shape[:-1], k), dtype=x.dtype, device=x.device)
    q = torch.empty((m, k), dtype=elem.torch_dtype, device=x.device)
    s = torch.empty((m, k // block_size), dtype=torch.uint8, device=x.device)
    return x2, y, q, s


def _check(x: torch.Tensor, k: int, block_size: int, name: str) -> None:
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{name} takes bfloat16, float16 or float32 input, got {x.dtype}")
    if k % block_size:
        raise ValueError(f"{name} needs K divisible by the MX block {block_size}, got K={k}")


def rmsnorm_mx(x: torch.Tensor, weight: torch.Tensor, eps: float, elem: ElemFormat, block_size: int = 32,
               pdl: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """RMSNorm of x [..., K] with ``weight`` [K] (x's dtype), rounded to MX (RCEIL): (rounded values
    [..., K] in x's dtype, fp8 codes [M, K], scale bytes [M, K/bs]) with M = x.numel() / K."""
    k = x.shape[-1]
    _check(x, k, block_size, "rmsnorm_mx")
    if weight.dtype != x.dtype or weight.shape != (k,):
        raise ValueError(f"rmsnorm_mx needs a weight of shape ({k},) in {x.dtype}, got {tuple(weight.shape)} {weight.dtype}")
    if k > RMSNORM_MAX_K:
        raise ValueError(f"rmsnorm_mx takes rows of at most {RMSNORM_MAX_K} elements, got {k}")
    x2, y, q, s = _rows_and_outputs(x, k, k, elem, block_size)
    m = x2.shape[0]
    if m:
        block = max(next_pow2(k), block_size)
        call(_rmsnorm_mx_kernel, (m, 1),
             (x2, weight.contiguous(), y, q.view(torch.uint8), s, k, float(eps), k, k, k, k // block_size),
             _consts(elem, block_size, x.device, block, pdl), num_warps=min(16, max(4, block // 1024)))  # fmt: skip
    return y, q, s


def silu_mul_mx(gu: torch.Tensor, elem: ElemFormat, block_size: int = 32,
                pdl: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """SiLU(gate) · up of gu [..., 2I] (gate the first I columns, up the last I: a fused gate/up
    projection's output), rounded to MX (RCEIL): (rounded values [..., I] in gu's dtype, fp8 codes
    [M, I], scale bytes [M, I/bs])."""
    k2 = gu.shape[-1]
    if k2 % 2:
        raise ValueError(f"silu_mul_mx needs gate and up side by side (an even last axis), got {k2}")
    k = k2 // 2
    _check(gu, k, block_size, "silu_mul_mx")
    g2, y, q, s = _rows_and_outputs(gu, k2, k, elem, block_size)
    m = g2.shape[0]
    if m:
        block = min(SILU_BLOCK, max(next_pow2(k), block_size))
        call(_silu_mul_mx_kernel, (m, cdiv(k, block)),
             (g2, y, q.view(torch.uint8), s, k, g2.stride(0), k, k, k // block_size),
             _consts(elem, block_size, gu.device, block, pdl), num_warps=4)  # fmt: skip
    return y, q, s
