"""Decode attention over the MXFP8 KV cache, warp-specialized (Gluon, Hopper sm_90).

The same function as ``attention_decode.decode_gqa_kernel`` (read ``attention_decode``'s module doc first):
one query token per sequence, all query heads of a kv head in one program, the context split
over programs (split-KV), scores and softmax in fp32, partial results merged by
``attention_decode_common.decode_merge_kernel``. What differs is the schedule, which plain Triton does not
let us write (kernels/NOTES.md, "Attention: decode fixed cost, the split merge": that kernel reaches ~65 % of DRAM bandwidth
because each warp's loads wait behind its own per-tile instruction chain):

- a **loader warp** streams each tile of BLOCK_N keys — K [BLOCK_N, D] fp8, its scale bytes,
  the BLOCK_N/32 V pages [D, 32] fp8 (contiguous in the cache: one TMA box of 128-byte rows,
  unswizzled, read back as row-major [D, 32] pages) and their scale bytes — through a ring of
  shared-memory stages with TMA and mbarriers, as far ahead as the ring allows;
- the **math warpgroup** computes per tile, on the tensor cores:
    Sᵀ[n, g] = Σ_j 2**ke[n, j] · cq[g, j] · Σ_{d in block j} k8[n, d] · qn[g, d]
  one wgmma per 32-wide D block. By default (``qk_fp8``) an fp8 wgmma (k32) with both operands in
  shared memory: the cache's K codes and the query's MX codes qn (cq = 2**scale), written by
  ``attention_decode_common.decode_query_blocks(codes=True)``; the tensor core sums the 32 exact products in
  fewer bits than fp32 (relative 2**-12 of Σ|products| at most). Otherwise K's codes are widened
  to fp16 in registers (the register operand) against qn normalized per block by a power of two
  (fp16-exact), fp32 sums. Then the online softmax in fp32 (log2 domain), P split into two fp16
  parts (P_hi + P_lo = P to ~2**-22) in shared memory, and
    Oᵀ[c, g] += 2**vs[c, page] · Σ_{n in page} v8[c, n] · (P_hi + P_lo)[n, g]
  (one wgmma pair per 32-key page, V's codes widened to fp16 in registers). Every product is
  exact; only the accumulation rounds.

The query heads of a kv head sit in the N = 8 columns of the MMAs (M = keys or channels): up to
8 query heads per kv head. Shapes taken: D in {64, 128}, the cache's paged V layout
(``MXFP8CacheLayer``), contiguous cache tensors, no attention mask; others take
``attention_decode.decode_gqa_kernel``. The Triton interpreter cannot run Gluon: the CPU tests
compile it for sm_90 (tests/test_sass_dev.py), the GPU tests compare it with the reference and
with the Triton kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mxq.formats import E4M3, ElemFormat, ScaleRule, as_elem_format, as_scale_rule
from mxq.kernels import gluon_api
from mxq.kernels.attention_decode_common import (
    DecodeProblem,
    check_counters,
    decode_merge_kernel,
    decode_problem,
    decode_query_blocks,
)
from mxq.kernels.buffers import split_counters
from mxq.kernels.common import e8m0_to_f32, gdc_launch_dependents, gdc_wait, pdl_ok
from mxq.kernels.gluon_api import (
    cta_barrier,
    gl,
    gluon,
    hopper,
    smem_view,
    tma_load,
)
from mxq.kernels.launch import cdiv, next_pow2, on_input_device
from mxq.kernels.reference import hadamard_block
from mxq.kernels.toolchain import configure_ptxas

GP = 8  # query-head slots per kv head: the MMAs' N
BLOCK_N = 64  # keys per tile: 2 V pages
LOG2E = 1.4426950408889634


if gluon_api.HAVE_GLUON:

    @gluon.jit
    def _load_stage(k_desc, ks_desc, v_desc, vs_desc, k_smem, ks_smem, v_smem, vs_smem, bar, s, i, key0, page0,
                    BLOCK_N: gl.constexpr):  # fmt: skip
        PP: gl.constexpr = BLOCK_N // 32
        D: gl.constexpr = k_desc.block_type.shape[1]
        DB: gl.constexpr = D // 32
        WIDE_V: gl.constexpr = v_desc.block_type.shape[1] == 128  # the tile's pages as one box of 128-byte rows
        VBOXES: gl.constexpr = 1 if WIDE_V else PP
        nbytes: gl.constexpr = (k_desc.block_type.nbytes + ks_desc.block_type.nbytes + VBOXES * v_desc.block_type.nbytes
                                + vs_desc.block_type.nbytes)  # fmt: skip
        hopper.mbarrier.expect(bar, nbytes)
        key = key0 + i * BLOCK_N
        tma_load(k_desc, [key, 0], bar, k_smem.index(s))
        tma_load(ks_desc, [(key * DB) // 64, 0], bar, ks_smem.index(s))  # 64 bytes a row
        if WIDE_V:  # PP consecutive pages = PP·D·32 contiguous bytes
            tma_load(v_desc, [(page0 + i * PP) * (D * 32 // 128), 0], bar, v_smem.index(s))
        else:
            for p in gl.static_range(PP):
                tma_load(v_desc, [(page0 + i * PP + p) * D, 0], bar, v_smem.index(s * PP + p))
        tma_load(vs_desc, [page0 + i * PP, 0], bar, vs_smem.index(s))

    @gluon.jit
    def _loader(k_desc, ks_desc, v_desc, vs_desc, q_desc, k_smem, ks_smem, v_smem, vs_smem, q_smem, p_smem,
                ready, empty, q_bar, cq_ptr, ml_ptr, acc_ptr, out_ptr, cnt_ptr, key0, page0, q_row, n_iter, n_full,
                lo, L, qk_scale, out_off, stride_oh, ml_row, split, NSPLIT, STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
                GROUP_C: gl.constexpr, FUSED: gl.constexpr):  # fmt: skip
        """Loader warp: the first STAGES tiles (the cache is complete when this kernel starts),
        then the query (written by the kernel this one may overlap), then the rest of the ring."""
        for i in gl.static_range(STAGES):
            if i < n_iter:
                _load_stage(k_desc, ks_desc, v_desc, vs_desc, k_smem, ks_smem, v_smem, vs_smem, ready.index(i), i, i,
                            key0, page0, BLOCK_N)  # fmt: skip
        gdc_wait()
        hopper.mbarrier.expect(q_bar, q_desc.block_type.nbytes)
        tma_load(q_desc, [q_row, 0], q_bar, q_smem)
        for i in range(STAGES, n_iter):
            s = i % STAGES
            hopper.mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
            _load_stage(k_desc, ks_desc, v_desc, vs_desc, k_smem, ks_smem, v_smem, vs_smem, ready.index(s), s, i,
                        key0, page0, BLOCK_N)  # fmt: skip

    @gluon.jit
    def _kblock(k_tile, q_smem, j: gl.constexpr, zero, a_l: gl.constexpr):
        """Block j's scores, asynchronous: (token, the register operand to keep alive until the wait)."""
        a = k_tile.slice(j * 32, 32, dim=1).load(a_l).to(gl.float16)
        return hopper.warpgroup_mma(a, q_smem.slice(j * 32, 32, dim=1).permute((1, 0)), zero, use_acc=False, is_async=True), a

    @gluon.jit
    def _kblock8(k_tile, q_smem, j: gl.constexpr, zero):
        """Block j's scores from the fp8 codes of K and Q in shared memory (one k32 fp8 wgmma), asynchronous."""
        b = q_smem.slice(j * 32, 32, dim=1).permute((1, 0))
        return hopper.warpgroup_mma(k_tile.slice(j * 32, 32, dim=1), b, zero, use_acc=False, is_async=True)

    @gluon.jit
    def _kscale(kw, cqj, j: gl.constexpr):
        """2**ke[n, j] · cq[g, j]: block j's factor for the scores [keys, heads]."""
        return e8m0_to_f32((kw >> (8 * j)) & 0xFF)[:, None] * cqj[None, :]

    @gluon.jit
    def _vpage(v_page, p_smem, vs_flat, pg: gl.constexpr, key, L, zero, a_l: gl.constexpr, row_l: gl.constexpr,
               MASKED: gl.constexpr):  # fmt: skip
        """Page pg of the tile (v_page: its [D, 32] codes in shared memory): Σ_n v8[c, n]·(P_hi + P_lo)[n, g]
        asynchronous (token, operand) and the page's channel scales 2**vs[c]."""
        D: gl.constexpr = zero.shape[0]
        va = v_page.load(a_l)
        vf = e8m0_to_f32(vs_flat.slice(pg * D, D).load(row_l).to(gl.int32))
        if MASKED:  # keys past the context: zero values (the cache may hold anything there)
            kv = key + pg * 32 + gl.arange(0, 32, layout=gl.SliceLayout(0, a_l))
            va = gl.where((kv < L)[None, :], va.to(gl.float16), 0.0)
            vf = gl.where(key + pg * 32 < L, vf, 1.0)  # a page past the end: its P is 0
        else:
            va = va.to(gl.float16)
        t = hopper.warpgroup_mma(va, p_smem.index(0).slice(pg * 32, 32, dim=1).permute((1, 0)), zero, use_acc=False, is_async=True)
        t = hopper.warpgroup_mma(va, p_smem.index(1).slice(pg * 32, 32, dim=1).permute((1, 0)), t, is_async=True)
        return t, va, vf

    @gluon.jit
    def _tile(acc, l_acc, m_i, k_smem, ks_smem, v_smem, vs_smem, q_smem, p_smem, ready, empty, cq0, cq1, cq2, cq3, i,
              lo, L, qk_scale, STAGES: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_C: gl.constexpr, MASKED: gl.constexpr):  # fmt: skip
        """One tile of BLOCK_N = 64 keys (2 V pages): scores, online softmax, P·V (module doc).
        The MMAs of each half are issued together and waited for once."""
        D: gl.constexpr = q_smem.type.shape[1]
        DB: gl.constexpr = D // 32
        gl.static_assert(BLOCK_N == 64, "two V pages a tile")
        mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 8, 16])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_l, k_width=2)
        row_l: gl.constexpr = gl.SliceLayout(1, mma_l)
        col_l: gl.constexpr = gl.SliceLayout(0, mma_l)
        flat_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        s = i % STAGES
        key = lo + i * BLOCK_N
        hopper.mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        k_tile = k_smem.index(s)
        zero_s = gl.zeros([BLOCK_N, 8], gl.float32, mma_l)
        # scores: DB block products in flight together; the K scale words (one per key) meanwhile
        # (the fp8 MMAs' accumulator layout names k32 instructions; its registers are mma_l's)
        mma8_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 8, 32])
        if q_smem.dtype.is_fp8() and DB == 4:  # fp8 codes of both sides straight from shared memory
            zero8 = gl.zeros([BLOCK_N, 8], gl.float32, mma8_l)
            t0 = _kblock8(k_tile, q_smem, 0, zero8)
            t1 = _kblock8(k_tile, q_smem, 1, zero8)
            t2 = _kblock8(k_tile, q_smem, 2, zero8)
            t3 = _kblock8(k_tile, q_smem, 3, zero8)
            kw = smem_view(ks_smem.index(s), gl.int32, [BLOCK_N], flat_l).load(row_l)
            r0, r1, r2, r3 = hopper.warpgroup_mma_wait(0, deps=(t0, t1, t2, t3))
            sc = (gl.convert_layout(r0, mma_l) * _kscale(kw, cq0, 0) + gl.convert_layout(r1, mma_l) * _kscale(kw, cq1, 1)
                  + gl.convert_layout(r2, mma_l) * _kscale(kw, cq2, 2) + gl.convert_layout(r3, mma_l) * _kscale(kw, cq3, 3))  # fmt: skip
        elif q_smem.dtype.is_fp8():
            zero8 = gl.zeros([BLOCK_N, 8], gl.float32, mma8_l)
            t0 = _kblock8(k_tile, q_smem, 0, zero8)
            t1 = _kblock8(k_tile, q_smem, 1, zero8)
            kw = smem_view(ks_smem.index(s), gl.int16, [BLOCK_N], flat_l).load(row_l).to(gl.int32)
            r0, r1 = hopper.warpgroup_mma_wait(0, deps=(t0, t1))
            sc = gl.convert_layout(r0, mma_l) * _kscale(kw, cq0, 0) + gl.convert_layout(r1, mma_l) * _kscale(kw, cq1, 1)
        elif DB == 4:
            t0, a0 = _kblock(k_tile, q_smem, 0, zero_s, a_l)
            t1, a1 = _kblock(k_tile, q_smem, 1, zero_s, a_l)
            t2, a2 = _kblock(k_tile, q_smem, 2, zero_s, a_l)
            t3, a3 = _kblock(k_tile, q_smem, 3, zero_s, a_l)
            kw = smem_view(ks_smem.index(s), gl.int32, [BLOCK_N], flat_l).load(row_l)
            r0, r1, r2, r3, a0, a1, a2, a3 = hopper.warpgroup_mma_wait(0, deps=(t0, t1, t2, t3, a0, a1, a2, a3))
            sc = r0 * _kscale(kw, cq0, 0) + r1 * _kscale(kw, cq1, 1) + r2 * _kscale(kw, cq2, 2) + r3 * _kscale(kw, cq3, 3)
        else:
            t0, a0 = _kblock(k_tile, q_smem, 0, zero_s, a_l)
            t1, a1 = _kblock(k_tile, q_smem, 1, zero_s, a_l)
            kw = smem_view(ks_smem.index(s), gl.int16, [BLOCK_N], flat_l).load(row_l).to(gl.int32)
            r0, r1, a0, a1 = hopper.warpgroup_mma_wait(0, deps=(t0, t1, a0, a1))
            sc = r0 * _kscale(kw, cq0, 0) + r1 * _kscale(kw, cq1, 1)
        sc = sc * qk_scale
        offs_g = gl.arange(0, 8, layout=col_l)
        ok = (offs_g < GROUP_C)[None, :]
        if MASKED:
            ok = ok & ((key + gl.arange(0, BLOCK_N, layout=row_l)) < L)[:, None]
        sc = gl.where(ok, sc, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(sc, axis=0))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(sc - m_use[None, :])
        l_acc = l_acc * alpha[None, :] + p
        p_hi = p.to(gl.float16)
        p_smem.index(0).permute((1, 0)).store(p_hi)
        p_smem.index(1).permute((1, 0)).store((p - p_hi.to(gl.float32)).to(gl.float16))
        hopper.fence_async_shared()
        cta_barrier()  # every warp's part of P is in shared memory before the MMAs read it
        # P·V: both pages (hi and lo parts) in flight together
        vs_flat = smem_view(vs_smem.index(s), gl.uint8, [2 * D], flat_l)
        zero_o = gl.zeros([D, 8], gl.float32, mma_l)
        if v_smem.type.shape[2] == 128:  # one [PP·D/4, 128]-byte box a tile: its pages are row-major [D, 32] runs
            flat8: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
            v_tile = smem_view(v_smem.index(s), v_smem.dtype, [2 * D, 32], flat8)
            v_pg0 = v_tile.slice(0, D, dim=0)
            v_pg1 = v_tile.slice(D, D, dim=0)
        else:
            v_pg0 = v_smem.index(2 * s)
            v_pg1 = v_smem.index(2 * s + 1)
        u0, v0, f0 = _vpage(v_pg0, p_smem, vs_flat, 0, key, L, zero_o, a_l, row_l, MASKED)
        u1, v1, f1 = _vpage(v_pg1, p_smem, vs_flat, 1, key, L, zero_o, a_l, row_l, MASKED)
        acc = acc * alpha[None, :]
        o0, o1, v0, v1 = hopper.warpgroup_mma_wait(0, deps=(u0, u1, v0, v1))
        hopper.mbarrier.arrive(empty.index(s))
        acc += o0 * f0[:, None] + o1 * f1[:, None]
        return acc, l_acc, m_new

    @gluon.jit
    def _math(k_desc, ks_desc, v_desc, vs_desc, q_desc, k_smem, ks_smem, v_smem, vs_smem, q_smem, p_smem,
              ready, empty, q_bar, cq_ptr, ml_ptr, acc_ptr, out_ptr, cnt_ptr, key0, page0, q_row, n_iter, n_full, lo,
              L, qk_scale, out_off, stride_oh, ml_row, split, NSPLIT, STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
              GROUP_C: gl.constexpr, FUSED: gl.constexpr):  # fmt: skip
        """Math warpgroup: the tiles of this program's key range, then its partial (or final) output."""
        D: gl.constexpr = q_smem.type.shape[1]
        mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 8, 16])
        row_l: gl.constexpr = gl.SliceLayout(1, mma_l)
        col_l: gl.constexpr = gl.SliceLayout(0, mma_l)
        acc = gl.zeros([D, 8], gl.float32, mma_l)
        l_acc = gl.zeros([BLOCK_N, 8], gl.float32, mma_l)
        m_i = gl.full([8], float("-inf"), gl.float32, col_l)
        DB: gl.constexpr = D // 32
        cq_base = cq_ptr + q_row * DB + gl.arange(0, 8, layout=col_l) * DB
        gdc_wait()  # cq comes from the query preparation
        cq0 = gl.load(cq_base)
        cq1 = gl.load(cq_base + 1)
        cq2 = gl.load(cq_base + (2 % DB))
        cq3 = gl.load(cq_base + (3 % DB))
        hopper.mbarrier.wait(q_bar, 0)
        for i in range(0, n_full):
            acc, l_acc, m_i = _tile(acc, l_acc, m_i, k_smem, ks_smem, v_smem, vs_smem, q_smem, p_smem, ready, empty,
                                    cq0, cq1, cq2, cq3, i, lo, L, qk_scale, STAGES, BLOCK_N, GROUP_C, False)  # fmt: skip
        for i in range(n_full, n_iter):  # at most one tile past the end of the context
            acc, l_acc, m_i = _tile(acc, l_acc, m_i, k_smem, ks_smem, v_smem, vs_smem, q_smem, p_smem, ready, empty,
                                    cq0, cq1, cq2, cq3, i, lo, L, qk_scale, STAGES, BLOCK_N, GROUP_C, True)  # fmt: skip
        if NSPLIT > 1 and not FUSED:  # the merge kernel behind this one may launch now (it waits for our partials)
            gdc_launch_dependents()
        l_i = gl.sum(l_acc, axis=0)
        offs_g = gl.arange(0, 8, layout=col_l)
        offs_d = gl.arange(0, D, layout=row_l)
        gmask = offs_g < GROUP_C
        omask = gmask[None, :] & (offs_d < D)[:, None]
        if NSPLIT == 1:
            o = acc / gl.where(l_i > 0, l_i, 1.0)[None, :]
            optrs = out_ptr + out_off + offs_g[None, :] * stride_oh + offs_d[:, None]
            gl.store(optrs, o.to(out_ptr.dtype.element_ty), mask=omask)
        else:
            rows = (ml_row + offs_g) * NSPLIT + split  # decode_merge_kernel's rows
            gl.store(ml_ptr + rows * 2, m_i, mask=gmask)
            gl.store(ml_ptr + rows * 2 + 1, l_i, mask=gmask)
            gl.store(acc_ptr + rows[None, :] * D + offs_d[:, None], acc, mask=omask)
            if FUSED:  # the split that finishes last for this (batch, kv head) merges them all
                cta_barrier()  # every thread's partial is stored before the release below
                ticket = gl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
                if ticket == NSPLIT - 1:
                    _merge(ml_ptr, acc_ptr, out_ptr, ml_row, NSPLIT, out_off, stride_oh, D, GROUP_C, mma_l)
                    gl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")  # ready for the next call / replay

    @gluon.jit
    def _merge(ml_ptr, acc_ptr, out_ptr, ml_row, NSPLIT, out_off, stride_oh, D: gl.constexpr, GROUP_C: gl.constexpr,
               mma_l: gl.constexpr):  # fmt: skip
        """The split-KV merge of ``decode_merge_kernel`` for the GROUP_C query heads of one
        kv head, in the decode kernel's last program: the largest m first, then Σ 2**(m_s - m)·acc_s
        and Σ 2**(m_s - m)·l_s in split order (whichever program is last: one result). Loads come 8
        (4) splits at a time, unrolled, so each group costs one L2 round trip, not one per split."""
        row_l: gl.constexpr = gl.SliceLayout(1, mma_l)
        col_l: gl.constexpr = gl.SliceLayout(0, mma_l)
        offs_g = gl.arange(0, 8, layout=col_l)
        offs_d = gl.arange(0, D, layout=row_l)
        gmask = offs_g < GROUP_C
        base = (ml_row + offs_g) * NSPLIT  # row of split 0 of each head
        mx = gl.full([8], float("-inf"), gl.float32, col_l)
        for s0 in range(0, NSPLIT, 8):
            for k in gl.static_range(8):
                ok = gmask & (s0 + k < NSPLIT)
                mk = gl.load(ml_ptr + (base + s0 + k) * 2, mask=ok, other=float("-inf"), cache_modifier=".cg")
                mx = gl.maximum(mx, mk)
        m_use = gl.where(mx == float("-inf"), 0.0, mx)
        lt = gl.zeros([8], gl.float32, col_l)
        tot = gl.zeros([D, 8], gl.float32, mma_l)
        for s0 in range(0, NSPLIT, 4):
            for k in gl.static_range(4):
                r = base + s0 + k
                ok = gmask & (s0 + k < NSPLIT)
                mk = gl.load(ml_ptr + r * 2, mask=ok, other=float("-inf"), cache_modifier=".cg")
                lk = gl.load(ml_ptr + r * 2 + 1, mask=ok, other=0.0, cache_modifier=".cg")
                ak = gl.load(acc_ptr + r[None, :] * D + offs_d[:, None], mask=ok[None, :], other=0.0, cache_modifier=".cg")
                w = gl.exp2(mk - m_use)
                lt += lk * w
                tot += ak * w[None, :]
        o = tot / gl.where(lt > 0, lt, 1.0)[None, :]
        optrs = out_ptr + out_off + offs_g[None, :] * stride_oh + offs_d[:, None]
        gl.store(optrs, o.to(out_ptr.dtype.element_ty), mask=gmask[None, :] & (offs_d < D)[:, None])

    @gluon.jit
    def decode_ws_kernel(
        k_desc, ks_desc, v_desc, vs_desc, q_desc, cq_ptr, ml_ptr, acc_ptr, out_ptr, cnt_ptr,
        Hkv, C, L, CHUNK, NSPLIT, qk_scale, stride_ob, stride_oh,
        STAGES: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_C: gl.constexpr, LOADER_REGS: gl.constexpr,
        FUSED: gl.constexpr,
    ):  # fmt: skip
        """One program per (batch, kv head, split): 4 warps of math + 1 loader warp."""
        D: gl.constexpr = q_desc.block_type.shape[1]
        PP: gl.constexpr = BLOCK_N // 32
        pid = gl.program_id(0)
        split = gl.program_id(1)
        b = pid // Hkv
        hk = pid % Hkv
        lo = split * CHUNK
        hi = gl.minimum(lo + CHUNK, L)
        n_iter = gl.cdiv(hi - lo, BLOCK_N)
        n_full = (hi - lo) // BLOCK_N
        key0 = pid * C + lo  # row of the [B*Hkv*C, D] K view
        page0 = key0 // 32  # row of the [B*Hkv*C/32, D] V-scale view; V page rows are D times that
        q_row = pid * 8
        ml_row = pid * GROUP_C  # b * Hq + the kv head's first query head
        out_off = b.to(gl.int64) * stride_ob + hk * GROUP_C * stride_oh
        cnt = cnt_ptr + pid  # the fused merge's ticket for this (batch, kv head)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, D], k_desc.layout)
        ks_smem = gl.allocate_shared_memory(ks_desc.dtype, [STAGES, BLOCK_N * (D // 32) // 64, 64], ks_desc.layout)
        if v_desc.block_type.shape[1] == 128:  # the tile's pages in one box (DecodeAttnWSConfig.wide_v)
            v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, PP * D * 32 // 128, 128], v_desc.layout)
        else:
            v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES * PP, D, 32], v_desc.layout)
        vs_smem = gl.allocate_shared_memory(vs_desc.dtype, [STAGES, PP, D], vs_desc.layout)
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [8, D], q_desc.layout)
        p_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([8, BLOCK_N], gl.float16)
        p_smem = gl.allocate_shared_memory(gl.float16, [2, 8, BLOCK_N], p_l)
        ready, empty = gluon_api.ring_barriers(STAGES)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], hopper.mbarrier.MBarrierLayout())
        hopper.mbarrier.init(q_bar, count=1)
        # one argument list for both partitions (Gluon's workers share a signature); inline, so
        # the constexprs stay constexprs
        gl.warp_specialize(
            [
                (_math, (k_desc, ks_desc, v_desc, vs_desc, q_desc, k_smem, ks_smem, v_smem, vs_smem, q_smem, p_smem,
                         ready, empty, q_bar, cq_ptr, ml_ptr, acc_ptr, out_ptr, cnt, key0, page0, q_row, n_iter,
                         n_full, lo, L, qk_scale, out_off, stride_oh, ml_row, split, NSPLIT, STAGES, BLOCK_N, GROUP_C,
                         FUSED)),
                (_loader, (k_desc, ks_desc, v_desc, vs_desc, q_desc, k_smem, ks_smem, v_smem, vs_smem, q_smem, p_smem,
                           ready, empty, q_bar, cq_ptr, ml_ptr, acc_ptr, out_ptr, cnt, key0, page0, q_row, n_iter,
                           n_full, lo, L, qk_scale, out_off, stride_oh, ml_row, split, NSPLIT, STAGES, BLOCK_N,
                           GROUP_C, FUSED)),
            ],
            [1],
            [LOADER_REGS],
        )  # fmt: skip
        gluon_api.invalidate_ring(ready, empty, STAGES)
        hopper.mbarrier.invalidate(q_bar)

