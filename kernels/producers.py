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
the decoder layer's residual add before it (``add_rmsnorm_mx``: ``residual + x`` rounded once to
the dtype, as torch adds, and written out as the new residual); SiLU·up: ``silu(gate) * up``, each
op rounded to the input dtype. The reductions and the
exponential are Triton's, so a value can differ from torch's by an ulp before rounding (then,
rarely, by one fp8 step): tests bound that. References: ``reference.rmsnorm_mx_reference``,
``reference.silu_mul_mx_reference``.

``PDL`` (programmatic dependent launch, sm_90+, not in the interpreter): the kernels let the
consumer launched behind them (``gemm_decode_ws``) start and stream its weights while they run, and
are themselves launched behind the kernel before them (a decode GEMM that lets them start early),
whose finish they wait for before reading anything: in a decode step GEMM, producer and GEMM
overlap their launches and first weight tiles.

Host cost: an eager decode step calls these three times per layer on one-row inputs, so each call's
launch is planned once per input signature (``ProducerPlan`` in ``PLANS``: argument checks,
constexprs, grid, output shapes); a repeat call allocates its outputs and hands the arguments to
the compiled kernel's C launcher (``launch.Launch.on_device``; through Triton where that is not
available: the interpreter, profiler hooks, ``MXQ_DEBUG=launch-check``).
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
    gdc_follow,
    mx_round_codes,
    mx_round_consts,
    pdl_launch,
    pdl_ok,
    pow2_f32,
)
from mxq.kernels.launch import Launch, PlanCache, cdiv, next_pow2

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
    """This program's row. With PDL, first: the consumer launched behind this kernel may start
    (it streams its weights, then waits for this kernel), then wait for the kernel this one was
    launched behind (it wrote x) to finish."""
    if PDL:
        gdc_follow()
    return tl.program_id(0).to(tl.int64)


@triton.jit
def _rmsnorm_mx_kernel(
    x_ptr, r_ptr, h_ptr, w_ptr, y_ptr, q_ptr, s_ptr,
    K, eps, stride_y, stride_q, stride_s,
    BLOCK: tl.constexpr, BS: tl.constexpr, EMAX: tl.constexpr, MBITS: tl.constexpr, MAXN: tl.constexpr,
    EMIN: tl.constexpr, EBIAS: tl.constexpr, NAN_BYTE: tl.constexpr, HW_CVT: tl.constexpr, FP8: tl.constexpr,
    PDL: tl.constexpr, ADD: tl.constexpr,
):  # fmt: skip
    """RMSNorm of a row (rows of K, unit stride, ``stride_y`` apart), MX-rounded; with ``ADD`` the
    row is ``r + x`` first (rounded to x's dtype, as torch adds two tensors of it), stored to h."""
    row64 = _start_row(PDL)
    cols = tl.arange(0, BLOCK)
    cmask = cols < K
    x = tl.load(x_ptr + row64 * stride_y + cols, mask=cmask, other=0.0)
    if ADD:
        r = tl.load(r_ptr + row64 * stride_y + cols, mask=cmask, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(x.dtype)
        tl.store(h_ptr + row64 * stride_y + cols, x, mask=cmask)
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
        BLOCK=block, BS=block_size, **mx_round_consts(elem, None, device),
        EBIAS=elem.bias, NAN_BYTE=elem.nan_byte, PDL=pdl and pdl_ok(device),
    )  # fmt: skip


def _check(x: torch.Tensor, k: int, block_size: int, name: str) -> None:
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{name} takes bfloat16, float16 or float32 input, got {x.dtype}")
    if k % block_size:
        raise ValueError(f"{name} needs K divisible by the MX block {block_size}, got K={k}")


def _rows(x: torch.Tensor, width: int) -> torch.Tensor:
    """x as contiguous rows [M, width] (a view where it already is)."""
    x2 = x.reshape(-1, width)
    return x2 if x2.is_contiguous() else x2.contiguous()


class ProducerPlan:
    """One producer kernel's launches for one input signature (kind, shape, dtype, 16-byte
    alignment, device, format, options), decided once: grid, constant arguments, output shapes and
    the ``launch.Launch`` whose compiled kernel's C launcher later calls take directly. A call
    allocates the outputs and launches once; the host work of argument checks, constexprs and the
    launch-site key is done when the plan is made (``PLANS``)."""

    __slots__ = ("go", "grid", "m", "k", "out_shape", "q_dtype", "nblk", "device", "dev_index", "add")

    def __init__(self, fn, grid, consts: dict, options: dict, m: int, k: int, out_shape, elem: ElemFormat,
                 block_size: int, device: torch.device, add: bool):  # fmt: skip
        # with PDL the kernel is itself launched behind its predecessor (a decode GEMM lets it start
        # early) and waits for it before reading anything (``_start_row``)
        self.go = Launch(fn, consts, dict(options, **pdl_launch(consts)))
        self.grid, self.m, self.k, self.out_shape, self.add = grid, m, k, out_shape, add
        self.q_dtype, self.nblk = elem.torch_dtype, k // block_size
        self.device, self.dev_index = device, device.index if device.type == "cuda" else -1

    def __call__(self, x2: torch.Tensor, w: torch.Tensor | None, r2: torch.Tensor | None, tail: tuple):
        """(rounded values, codes, scales[, the sum]) for rows ``x2`` (``r2``: residual rows, ``w``:
        the norm's weight; ``tail``: the kernel's arguments after the pointers)."""
        dev, m, k = self.device, self.m, self.k
        y = torch.empty(self.out_shape, dtype=x2.dtype, device=dev)
        q = torch.empty((m, k), dtype=torch.uint8, device=dev)
        s = torch.empty((m, self.nblk), dtype=torch.uint8, device=dev)
        h = torch.empty(self.out_shape, dtype=x2.dtype, device=dev) if self.add else None
        if m:
            args = (x2, y, q, s) if w is None else (x2, x2 if r2 is None else r2, y if h is None else h, w, y, q, s)
            self.go.on_device(self.grid, self.dev_index, *args, *tail)
        q = q.view(self.q_dtype)
        return (y, q, s) if h is None else (h, y, q, s)


