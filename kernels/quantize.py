"""Activation quantization: rows of X [M, K] -> MXFP8 with 1x32 blocks along K.

One program quantizes a [BLOCK_M, BLOCK_K] tile: it loads the tile once, takes each 32-element
block's amax, derives the E8M0 exponent with integer arithmetic on the amax's fp32 bits (so
every scale rule is exact, no log2), and writes any of: the fp8 elements, the scale bytes,
and the MX-rounded values (fp8 value x 2**e) in a wide dtype. The last output is what the
Hopper GEMM feeds its right operand: for an MX value the product fp8 x 2**e has at most four
significant bits, so bf16 holds it exactly unless the block sits at the very bottom of the
fp32 range (amax under about 2**-120).

Bit-identical to ``mxq.formats.quantize_mx(x, -1, elem, block_size, rule)`` (reference at the
end of the file). The one caveat is ScaleRule.MSE: the per-candidate squared error is a
float64 sum of 32 exact terms whose order differs from torch's, so two candidates whose
errors agree to ~1e-16 relative may tie-break differently.

Memory bound: 2 (bf16 in) + 1 + 1/32 (MX out) bytes per element, or 2 + 2 with the bf16
MX-rounded output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mxq.formats import ElemFormat, ScaleRule, as_elem_format, as_scale_rule
from mxq.kernels.common import (
    SCALE_BIAS,
    SCALE_NAN,
    elem_bits,
    gdc_follow,
    mx_fast_exponent,
    mx_round_consts,
    mx_scaled,
    pdl_launch,
    pdl_ok,
    pow2_f32,
    round_to_elem,
)
from mxq.kernels.launch import Launch, call, cdiv, on_input_device


@triton.jit
def _mx_block_quantize(
    xf,  # fp32 [BM, NB, BS]
    EMAX: tl.constexpr,
    MBITS: tl.constexpr,
    MAXN: tl.constexpr,
    EMIN: tl.constexpr,
    RULE: tl.constexpr,
):
    """Returns (elements as exact fp32 values [BM, NB, BS], exponent int32 [BM, NB], non-finite mask [BM, NB])."""
    ax = tl.abs(xf)
    finite = ax < float("inf")  # False for NaN and +-Inf
    nonfinite = tl.max(tl.where(finite, 0, 1), axis=2) > 0
    clean = tl.where(finite, xf, 0.0)
    amax = tl.max(tl.where(finite, ax, 0.0), axis=2)
    bits = amax.to(tl.int32, bitcast=True)
    # floor(log2 amax) for normal amax. Subnormal amax reads as -127, which every rule then
    # pushes below -126, where the clamp lands it anyway (as the exact floor would).
    f = (bits >> 23) - 127
    mant = bits & 0x7FFFFF
    if RULE == 0:  # FLOOR
        e = f - EMAX
    elif RULE == 2:  # EVEN: mantissa rounded half-up to MBITS carries into the next binade
        e = f - EMAX + (mant >= (0x800000 - (1 << (22 - MBITS)))).to(tl.int32)
    else:  # RCEIL (and MSE's first candidate): the block max fits unless mantissa > 1.75
        e = f - EMAX + (mant > 0x600000).to(tl.int32)
    e = tl.where(amax > 0, e, -126)
    e = tl.minimum(tl.maximum(e, -126), 127)
    if RULE == 3:  # MSE: RCEIL, RCEIL-1, RCEIL-2; strict improvement wins, RCEIL first
        c64 = clean.to(tl.float64)
        q = round_to_elem(clean, e, MAXN, MBITS, EMIN) * pow2_f32(e)[:, :, None]
        best_err = tl.sum((q.to(tl.float64) - c64) * (q.to(tl.float64) - c64), axis=2)
        best_e = e
        for off in tl.static_range(1, 3):
            ec = tl.maximum(e - off, -126)
            q = round_to_elem(clean, ec, MAXN, MBITS, EMIN) * pow2_f32(ec)[:, :, None]
            err = tl.sum((q.to(tl.float64) - c64) * (q.to(tl.float64) - c64), axis=2)
            better = err < best_err
            best_e = tl.where(better, ec, best_e)
            best_err = tl.where(better, err, best_err)
        e = best_e
    return round_to_elem(clean, e, MAXN, MBITS, EMIN), e, nonfinite


@triton.jit
def quantize_rows_kernel(
    x_ptr, q_ptr, s_ptr, d_ptr,
    M, K, KP, NBLK,
    stride_xm, stride_qm, stride_sm, stride_dm,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BS: tl.constexpr,
    EMAX: tl.constexpr, MBITS: tl.constexpr, MAXN: tl.constexpr, NAN_BYTE: tl.constexpr,
    EMIN: tl.constexpr, EBIAS: tl.constexpr, RULE: tl.constexpr,
    WRITE_Q: tl.constexpr, WRITE_D: tl.constexpr,
    HW_CVT: tl.constexpr = False, FP8: tl.constexpr = tl.float8e4nv, PDL: tl.constexpr = False,
):  # fmt: skip
    NB: tl.constexpr = BLOCK_K // BS
    if PDL:
        # A kernel launched after this one with programmatic dependent launch (gemm_decode_ws) may
        # start now: it streams its weights and waits before reading X. This one is launched the
        # same way behind the kernel that wrote X, and waits for it.
        gdc_follow()
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    rmask = rows < M
    rows64 = rows.to(tl.int64)
    x = tl.load(
        x_ptr + rows64[:, None] * stride_xm + cols[None, :],
        mask=rmask[:, None] & (cols < K)[None, :],
        other=0.0,
    )
    xf = tl.reshape(x.to(tl.float32), (BLOCK_M, NB, BS))
    if RULE == 3:
        q, e, nonfinite = _mx_block_quantize(xf, EMAX, MBITS, MAXN, EMIN, RULE)
    else:
        # Fast path: integer amax, and on the GPU the hardware fp8 conversion does the
        # rounding (a handful of instructions per element instead of ~40: the bit-level
        # route made this kernel ALU bound at half the copy bandwidth).
        e, nonfinite = mx_fast_exponent(xf, EMAX, MBITS, RULE)
        if HW_CVT:
            s8 = mx_scaled(xf, e, MAXN, RULE).to(FP8, fp_downcast_rounding="rtne")
            q = s8.to(tl.float32)
        else:
            q = round_to_elem(xf, e, MAXN, MBITS, EMIN)
    if WRITE_Q:
        if HW_CVT and RULE != 3:
            qb = s8.to(tl.uint8, bitcast=True)
        else:
            qb = elem_bits(q, MBITS, EMIN, EBIAS).to(tl.uint8)
        qb = tl.where(nonfinite[:, :, None], NAN_BYTE, qb).to(tl.uint8)
        qb = tl.reshape(qb, (BLOCK_M, BLOCK_K))
        tl.store(
            q_ptr + rows64[:, None] * stride_qm + cols[None, :],
            qb,
            mask=rmask[:, None] & (cols < KP)[None, :],
        )
        blks = pid_k * NB + tl.arange(0, NB)
        sb = tl.where(nonfinite, SCALE_NAN, e + SCALE_BIAS).to(tl.uint8)
        tl.store(
            s_ptr + rows64[:, None] * stride_sm + blks[None, :],
            sb,
            mask=rmask[:, None] & (blks < NBLK)[None, :],
        )
    if WRITE_D:
        d = q * pow2_f32(e)[:, :, None]
        d = tl.where(nonfinite[:, :, None], float("nan"), d)
        d = tl.reshape(d, (BLOCK_M, BLOCK_K))
        tl.store(
            d_ptr + rows64[:, None] * stride_dm + cols[None, :],
            d.to(d_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
            mask=rmask[:, None] & (cols < K)[None, :],
        )


def quantize_tile(rule: ScaleRule, block_size: int, tile=None) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_K, warps) of ``quantize_rows_kernel``; defaults from the tile sweep (kernels/NOTES.md,
    "Activation quantizer")."""
    if block_size & (block_size - 1) or not 16 <= block_size <= 128:
        raise ValueError(f"block_size must be a power of two in [16, 128], got {block_size}")
    block_m, block_k, warps = tile or ((8, 128, 4) if rule is ScaleRule.MSE else (8, 512, 4))
    return block_m, max(block_k, block_size), warps