else:  # pragma: no cover
    decode_ws_kernel = gluon_api.unavailable("attention_decode_ws")


@dataclass(frozen=True)
class DecodeAttnWSConfig:
    """Tiles of ``decode_ws_kernel``; the defaults are the H100's (``default_config``: per device)."""

    # ring depth in tiles of BLOCK_N = 64 keys (16.9 KB a stage at D = 128): 2 is the sweep's best
    # (kernels/NOTES.md, "Attention: decode warp-specialized in Gluon"); programs and registers per
    # device: ``default_config``
    stages: int = 2
    programs: int = 264  # programs wanted over the grid (2 per SM on 132 SMs): sets the split
    # registers per thread at launch: Triton launches 2 warpgroups (math + the loader's, padded),
    # then hands the loader's down to ``loader_regs``. 128: 2 programs per SM; 80: 3 (no spills)
    maxnreg: int = 128
    loader_regs: int = 24
    pdl: bool = True  # the query preparation lets this kernel start and stream its first tiles
    # the query preparation itself launched with PDL behind whatever wrote q and the cache: it waits
    # for that kernel before it lets this one start; no measurable gain, so off (kernels/NOTES.md,
    # "Attention: decode fixed part")
    prep_pdl: bool = False
    merge_pdl: bool = True  # the split merge kernel launches while this kernel's last programs finish
    # the split merge inside this kernel (the last split of each (batch, kv head), by an atomic
    # ticket) instead of the merge kernel: one launch fewer, but slower per call in CUDA graphs
    # (kernels/NOTES.md, "Attention: decode stream and per-device tiles"), so off by default
    fused_merge: bool = False
    # V by TMA as one box of 128-byte rows a tile (both pages, unswizzled) instead of a [D, 32] box
    # (32-byte rows) per page: 32-byte TMA rows stream slower; a gain wherever enough bytes are in
    # flight (kernels/NOTES.md, "Attention: decode stream and per-device tiles")
    wide_v: bool = True
    # Q·Kᵀ as fp8 wgmmas (k32, one per 32-wide D block) on the MX codes of K and of the query, both
    # from shared memory, instead of K widened to fp16 in registers against a normalized fp16 query:
    # no K loads or conversions in the math warps (the query's codes come from the query preparation):
    # fewer instructions per tile, faster (kernels/NOTES.md, "Attention: decode scores on fp8 codes").
    # E4M3 cache and query only (else the fp16 route). The fp8 MMA sums each 32-block in fewer bits than fp32 (2**-12 of the sum of
    # |products| at most; the GPU test's bound), well under the bf16 output's rounding
    qk_fp8: bool = True


