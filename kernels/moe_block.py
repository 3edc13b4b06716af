"""The routed experts of one MoE layer in two to six launches: ``experts_forward``.

``MXExperts.forward`` takes the router's choice (``top_k_index`` [T, k], ``top_k_weights``) and
returns the weighted sum of the chosen experts' outputs per token. Here that is:

1. ``_route_count_kernel`` (prefill only) and ``_route_sort_kernel``: a stable counting sort of
   the T·k (token, slot) pairs by expert. It writes ``pos`` (each pair's sorted row), ``token``
   (each sorted row's token) and ``group_end`` [E] (each expert's cumulative row end). An index
   outside [0, E) means "no expert": such rows sort past ``group_end[-1]`` and come out zero.
2. Prefill: ``gather_mx_rows`` puts X's rows in sorted order, MX-rounded for W8A8.
3. The gate-up grouped GEMM with the family's gate in its epilogue (``glu``: SiLU·up on
   [gate | up] halves, or gpt-oss's clamped GLU on interleaved rows, biases included), writing the
   down projection's input, MX-rounded for W8A8 (prefill: ``_grouped_glu_kernel`` on tensor cores;
   decode: ``moe.grouped_decode_kernel`` with ``GATE``, reading X through ``token``, no gather).
4. The down grouped GEMM (``moe``'s prefill or decode kernel).
5. ``_combine_kernel``: out[t] = Σ_j y[pos[t, j]] · w[t, j] in fp32, in slot order (deterministic;
   no float32 [T·k, H] temporary, no ``index_add_``).

Decode (T·k <= ``DECODE_MAX_ROWS``) runs 4 and 5 as one kernel (``moe_decode``: a program per slot,
the token's last one summing in slot order), and up to ``DIRECT_MAX_TOKENS`` tokens skips the sort (the
router's slots are the rows): 2 launches at one token, 3 for W8A8 (X MX-rounded once by a small launch
that gate-up starts behind by PDL, ``moe_decode.ROUND_X``).

It is the function of ``MXExperts``' reference forward (sort, per-expert products, the family's
gate on the projection's output dtype, the down product, the fp32 weighted sum): the gate rounds
to the output dtype after every step as the model's own gate does. A plan per input signature
holds the compiled kernels' launchers (``launch.Launch``); shapes alone choose every grid, so a
call never syncs and can be captured in a CUDA graph.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch

from mxq.formats import ElemFormat, ScaleRule
from mxq.kernels import launch, moe_decode
from mxq.kernels.buffers import split_counters
from mxq.kernels.dispatch import triton_runs
from mxq.kernels.launch import PlanCache, cdiv, next_pow2
from mxq.kernels.registry import KernelPath, Registry

try:
    import triton.language as tl

    from mxq.kernels.common import (
        GATE_GPT_OSS,
        GATE_NONE,
        GATE_SILU,
        INTERPRET,
        TensorDescriptor,
        glu,
        mx_round_consts,
        mx_round_dequant,
        pdl_ok,
        to_out,
    )
    from mxq.kernels.launch import Launch
    from mxq.kernels.moe import (
        HAS_TRITON,
        GroupedGemmConfig,
        dequant_tile,
        grouped_decode_kernel,
        grouped_gemm_kernel,
        jit,
        pick_grouped_gemm_config,
        prefill_tile,
        x_tile,
    )
    from mxq.kernels.moe_decode import down_combine_kernel, down_slots_kernel, pick_decode_configs
    from mxq.kernels.moe_gather import gather_rows_kernel
    from mxq.kernels.toolchain import wgmma_async_ok
except ImportError:  # no triton: MXExperts keeps its reference forward
    HAS_TRITON = False
    GATE_NONE, GATE_SILU, GATE_GPT_OSS = 0, 1, 2

    def jit(fn):
        return fn


# Largest number of sorted rows (tokens x top-k) the decode kernels take; above, the prefill ones.
DECODE_MAX_ROWS = 64
DIRECT_MAX_TOKENS = 4  # decode without the sort up to this many tokens (BlockPlan)
# The sort: one program up to SORT_ONE_MAX pairs; above, a count and a sort launch over chunks of 64
# pairs (up to 1024) or SORT_CHUNK. One program for 256 pairs ran 32 serial steps (21 µs; kernels/NOTES.md,
# "The sort's chunks").
SORT_ONE_MAX = 64
SORT_CHUNK = 128


@jit
def _buckets(ids_ptr, offs, S, E):
    """Each pair's bucket: its expert, E for an index outside [0, E), -1 past S (matches none)."""
    valid = offs < S
    ids = tl.load(ids_ptr + offs, mask=valid, other=0)
    return tl.where(valid, tl.where((ids >= 0) & (ids < E), ids, E), -1).to(tl.int32)


