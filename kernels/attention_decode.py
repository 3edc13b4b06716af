"""MXFP8 attention decode: one query token per sequence against the MXFP8 KV cache.

What it computes: ``mx_attention_decode`` is ``mxq.kernels.reference.mx_attention_reference``
on the dequantized cache (``k_rotated`` when ``qk_rotation``): the cache's MX values are fixed
points of MX rounding, so Q is the only operand rounded here (and rotated, with the Q/K
rotation). The kernels read the cache as it is stored, fp8 elements + E8M0 bytes (1 + 1/32 bytes
per element), split the context over programs (split-KV) and merge the partial softmaxes.

Which kernel runs is the registry ``DECODE`` (``kernels/registry.py``), in order:

- ``attn_decode_ws`` (``attention_decode_ws``, Gluon): Hopper only, and by default only under
  CUDA-graph capture, where GPU time decides and ws takes less of it than gqa; eager calls are
  launch-bound and gqa is one launch, ws three (kernels/NOTES.md, "Attention: decode
  warp-specialized in Gluon"). A compile error turns it off and the call takes the next path.
- ``attn_decode_gqa`` (``decode_gqa_kernel``, Triton): wherever Triton runs (CUDA, or the CPU
  interpreter): all query heads of a kv head in one program, fp16 MMAs on the raw fp8 tiles
  (exact), the E8M0 scales applied per block after the products.
- ``reference``: ``mx_attention_reference`` on the dequantized cache, in torch.

``decode_path`` gives the path a call takes (what a benchmark table reports is what ran).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from mxq.formats import E4M3, ElemFormat, ScaleRule, as_elem_format, as_scale_rule, decode_e8m0
from mxq.kernels import attention_decode_ws as _ws
from mxq.kernels import gluon_api
from mxq.kernels.attention_decode_common import (
    DecodeProblem,
    check_counters,
    decode_merge_kernel,
    decode_problem,
    decode_qn,
)
from mxq.kernels.attention_rotate import (
    LOG2E,
    bf16_parts,
    mask_args,
    padded_head_dim,
    q_rotation_operand,
)
from mxq.kernels.common import INTERPRET, masked_max, mma, mx_round_consts
from mxq.kernels.launch import call, cdiv, next_pow2, on_input_device
from mxq.kernels.reference import hadamard_block, mx_attention_reference
from mxq.kernels.registry import KernelPath, Registry

# ---------------------------------------------------------------------------------------------
# The Triton kernel ("gqa")
# ---------------------------------------------------------------------------------------------

@triton.jit
def _gqa_scales(
    ksbase, vsbase, start_n, L, DP, D, stride_ksn, stride_vsd, stride_vsp,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, MASK_D: tl.constexpr,
):  # fmt: skip
    """The E8M0 bytes of one decode tile (keys ``start_n`` on, masked to L): K's per key and D
    block, V's per channel and 32-key page. Loaded one tile ahead of their use (a plain load is
    not pipelined by the compiler, and its latency would sit in every tile's chain)."""
    DB: tl.constexpr = BLOCK_D // 32
    PP: tl.constexpr = BLOCK_N // 32
    cols = start_n + tl.arange(0, BLOCK_N)
    offs_j = tl.arange(0, DB)
    offs_d = tl.arange(0, BLOCK_D)
    pages = start_n // 32 + tl.arange(0, PP)
    smask = (cols < L)[:, None]
    vsmask = (pages * 32 < L)[None, :]
    if MASK_D:
        smask = smask & (offs_j < DP // 32)[None, :]
        vsmask = vsmask & (offs_d < D)[:, None]
    ke = tl.load(ksbase + cols[:, None] * stride_ksn + offs_j[None, :], mask=smask, other=127)
    ve = tl.load(vsbase + offs_d[:, None] * stride_vsd + pages[None, :] * stride_vsp, mask=vsmask, other=127)
    return ke, ve


@triton.jit
def _gqa_tile(
    acc, m_i, l_i, qb, cq, kbase, ke, vbase, ve, mbase, start_n,
    L, DP, D, qk_scale, stride_kn, stride_vd, stride_vp, stride_mh, stride_mn,
    GP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, GROUP_C: tl.constexpr,
    MASKED: tl.constexpr, MASK_D: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr,
    INTERP: tl.constexpr,
):  # fmt: skip
    DB: tl.constexpr = BLOCK_D // 32
    PP: tl.constexpr = BLOCK_N // 32
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_p = tl.arange(0, PP)
    offs_g = tl.arange(0, GP)
    cols = start_n + offs_n
    kin = cols < L
    # Q·Kᵀ with the K scales after the product: R[n, (g, j)] = q8_j[g]·k8_j[n] over D block j
    # (qb is block-diagonal over the D blocks), s[n, g] = sum_j R[n, (g, j)] * 2^ek[n, j] * cq[g, j].
    kmask = None
    if MASKED:
        kmask = kin[:, None]
    if MASK_D:
        kmask = (offs_d < DP)[None, :] if kmask is None else kmask & (offs_d < DP)[None, :]
    if MASKED or MASK_D:
        k8 = tl.load(kbase + cols[:, None] * stride_kn + offs_d[None, :], mask=kmask, other=0.0)
    else:
        k8 = tl.load(kbase + cols[:, None] * stride_kn + offs_d[None, :])
    # E8M0 -> fp32 by the bare shift, not ``common.e8m0_to_f32``: the same value for every byte a
    # cache written by mxq holds. Byte 0 does not occur (``mxq.formats`` clamps finite scales to
    # 2**-126 and up), and byte 255 (a block holding a NaN or Inf) comes with NaN element codes, so
    # the block's product is NaN with the +inf scale as well. The two selects for those bytes would
    # lengthen every tile's instruction chain, measurably (kernels/NOTES.md, "Attention: the Triton
    # decode kernel"). The same for V's scales below.
    ksc = (ke.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    r = mma(k8.to(tl.float16), qb, tl.zeros([BLOCK_N, GP * DB], tl.float32), INTERP)
    r = tl.reshape(r, (BLOCK_N, GP, DB))
    s = tl.sum(r * (ksc[:, None, :] * cq[None, :, :]), axis=2) * qk_scale  # [BLOCK_N, GP]
    ok = (offs_g < GROUP_C)[None, :]
    if MASKED:
        ok = ok & kin[:, None]
    mv = 0
    if HAS_MASK:
        mv = tl.load(mbase + offs_g[None, :] * stride_mh + cols[:, None] * stride_mn, mask=ok, other=0)
    s, m_new, m_use = masked_max(s, ok, mv, m_i, 0, HAS_MASK, MASK_BOOL)
    alpha = tl.math.exp2(m_i - m_use)
    p = tl.math.exp2(s - m_use[None, :])
    l_i = l_i * alpha + tl.sum(p, 0)
    # P·V with V's per-page scales after the product: P' [n, (g, page, hi|lo)] is P split in two
    # fp16 parts (fp32-class) placed block-diagonally over the 32-key pages of the tile.
    p_hi = p.to(tl.float16)
    p_lo = (p - p_hi.to(tl.float32)).to(tl.float16)
    onpage = (offs_n // 32)[:, None, None, None] == offs_p[None, None, :, None]
    hl = tl.arange(0, 2)[None, None, None, :]
    pp4 = tl.where(hl == 0, p_hi[:, :, None, None], p_lo[:, :, None, None])
    pp4 = tl.where(onpage, pp4, tl.zeros([BLOCK_N, GP, PP, 2], tl.float16))
    pb = tl.reshape(pp4, (BLOCK_N, GP * PP * 2))
    vmask = None
    if MASKED:
        vmask = kin[None, :]
    if MASK_D:
        vmask = (offs_d < D)[:, None] if vmask is None else vmask & (offs_d < D)[:, None]
    # key n of V sits at page n // 32, slot n % 32: one row of Vᵀ (stride_vp = 32) or [D, 32] pages
    vcols = (cols // 32) * stride_vp + cols % 32
    if MASKED or MASK_D:
        v8 = tl.load(vbase + offs_d[:, None] * stride_vd + vcols[None, :], mask=vmask, other=0.0)
    else:
        v8 = tl.load(vbase + offs_d[:, None] * stride_vd + vcols[None, :])
    vsc = (ve.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # the bare shift: see ksc above
    t = mma(v8.to(tl.float16), pb, tl.zeros([BLOCK_D, GP * PP * 2], tl.float32), INTERP)
    t = tl.sum(tl.reshape(t, (BLOCK_D, GP, PP, 2)), axis=3)
    acc = acc * alpha[None, :] + tl.sum(t * vsc[:, None, :], axis=2)
    return acc, m_new, l_i


@triton.jit
def _block_diagonal(qn, BLOCK_D: tl.constexpr, DB: tl.constexpr, GP: tl.constexpr):
    """``decode_qn``'s query blocks [GP, BLOCK_D] laid block-diagonally over the D blocks:
    [BLOCK_D, GP * DB] fp16, column (g, j) holding head g's block j."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_j = tl.arange(0, DB)
    qb = tl.where((offs_d // 32)[:, None, None] == offs_j[None, None, :], tl.trans(qn)[:, :, None], 0.0)
    return tl.reshape(qb, (BLOCK_D, GP * DB)).to(tl.float16)


@triton.jit
def decode_gqa_kernel(
    Q, KD, KS, VD, VS, ML, ACC, MASK, ROT,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kn,
    stride_ksb, stride_ksh, stride_ksn,
    stride_vb, stride_vh, stride_vd,
    stride_vsb, stride_vsh, stride_vsd,
    stride_mb, stride_mh, stride_mn,
    stride_vp, stride_vsp,
    Hkv, L, D, DP, CHUNK, NSPLIT, qk_scale,
    GROUP_C: tl.constexpr, GP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    MASK_D: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr,
    EMAX: tl.constexpr, MBITS: tl.constexpr, MAXN: tl.constexpr, EMIN: tl.constexpr,
    RULE: tl.constexpr, HW_CVT: tl.constexpr, FP8: tl.constexpr, INTERP: tl.constexpr,
    QPARTS: tl.constexpr = 0, QM: tl.constexpr = 16, ROT_NB: tl.constexpr = 0,
    FUSE_MERGE: tl.constexpr = False, COUNT=None, Out=None, stride_ob=0, stride_oh=0, MERGE_CHUNK: tl.constexpr = 4,
):  # fmt: skip
    """One program per (batch, kv head, split): all GROUP_C query heads of the KV head at once.

    The cache tiles are read once as fp8, widened to fp16 (exact) and fed to the MMAs unscaled;
    the E8M0 scales multiply the per-block partial products (one per 32 D-columns for K, one per
    32-key page and channel for V) instead of every element.
    """
    DB: tl.constexpr = BLOCK_D // 32
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // Hkv
    hk = pid % Hkv
    offs_g = tl.arange(0, GP)
    heads = hk * GROUP_C + offs_g
    gmask = offs_g < GROUP_C

    lo = split * CHUNK
    hi = tl.minimum(lo + CHUNK, L)
    n_full = tl.maximum(lo, lo + (hi - lo) // BLOCK_N * BLOCK_N)
    qn, cq = decode_qn(
        Q, ROT, b, hk, stride_qb, stride_qh, stride_qd, D, GROUP_C, GP, BLOCK_D, DB,
        EMAX, MBITS, MAXN, EMIN, RULE, HW_CVT, FP8, INTERP, QPARTS, QM, ROT_NB,
    )  # fmt: skip
    qb = _block_diagonal(qn, BLOCK_D, DB, GP)  # Q·Kᵀ for every D block in one MMA

    kbase = KD + b.to(tl.int64) * stride_kb + hk * stride_kh
    ksbase = KS + b.to(tl.int64) * stride_ksb + hk * stride_ksh
    vbase = VD + b.to(tl.int64) * stride_vb + hk * stride_vh
    vsbase = VS + b.to(tl.int64) * stride_vsb + hk * stride_vsh
    mbase = MASK + b.to(tl.int64) * stride_mb + hk * GROUP_C * stride_mh

    m_i = tl.full([GP], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GP], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D, GP], dtype=tl.float32)
    ke, ve = _gqa_scales(ksbase, vsbase, lo, L, DP, D, stride_ksn, stride_vsd, stride_vsp, BLOCK_N, BLOCK_D, MASK_D)
    for start_n in range(lo, n_full, BLOCK_N):
        ke_next, ve_next = _gqa_scales(
            ksbase, vsbase, start_n + BLOCK_N, L, DP, D, stride_ksn, stride_vsd, stride_vsp, BLOCK_N, BLOCK_D, MASK_D
        )  # fmt: skip
        acc, m_i, l_i = _gqa_tile(
            acc, m_i, l_i, qb, cq, kbase, ke, vbase, ve, mbase, start_n,
            L, DP, D, qk_scale, stride_kn, stride_vd, stride_vp, stride_mh, stride_mn,
            GP, BLOCK_N, BLOCK_D, GROUP_C, False, MASK_D, HAS_MASK, MASK_BOOL, INTERP,
        )  # fmt: skip
        ke, ve = ke_next, ve_next
    for start_n in range(n_full, hi, BLOCK_N):  # at most one partial tile; its scales are loaded
        acc, m_i, l_i = _gqa_tile(
            acc, m_i, l_i, qb, cq, kbase, ke, vbase, ve, mbase, start_n,
            L, DP, D, qk_scale, stride_kn, stride_vd, stride_vp, stride_mh, stride_mn,
            GP, BLOCK_N, BLOCK_D, GROUP_C, True, MASK_D, HAS_MASK, MASK_BOOL, INTERP,
        )  # fmt: skip

    if FUSE_MERGE:
        _merge_splits(
            acc, m_i, l_i, ML, ACC, COUNT + pid, Out + b.to(tl.int64) * stride_ob + hk * GROUP_C * stride_oh,
            stride_oh, (b * Hkv + hk) * GROUP_C, split, NSPLIT, D, GP, GROUP_C, BLOCK_D, MERGE_CHUNK,
        )  # fmt: skip
    else:
        _store_partial(acc, m_i, l_i, ML, ACC, (b * Hkv * GROUP_C + heads) * NSPLIT + split, gmask, BLOCK_D)


@triton.jit
def _store_partial(acc, m_i, l_i, ML, ACC, row, gmask, BLOCK_D: tl.constexpr):
    """One split's partial result for the merge: (m, l) per query head, acc [BLOCK_D, GP] as rows."""
    tl.store(ML + row * 2, m_i, mask=gmask)
    tl.store(ML + row * 2 + 1, l_i, mask=gmask)
    tl.store(ACC + row[None, :] * BLOCK_D + tl.arange(0, BLOCK_D)[:, None], acc, mask=gmask[None, :])


@triton.jit
def _merge_splits(
    acc, m_i, l_i, ML, ACC, count_ptr, out_base, stride_oh, head0, split, NSPLIT, D,
    GP: tl.constexpr, GROUP_C: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK_S: tl.constexpr,
):  # fmt: skip
    """The split-KV merge inside the decode kernel: every split stores its partial (m, l, acc);
    the program that finishes last for this (batch, kv head) merges them all and writes the
    output. Last = the one whose ticket from an atomic counter is NSPLIT - 1; it resets the
    counter to 0, so the same counter serves the next call and every CUDA-graph replay.
    acc is [BLOCK_D, GP] (channels x query heads of this kv head); m, l in the log2 domain."""
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, BLOCK_D)
    gmask = offs_g < GROUP_C
    heads = head0 + offs_g
    omask = gmask[None, :] & (offs_d < D)[:, None]
    optrs = out_base + offs_g[None, :] * stride_oh + offs_d[:, None]
    if NSPLIT == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[None, :]
        tl.store(optrs, out.to(out_base.dtype.element_ty), mask=omask)
    else:
        _store_partial(acc, m_i, l_i, ML, ACC, heads * NSPLIT + split, gmask, BLOCK_D)
        tl.debug_barrier()  # every thread's stores happen before the release below
        ticket = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
        if ticket == NSPLIT - 1:
            # One online merge step per CHUNK_S splits (all of them at the usual split counts): a
            # chunk's loads are independent, so one L2 round trip per chunk, not per split.
            offs_s = tl.arange(0, CHUNK_S)
            mx = tl.full([GP], float("-inf"), tl.float32)
            lt = tl.zeros([GP], tl.float32)
            tot = tl.zeros([BLOCK_D, GP], tl.float32)
            for s0 in range(0, NSPLIT, CHUNK_S):
                r = heads[None, :] * NSPLIT + (s0 + offs_s)[:, None]  # [CHUNK_S, GP]
                ok = gmask[None, :] & ((s0 + offs_s) < NSPLIT)[:, None]
                ms = tl.load(ML + r * 2, mask=ok, other=float("-inf"), cache_modifier=".cg")
                ls = tl.load(ML + r * 2 + 1, mask=ok, other=0.0, cache_modifier=".cg")
                a = tl.load(
                    ACC + r[:, None, :] * BLOCK_D + offs_d[None, :, None], mask=ok[:, None, :], other=0.0,
                    cache_modifier=".cg",
                )  # fmt: skip
                m_new = tl.maximum(mx, tl.max(ms, 0))
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.math.exp2(mx - m_use)
                w = tl.math.exp2(ms - m_use[None, :])  # [CHUNK_S, GP]
                lt = lt * alpha + tl.sum(ls * w, 0)
                tot = tot * alpha[None, :] + tl.sum(a * w[:, None, :], 0)
                mx = m_new
            out = tot / tl.where(lt > 0, lt, 1.0)[None, :]
            tl.store(optrs, out.to(out_base.dtype.element_ty), mask=omask)
            tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")


def _decode_config(on_gpu: bool) -> tuple[int, int, int, int]:
    """(block_n, num_warps, num_stages, programs wanted over the whole grid) of the gqa kernel."""
    if not on_gpu:
        return 32, 4, 1, 4
    # The sweep's best at every context (kernels/NOTES.md, "Attention: the Triton decode kernel"):
    # 64 keys, 2 warps, 3 stages, 4 programs per SM. Small programs let more of them share an SM,
    # which hides the latency of the per-tile instruction chain; register caps that fit more
    # programs per SM spill and are slower.
    return 64, 2, 3, 528


# ---------------------------------------------------------------------------------------------
# The paths (one signature: the problem, the call's arguments)
# ---------------------------------------------------------------------------------------------

def _run_gqa(
    problem: DecodeProblem, q, k_data, k_scale, v_data, v_scale, length, *, attention_mask=None, scale=None,
    elem=E4M3, rule=ScaleRule.RCEIL, out=None, qk_rotation=False, counters=None, block_n=None, chunk=None,
    num_warps=None, num_stages=None, maxnreg=None, merge=None,
):  # fmt: skip
    """``decode_gqa_kernel``, its split merge fused into it or by ``decode_merge_kernel``."""
    b, hq, _, d = q.shape
    paged = v_data.dim() == 5
    if paged:  # [B, Hkv, P, D, 32] pages: address V as (page, channel, slot) through the strides
        vp, vsp = v_data.stride(2), v_scale.stride(2)
        v_data, v_scale = v_data.transpose(2, 3), v_scale.transpose(2, 3)  # [B, Hkv, D, P, 32], [B, Hkv, D, P]
    else:
        vp, vsp = 32, v_scale.stride(3)
    hkv = k_data.shape[1]
    dp = k_data.shape[-1]
    group = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    bd = padded_head_dim(d)
    on_gpu = q.device.type == "cuda"
    cfg = _decode_config(on_gpu)
    if not block_n:  # the device's tile, or the largest part of it that divides a caller's chunk
        block_n = cfg[0] if chunk is None else math.gcd(cfg[0], chunk)
    num_warps = num_warps or cfg[1]
    num_stages = num_stages or cfg[2]
    if chunk is None:
        want = max(1, cfg[3] // max(1, b * hkv)) if on_gpu else 4
        chunk = max(block_n, cdiv(cdiv(length, want), block_n) * block_n)
    if chunk % block_n or block_n % 16:
        raise ValueError(f"chunk {chunk} is not a multiple of block_n {block_n} (a multiple of 16)")
    nsplit = max(1, cdiv(length, chunk))
    if merge is None:  # under CUDA-graph capture GPU time decides, eagerly the CPU time of a launch
        merge = "kernel" if problem.capturing else "fused"
    if merge not in ("fused", "kernel"):
        raise ValueError(f"merge={merge!r}: expected 'fused' (inside the decode kernel) or 'kernel'")
    fused = merge == "fused"
    work = torch.empty(b * hq * nsplit * (bd + 2), dtype=torch.float32, device=q.device)  # one allocation
    acc = work[: b * hq * nsplit * bd].view(b * hq * nsplit, bd)
    ml = work[b * hq * nsplit * bd :].view(b * hq * nsplit, 2)
    if fused:
        if counters is None:
            counters = torch.zeros(b * hkv, dtype=torch.int32, device=q.device)
        else:
            check_counters(counters, b * hkv, q.device)
    if out is None:
        out = torch.empty((b, 1, hq, d), dtype=q.dtype, device=q.device).transpose(1, 2)
    if qk_rotation:  # the kernel rotates q itself
        scale = scale / hadamard_block(d)
    mask, ms, mask_bool = mask_args(attention_mask, b, hq, 1, length)
    if block_n % 32:
        raise ValueError("the gqa decode kernel needs block_n a multiple of 32")
    db, pp = bd // 32, block_n // 32
    gp = max(next_pow2(group), cdiv(16, db), cdiv(16, 2 * pp))
    rot_nb, rot = q_rotation_operand(d, bd, q.device) if qk_rotation else (0, q)
    call(
        decode_gqa_kernel, (b * hkv, nsplit),
        (q, k_data, k_scale, v_data, v_scale, ml, acc, mask if mask is not None else q, rot,
         q.stride(0), q.stride(1), q.stride(3),
         k_data.stride(0), k_data.stride(1), k_data.stride(2),
         k_scale.stride(0), k_scale.stride(1), k_scale.stride(2),
         v_data.stride(0), v_data.stride(1), v_data.stride(2),
         v_scale.stride(0), v_scale.stride(1), v_scale.stride(2),
         ms[0], ms[1], ms[3], vp, vsp,
         hkv, length, d, dp, chunk, nsplit, scale * LOG2E,
         counters if fused else ml, out, out.stride(0), out.stride(1)),  # COUNT, Out, stride_ob, stride_oh
        dict(GROUP_C=group, GP=gp, BLOCK_N=block_n, BLOCK_D=bd, MASK_D=bd != d,
             HAS_MASK=mask is not None, MASK_BOOL=mask_bool, **mx_round_consts(elem, rule, q.device), INTERP=INTERPRET,
             QPARTS=bf16_parts(q.dtype) if qk_rotation else 0, QM=max(16, gp), ROT_NB=rot_nb,
             FUSE_MERGE=fused, MERGE_CHUNK=min(16, next_pow2(nsplit))),
        num_warps=num_warps, num_stages=num_stages, **({"maxnreg": maxnreg} if maxnreg and on_gpu else {}),
    )  # fmt: skip
    if not fused:
        call(
            decode_merge_kernel, (b * hq,), (ml, acc, out, hq, d, nsplit, out.stride(0), out.stride(1)),
            dict(SPLIT_PAD=next_pow2(nsplit), BLOCK_D=bd), num_warps=4,
        )  # fmt: skip
    return out


def _run_ws(
    problem: DecodeProblem, q, k_data, k_scale, v_data, v_scale, length, *, attention_mask=None, scale=None,
    elem=E4M3, rule=ScaleRule.RCEIL, out=None, qk_rotation=False, counters=None, **gqa_tuning,
):  # fmt: skip
    """``attention_decode_ws.mx_attention_decode_ws`` (its own tiles: the tuning arguments are the gqa kernel's)."""
    if attention_mask is not None:
        raise ValueError("the ws decode kernel takes no attention_mask (variant='gqa' does)")
    return _ws.mx_attention_decode_ws(
        q, k_data, k_scale, v_data, v_scale, length, scale=scale, elem=elem, rule=rule, out=out,
        qk_rotation=qk_rotation, counters=counters,
    )  # fmt: skip


def _run_reference(
    problem: DecodeProblem, q, k_data, k_scale, v_data, v_scale, length, *, attention_mask=None, scale=None,
    elem=E4M3, rule=ScaleRule.RCEIL, out=None, qk_rotation=False, **unused,
):  # fmt: skip
    """``mx_attention_reference`` on the cache dequantized by the format core (its MX values are
    fixed points of MX rounding: the reference's rounding leaves them as they are)."""
    d = q.shape[-1]
    pages = cdiv(length, 32)
    k = k_data[:, :, :length].float().unflatten(-1, (-1, 32)) * decode_e8m0(k_scale[:, :, :length]).unsqueeze(-1)
    k = k.flatten(-2)[..., :d]
    if v_data.dim() == 5:  # pages [B, Hkv, P, D, 32], scales [B, Hkv, P, D]
        v = v_data[:, :, :pages].float() * decode_e8m0(v_scale[:, :, :pages]).unsqueeze(-1)
        v = v.transpose(-1, -2).flatten(2, 3)
    else:  # rows of Vᵀ [B, Hkv, D, C], scales [B, Hkv, D, C/32]
        v = v_data[..., : pages * 32].float().unflatten(-1, (-1, 32)) * decode_e8m0(v_scale[..., :pages]).unsqueeze(-1)
        v = v.flatten(-2).transpose(-1, -2)
    res = mx_attention_reference(
        q, k, v[:, :, :length], attention_mask=attention_mask, scale=scale, elem=elem, rule=rule,
        qk_rotation=qk_rotation, k_rotated=qk_rotation,
    )  # fmt: skip
    return res if out is None else out.copy_(res)


def _ws_supports(p: DecodeProblem) -> bool:
    # only under CUDA-graph capture (module doc): eager calls are launch-bound, and gqa is one launch
    return p.capturing and _ws.supports(p)


def _gqa_config(p: DecodeProblem) -> str:
    block_n, warps, stages, programs = _decode_config(p.device.type == "cuda")
    return f"block_n={block_n} warps={warps} stages={stages} programs={programs}"


DECODE = Registry(
    "attention decode",
    [
        KernelPath(
            "attn_decode_ws", "Gluon, Hopper, under CUDA-graph capture: TMA loader warp, fp8 wgmmas on the cache codes",
            _ws_supports, _run_ws, config=lambda p: _ws.default_config(p.device) if p.device.type == "cuda" else None,
            gluon="attention_decode_ws",
        ),
        KernelPath(
            "attn_decode_gqa", "Triton split-KV: fp16 MMAs on the raw fp8 tiles, E8M0 scales after the products",
            lambda p: p.device.type == "cuda" or p.interpret, _run_gqa, config=_gqa_config,
        ),
        KernelPath("reference", "torch: mx_attention_reference on the dequantized cache", lambda p: True, _run_reference),
    ],
)  # fmt: skip
VARIANTS = {"ws": DECODE["attn_decode_ws"], "gqa": DECODE["attn_decode_gqa"]}  # mx_attention_decode(variant=...)


def _choose(problem: DecodeProblem, variant: str | None, kernels: str | None) -> KernelPath:
    if variant is None:
        return DECODE.choose(problem, kernels)
    if variant not in VARIANTS:
        raise ValueError(f"unknown decode variant {variant!r} (ws, gqa)")
    return VARIANTS[variant]


def decode_path(
    q: torch.Tensor, k_data: torch.Tensor, k_scale: torch.Tensor, v_data: torch.Tensor, v_scale: torch.Tensor, *,
    attention_mask: torch.Tensor | None = None, variant: str | None = None, kernels: str | None = None,
    capturing: bool | None = None,
) -> KernelPath:
    """The path ``mx_attention_decode`` takes for these arguments (the same choice: for tables).
    ``capturing``: as if under CUDA-graph capture (True) or not (False); None asks the stream."""
    return _choose(decode_problem(q, k_data, k_scale, v_data, v_scale, attention_mask, capturing=capturing), variant, kernels)  # fmt: skip


@on_input_device
def mx_attention_decode(
    q: torch.Tensor,
    k_data: torch.Tensor,
    k_scale: torch.Tensor,
    v_data: torch.Tensor,
    v_scale: torch.Tensor,
    length: int,
    *,
    attention_mask: torch.Tensor | None = None,
    scale: float | None = None,
    elem: ElemFormat | str = E4M3,
    rule: ScaleRule | str = ScaleRule.RCEIL,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    chunk: int | None = None,
    variant: str | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    maxnreg: int | None = None,
    qk_rotation: bool = False,
    merge: str | None = None,
    counters: torch.Tensor | None = None,
    kernels: str | None = None,
) -> torch.Tensor:
    """One query token per sequence against an MXFP8 cache; result [B, Hq, 1, D] in q.dtype.

    ``qk_rotation``: the cache's K was rotated before it was quantized (``MXFP8CacheLayer``
    with rotation on); q is rotated here and the scores divided by the rotation's block size.

    q [B, Hq, 1, D]. Cache (capacity C >= length, C % 32 == 0): k_data fp8 [B, Hkv, C, Dp]
    (Dp = D padded to 32), k_scale uint8 [B, Hkv, C, Dp/32]; V in 32-key pages (``MXFP8CacheLayer``'s
    layout) v_data fp8 [B, Hkv, C/32, D, 32], v_scale uint8 [B, Hkv, C/32, D], or as rows of Vᵀ
    (4-D v_data) fp8 [B, Hkv, D, C], v_scale uint8 [B, Hkv, D, C/32].
    ``attention_mask``: bool or additive, broadcastable to [B, Hq, 1, length]. Reads
    (1 + 1/32) bytes per cached element.

    The path: the first of ``DECODE`` (module doc) that takes the call, among those ``kernels``
    admits ("auto", "reference" or path names joined by commas, as ``MXQ_KERNELS``; default that
    variable, else "auto"). ``variant`` runs one path whatever the rest: "ws" (the warp-specialized
    Gluon kernel, TMA loader warp + wgmma; no mask) or "gqa" (the Triton kernel). The tuning
    arguments below and ``merge`` belong to "gqa" ("ws" takes its own ``DecodeAttnWSConfig``;
    ``counters`` serve its opt-in fused merge too). ``block_n``, ``chunk`` (keys per split),
    ``num_warps``, ``num_stages``, ``maxnreg`` (register cap per thread, so more programs fit on an
    SM): tuning, defaults from the sweep (``_decode_config``).

    ``merge``: how the split-KV partials are combined: "fused" (the split that finishes last for a
    (batch, kv head) merges them inside the decode kernel: one launch) or "kernel" (a second
    kernel). Default: "kernel" while a CUDA graph is being captured (less GPU time per call),
    "fused" otherwise (eager calls are launch-bound: one Triton launch fewer; kernels/NOTES.md,
    "Attention: decode fixed cost, the split merge"). ``counters``: int32 zeros, at least B*Hkv of them, for the fused merge's
    arrival counts (each call leaves them at zero again); the cache layer owns one per layer so
    CUDA graphs replay it. Without it a zeroed one is allocated per call. Two calls running at
    the same time on different streams need different counters.
    """
    if q.shape[2] != 1:
        raise ValueError(f"mx_attention_decode takes one query token, got {q.shape[2]}")
    elem, rule = as_elem_format(elem), as_scale_rule(rule)
    problem = decode_problem(q, k_data, k_scale, v_data, v_scale, attention_mask)
    path = _choose(problem, variant, kernels)
    args = (problem, q, k_data, k_scale, v_data, v_scale, length)
    kw = dict(
        attention_mask=attention_mask, scale=scale, elem=elem, rule=rule, out=out, qk_rotation=qk_rotation,
        counters=counters, block_n=block_n, chunk=chunk, num_warps=num_warps, num_stages=num_stages,
        maxnreg=maxnreg, merge=merge,
    )  # fmt: skip
    if path.gluon is None or variant is not None:  # a path named by ``variant`` runs as it is
        return path.run(*args, **kw)
    return gluon_api.run_or_fall_back(
        path.gluon, lambda: path.run(*args, **kw), lambda: DECODE.choose(problem, kernels, skip=path).run(*args, **kw)
    )