def quantize_grid(m: int, k: int, rule: ScaleRule, block_size: int, tile=None) -> tuple[int, int]:
    block_m, block_k, _ = quantize_tile(rule, block_size, tile)
    return cdiv(m, block_m), cdiv(cdiv(k, block_size) * block_size, block_k)


def _quantize_consts(elem: ElemFormat, rule: ScaleRule, block_size: int, write_q: bool, write_d: bool, pdl: bool,
                     device: torch.device, tile=None) -> tuple[dict, int]:  # fmt: skip
    """``quantize_rows_kernel``'s constexprs for these options, and its warp count."""
    block_m, block_k, warps = quantize_tile(rule, block_size, tile)
    consts = dict(
        BLOCK_M=block_m, BLOCK_K=block_k, BS=block_size,
        **mx_round_consts(elem, rule, device), NAN_BYTE=elem.nan_byte, EBIAS=elem.bias,
        WRITE_Q=write_q, WRITE_D=write_d, PDL=pdl and pdl_ok(device),
    )  # fmt: skip
    return consts, warps


def quantize_launch(
    elem: ElemFormat, rule: ScaleRule, block_size: int, *, write_q: bool, write_d: bool, pdl: bool,
    device: torch.device, tile=None,
) -> Launch:  # fmt: skip
    """``quantize_rows_kernel``'s launch for one plan (``gemm_decode_ws``). Runtime arguments:
    x, q, s, d, M, K, KP (K padded to blocks), NBLK, and the row strides of x, q, s, d."""
    consts, warps = _quantize_consts(elem, rule, block_size, write_q, write_d, pdl, device, tile)
    return Launch(quantize_rows_kernel, consts, dict(num_warps=warps, **pdl_launch(consts)))