def default_config(device: torch.device) -> DecodeAttnWSConfig:
    """The tiles ``mx_attention_decode_ws`` uses on ``device`` when no config is given. The H100 and
    the H200 both have 132 SMs; the H200's faster HBM3e wants more bytes in flight: 3 programs per SM
    (396, maxnreg 80) beat 2 there and tie on the H100 (kernels/NOTES.md, "Attention: decode stream
    and per-device tiles"). Other devices take the H100's tiles."""
    if "H200" in torch.cuda.get_device_name(device):
        return DecodeAttnWSConfig(programs=396, maxnreg=80)
    return DecodeAttnWSConfig()


def supports(p: DecodeProblem) -> bool:
    """The calls this kernel takes (module doc), whether or not a CUDA graph is being captured;
    the rest go to the Triton decode kernel."""
    return (
        gluon_api.usable("attention_decode_ws") and not p.has_mask and p.paged and p.capability[0] == 9
        and p.q_len == 1 and p.head_dim in (64, 128) and p.k_dim == p.head_dim and p.q_heads % p.kv_heads == 0
        and p.q_heads // p.kv_heads <= GP and p.capacity % 32 == 0 and p.contiguous
        and p.q_dtype in (torch.bfloat16, torch.float16, torch.float32)
    )  # fmt: skip


