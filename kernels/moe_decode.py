"""The fused experts block's decode kernels after the gate-up projection: the down projection and
the combine into token order (``moe_block`` runs them; its module doc has the whole block).

Two kernels compute the same function, out[t] = Σ_j fp32(y_j) · w[t, j] in slot order (one fused
multiply-add a slot, so the same bits in both), with
y_j = h[row_j] · W[e_j]ᵀ + b[e_j] rounded to the output dtype and a slot outside [0, E) adding
nothing:

- ``down_slots_kernel``: program (column tile, slot). Each slot's y tile goes to a small buffer in
  the output dtype; the program that takes the token's last ticket (an atomic counter per token
  and column tile, ``buffers.split_counters``) sums the token's k tiles in slot order, writes the
  output and resets the ticket. k times the programs of the per-token kernel, so k times the
  weight bytes in flight, and still one launch.
- ``down_combine_kernel``: program (column tile, token), the token's k experts one after another.
  It needs no counters: the block takes it while a CUDA graph is being captured before the
  counters exist.
"""

from __future__ import annotations

import dataclasses

import torch

from mxq.kernels.moe import (
    HAS_TRITON,
    GroupedDecodeConfig,
    jit,
    pick_grouped_decode_config,
    weight_block_step,
)

if HAS_TRITON:
    import triton.language as tl

    from mxq.kernels.common import INTERPRET, mx_round_dequant, to_out


@jit
def _expert_row(h_ptr, w_ptr, s_ptr, b_ptr, pos_ptr, ej, slot, rn, nmask, K, stride_hm, stride_we, stride_wn,
                stride_se, stride_sn, stride_be, OUT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                BS: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, QUANT: tl.constexpr,
                NUM_STAGES: tl.constexpr, SORTED: tl.constexpr, EMAX: tl.constexpr, MBITS: tl.constexpr,
                MAXN: tl.constexpr, EMIN: tl.constexpr, RULE: tl.constexpr, HW_CVT: tl.constexpr,
                FP8: tl.constexpr):  # fmt: skip
    """y = h[row] · W[ej]ᵀ (+ b[ej]) for the BN weight rows ``rn``, rounded to ``OUT``, as fp32; row is
    ``slot``, or ``pos[slot]`` where h is in sorted order. W as ``moe.grouped_decode_kernel``'s
    one-row tiles ([BN, NB, BS] codes, a block's sum in-thread), h MX-rounded as loaded for W8A8."""
    row = slot.to(tl.int64)
    if SORTED:
        row = tl.load(pos_ptr + slot).to(tl.int64)
    NB: tl.constexpr = BK // BS
    offs_b = tl.arange(0, NB)
    kk = offs_b[:, None] * BS + tl.arange(0, BS)[None, :]
    w_ptrs = w_ptr + ej * stride_we + rn[:, None, None] * stride_wn + kk[None, :, :]
    s_ptrs = s_ptr + ej * stride_se + rn[:, None] * stride_sn + offs_b[None, :]
    acc = tl.zeros((BN, NB), dtype=tl.float32)
    for i in tl.range(tl.cdiv(K, BK), num_stages=NUM_STAGES):
        k = i * BK
        wf, sf = weight_block_step(w_ptrs, s_ptrs, i, K, BK, BS, EVEN_K)
        if EVEN_K:
            hm = tl.load(h_ptr + row * stride_hm + k + kk)
        else:
            hm = tl.load(h_ptr + row * stride_hm + k + kk, mask=(k + kk) < K, other=0.0)
        hm = hm.to(tl.float32)[None, :, :]
        if QUANT:
            hm = mx_round_dequant(hm, EMAX, MBITS, MAXN, EMIN, RULE, HW_CVT, FP8)
        acc += tl.sum(wf * hm, axis=2) * sf
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + ej * stride_be + rn, mask=nmask, other=0.0).to(tl.float32)
    return to_out(y, OUT).to(tl.float32)