PLANS = PlanCache()


def _norm_plan(key, x2, weight, eps, elem, block_size, pdl, add, out_shape) -> ProducerPlan:
    name = "add_rmsnorm_mx" if add else "rmsnorm_mx"
    k = x2.shape[1]
    _check(x2, k, block_size, name)
    if weight.dtype != x2.dtype or weight.shape != (k,):
        raise ValueError(f"{name} needs a weight of shape ({k},) in {x2.dtype}, got {tuple(weight.shape)} {weight.dtype}")
    if k > RMSNORM_MAX_K:
        raise ValueError(f"{name} takes rows of at most {RMSNORM_MAX_K} elements, got {k}")
    block = max(next_pow2(k), block_size)
    consts = _consts(elem, block_size, x2.device, block, pdl)
    consts["ADD"] = add
    plan = ProducerPlan(_rmsnorm_mx_kernel, (x2.shape[0], 1), consts, dict(num_warps=min(16, max(4, block // 1024))),
                        x2.shape[0], k, out_shape, elem, block_size, x2.device, add)  # fmt: skip
    return PLANS.put(key, plan)


def rmsnorm_mx(x: torch.Tensor, weight: torch.Tensor, eps: float, elem: ElemFormat, block_size: int = 32,
               pdl: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """RMSNorm of x [..., K] with ``weight`` [K] (x's dtype), rounded to MX (RCEIL): (rounded values
    [..., K] in x's dtype, fp8 codes [M, K], scale bytes [M, K/bs]) with M = x.numel() / K."""
    k = x.shape[-1]
    x2 = _rows(x, k)
    key = (0, x.shape, x.dtype, x2.data_ptr() & 15, x.device, weight.dtype, weight.shape, weight.data_ptr() & 15,
           elem, block_size, pdl)  # fmt: skip
    plan = PLANS.get(key) or _norm_plan(key, x2, weight, eps, elem, block_size, pdl, False, x.shape)
    return plan(x2, weight if weight.is_contiguous() else weight.contiguous(), None, (k, float(eps), k, k, k // block_size))


def add_rmsnorm_mx(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, elem: ElemFormat,
                   block_size: int = 32, pdl: bool = True):  # fmt: skip
    """A decoder layer's residual add and the RMSNorm after it in one pass: h = residual + x (x's
    dtype, as torch adds them), then ``rmsnorm_mx(h, ...)``. Returns (h, rounded values, codes,
    scales)."""
    k = x.shape[-1]
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"add_rmsnorm_mx needs a residual like x {tuple(x.shape)} {x.dtype}, "
                         f"got {tuple(residual.shape)} {residual.dtype}")  # fmt: skip
    x2, r2 = _rows(x, k), _rows(residual, k)
    key = (1, x.shape, x.dtype, x2.data_ptr() & 15, r2.data_ptr() & 15, x.device, weight.dtype, weight.shape,
           weight.data_ptr() & 15, elem, block_size, pdl)  # fmt: skip
    plan = PLANS.get(key) or _norm_plan(key, x2, weight, eps, elem, block_size, pdl, True, x.shape)
    return plan(x2, weight if weight.is_contiguous() else weight.contiguous(), r2, (k, float(eps), k, k, k // block_size))


def _silu_plan(key, g2, k, elem, block_size, pdl, out_shape) -> ProducerPlan:
    _check(g2, k, block_size, "silu_mul_mx")
    block = min(SILU_BLOCK, max(next_pow2(k), block_size))
    plan = ProducerPlan(_silu_mul_mx_kernel, (g2.shape[0], cdiv(k, block)), _consts(elem, block_size, g2.device, block, pdl),
                        dict(num_warps=4), g2.shape[0], k, out_shape, elem, block_size, g2.device, False)  # fmt: skip
    return PLANS.put(key, plan)


def silu_mul_mx(gu: torch.Tensor, elem: ElemFormat, block_size: int = 32,
                pdl: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """SiLU(gate) · up of gu [..., 2I] (gate the first I columns, up the last I: a fused gate/up
    projection's output), rounded to MX (RCEIL): (rounded values [..., I] in gu's dtype, fp8 codes
    [M, I], scale bytes [M, I/bs])."""
    k2 = gu.shape[-1]
    if k2 % 2:
        raise ValueError(f"silu_mul_mx needs gate and up side by side (an even last axis), got {k2}")
    k = k2 // 2
    g2 = _rows(gu, k2)
    key = (2, gu.shape, gu.dtype, g2.data_ptr() & 15, gu.device, elem, block_size, pdl)
    plan = PLANS.get(key) or _silu_plan(key, g2, k, elem, block_size, pdl, (*gu.shape[:-1], k))
    return plan(g2, None, None, (k, k2, k, k, k // block_size))
