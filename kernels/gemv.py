"""Decode GEMM on CUDA cores: Y = X·dequant(W)ᵀ (+ bias) for M <= ``GEMV_MAX_M`` rows of X.

A weight stream with no MMA and no operand layouts: each program streams [BLOCK_N, BLOCK_K] fp8
weight tiles, converts them to fp32 with their E8M0 block scales applied, and does one fp32 FMA
per weight and activation row (fp8 · 2**e times a bf16/fp16 value is exact in fp32). W8A8
rounds X to MX inside the kernel (one launch). K is split until the grid covers the SMs; the
fp32 partials are summed in split order by a reduction launch, or (``GemvConfig.fused``) by the
last split of each N tile (``split_k_epilogue``): both deterministic. On Hopper it is a link of
the decode chain: launched behind its predecessor, it lets the next kernel launch at once
(programmatic dependent launch), and so does its reduction. Any float X dtype; the function every path must compute
is ``mxq.kernels.reference.mx_linear_reference``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mxq.formats import ElemFormat, ScaleRule
from mxq.kernels.buffers import split_counters
from mxq.kernels.common import (
    INTERPRET,
    check_gemm_args,
    e8m0_to_f32,
    gdc_follow,
    mx_round_consts,
    mx_round_dequant,
    operands_and_output,
    pdl_launch,
    pdl_ok,
    sm_count,
    tma_or_pointer,
)
from mxq.kernels.launch import call, cdiv, next_pow2, on_input_device
from mxq.kernels.splitk import split_k_epilogue, split_k_finish, split_k_plan


@triton.jit
def _mx_gemv_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr,
    M, N, K, K_SPLIT,
    stride_xm, stride_wn, stride_sn, stride_ym,
    M_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BS: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, FUSED: tl.constexpr, EVEN_K: tl.constexpr,
    TMA_W: tl.constexpr, QUANT: tl.constexpr,
    EMAX: tl.constexpr, MBITS: tl.constexpr, MAXN: tl.constexpr, EMIN: tl.constexpr,
    RULE: tl.constexpr, HW_CVT: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Decode (M <= 16) on CUDA cores: a weight stream with no MMA and no operand layouts.

    Each program streams a [BLOCK_N, BLOCK_K] fp8 tile per step, converts it to fp32 and
    applies the block scales once, then for each of the M_ROWS activation rows does one fp32
    FMA per weight and a row reduction. fp8 x 2**e times a bf16/fp16 value is exact in fp32.
    With QUANT the activation row is MX-rounded here (per K tile, in registers): W8A8 decode is
    one launch, no quantizer kernel and no bf16 round trip of X. Split K: ``split_k_epilogue``
    (partials out, and with FUSED the last split of an N tile sums them). PDL: first thing, the kernel behind this
    one may launch, and this one waits for the kernel it was launched behind (it wrote X).
    """
    if PDL:
        gdc_follow()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    NB: tl.constexpr = BLOCK_K // BS
    offs_k = tl.arange(0, BLOCK_K)
    offs_b = tl.arange(0, NB)
    offs_m = tl.arange(0, BLOCK_M)
    k_lo = pid_k * K_SPLIT
    k_hi = min(k_lo + K_SPLIT, K)
    n_iter = tl.cdiv(k_hi - k_lo, BLOCK_K)
    if not TMA_W:
        w_ptrs = w_ptr + rn[:, None] * stride_wn + (k_lo + offs_k)[None, :]
    s_ptrs = s_ptr + rn[:, None] * stride_sn + (k_lo // BS + offs_b)[None, :]
    x_ptrs = x_ptr + k_lo + offs_k
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(n_iter):
        k = k_lo + i * BLOCK_K
        kmask = (k + offs_k) < k_hi
        if TMA_W:
            w = w_ptr.load([pid_n * BLOCK_N, k])
        elif EVEN_K:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=kmask[None, :], other=0.0)
        if EVEN_K:
            sc = tl.load(s_ptrs)
        else:
            sc = tl.load(s_ptrs, mask=((k + offs_b * BS) < k_hi)[None, :], other=127)
        wf = tl.reshape(w.to(tl.float32), (BLOCK_N, NB, BS)) * e8m0_to_f32(sc)[:, :, None]
        wf = tl.reshape(wf, (BLOCK_N, BLOCK_K))
        for m in tl.static_range(M_ROWS):
            if EVEN_K:
                xm = tl.load(x_ptrs + m * stride_xm).to(tl.float32)
            else:
                xm = tl.load(x_ptrs + m * stride_xm, mask=kmask, other=0.0).to(tl.float32)
            if QUANT:
                xq = mx_round_dequant(tl.reshape(xm, (1, NB, BS)), EMAX, MBITS, MAXN, EMIN, RULE, HW_CVT, FP8)
                xm = tl.reshape(xq, (BLOCK_K,))
            r = tl.sum(wf * xm[None, :], axis=1)
            acc = tl.where(offs_m[:, None] == m, acc + r[None, :], acc)
        if not TMA_W:
            w_ptrs += BLOCK_K
        s_ptrs += NB
        x_ptrs += BLOCK_K

    split_k_epilogue(tl.trans(acc), tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), b_ptr, y_ptr, ws_ptr, cnt_ptr, M, N,
                     stride_ym, pid_n, pid_k, offs_n, offs_m, offs_n < N, offs_m < M, SPLIT, FUSED, HAS_BIAS)  # fmt: skip


