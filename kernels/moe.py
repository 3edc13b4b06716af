"""Grouped MX GEMM for mixtures of experts: ``mx_grouped_linear`` and its registry ``GROUPED``.

Tokens arrive sorted by expert; ``group_end`` [E] holds each expert's cumulative row end (the
``offs`` of ``torch._grouped_mm``). Every path computes ``mx_grouped_linear_reference``
(``mxq.kernels.reference``): rows of expert e times expert e's MX weight [N, K] (blocks along K),
plus its bias; rows past ``group_end[-1]`` are zeros. The registry picks the path from host facts
only (shapes, dtypes, device), so a call never syncs and can be captured in a CUDA graph.

Both kernels read ``group_end`` on the device. Their grids come from shapes alone: an upper bound
of row tiles, ``cdiv(S, BM) + min(S, E)`` (an expert's rows add at most one partial tile), and each
program maps its tile index to (expert, first row) with a scan over the E row ends (``row_tile``).
Tiles past the last expert's end cover the rows past ``group_end[-1]`` (stored as zeros); the
rest exit before loading anything.

- ``grouped_gemm`` (prefill): Yᵀ tiles = W[e]·Xᵀ with the dequantized MX weight as wgmma's left
  operand, converted in registers (Hopper converts a register operand cheaply, a shared-memory one
  not: kernels/NOTES.md, "GEMM: the exact emulation kernel"); X by TMA as the right operand. A tile
  never spans two experts: rows of the next expert that a tile loads are computed and not stored.
  W8A8 rounds X to MX into bf16 first (exact, see quantize.py); the bf16 product is then exact up
  to accumulation order. fp16 X runs tf32 operands (an fp16 value and an fp8 value times a power
  of two both fit tf32 exactly), fp32 X fp32 FMA.
- ``grouped_decode`` (a few rows): a CUDA-core weight stream over the active experts only. Each
  program streams [BN, BK] fp8 tiles of one expert, sums each 32-block's fp8 x X products in fp32
  and applies the block scale once per block (fp8 x bf16 is exact in fp32); W8A8 rounds X inside.
  One row per tile (``block_m`` 1) where experts hold about one row each (top-k decode): an expert
  with r rows is streamed r times, the repeats from L2. No split-K: narrow N tiles (16 weight rows;
  64 when X is rounded inside) over the active experts fill the SMs.

The Triton interpreter (CPU tests) computes bf16 dots wrongly; the dot dtype is a constexpr and the
interpreter runs fp32. ``gather_mx_rows``: X's rows in sorted order (``x[index]``), MX-rounded
(W8A8) in the same pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from mxq.formats import ElemFormat, ScaleRule, as_elem_format, as_scale_rule
from mxq.kernels.dispatch import triton_runs
from mxq.kernels.launch import on_input_device
from mxq.kernels.reference import mx_grouped_linear_reference
from mxq.kernels.registry import KernelPath, Registry, check_kernels, default_kernels

try:
    import triton
    import triton.language as tl

    from mxq.kernels.common import (
        GATE_NONE,
        INTERPRET,
        e8m0_to_f32,
        gdc_wait,
        glu,
        mx_round_consts,
        mx_round_dequant,
        tma_or_pointer,
        to_out,
    )
    from mxq.kernels.launch import call, cdiv, next_pow2
    from mxq.kernels.quantize import fake_quantize_mx_rows
    from mxq.kernels.toolchain import wgmma_async_ok

    HAS_TRITON = True
    jit = triton.jit
except ImportError:  # no triton wheel: the reference runs everywhere
    HAS_TRITON = INTERPRET = False

    def jit(fn):
        return fn


from mxq.kernels.moe_gather import gather_mx_rows  # noqa: E402, F401  (the token gather lives there)

# Largest row count that ``kernels="auto"`` sends to the decode kernel (B <= 8 tokens x top-8).
GROUPED_DECODE_MAX_S = 64


class GroupedProblem(NamedTuple):
    """One ``mx_grouped_linear`` call as dispatch sees it (host facts only; hashable)."""

    s: int  # rows (token-expert pairs)
    e: int  # experts
    n: int
    k: int
    x_dtype: torch.dtype
    act_elem: ElemFormat | None
    act_rule: ScaleRule
    block_size: int
    device: torch.device
    triton: bool  # Triton runs here: a CUDA device, or the interpreter for a path named on a CPU


# --------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------


@jit
def row_tile(ge_ptr, t, S, E, BM: tl.constexpr, EP2: tl.constexpr):
    """Row tile ``t`` of the sorted rows: (expert, first row, end of the rows it may store, kind);
    kind 0: rows of expert e, 1: rows past group_end[-1] (zeros), 2: nothing to do. Row ends are
    non-decreasing (the contract); an end past S counts as S."""
    offs = tl.arange(0, EP2)
    inside = offs < E
    ends = tl.minimum(tl.load(ge_ptr + offs, mask=inside, other=0).to(tl.int32), S)
    last = tl.max(ends, axis=0)
    if BM == 1:  # tile = row: its expert is the number of experts that end at or before it
        e = tl.sum((inside & (ends <= t)).to(tl.int32), axis=0)
        row0 = t
        end = tl.where(t < last, t + 1, S)
        kind = tl.where(t < last, 0, tl.where(t < S, 1, 2))
    else:
        starts = tl.minimum(tl.load(ge_ptr + offs - 1, mask=inside & (offs > 0), other=0).to(tl.int32), S)
        tiles = (tl.maximum(ends - starts, 0) + BM - 1) // BM
        cum = tl.cumsum(tiles, axis=0)
        total = tl.sum(tiles, axis=0)
        e = tl.sum((inside & (cum <= t)).to(tl.int32), axis=0)
        sel = offs == e
        first = tl.sum(tl.where(sel, starts + (t - cum + tiles) * BM, 0), axis=0)
        tail = last + (t - total) * BM
        row0 = tl.where(t < total, first, tail)
        end = tl.where(t < total, tl.sum(tl.where(sel, ends, 0), axis=0), S)
        kind = tl.where(t < total, 0, tl.where(tail < S, 1, 2))
    return e, row0, end, kind


@jit
def grouped_order(pid, N, T, BN: tl.constexpr, GROUP: tl.constexpr):
    """Program ``pid``'s (row tile, N tile): GROUP consecutive row tiles (a few experts) under every
    N tile, so that their weight panels and X rows stay in L2 while the group runs."""
    per_group = GROUP * tl.cdiv(N, BN)
    first_t = (pid // per_group) * GROUP
    group_t = tl.minimum(T - first_t, GROUP)
    return first_t + (pid % per_group) % group_t, (pid % per_group) // group_t


@jit
def weight_block_step(w_ptrs, s_ptrs, i, K, BK: tl.constexpr, BS: tl.constexpr, EVEN_K: tl.constexpr):
    """Step ``i`` along K of a one-row-tile weight ([BN, NB, BS] codes from ``w_ptrs``, [BN, NB]
    scales from ``s_ptrs``; a block's sum stays in-thread): (codes, scales) as fp32, zeros past K."""
    NB: tl.constexpr = BK // BS
    k = i * BK
    offs_b = tl.arange(0, NB)
    if EVEN_K:
        w = tl.load(w_ptrs + k)
        sc = tl.load(s_ptrs + i * NB)
    else:
        kk = offs_b[:, None] * BS + tl.arange(0, BS)[None, :]
        w = tl.load(w_ptrs + k, mask=((k + kk) < K)[None, :, :], other=0.0)
        sc = tl.load(s_ptrs + i * NB, mask=((k + offs_b * BS) < K)[None, :], other=127)
    return w.to(tl.float32), e8m0_to_f32(sc)


@jit
def out_tile(y_ptr, row0, row_end, kind, pid_n, N, stride_ym, BM: tl.constexpr, BN: tl.constexpr):
    """The output tile's rows, columns, store mask (rows before ``row_end``, columns inside N) and
    offsets into Y; a kind-1 tile (``row_tile``) gets its zeros stored here. The kernel returns
    unless ``kind`` is 0."""
    offs_m = row0 + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask = (offs_m < row_end)[:, None] & (offs_n < N)[None, :]
    y_offs = offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    if kind == 1:
        tl.store(y_ptr + y_offs, tl.zeros((BM, BN), y_ptr.dtype.element_ty), mask=mask)
    return offs_m, offs_n, mask, y_offs


@jit
def prefill_tile(ge_ptr, y_ptr, S, N, E, T, stride_ym, BM: tl.constexpr, BN: tl.constexpr, EP2: tl.constexpr,
                 GROUP: tl.constexpr):  # fmt: skip
    """This program's tile of a grouped prefill kernel (``grouped_order``, ``row_tile``,
    ``out_tile``): (expert, first row, N tile, kind, rows, columns, store mask, offsets into Y)."""
    t, pid_n = grouped_order(tl.program_id(0), N, T, BN, GROUP)
    e, row0, row_end, kind = row_tile(ge_ptr, t, S, E, BM, EP2)
    offs_m, offs_n, mask, y_offs = out_tile(y_ptr, row0, row_end, kind, pid_n, N, stride_ym, BM, BN)
    return e, row0, pid_n, kind, offs_m, offs_n, mask, y_offs


@jit
def dequant_tile(w, sc, BN: tl.constexpr, NB: tl.constexpr, BS: tl.constexpr, DEQ_BF16: tl.constexpr):
    """A [BN, NB·BS] fp8 tile times its E8M0 scales (exact; bf16 where the dot is bf16: a
    power-of-two product is exact there, half the work of the fp32 route)."""
    if DEQ_BF16:
        wf = tl.reshape(w.to(tl.bfloat16), (BN, NB, BS)) * e8m0_to_f32(sc).to(tl.bfloat16)[:, :, None]
    else:
        wf = tl.reshape(w.to(tl.float32), (BN, NB, BS)) * e8m0_to_f32(sc)[:, :, None]
    return tl.reshape(wf, (BN, NB * BS))


@jit
def x_tile(x_ptr, x_ptrs, row0, k, K, offs_k, TMA_X: tl.constexpr, EVEN_K: tl.constexpr):
    """Xᵀ [BK, BM] at K offset ``k`` for a grouped prefill kernel: by TMA (``x_ptr`` a descriptor,
    rows from ``row0``) or by pointers (``x_ptrs``), zeros past K."""
    if TMA_X:
        return tl.trans(x_ptr.load([row0, k]))
    elif EVEN_K:
        return tl.load(x_ptrs + k)
    else:
        return tl.load(x_ptrs + k, mask=((k + offs_k) < K)[:, None], other=0.0)


@jit
def grouped_gemm_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, ge_ptr,
    S, N, K, E, T,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_ym,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BS: tl.constexpr, EP2: tl.constexpr,
    GROUP: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr, TMA_X: tl.constexpr, TMA_W: tl.constexpr, DEQ_BF16: tl.constexpr,
    ZERO_DOT: tl.constexpr,
):  # fmt: skip
    """Yᵀ tile [BN weight rows, BM sorted rows] of one expert over the whole K."""
    e, row0, pid_n, kind, offs_m, offs_n, mask, y_offs = prefill_tile(ge_ptr, y_ptr, S, N, E, T, stride_ym, BM, BN, EP2, GROUP)
    if kind != 0:
        return
    NB: tl.constexpr = BK // BS
    offs_k = tl.arange(0, BK)
    offs_b = tl.arange(0, NB)
    # Out-of-range rows read row 0: never stored.
    rn = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    rm = tl.where(offs_m < S, offs_m, 0).to(tl.int64)
    e64 = e.to(tl.int64)
    s_ptrs = s_ptr + e64 * stride_se + rn[:, None] * stride_sn + offs_b[None, :]
    w_ptrs = w_ptr
    x_ptrs = x_ptr
    if not TMA_W:
        w_ptrs = w_ptr + e64 * stride_we + rn[:, None] * stride_wn + offs_k[None, :]
    if not TMA_X:
        x_ptrs = x_ptr + rm[None, :] * stride_xm + offs_k[:, None]
    w_row = e * N + pid_n * BN  # TMA: W as [E*N, K]; rows past this expert's N are never stored
    # Scales one K step ahead: their load feeds the dot only through the dequant, and Triton does
    # not pipeline it (kernels/NOTES.md, "GEMM: the exact emulation kernel").
    sc_next = tl.load(s_ptrs, mask=(offs_b * BS < K)[None, :], other=127)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    if ZERO_DOT:
        # A wgmma defines the accumulator, not moves: otherwise ptxas serializes every wgmma (C7515).
        acc = tl.dot(tl.zeros((BN, BK), DOT), tl.zeros((BK, BM), DOT), acc, input_precision=PRECISION)
    for i in range(tl.cdiv(K, BK)):
        k = i * BK
        if TMA_W:
            w = w_ptr.load([w_row, k])
        elif EVEN_K:
            w = tl.load(w_ptrs + k)
        else:
            w = tl.load(w_ptrs + k, mask=((k + offs_k) < K)[None, :], other=0.0)
        xt = x_tile(x_ptr, x_ptrs, row0, k, K, offs_k, TMA_X, EVEN_K)
        sc = sc_next
        sc_next = tl.load(s_ptrs + (i + 1) * NB, mask=((k + BK + offs_b * BS) < K)[None, :], other=127)
        acc = tl.dot(dequant_tile(w, sc, BN, NB, BS, DEQ_BF16).to(DOT), xt.to(DOT), acc, input_precision=PRECISION)
    # The bias goes in while acc is in the MMA layout (as gemm.py: after tl.trans it gave garbage).
    if HAS_BIAS:
        acc += tl.load(b_ptr + e64 * N + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
    tl.store(y_ptr + y_offs, tl.trans(to_out(acc, y_ptr.dtype.element_ty)), mask=mask)


@jit
def grouped_decode_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, ge_ptr, idx_ptr,
    S, N, K, E, UO,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_ym, alpha, limit,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BS: tl.constexpr, EP2: tl.constexpr,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, QUANT: tl.constexpr, NUM_STAGES: tl.constexpr,
    EMAX: tl.constexpr, MBITS: tl.constexpr, MAXN: tl.constexpr, EMIN: tl.constexpr,
    RULE: tl.constexpr, HW_CVT: tl.constexpr, FP8: tl.constexpr,
    GATE: tl.constexpr, GS: tl.constexpr, X_IDX: tl.constexpr, DIRECT: tl.constexpr = False, TOPK: tl.constexpr = 1,
    PDL_WAIT: tl.constexpr = False,
):  # fmt: skip
    """Y tile [BM rows, BN] of one expert on CUDA cores; programs of absent tiles load nothing.

    ``GATE`` (``common.glu``): the gate-up projection with the family's gate in the epilogue. Y's column
    j reads weight rows j·GS (gate) and j·GS + UO (up): [gate | up] halves (GS 1, UO = N) or
    gpt-oss's interleaved rows (GS 2, UO 1). ``X_IDX``: sorted row r reads X row idx[r] (the
    token), so the gather costs no launch. ``DIRECT`` (BM 1, no sort): row r is the router's slot r,
    its expert idx[r] (the ``top_k_index`` as stored; outside [0, E): a zero row) and its X row
    r // TOPK. ``PDL_WAIT``: launched behind the kernel that writes X (programmatic dependent launch);
    X is read after its wait."""
    pid_n = tl.program_id(0)
    t = tl.program_id(1)
    if DIRECT:
        ed = tl.load(idx_ptr + t).to(tl.int64)
        e = tl.where((ed >= 0) & (ed < E), ed, 0).to(tl.int32)
        row0, row_end = t, t + 1
        kind = tl.where((ed >= 0) & (ed < E), 0, 1)
    else:
        e, row0, row_end, kind = row_tile(ge_ptr, t, S, E, BM, EP2)
    offs_m, offs_n, mask, y_offs = out_tile(y_ptr, row0, row_end, kind, pid_n, N, stride_ym, BM, BN)
    if kind != 0:
        return
    NB: tl.constexpr = BK // BS
    offs_b = tl.arange(0, NB)
    # W as [BN, NB, BS] straight from memory: each thread holds 16 codes of one block, so a block's
    # sum is in-thread adds and one shuffle (a reshaped 2-D tile put a block across 16 lanes).
    kk = offs_b[:, None] * BS + tl.arange(0, BS)[None, :]
    rn = tl.where(offs_n < N, offs_n, 0).to(tl.int64) * GS
    ru = rn + UO  # GATE: the up rows
    e64 = e.to(tl.int64)
    w_ptrs = w_ptr + e64 * stride_we + rn[:, None, None] * stride_wn + kk[None, :, :]
    s_ptrs = s_ptr + e64 * stride_se + rn[:, None] * stride_sn + offs_b[None, :]
    wu_ptrs = w_ptr + e64 * stride_we + ru[:, None, None] * stride_wn + kk[None, :, :]
    su_ptrs = s_ptr + e64 * stride_se + ru[:, None] * stride_sn + offs_b[None, :]
    if BM == 1:  # the accumulator stays in the layout of the block sums
        acc = tl.zeros((BN, NB), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN, NB), dtype=tl.float32)
    acc_u = acc
    offs_r = tl.arange(0, BM)
    xrows = offs_m
    if DIRECT:
        xrows = offs_m // TOPK
    elif X_IDX:
        xrows = tl.load(idx_ptr + offs_m, mask=offs_m < row_end, other=0)
    if PDL_WAIT:
        gdc_wait()
    for i in tl.range(tl.cdiv(K, BK), num_stages=NUM_STAGES):
        k = i * BK
        kmask = (k + kk) < K
        wf, sf = weight_block_step(w_ptrs, s_ptrs, i, K, BK, BS, EVEN_K)
        if GATE:
            wuf, suf = weight_block_step(wu_ptrs, su_ptrs, i, K, BK, BS, EVEN_K)
        for m in tl.static_range(BM):
            row = row0 + m
            xrow = row
            if DIRECT:
                xrow = row // TOPK
            elif X_IDX:
                xrow = tl.sum(tl.where(offs_r == m, xrows, 0), axis=0)
            xm = tl.load(x_ptr + xrow.to(tl.int64) * stride_xm + k + kk, mask=kmask & (row < row_end), other=0.0)
            xm = xm.to(tl.float32)[None, :, :]
            if QUANT:
                xm = mx_round_dequant(xm, EMAX, MBITS, MAXN, EMIN, RULE, HW_CVT, FP8)
            # fp8 x X products summed per 32-block in fp32, the block's scale applied once
            p = tl.sum(wf * xm, axis=2) * sf
            if BM == 1:
                acc += p
            else:
                acc = tl.where(offs_r[:, None, None] == m, acc + p[None, :, :], acc)
            if GATE:
                pu = tl.sum(wuf * xm, axis=2) * suf
                if BM == 1:
                    acc_u += pu
                else:
                    acc_u = tl.where(offs_r[:, None, None] == m, acc_u + pu[None, :, :], acc_u)
    if BM == 1:
        out = tl.sum(acc, axis=1)[None, :]
        out_u = tl.sum(acc_u, axis=1)[None, :]
    else:
        out = tl.sum(acc, axis=2)
        out_u = tl.sum(acc_u, axis=2)
    if HAS_BIAS:
        out += tl.load(b_ptr + e64 * stride_be + rn, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        if GATE:
            out_u += tl.load(b_ptr + e64 * stride_be + ru, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    if GATE:
        out = glu(out, out_u, y_ptr.dtype.element_ty, GATE, alpha, limit)
    tl.store(y_ptr + y_offs, to_out(out.to(tl.float32), y_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupedGemmConfig:
    """Tiles of ``grouped_gemm_kernel``."""

    block_m: int  # sorted rows per tile (the MMA's N side)
    block_n: int  # weight rows per tile (the MMA's M side)
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    group: int = 8  # row tiles sharing every N tile's pass, for L2 reuse
    tma: bool = True  # X and W tiles through TMA (pointer loads where not possible)
    deq_bf16: bool = True  # scale multiply in bf16 (bf16 dots only)


@dataclass(frozen=True)
class GroupedDecodeConfig:
    """Tiles of ``grouped_decode_kernel``."""

    block_m: int = 1  # rows per tile (1: an expert with r rows is streamed r times, from L2)
    block_n: int = 16
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 3


def pick_grouped_gemm_config(s: int, e: int, n: int, k: int, x_dtype: torch.dtype, device: torch.device,
                             out_dtype: torch.dtype | None = None) -> GroupedGemmConfig:  # fmt: skip
    """Tiles from host facts. A tile holds one expert's rows, and the weight dequant, not the MMA,
    bounds this kernel at these sizes: 256-row tiles (one per expert at ~128 rows, half padding)
    beat 128-row ones (1.5 per expert) (kernels/NOTES.md, "MoE: the grouped GEMM")."""
    if INTERPRET or device.type != "cuda":
        return GroupedGemmConfig(16, 32, 64, num_warps=4, num_stages=1, tma=False)
    if x_dtype != torch.bfloat16:  # fp32 operands: twice the shared memory per tile
        return GroupedGemmConfig(64, 64, 32, num_warps=4, num_stages=3, deq_bf16=False)
    if not wgmma_async_ok() and (out_dtype == torch.float32 or n % 128):
        # the serialized loop's 8-warp epilogues gave garbage there in gemm.py (kernels/NOTES.md,
        # "GEMM: the exact emulation kernel"); the 4-warp tile was right everywhere
        return GroupedGemmConfig(128, 64, 64, num_warps=4, num_stages=4)
    if s >= 96 * max(e, 1):
        return GroupedGemmConfig(256, 128, 64, num_warps=8, num_stages=3)
    return GroupedGemmConfig(128, 128, 64, num_warps=8, num_stages=4)  # one tile for up to 128 rows


def pick_grouped_decode_config(s: int, e: int, n: int, k: int, device: torch.device, w8a8: bool = False) -> GroupedDecodeConfig:
    """Rows per tile from the rows per active expert (at least s / min(s, e)). One row per tile:
    16 x 256 weight tiles (W8A16); 64 x 256 with 8 warps when X is rounded inside (W8A8), which
    spreads each thread's rounding work over more weight rows (the H100 sweep in kernels/NOTES.md,
    "MoE: the grouped GEMM")."""
    bm = min(8, next_pow2(max(1, -(-s // max(1, min(s, e))))))
    if INTERPRET or device.type != "cuda":
        return GroupedDecodeConfig(block_m=bm, block_n=16, block_k=64, num_warps=4, num_stages=1)
    if bm > 1:
        return GroupedDecodeConfig(block_m=bm, block_n=16, block_k=128)
    if w8a8:
        return GroupedDecodeConfig(block_m=1, block_n=64, block_k=256, num_warps=8)
    return GroupedDecodeConfig(block_m=1, block_n=16, block_k=256)


def _prepare(x, group_end, weight, weight_scale, bias, block_size, block_k, out_dtype):
    """Unit-stride operands, the output, and whether the call is already done (no rows or columns)."""
    s, k = x.shape
    e, n, _ = weight.shape
    if block_k % block_size:
        raise ValueError(f"block_k={block_k} must be a multiple of block_size={block_size}")
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(2) == 1 else weight.contiguous()
    weight_scale = weight_scale if weight_scale.stride(2) == 1 else weight_scale.contiguous()
    bias = bias.contiguous() if bias is not None else None
    y = torch.empty((s, n), dtype=out_dtype or x.dtype, device=x.device)
    done = not (s and n)
    if not done and (not k or not e):  # no K: the bias per group (reference path)
        y.copy_(mx_grouped_linear_reference(x, group_end, weight, weight_scale, bias, block_size=block_size))
        done = True
    return x, group_end.contiguous(), weight, weight_scale, bias, y, done


@on_input_device
def mx_grouped_gemm(
    x: torch.Tensor,
    group_end: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
    config: GroupedGemmConfig | None = None,
    block_size: int = 32,
) -> torch.Tensor:
    """Grouped Y [S, N] = X · dequant(W[e])ᵀ (+ bias[e]) per expert group, X used as given (W8A16;
    W8A8 callers round X first): the prefill kernel, one launch, no host sync."""
    check_grouped_args(x, group_end, weight, weight_scale, bias, block_size)
    s, k = x.shape
    e, n, _ = weight.shape
    cfg = config or pick_grouped_gemm_config(s, e, n, k, x.dtype, x.device, out_dtype or x.dtype)
    x, group_end, weight, weight_scale, bias, y, done = _prepare(x, group_end, weight, weight_scale, bias, block_size,
                                                                 cfg.block_k, out_dtype)  # fmt: skip
    if done:
        return y
    if INTERPRET:
        dot, precision, x = tl.float32, "ieee", x.float()
    elif x.dtype == torch.bfloat16:
        dot, precision = tl.bfloat16, "tf32"  # precision is ignored for bf16 operands
    else:  # exact: fp16 values fit tf32; fp32 ones need FMA
        dot, precision, x = tl.float32, "tf32" if x.dtype == torch.float16 else "ieee", x.float()
    tiles = cdiv(s, cfg.block_m) + min(s, e)
    tma_x, x_arg = tma_or_pointer(x, [cfg.block_m, cfg.block_k], cfg.tma)
    tma_w, w_arg = tma_or_pointer(weight.view(e * n, k), [cfg.block_n, cfg.block_k], cfg.tma and weight.is_contiguous())
    w_arg = w_arg if tma_w else weight
    call(
        grouped_gemm_kernel, (tiles * cdiv(n, cfg.block_n),),
        (x_arg, w_arg, weight_scale, bias if bias is not None else weight_scale, y, group_end,
         s, n, k, e, tiles, x.stride(0), weight.stride(0), weight.stride(1), weight_scale.stride(0),
         weight_scale.stride(1), y.stride(0)),
        dict(BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, BS=block_size, EP2=max(16, next_pow2(e)),
             GROUP=cfg.group, DOT=dot, PRECISION=precision, HAS_BIAS=bias is not None,
             EVEN_K=k % cfg.block_k == 0, TMA_X=tma_x, TMA_W=tma_w, DEQ_BF16=cfg.deq_bf16 and dot == tl.bfloat16,
             ZERO_DOT=not INTERPRET and wgmma_async_ok()),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return y


@on_input_device
def mx_grouped_decode(
    x: torch.Tensor,
    group_end: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    act_elem: ElemFormat | None = None,
    act_rule: ScaleRule = ScaleRule.RCEIL,
    out_dtype: torch.dtype | None = None,
    config: GroupedDecodeConfig | None = None,
    block_size: int = 32,
) -> torch.Tensor:
    """Grouped Y [S, N] for a few rows on CUDA cores, reading only the active experts' weights.
    With ``act_elem`` X is MX-rounded along K inside the kernel (ScaleRule.MSE: rounded first)."""
    check_grouped_args(x, group_end, weight, weight_scale, bias, block_size)
    s, k = x.shape
    e, n, _ = weight.shape
    if s > 65535:
        raise ValueError(f"mx_grouped_decode is for few rows (one grid row per tile), got S={s}")
    out_dtype = out_dtype or x.dtype
    if act_elem is not None and act_rule is ScaleRule.MSE:
        x, act_elem = fake_quantize_mx_rows(x, act_elem, act_rule, block_size, out_dtype=torch.float32), None
    cfg = config or pick_grouped_decode_config(s, e, n, k, x.device, w8a8=act_elem is not None)
    x, group_end, weight, weight_scale, bias, y, done = _prepare(x, group_end, weight, weight_scale, bias, block_size,
                                                                 cfg.block_k, out_dtype)  # fmt: skip
    if done:
        return y
    bm = cfg.block_m
    tiles = s if bm == 1 else cdiv(s, bm) + min(s, e)  # one row per tile: exactly the rows
    call(
        grouped_decode_kernel, (cdiv(n, cfg.block_n), tiles),
        (x, weight, weight_scale, bias if bias is not None else weight_scale, y, group_end, group_end,
         s, n, k, e, 0, x.stride(0), weight.stride(0), weight.stride(1), weight_scale.stride(0), weight_scale.stride(1),
         n, y.stride(0), 0.0, 0.0),
        dict(BM=bm, BN=cfg.block_n, BK=cfg.block_k, BS=block_size, EP2=max(16, next_pow2(e)),
             HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0, QUANT=act_elem is not None,
             **mx_round_consts(act_elem, act_rule, x.device), GATE=GATE_NONE, GS=1, X_IDX=False),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return y


# --- the registry: supports(p) on host facts, run(p, x, group_end, weight, weight_scale, bias) ---


def _reference_run(p: GroupedProblem, x, group_end, weight, weight_scale, bias):
    return mx_grouped_linear_reference(
        x, group_end, weight, weight_scale, bias, act_elem=p.act_elem, act_rule=p.act_rule, block_size=p.block_size
    ).to(x.dtype)


def _triton_supports(p: GroupedProblem) -> bool:
    return p.triton and p.block_size in (16, 32, 64) and p.x_dtype in (torch.bfloat16, torch.float16, torch.float32)


def _decode_supports(p: GroupedProblem) -> bool:
    return _triton_supports(p) and p.s <= GROUPED_DECODE_MAX_S


def _decode_run(p: GroupedProblem, x, group_end, weight, weight_scale, bias):
    return mx_grouped_decode(x, group_end, weight, weight_scale, bias, act_elem=p.act_elem, act_rule=p.act_rule,
                             block_size=p.block_size)  # fmt: skip


def _gemm_run(p: GroupedProblem, x, group_end, weight, weight_scale, bias):
    xin = x
    if p.act_elem is not None:  # X rounded to MX into bf16 (exact), then the bf16 product
        xin = fake_quantize_mx_rows(x, p.act_elem, p.act_rule, p.block_size,
                                    out_dtype=torch.float32 if INTERPRET else torch.bfloat16)  # fmt: skip
    return mx_grouped_gemm(xin, group_end, weight, weight_scale, bias, out_dtype=x.dtype, block_size=p.block_size)


_paths = [KernelPath("reference", "torch reference (per-expert loop over dequantized weights)", lambda p: True, _reference_run)]
if HAS_TRITON:
    _paths = [
        KernelPath("grouped_decode", "grouped decode: CUDA-core stream of the active experts", _decode_supports, _decode_run,
                   lambda p: pick_grouped_decode_config(p.s, p.e, p.n, p.k, p.device,
                                                        w8a8=p.act_elem is not None and p.act_rule is not ScaleRule.MSE)),
        KernelPath("grouped_gemm", "grouped prefill: dequantized weight as the register operand, one launch",
                   _triton_supports, _gemm_run,
                   lambda p: pick_grouped_gemm_config(p.s, p.e, p.n, p.k, torch.bfloat16 if p.act_elem else p.x_dtype,
                                                      p.device, p.x_dtype)),
    ] + _paths  # fmt: skip
GROUPED = Registry("grouped", _paths)


def check_grouped_args(x, group_end, weight, weight_scale, bias, block_size: int) -> None:
    """One-line errors for operands that do not fit together."""
    if weight.dim() != 3 or weight.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"mx_grouped_linear: weight must be fp8 [E, N, K], got {weight.dtype}{list(weight.shape)}")
    e, n, k = weight.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"mx_grouped_linear: x must be [S, {k}], got {list(x.shape)}")
    if weight_scale.dtype != torch.uint8 or tuple(weight_scale.shape) != (e, n, k // block_size) or k % block_size:
        raise ValueError(f"mx_grouped_linear: weight_scale must be uint8 [{e}, {n}, {k // block_size}], got {weight_scale.dtype}{list(weight_scale.shape)}")
    if group_end.dim() != 1 or group_end.shape[0] != e or group_end.dtype.is_floating_point:
        raise ValueError(f"mx_grouped_linear: group_end must be an integer tensor [{e}], got {group_end.dtype}{list(group_end.shape)}")
    if bias is not None and tuple(bias.shape) != (e, n):
        raise ValueError(f"mx_grouped_linear: bias must be [{e}, {n}], got {list(bias.shape)}")
    others = [("weight", weight), ("weight_scale", weight_scale), ("group_end", group_end)] + ([("bias", bias)] if bias is not None else [])
    for name, t in others:
        if t.device != x.device:
            raise ValueError(f"mx_grouped_linear: {name} is on {t.device}, x on {x.device}")


@on_input_device
def mx_grouped_linear(
    x: torch.Tensor,
    group_end: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    act_elem: ElemFormat | None = None,
    act_rule: ScaleRule = ScaleRule.RCEIL,
    block_size: int = 32,
    kernels: str | None = None,
) -> torch.Tensor:
    """Grouped Y [S, N] = X · W[e]ᵀ (+ bias[e]) per expert group (module doc); ``kernels`` as for
    ``mx_linear`` ("auto", "reference" or path names). "auto" on CUDA: ``grouped_decode`` up to
    ``GROUPED_DECODE_MAX_S`` rows, ``grouped_gemm`` above; on a CPU the reference (a path named
    there runs in the Triton interpreter)."""
    check_grouped_args(x, group_end, weight, weight_scale, bias, block_size)
    if act_elem is not None:
        act_elem, act_rule = as_elem_format(act_elem), as_scale_rule(act_rule)
    spec = check_kernels(kernels) if kernels is not None else default_kernels()
    p = grouped_problem(x, weight, act_elem, act_rule, block_size, spec)
    return GROUPED.choose(p, spec).run(p, x, group_end, weight, weight_scale, bias)


def grouped_problem(x, weight, act_elem, act_rule, block_size: int, spec: str) -> GroupedProblem:
    e, n, k = weight.shape
    return GroupedProblem(x.shape[0], e, n, k, x.dtype, act_elem, act_rule, block_size, x.device,
                          HAS_TRITON and triton_runs(x.device, spec))  # fmt: skip


def grouped_path(p: GroupedProblem, kernels: str | None = None) -> KernelPath:
    """The path ``mx_grouped_linear`` takes for ``p`` (what benchmark tables print)."""
    return GROUPED.choose(p, kernels)