@jit
def down_slots_kernel(
    h_ptr, w_ptr, s_ptr, b_ptr, y_ptr, out_ptr, cnt_ptr, ids_ptr, pos_ptr, rw_ptr,
    N, K, E, NT, stride_hm, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_ym, stride_om,
    TOPK: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BS: tl.constexpr, HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr, QUANT: tl.constexpr, NUM_STAGES: tl.constexpr, SORTED: tl.constexpr,
    EMAX: tl.constexpr, MBITS: tl.constexpr, MAXN: tl.constexpr, EMIN: tl.constexpr,
    RULE: tl.constexpr, HW_CVT: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    """Program (n tile, slot): the slot's y tile into ``y`` [T·k, N] (output dtype); the token's
    last program (ticket ``cnt[t · NT + n tile]``) sums fp32(y_j) · w[t, j] over its slots in slot
    order into ``out`` and resets the ticket (module doc). h's row is the slot, or ``pos[slot]``
    where h is in sorted order."""
    pid_n = tl.program_id(0)
    slot = tl.program_id(1)
    t = slot // TOPK
    offs_n = pid_n * BN + tl.arange(0, BN)
    nmask = offs_n < N
    rn = tl.where(nmask, offs_n, 0).to(tl.int64)
    ej = tl.load(ids_ptr + slot).to(tl.int64)
    if (ej >= 0) & (ej < E):
        y = _expert_row(h_ptr, w_ptr, s_ptr, b_ptr, pos_ptr, ej, slot, rn, nmask, K, stride_hm, stride_we, stride_wn,
                        stride_se, stride_sn, stride_be, out_ptr.dtype.element_ty, BN, BK, BS, HAS_BIAS, EVEN_K,
                        QUANT, NUM_STAGES, SORTED, EMAX, MBITS, MAXN, EMIN, RULE, HW_CVT, FP8)  # fmt: skip
        tl.store(y_ptr + slot.to(tl.int64) * stride_ym + offs_n, y.to(y_ptr.dtype.element_ty), mask=nmask)
    tl.debug_barrier()  # every thread's tile is stored before the release below
    ticket = tl.atomic_add(cnt_ptr + t * NT + pid_n, 1, sem="acq_rel", scope="gpu")
    if ticket == TOPK - 1:
        total = tl.zeros((BN,), tl.float32)
        for j in tl.static_range(TOPK):  # slot order: the same sum whoever is last
            sj = t * TOPK + j
            e2 = tl.load(ids_ptr + sj)
            yj = tl.load(y_ptr + sj.to(tl.int64) * stride_ym + offs_n, mask=nmask, other=0.0, cache_modifier=".cg")
            wj = tl.load(rw_ptr + sj).to(tl.float32)
            total = tl.where((e2 >= 0) & (e2 < E), tl.fma(yj.to(tl.float32), wj, total), total)
        tl.store(out_ptr + t.to(tl.int64) * stride_om + offs_n, to_out(total, out_ptr.dtype.element_ty), mask=nmask)
        tl.atomic_xchg(cnt_ptr + t * NT + pid_n, 0, sem="relaxed", scope="gpu")  # ready for the next call


@jit
def down_combine_kernel(
    h_ptr, w_ptr, s_ptr, b_ptr, out_ptr, ids_ptr, pos_ptr, rw_ptr,
    N, K, E, stride_hm, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_om,
    TOPK: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BS: tl.constexpr, HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr, QUANT: tl.constexpr, NUM_STAGES: tl.constexpr, SORTED: tl.constexpr,
    EMAX: tl.constexpr, MBITS: tl.constexpr, MAXN: tl.constexpr, EMIN: tl.constexpr,
    RULE: tl.constexpr, HW_CVT: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    """Program (n tile, token t): the token's k slots one after another, summed as in
    ``down_slots_kernel``'s last program (module doc)."""
    pid_n = tl.program_id(0)
    t = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    nmask = offs_n < N
    rn = tl.where(nmask, offs_n, 0).to(tl.int64)
    total = tl.zeros((BN,), tl.float32)
    for j in range(TOPK):
        slot = t * TOPK + j
        ej = tl.load(ids_ptr + slot).to(tl.int64)
        if (ej >= 0) & (ej < E):
            y = _expert_row(h_ptr, w_ptr, s_ptr, b_ptr, pos_ptr, ej, slot, rn, nmask, K, stride_hm, stride_we,
                            stride_wn, stride_se, stride_sn, stride_be, out_ptr.dtype.element_ty, BN, BK, BS, HAS_BIAS,
                            EVEN_K, QUANT, NUM_STAGES, SORTED, EMAX, MBITS, MAXN, EMIN, RULE, HW_CVT, FP8)  # fmt: skip
            total = tl.fma(y, tl.load(rw_ptr + slot).to(tl.float32), total)
    tl.store(out_ptr + t.to(tl.int64) * stride_om + offs_n, to_out(total, out_ptr.dtype.element_ty), mask=nmask)


def pick_decode_configs(s: int, e: int, i: int, h: int, device: torch.device, w8a8: bool):
    """Tiles of the two decode launches: gate-up one row per tile (row blocks of 2-8 were slower on
    an H100 at every batch measured), 16 output columns a program (two weight streams: more programs
    on the SMs); the down kernel's output columns per program, K step, warps and stages
    (kernels/NOTES.md, "MoE: the fused block")."""
    if INTERPRET or device.type != "cuda":
        c1 = pick_grouped_decode_config(s, e, i, h, device, w8a8)
        return dataclasses.replace(c1, block_m=1), GroupedDecodeConfig(1, 16, 64, num_warps=4, num_stages=1)
    c1 = GroupedDecodeConfig(1, 16, 256, num_warps=4)
    if SLOTS:  # a program per slot: 32 x 256 tiles, 8 warps where h is rounded as loaded (W8A8)
        return c1, GroupedDecodeConfig(1, 32, 256, num_warps=8 if w8a8 else 4, num_stages=3)
    if s <= 8:  # one token (top-8 or less): the fewest columns, the most programs (8 x 256 tiles, 4 warps)
        return c1, GroupedDecodeConfig(1, 8, 256, num_warps=4, num_stages=4)
    return c1, GroupedDecodeConfig(1, 32, 256, num_warps=8, num_stages=4)


ROUND_X = True  # W8A8: X rounded once ahead of gate-up (False: inside every gate-up program, for A/B)
SLOTS = True  # down_slots_kernel where the counters exist (False: down_combine_kernel, for A/B)