def takes(q: torch.Tensor, k_data: torch.Tensor, k_scale: torch.Tensor, v_data: torch.Tensor,
          v_scale: torch.Tensor, attention_mask) -> bool:  # fmt: skip
    """``supports`` for the call with these arguments."""
    return supports(decode_problem(q, k_data, k_scale, v_data, v_scale, attention_mask, capturing=False))


def _gl_dtype(dt: torch.dtype):
    return {torch.float8_e4m3fn: gl.float8e4nv, torch.float8_e5m2: gl.float8e5, torch.float16: gl.float16}[dt]


def tma_boxes(bn: int, d: int, fp8: torch.dtype, wide_v: bool = True, q_dtype: torch.dtype = torch.float16) -> tuple[list, list]:
    """TMA boxes and shared layouts of K, K scales, V, V scales, the query (fp16 normalized blocks,
    or fp8 codes): the scale bytes unswizzled (the math warps read them as flat words). V: the
    tile's bn/32 pages as one box of 128-byte rows, unswizzled (``wide_v``), or a [D, 32] box per
    page (32-byte rows, swizzled)."""
    f8 = _gl_dtype(fp8)
    lay = gl.NVMMASharedLayout.get_default_for
    flat = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
    v_box, v_lay = ([bn * d // 128, 128], flat) if wide_v else ([d, 32], lay([d, 32], f8))
    boxes = [[bn, d], [bn * (d // 32) // 64, 64], v_box, [bn // 32, d], [GP, d]]
    return boxes, [lay([bn, d], f8), flat, v_lay, flat, lay([GP, d], _gl_dtype(q_dtype))]


@on_input_device
def mx_attention_decode_ws(
    q: torch.Tensor,
    k_data: torch.Tensor,
    k_scale: torch.Tensor,
    v_data: torch.Tensor,
    v_scale: torch.Tensor,
    length: int,
    *,
    scale: float | None = None,
    elem: ElemFormat | str = E4M3,
    rule: ScaleRule | str = ScaleRule.RCEIL,
    out: torch.Tensor | None = None,
    qk_rotation: bool = False,
    config: DecodeAttnWSConfig | None = None,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """``attention_decode.mx_attention_decode`` (paged V, no mask) on a Hopper GPU: [B, Hq, 1, D] in q.dtype.

    ``counters``: int32 zeros, >= B*Hkv of them, the fused merge's tickets (each call leaves them
    at zero; the cache layer owns one per layer). Without: the device's shared split-K tickets
    (``buffers.split_counters``), or, under CUDA-graph capture before those exist, the merge
    kernel."""
    if not takes(q, k_data, k_scale, v_data, v_scale, None):
        raise ValueError(
            "mx_attention_decode_ws needs Gluon, a Hopper GPU, one query token, D in {64, 128}, <= 8 query heads per "
            f"kv head, the paged V cache and contiguous cache tensors; got q {tuple(q.shape)}, "
            f"k_data {tuple(k_data.shape)}, v_data {tuple(v_data.shape)} on {q.device}"
        )
    elem, rule = as_elem_format(elem), as_scale_rule(rule)
    cfg = config or default_config(q.device)
    b, hq, _, d = q.shape
    hkv, cap = k_data.shape[1], k_data.shape[2]
    group = hq // hkv
    if not 1 <= length <= cap:
        raise ValueError(f"mx_attention_decode_ws: length {length} outside 1..{cap} (the cache's capacity)")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if qk_rotation:
        scale = scale / hadamard_block(d)
    bn = BLOCK_N
    want = max(1, cfg.programs // (b * hkv))
    chunk = max(bn, cdiv(cdiv(length, want), bn) * bn)
    nsplit = cdiv(length, chunk)
    pdl = cfg.pdl and pdl_ok(q.device)
    merge_pdl = cfg.merge_pdl and pdl_ok(q.device)
    qk_fp8 = cfg.qk_fp8 and k_data.dtype == torch.float8_e4m3fn and elem.mbits == 3  # E4M3 x E4M3 (the one tested)
    qn, cq = decode_query_blocks(q, hkv, gp=GP, elem=elem, rule=rule, qk_rotation=qk_rotation, pdl=pdl, codes=qk_fp8,
                                   launch_pdl=cfg.prep_pdl)  # fmt: skip
    if out is None:
        out = torch.empty((b, 1, hq, d), dtype=q.dtype, device=q.device).transpose(1, 2)
    fused = nsplit > 1 and cfg.fused_merge
    if fused:
        if counters is None:
            counters = split_counters(q.device, b * hkv)
            fused = counters is not None
        else:
            check_counters(counters, b * hkv, q.device)
    if nsplit > 1:
        work = torch.empty(b * hq * nsplit * (d + 2), dtype=torch.float32, device=q.device)
        acc = work[: b * hq * nsplit * d]
        ml = work[b * hq * nsplit * d :]
    else:
        acc = ml = cq
    k2 = k_data.view(b * hkv * cap, d)
    ks2 = k_scale.view(-1, 64)  # 64 scale bytes a row: BLOCK_N * D/32 / 64 rows a tile
    v2 = v_data.view(-1, 128 if cfg.wide_v else 32)  # a page = D·32 contiguous bytes
    vs2 = v_scale.view(-1, d)
    k_desc, ks_desc, v_desc, vs_desc, q_desc = (
        gluon_api.TensorDescriptor(t, list(t.shape), list(t.stride()), box, lay)
        for t, box, lay in zip((k2, ks2, v2, vs2, qn), *tma_boxes(bn, d, k_data.dtype, cfg.wide_v, qn.dtype))
    )
    configure_ptxas()
    decode_ws_kernel[(b * hkv, nsplit)](
        k_desc, ks_desc, v_desc, vs_desc, q_desc, cq, ml, acc, out, counters if fused else cq,
        hkv, cap, length, chunk, nsplit, scale * LOG2E, out.stride(0), out.stride(1),
        STAGES=cfg.stages, BLOCK_N=bn, GROUP_C=group, LOADER_REGS=cfg.loader_regs, FUSED=fused,
        num_warps=4, maxnreg=cfg.maxnreg, launch_pdl=pdl,
    )  # fmt: skip
    if nsplit > 1 and not fused:
        decode_merge_kernel[(b * hq,)](
            ml, acc, out, hq, d, nsplit, out.stride(0), out.stride(1), SPLIT_PAD=next_pow2(nsplit), BLOCK_D=d,
            PDL=merge_pdl, num_warps=4, launch_pdl=merge_pdl,
        )  # fmt: skip
    return out