@jit
def _route_count_kernel(ids_ptr, counts_ptr, S, E, C: tl.constexpr, SUB: tl.constexpr, EP2: tl.constexpr):
    """counts[p, b]: the pairs of chunk p (C pairs) in bucket b."""
    p = tl.program_id(0)
    be = tl.arange(0, EP2)
    cnt = tl.zeros((EP2,), tl.int32)
    for s0 in range(0, C, SUB):
        b = _buckets(ids_ptr, p * C + s0 + tl.arange(0, SUB), S, E)
        cnt += tl.sum((b[:, None] == be[None, :]).to(tl.int32), axis=0)
    tl.store(counts_ptr + p * EP2 + be, cnt)


@jit
def _route_sort_kernel(
    ids_ptr, counts_ptr, pos_ptr, tok_ptr, ge_ptr, S, E, P, TOPK,
    C: tl.constexpr, SUB: tl.constexpr, EP2: tl.constexpr, PB: tl.constexpr, ONE: tl.constexpr,
):  # fmt: skip
    """Stable counting sort of chunk p: pair i of bucket b goes to start[b] + (pairs of bucket b
    before it). ``ONE``: the whole input is this chunk (no counts buffer)."""
    p = tl.program_id(0)
    be = tl.arange(0, EP2)
    total = tl.zeros((EP2,), tl.int32)
    before = tl.zeros((EP2,), tl.int32)
    if ONE:
        for s0 in range(0, C, SUB):
            b = _buckets(ids_ptr, s0 + tl.arange(0, SUB), S, E)
            total += tl.sum((b[:, None] == be[None, :]).to(tl.int32), axis=0)
    else:
        for q0 in range(0, P, PB):
            q = q0 + tl.arange(0, PB)
            tile = tl.load(counts_ptr + q[:, None] * EP2 + be[None, :], mask=(q < P)[:, None], other=0)
            total += tl.sum(tile, axis=0)
            before += tl.sum(tl.where((q < p)[:, None], tile, 0), axis=0)
    ends = tl.cumsum(total, axis=0)
    base = ends - total + before
    for s0 in range(0, C, SUB):
        offs = p * C + s0 + tl.arange(0, SUB)
        b = _buckets(ids_ptr, offs, S, E)
        oh = (b[:, None] == be[None, :]).to(tl.int32)
        rank = tl.cumsum(oh, axis=0) - 1 + base[None, :]
        r = tl.sum(oh * rank, axis=1)
        valid = offs < S
        tl.store(pos_ptr + offs, r, mask=valid)
        tl.store(tok_ptr + r, offs // TOPK, mask=valid)
        base += tl.sum(oh, axis=0)
    if p == 0:
        tl.store(ge_ptr + be, ends, mask=be < E)


@jit
def _combine_kernel(y_ptr, pos_ptr, w_ptr, out_ptr, H, stride_ym, stride_om, TOPK: tl.constexpr, BH: tl.constexpr):
    """out[t] = Σ_j fp32(y[pos[t·k + j]]) · w[t, j], slot by slot."""
    t = tl.program_id(0)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    m = cols < H
    acc = tl.zeros((BH,), tl.float32)
    for j in tl.static_range(TOPK):
        r = tl.load(pos_ptr + t * TOPK + j).to(tl.int64)
        wj = tl.load(w_ptr + t * TOPK + j).to(tl.float32)
        acc += tl.load(y_ptr + r * stride_ym + cols, mask=m, other=0.0).to(tl.float32) * wj
    tl.store(out_ptr + t.to(tl.int64) * stride_om + cols, to_out(acc, out_ptr.dtype.element_ty), mask=m)


@jit
def _grouped_glu_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, ge_ptr,
    S, N, K, E, T, UO, NG, UROW, UCOL,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_ym, alpha, limit,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BS: tl.constexpr, EP2: tl.constexpr,
    GROUP: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr, TMA_X: tl.constexpr, TMA_W: tl.constexpr, DEQ_BF16: tl.constexpr,
    ZERO_DOT: tl.constexpr, GATE: tl.constexpr, GS: tl.constexpr, QUANT_OUT: tl.constexpr,
    EMAX: tl.constexpr, MBITS: tl.constexpr, MAXN: tl.constexpr, EMIN: tl.constexpr,
    RULE: tl.constexpr, HW_CVT: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    """``moe.grouped_gemm_kernel`` for the gate-up projection: Yᵀ [BN columns, BM rows] of
    ``glu(gate, up)``, from weight rows j·GS and j·GS + UO of output column j (as the decode kernel
    reads them); the TMA view of W holds NG rows per expert, the up tile at (+UROW, +UCOL) from the
    gate tile. ``QUANT_OUT``: the result MX-rounded along its columns (the down projection's K)."""
    e, row0, pid_n, kind, offs_m, offs_n, mask, y_offs = prefill_tile(ge_ptr, y_ptr, S, N, E, T, stride_ym, BM, BN, EP2, GROUP)
    if kind != 0:
        return
    NB: tl.constexpr = BK // BS
    offs_k = tl.arange(0, BK)
    offs_b = tl.arange(0, NB)
    rn = tl.where(offs_n < N, offs_n, 0).to(tl.int64) * GS
    ru = rn + UO
    rm = tl.where(offs_m < S, offs_m, 0).to(tl.int64)
    e64 = e.to(tl.int64)
    s_ptrs = s_ptr + e64 * stride_se + rn[:, None] * stride_sn + offs_b[None, :]
    su_ptrs = s_ptr + e64 * stride_se + ru[:, None] * stride_sn + offs_b[None, :]
    w_ptrs = w_ptr
    wu_ptrs = w_ptr
    x_ptrs = x_ptr
    if not TMA_W:
        w_ptrs = w_ptr + e64 * stride_we + rn[:, None] * stride_wn + offs_k[None, :]
        wu_ptrs = w_ptr + e64 * stride_we + ru[:, None] * stride_wn + offs_k[None, :]
    if not TMA_X:
        x_ptrs = x_ptr + rm[None, :] * stride_xm + offs_k[:, None]
    w_row = e * NG + pid_n * BN
    smask = (offs_b * BS < K)[None, :]
    sc_next = tl.load(s_ptrs, mask=smask, other=127)
    scu_next = tl.load(su_ptrs, mask=smask, other=127)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    acc_u = tl.zeros((BN, BM), dtype=tl.float32)
    if ZERO_DOT:  # as in moe.grouped_gemm_kernel: a wgmma defines the accumulators
        acc = tl.dot(tl.zeros((BN, BK), DOT), tl.zeros((BK, BM), DOT), acc, input_precision=PRECISION)
        acc_u = tl.dot(tl.zeros((BN, BK), DOT), tl.zeros((BK, BM), DOT), acc_u, input_precision=PRECISION)
    for i in range(tl.cdiv(K, BK)):
        k = i * BK
        if TMA_W:
            w = w_ptr.load([w_row, k])
            wu = w_ptr.load([w_row + UROW, k + UCOL])
        elif EVEN_K:
            w = tl.load(w_ptrs + k)
            wu = tl.load(wu_ptrs + k)
        else:
            kmask = ((k + offs_k) < K)[None, :]
            w = tl.load(w_ptrs + k, mask=kmask, other=0.0)
            wu = tl.load(wu_ptrs + k, mask=kmask, other=0.0)
        xt = x_tile(x_ptr, x_ptrs, row0, k, K, offs_k, TMA_X, EVEN_K)
        sc = sc_next
        scu = scu_next
        nmask = ((k + BK + offs_b * BS) < K)[None, :]
        sc_next = tl.load(s_ptrs + (i + 1) * NB, mask=nmask, other=127)
        scu_next = tl.load(su_ptrs + (i + 1) * NB, mask=nmask, other=127)
        xd = xt.to(DOT)
        acc = tl.dot(dequant_tile(w, sc, BN, NB, BS, DEQ_BF16).to(DOT), xd, acc, input_precision=PRECISION)
        acc_u = tl.dot(dequant_tile(wu, scu, BN, NB, BS, DEQ_BF16).to(DOT), xd, acc_u, input_precision=PRECISION)
    if HAS_BIAS:  # in the MMA layout, before any transpose (moe.grouped_gemm_kernel)
        acc += tl.load(b_ptr + e64 * stride_be + rn, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
        acc_u += tl.load(b_ptr + e64 * stride_be + ru, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
    h = tl.trans(glu(acc, acc_u, y_ptr.dtype.element_ty, GATE, alpha, limit).to(tl.float32))
    if QUANT_OUT:
        h = tl.reshape(mx_round_dequant(tl.reshape(h, (BM, BN // BS, BS)), EMAX, MBITS, MAXN, EMIN, RULE, HW_CVT, FP8),
                       (BM, BN))  # fmt: skip
    tl.store(y_ptr + y_offs, to_out(h, y_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpertsWeights:
    """What the fused block reads of an ``MXExperts``: gate-up and down codes [E, N, K], scales
    [E, N, K/bs], biases [E, N] or None; the gate (``GATE_*``), its row rule (GS, UO: module doc
    of ``moe.grouped_decode_kernel``) and gpt-oss's alpha and limit; the activations' MX format
    (None: W8A16) and rule."""

    w1: torch.Tensor
    s1: torch.Tensor
    b1: torch.Tensor | None
    w2: torch.Tensor
    s2: torch.Tensor
    b2: torch.Tensor | None
    gate: int
    interleaved: bool
    alpha: float
    limit: float
    act_elem: ElemFormat | None
    act_rule: ScaleRule
    block_size: int


def _rows_per_expert(s: int, e: int) -> int:
    return -(-s // max(1, min(s, e)))


def pick_glu_config(s: int, e: int, n: int, k: int, x_dtype: torch.dtype, device: torch.device) -> GroupedGemmConfig:
    """Tiles of ``_grouped_glu_kernel`` (two accumulators: 64 columns a half). The row tile follows
    the rows per active expert: at a few rows each, 16-row tiles load 8x less padding than 128-row
    ones (H100, Qwen3-30B-A3B widths: 273 against 598 µs a layer at 32 tokens)."""
    if INTERPRET or device.type != "cuda":
        return GroupedGemmConfig(16, 32, 64, num_warps=4, num_stages=1, tma=False)
    if x_dtype != torch.bfloat16:
        return GroupedGemmConfig(64, 32, 32, num_warps=4, num_stages=3, deq_bf16=False)
    r = _rows_per_expert(s, e)
    if r <= 8:
        return GroupedGemmConfig(16, 64, 64, num_warps=4, num_stages=4)
    if r < 256:
        return GroupedGemmConfig(64, 64, 64, num_warps=4, num_stages=4)
    return GroupedGemmConfig(128, 64, 64, num_warps=8, num_stages=4)


def pick_down_config(s: int, e: int, n: int, k: int, x_dtype: torch.dtype, device: torch.device) -> GroupedGemmConfig:
    """Tiles of the down projection's grouped GEMM: row tiles by rows per expert as for gate-up,
    ``moe.pick_grouped_gemm_config`` from 64 rows an expert."""
    if INTERPRET or device.type != "cuda" or x_dtype != torch.bfloat16:
        return pick_grouped_gemm_config(s, e, n, k, x_dtype, device)
    r = _rows_per_expert(s, e)
    if r <= 8:
        return GroupedGemmConfig(16, 128, 64, num_warps=4, num_stages=4)
    if r <= 64:
        return GroupedGemmConfig(64, 128, 64, num_warps=8, num_stages=4)
    return pick_grouped_gemm_config(s, e, n, k, x_dtype, device)


def sort_chunks(s: int, ep2: int) -> tuple[int, int]:
    """The counting sort's step (pairs a loop step one-hots against ``ep2`` buckets) and chunk (pairs a
    program sorts) for ``s`` pairs (the constants above)."""
    sub = max(8, min(64, 4096 // ep2))
    if s <= SORT_ONE_MAX:
        return sub, max(sub, next_pow2(s))
    return sub, max(sub, 64 if s <= 1024 else SORT_CHUNK)


class BlockPlan:
    """One input signature's launches (module doc): which kernels, their tiles and grids."""

    def __init__(self, x: torch.Tensor, k_top: int, ex: ExpertsWeights):
        t, h = x.shape
        e, n1, _ = ex.w1.shape
        i = n1 // 2
        self.t, self.k_top, self.h, self.i, self.e = t, k_top, h, i, e
        s = self.s = t * k_top
        dev = x.device
        self.dev_index = x.get_device() if x.device.type == "cuda" else -1
        self.decode = s <= DECODE_MAX_ROWS
        self.ep2 = ep2 = max(16, next_pow2(e + 1))
        sub, self.chunk = sort_chunks(s, ep2)
        self.parts = cdiv(s, self.chunk)
        self.count = Launch(_route_count_kernel, dict(C=self.chunk, SUB=sub, EP2=ep2), dict(num_warps=8))
        self.sort = Launch(_route_sort_kernel, dict(C=self.chunk, SUB=sub, EP2=ep2, PB=8, ONE=self.parts == 1),
                           dict(num_warps=8))  # fmt: skip
        self.bh = min(1024, max(16, next_pow2(h)))
        self.combine = Launch(_combine_kernel, dict(TOPK=k_top, BH=self.bh), dict(num_warps=4))
        w8a8 = ex.act_elem is not None
        rnd = mx_round_consts(ex.act_elem, ex.act_rule, dev)
        bs = ex.block_size
        gate_rows = dict(GS=2 if ex.interleaved else 1)
        if self.decode:
            c1, c2 = pick_decode_configs(s, e, i, h, dev, w8a8)
            self.c1, self.c2 = c1, c2
            # a few tokens: no sort (the slots are the rows; a repeated expert is read again, from L2)
            self.direct = t <= DIRECT_MAX_TOKENS
            # W8A8: X's rows MX-rounded once by a small launch, gate-up behind it by PDL (moe_decode.ROUND_X)
            self.xq = None
            pdl = False
            if w8a8 and moe_decode.ROUND_X:
                pdl = pdl_ok(dev)
                self.xq = Launch(gather_rows_kernel, dict(BR=min(8, next_pow2(t)), BK=max(bs, min(256, next_pow2(h))),
                                                          BS=bs, QUANT=True, **rnd, IDX=False, PDL=pdl),
                                 dict(num_warps=4))  # fmt: skip
                self.bkx = self.xq.consts["BK"]
            self.g1 = Launch(grouped_decode_kernel, dict(
                BM=1, BN=c1.block_n, BK=c1.block_k, BS=bs, EP2=max(16, next_pow2(e)), HAS_BIAS=ex.b1 is not None,
                EVEN_K=h % c1.block_k == 0, QUANT=w8a8 and self.xq is None, NUM_STAGES=c1.num_stages, **rnd,
                GATE=ex.gate, GS=gate_rows["GS"], X_IDX=not self.direct, DIRECT=self.direct, TOPK=k_top,
                PDL_WAIT=pdl), dict(num_warps=c1.num_warps, launch_pdl=pdl))  # fmt: skip
            down = dict(TOPK=k_top, BN=c2.block_n, BK=c2.block_k, BS=bs, HAS_BIAS=ex.b2 is not None,
                        EVEN_K=i % c2.block_k == 0, QUANT=w8a8, NUM_STAGES=c2.num_stages, SORTED=not self.direct, **rnd)
            self.g2 = Launch(down_combine_kernel, down, dict(num_warps=c2.num_warps))
            self.slots = Launch(down_slots_kernel, down, dict(num_warps=c2.num_warps)) if moe_decode.SLOTS else None
            self.nt = cdiv(h, c2.block_n)
            return
        interp = INTERPRET or dev.type != "cuda"
        # bf16 X: bf16 dots (exact products); otherwise fp32 rows and fp32 FMA dots, exact as well
        exact32 = interp or x.dtype != torch.bfloat16
        xdt = torch.float32 if exact32 else torch.bfloat16
        c1, c2 = pick_glu_config(s, e, i, h, xdt, dev), pick_down_config(s, e, h, i, xdt, dev)
        self.c1, self.c2 = c1, c2
        dot, prec = (tl.float32, "ieee") if exact32 else (tl.bfloat16, "tf32")
        self.xdtype = xdt  # the rows the tensor-core kernels read
        zero = not interp and wgmma_async_ok()
        self.gather = Launch(gather_rows_kernel, dict(
            BR=8, BK=max(bs, min(512, next_pow2(h))), BS=bs, QUANT=w8a8, **rnd), dict(num_warps=4))  # fmt: skip
        self.tma = tma = c1.tma and c2.tma and not interp and TensorDescriptor is not None
        common = dict(BS=bs, EP2=max(16, next_pow2(e)), GROUP=c1.group, DOT=dot, PRECISION=prec, ZERO_DOT=zero)
        self.g1 = Launch(_grouped_glu_kernel, dict(
            BM=c1.block_m, BN=c1.block_n, BK=c1.block_k, HAS_BIAS=ex.b1 is not None, EVEN_K=h % c1.block_k == 0,
            TMA_X=tma, TMA_W=tma, DEQ_BF16=dot == tl.bfloat16, GATE=ex.gate, QUANT_OUT=w8a8, **gate_rows, **rnd,
            **common), dict(num_warps=c1.num_warps, num_stages=c1.num_stages))  # fmt: skip
        self.g2 = Launch(grouped_gemm_kernel, dict(
            BM=c2.block_m, BN=c2.block_n, BK=c2.block_k, HAS_BIAS=ex.b2 is not None, EVEN_K=i % c2.block_k == 0,
            TMA_X=tma, TMA_W=tma, DEQ_BF16=dot == tl.bfloat16, **{**common, "GROUP": c2.group}),
            dict(num_warps=c2.num_warps, num_stages=c2.num_stages))  # fmt: skip
        self.tiles1 = cdiv(s, c1.block_m) + min(s, e)
        self.tiles2 = cdiv(s, c2.block_m) + min(s, e)

    def _sort(self, ids):
        """The counting sort (one launch; two from ``SORT_CHUNK`` pairs): pos, token, group_end."""
        dv, dev = ids.device, self.dev_index
        pos = torch.empty(self.s, dtype=torch.int32, device=dv)
        tok = torch.empty(self.s, dtype=torch.int32, device=dv)
        ge = torch.empty(self.e, dtype=torch.int32, device=dv)
        if self.parts > 1:
            counts = torch.empty((self.parts, self.ep2), dtype=torch.int32, device=dv)
            self.count.on_device((self.parts,), dev, ids, counts, self.s, self.e)
        else:
            counts = pos
        self.sort.on_device((self.parts,), dev, ids, counts, pos, tok, ge, self.s, self.e, self.parts, self.k_top)
        return pos, tok, ge

    def _decode(self, x, ids, weights, ex: ExpertsWeights) -> torch.Tensor:
        """Decode: (the sort,) (X rounded,) gate-up with the gate, then down with the combine: 2-4 launches."""
        s, h, i, dev, c1 = self.s, self.h, self.i, self.dev_index, self.c1
        if self.direct:
            pos = ge = idx = ids
        else:
            pos, idx, ge = self._sort(ids)
        b1 = ex.b1 if ex.b1 is not None else ex.s1
        b2 = ex.b2 if ex.b2 is not None else ex.s2
        if self.xq is not None:
            xr = torch.empty((self.t, h), dtype=x.dtype, device=x.device)
            self.xq.on_device((cdiv(self.t, self.xq.consts["BR"]), cdiv(h, self.bkx)), dev,
                              x, ids, xr, self.t, h, x.stride(0), xr.stride(0))  # fmt: skip
            x = xr
        hid = torch.empty((s, i), dtype=x.dtype, device=x.device)
        self.g1.on_device((cdiv(i, c1.block_n), s), dev,
                          x, ex.w1, ex.s1, b1, hid, ge, idx, s, i, h, self.e, 1 if ex.interleaved else i, x.stride(0),
                          ex.w1.stride(0), ex.w1.stride(1), ex.s1.stride(0), ex.s1.stride(1),
                          ex.b1.stride(0) if ex.b1 is not None else 0, hid.stride(0), ex.alpha, ex.limit)  # fmt: skip
        out = torch.empty((self.t, h), dtype=x.dtype, device=x.device)
        strides = (ex.w2.stride(0), ex.w2.stride(1), ex.s2.stride(0), ex.s2.stride(1),
                   ex.b2.stride(0) if ex.b2 is not None else 0)  # fmt: skip
        cnt = split_counters(x.device, self.t * self.nt) if self.slots is not None else None
        if cnt is not None:
            y = torch.empty((s, h), dtype=x.dtype, device=x.device)
            self.slots.on_device((self.nt, s), dev, hid, ex.w2, ex.s2, b2, y, out, cnt, ids, pos, weights, h, i,
                                 self.e, self.nt, hid.stride(0), *strides, y.stride(0), out.stride(0))  # fmt: skip
        else:  # no counters yet (a CUDA graph being captured): the per-token kernel
            self.g2.on_device((self.nt, self.t), dev, hid, ex.w2, ex.s2, b2, out, ids, pos, weights, h, i, self.e,
                              hid.stride(0), *strides, out.stride(0))  # fmt: skip
        return out

    def __call__(self, x, ids, weights, ex: ExpertsWeights) -> torch.Tensor:
        s, e, h, i, dev = self.s, self.e, self.h, self.i, self.dev_index
        dv = x.device
        if self.decode:
            return self._decode(x, ids, weights, ex)
        pos, tok, ge = self._sort(ids)
        w1, s1, w2, s2 = ex.w1, ex.s1, ex.w2, ex.s2
        b1 = ex.b1 if ex.b1 is not None else s1
        b2 = ex.b2 if ex.b2 is not None else s2
        uo = 1 if ex.interleaved else i
        hid = torch.empty((s, i), dtype=x.dtype, device=dv)
        y = torch.empty((s, h), dtype=x.dtype, device=dv)
        c1, c2 = self.c1, self.c2
        xs = torch.empty((s, h), dtype=self.xdtype, device=dv)
        self.gather.on_device((cdiv(s, 8), cdiv(h, self.gather.consts["BK"])), dev,
                              x, tok, xs, s, h, x.stride(0), xs.stride(0))  # fmt: skip
        if ex.interleaved:
            ng, urow, ucol = i, 0, h
            w1v = w1.view(e * i, 2 * h)
        else:
            ng, urow, ucol = 2 * i, i, 0
            w1v = w1.view(e * 2 * i, h)
        if self.tma:
            xa = launch.descriptor(TensorDescriptor, xs, [s, h], [h, 1], [c1.block_m, c1.block_k])
            wa = launch.descriptor(TensorDescriptor, w1v, list(w1v.shape), [w1v.stride(0), 1], [c1.block_n, c1.block_k])
        else:
            xa, wa = xs, w1
        self.g1.on_device((self.tiles1 * cdiv(i, c1.block_n),), dev,
                          xa, wa, s1, b1, hid, ge, s, i, h, e, self.tiles1, uo, ng, urow, ucol,
                          xs.stride(0), w1.stride(0), w1.stride(1), s1.stride(0), s1.stride(1),
                          b1.stride(0) if ex.b1 is not None else 0, hid.stride(0), ex.alpha, ex.limit)  # fmt: skip
        hin = hid if hid.dtype == self.xdtype else hid.to(self.xdtype)
        if self.tma:
            ha = launch.descriptor(TensorDescriptor, hin, [s, i], [i, 1], [c2.block_m, c2.block_k])
            w2v = w2.view(e * h, i)
            wa2 = launch.descriptor(TensorDescriptor, w2v, [e * h, i], [i, 1], [c2.block_n, c2.block_k])
        else:
            ha, wa2 = hin, w2
        self.g2.on_device((self.tiles2 * cdiv(h, c2.block_n),), dev,
                          ha, wa2, s2, b2, y, ge, s, h, i, e, self.tiles2, hin.stride(0), w2.stride(0),
                          w2.stride(1), s2.stride(0), s2.stride(1), y.stride(0))  # fmt: skip
        out = torch.empty((self.t, h), dtype=x.dtype, device=dv)
        self.combine.on_device((self.t, cdiv(h, self.bh)), dev, y, pos, weights, out, h, y.stride(0), out.stride(0))
        return out


PLANS = PlanCache(256)


class BlockProblem(NamedTuple):
    """One experts call as the registry sees it (host facts; hashable)."""

    device: torch.device
    x_dtype: torch.dtype
    gate: int  # GATE_*
    block_size: int
    act: object  # the activations' TensorSpec, None for W8A16
    spec: str  # the kernels spec (a path named on a CPU runs in the interpreter)


def _block_supports(p: BlockProblem) -> bool:
    return (HAS_TRITON and p.gate != GATE_NONE and triton_runs(p.device, p.spec)
            and p.x_dtype in (torch.bfloat16, torch.float16, torch.float32) and p.block_size in (16, 32, 64)
            and (p.act is None or p.act.scale_rule is not ScaleRule.MSE))  # fmt: skip


def _not_here(*args):
    raise AssertionError("the experts module runs its own paths: BLOCK only chooses")


# The fused block, or "reference": the experts module's per-projection path (``GROUPED`` per
# projection, the family's gate in torch), which takes the named grouped paths.
BLOCK = Registry("moe block", [
    KernelPath("moe_block", "fused experts block: sort, gate-up + gate, down, combine in <= 6 launches",
               _block_supports, _not_here),
    KernelPath("reference", "per-projection grouped GEMMs, the family's gate and the combine in torch",
               lambda p: True, _not_here),
])  # fmt: skip


def experts_forward(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, ex: ExpertsWeights) -> torch.Tensor:
    """The experts' weighted sum per token (module doc): x [T, H], ``top_k_index`` [T, k] (any
    integer dtype), ``top_k_weights`` [T, k] -> [T, H] in x's dtype."""
    x = x if x.is_contiguous() else x.contiguous()
    if not all(t is None or t.is_contiguous() for t in (ex.w1, ex.s1, ex.b1, ex.w2, ex.s2, ex.b2)):
        ex = dataclasses.replace(ex, **{f: getattr(ex, f).contiguous() for f in ("w1", "s1", "b1", "w2", "s2", "b2")
                                        if getattr(ex, f) is not None})  # a strided view (a shard): copied
    ids = top_k_index if top_k_index.is_contiguous() else top_k_index.contiguous()
    w = top_k_weights if top_k_weights.is_contiguous() else top_k_weights.contiguous()
    t, k_top = ids.shape
    if t == 0:
        return x.new_zeros(x.shape)
    key = (t, k_top, tuple(x.shape), x.dtype, x.device, ids.dtype, w.dtype, x.data_ptr() % 16 == 0,
           ex.w1.shape, ex.w2.shape, ex.w1.dtype, ex.b1 is not None, ex.b2 is not None, ex.gate, ex.interleaved,
           ex.act_elem, ex.act_rule, ex.block_size)  # fmt: skip
    plan = PLANS.get(key)
    if plan is None:
        plan = PLANS.put(key, BlockPlan(x, k_top, ex))
    return plan(x, ids, w, ex)