def _launch(x2, elem: ElemFormat, rule: ScaleRule, block_size: int, q, s, d, tile=None, pdl=False):
    m, k = x2.shape
    nblk = cdiv(k, block_size)
    consts, warps = _quantize_consts(elem, rule, block_size, q is not None, d is not None, pdl, x2.device, tile)
    dummy = x2
    call(
        quantize_rows_kernel, quantize_grid(m, k, rule, block_size, tile),
        (x2, q if q is not None else dummy, s if s is not None else dummy, d if d is not None else dummy,
         m, k, nblk * block_size, nblk,
         x2.stride(0), q.stride(0) if q is not None else 0, s.stride(0) if s is not None else 0,
         d.stride(0) if d is not None else 0),
        consts, num_warps=warps, **pdl_launch(consts),
    )  # fmt: skip


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{name} takes bfloat16, float16 or float32 input, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"{name} needs a non-empty last axis, got shape {tuple(x.shape)}")
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2


@on_input_device
def quantize_mx_rows(
    x: torch.Tensor,
    elem: ElemFormat | str,
    rule: ScaleRule | str = ScaleRule.RCEIL,
    block_size: int = 32,
    *,
    tile: tuple[int, int, int] | None = None,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """X [..., K] -> (fp8 data [..., Kp], uint8 E8M0 scales [..., ceil(K/bs)]), blocks along K.

    Kp is K padded to whole blocks (the padding quantizes zeros). Same bytes as
    ``mxq.formats.quantize_mx(x, -1, elem, block_size, rule)``. ``pdl``: let a kernel launched
    next with programmatic dependent launch start while this one runs (sm_90+; ignored elsewhere).
    """
    elem, rule = as_elem_format(elem), as_scale_rule(rule)
    x2 = _rows(x, "quantize_mx_rows")
    m, k = x2.shape
    nblk = cdiv(k, block_size)
    kp = nblk * block_size
    buf = torch.empty(m * kp + m * nblk, dtype=torch.uint8, device=x.device)  # one allocation: data, then scales
    q, s = buf[: m * kp].view(m, kp), buf[m * kp :].view(m, nblk)
    if m:
        _launch(x2, elem, rule, block_size, q, s, None, tile, pdl=pdl)
    if x.dim() == 2:
        return q.view(elem.torch_dtype), s
    lead = tuple(x.shape[:-1])
    return q.view(elem.torch_dtype).reshape(*lead, -1), s.reshape(*lead, nblk)


@on_input_device
def fake_quantize_mx_rows(
    x: torch.Tensor,
    elem: ElemFormat | str,
    rule: ScaleRule | str = ScaleRule.RCEIL,
    block_size: int = 32,
    out_dtype: torch.dtype | None = None,
    *,
    tile: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """The MX-rounded values of X [..., K] (blocks along K) in ``out_dtype`` (default x.dtype).

    Same values as ``mxq.formats.fake_quantize_mx(x, -1, ...)`` cast to ``out_dtype``.
    """
    elem, rule = as_elem_format(elem), as_scale_rule(rule)
    x2 = _rows(x, "fake_quantize_mx_rows")
    out_dtype = out_dtype or x.dtype
    d = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    if x2.shape[0]:
        _launch(x2, elem, rule, block_size, None, None, d, tile)
    return d.reshape(x.shape)


# Reference: mxq.kernels.reference.quantize_mx_rows / fake_quantize_mx_rows (the format core).