@dataclass(frozen=True)
class GemvConfig:
    """Tiles of the CUDA-core decode kernel (``_mx_gemv_kernel``)."""

    block_n: int = 32
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    tma_w: bool = False
    # split-K partials summed by the last split, or by a reduction launch (faster in the PDL chain on
    # most shapes: kernels/NOTES.md, "GEMM: the portable decode paths in the chain")
    fused: bool = False
    pdl: bool = True  # launched behind its predecessor (programmatic dependent launch, sm_90+)


# Largest M that takes the CUDA-core decode kernel on a GPU (kernels/NOTES.md, "GEMM: the CUDA-core decode gemv").
GEMV_MAX_M = 2


def pick_gemv_config(m: int, n: int, k: int, device: torch.device) -> GemvConfig:
    """Decode tiles from the shape alone (no sync). K is split until the grid covers the SMs."""
    if INTERPRET or device.type != "cuda":
        return GemvConfig(block_n=16, block_k=64, num_warps=4, num_stages=1, split_k=2 if k >= 128 else 1)
    sms = sm_count(device)
    cfg = GemvConfig(block_n=32, block_k=256, num_warps=4, num_stages=3)
    # the sweep's best: 512-800 programs (kernels/NOTES.md, "GEMM: the CUDA-core decode gemv")
    tiles = cdiv(n, cfg.block_n)
    split = 1
    while tiles * split * 2 <= 6 * sms and k // (split * 2) >= 2 * cfg.block_k and split < 8:
        split *= 2
    return dataclasses.replace(cfg, split_k=split)


@on_input_device
def mx_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
    config: GemvConfig | None = None,
    block_size: int = 32,
    act_elem: ElemFormat | None = None,
    act_rule: ScaleRule = ScaleRule.RCEIL,
) -> torch.Tensor:
    """Y [M, N] = X [M, K] · dequant(W)ᵀ (+ bias) for small M, on CUDA cores.

    With ``act_elem`` X is MX-rounded along K inside the kernel (W8A8); ScaleRule.MSE is not
    supported there (callers round X first). Any float X dtype: the products are fp32 FMAs.
    """
    m, k = check_gemm_args(x, weight, weight_scale, bias, block_size)
    n = weight.shape[0]
    if act_elem is not None and act_rule is ScaleRule.MSE:
        raise ValueError("mx_gemv rounds X itself only for FLOOR/RCEIL/EVEN; round MSE first")
    if m > 64:
        raise ValueError(f"mx_gemv is for small M (unrolled over rows), got M={m}")
    x, weight, weight_scale, y, done = operands_and_output(x, weight, weight_scale, bias, out_dtype, n)
    if done:
        return y
    cfg = config or pick_gemv_config(m, n, k, x.device)
    if cfg.block_k % block_size:
        raise ValueError(f"block_k={cfg.block_k} must be a multiple of block_size={block_size}")
    split, k_split, even_k, ws = split_k_plan(y, k, cfg.split_k, cfg.block_k)
    tiles = cdiv(n, cfg.block_n)
    counters = split_counters(x.device, tiles) if split > 1 and cfg.fused else None
    tma_w, w_arg = tma_or_pointer(weight, [cfg.block_n, cfg.block_k], cfg.tma_w)
    consts = dict(M_ROWS=m, BLOCK_M=next_pow2(m), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BS=block_size,
                  HAS_BIAS=bias is not None, SPLIT=split, FUSED=counters is not None, EVEN_K=even_k, TMA_W=tma_w,
                  QUANT=act_elem is not None, **mx_round_consts(act_elem, act_rule, x.device),
                  PDL=cfg.pdl and pdl_ok(x.device))
    call(
        _mx_gemv_kernel, (tiles, split),
        (x, w_arg, weight_scale, bias if bias is not None else weight_scale, y, ws,
         counters if counters is not None else weight_scale,
         m, n, k, k_split, x.stride(0), weight.stride(0), weight_scale.stride(0), n),
        consts, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(consts),
    )  # fmt: skip
    if split > 1 and counters is None:
        split_k_finish(ws, y, bias, split, pdl=consts["PDL"])
    return y
