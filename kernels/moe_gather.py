"""The token gather of the MoE layers: ``x[index]`` in sorted order, MX-rounded along K for W8A8,
in one pass (``gather_mx_rows``; its kernel is the fused block's prefill gather too).

The rounding costs nothing over the copy: each program loads a tile of whole 32-blocks of the rows
it moves and rounds them in registers (kernels/NOTES.md, "MoE: the grouped GEMM").
"""

from __future__ import annotations

import torch

from mxq.formats import ElemFormat, ScaleRule, as_elem_format, as_scale_rule
from mxq.kernels import reference
from mxq.kernels.launch import on_input_device

try:
    import triton
    import triton.language as tl

    from mxq.kernels.common import (
        INTERPRET,
        gdc_launch_dependents,
        mx_round_consts,
        mx_round_dequant,
    )
    from mxq.kernels.launch import call, cdiv, next_pow2
    from mxq.kernels.quantize import fake_quantize_mx_rows

    HAS_TRITON = True
    jit = triton.jit
except ImportError:  # no triton wheel: the torch gather runs everywhere
    HAS_TRITON = INTERPRET = False

    def jit(fn):
        return fn


@jit
def gather_rows_kernel(
    x_ptr, idx_ptr, y_ptr, R, K, stride_xm, stride_ym,
    BR: tl.constexpr, BK: tl.constexpr, BS: tl.constexpr, QUANT: tl.constexpr,
    EMAX: tl.constexpr, MBITS: tl.constexpr, MAXN: tl.constexpr, EMIN: tl.constexpr,
    RULE: tl.constexpr, HW_CVT: tl.constexpr, FP8: tl.constexpr, IDX: tl.constexpr = True, PDL: tl.constexpr = False,
):  # fmt: skip
    """y[r] = x[idx[r]] (``IDX`` False: x[r]), MX-rounded for ``QUANT``. ``PDL``: a kernel launched
    behind this one by programmatic dependent launch may start now (it waits for these rows)."""
    if PDL:
        gdc_launch_dependents()
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BK + tl.arange(0, BK)
    rmask = rows < R
    if IDX:
        src = tl.load(idx_ptr + rows, mask=rmask, other=0).to(tl.int64)
    else:
        src = rows.to(tl.int64)
    m2 = rmask[:, None] & (cols < K)[None, :]
    v = tl.load(x_ptr + src[:, None] * stride_xm + cols[None, :], mask=m2, other=0.0)
    if QUANT:  # a partial last block is padded with zeros, as mxq.formats pads it
        v = tl.reshape(mx_round_dequant(tl.reshape(v.to(tl.float32), (BR, BK // BS, BS)), EMAX, MBITS, MAXN, EMIN,
                                        RULE, HW_CVT, FP8), (BR, BK))  # fmt: skip
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :], v.to(y_ptr.dtype.element_ty), mask=m2)


@on_input_device
def gather_mx_rows(
    x: torch.Tensor,
    index: torch.Tensor,
    act_elem: ElemFormat | str | None = None,
    act_rule: ScaleRule | str = ScaleRule.RCEIL,
    block_size: int = 32,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x[index]`` (rows of X [T, K] in sorted order), MX-rounded along K when ``act_elem`` is set
    (the values, in ``out_dtype``, default x.dtype; bf16 holds them exactly), in one pass. Feed the
    result to ``mx_grouped_linear`` as W8A16 (act_elem None): the same product as W8A8 on x[index]."""
    if x.dim() != 2 or index.dim() != 1 or index.dtype.is_floating_point:
        raise ValueError(f"gather_mx_rows: x must be [T, K] and index an integer [R], got {list(x.shape)} and {index.dtype}{list(index.shape)}")
    out_dtype = out_dtype or x.dtype
    if act_elem is not None:
        act_elem, act_rule = as_elem_format(act_elem), as_scale_rule(act_rule)
    triton_here = HAS_TRITON and (x.device.type == "cuda" or INTERPRET)
    if not triton_here or (act_elem is not None and act_rule is ScaleRule.MSE):
        v = x[index]
        if act_elem is None:
            return v.to(out_dtype)
        quantize = fake_quantize_mx_rows if triton_here else reference.fake_quantize_mx_rows
        return quantize(v, act_elem, act_rule, block_size, out_dtype=out_dtype)
    r, k = index.shape[0], x.shape[1]
    x = x if x.stride(1) == 1 else x.contiguous()
    y = torch.empty((r, k), dtype=out_dtype, device=x.device)
    if r and k:
        bk = max(block_size, min(512, next_pow2(k)))
        call(
            gather_rows_kernel, (cdiv(r, 8), cdiv(k, bk)),
            (x, index.contiguous(), y, r, k, x.stride(0), y.stride(0)),
            dict(BR=8, BK=bk, BS=block_size, QUANT=act_elem is not None, **mx_round_consts(act_elem, act_rule, x.device)),
            num_warps=4,
        )  # fmt: skip
    return y
