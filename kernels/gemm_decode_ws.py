"""W8A8 decode GEMM on fp8 tensor cores, warp-specialized (Gluon, Hopper sm_90).

The same function as ``gemm_decode._mx_decode_f8_kernel`` (read its module doc first):

    Yᵀ[n, m] = Σ_b  2**sw[n, b] · 2**sx[m, b] · Σ_{k in block b} w[n, k] · q[m, k]

one fp8 wgmma (k32) per MX block on the raw bytes of W and of X (quantized first by
``quantize_mx_rows``), each block product scaled by its two powers of two into an fp32
accumulator. What differs is the schedule, which plain Triton does not let us write
(kernels/NOTES.md, "GEMM: W8A8 decode on fp8 tensor cores": that kernel is latency bound, 1.3-3.1 TB/s):

- a **loader warp** streams W and X tiles through a ring of shared-memory stages with TMA and
  mbarriers, as far ahead as the ring allows, independent of the math;
- the **math warpgroup** issues the KB block products of step i asynchronously and, while the
  tensor core runs them, rescales the products of step i-1 into the accumulator; then it waits,
  releases the stage to the loader and goes on. Scale words (4 blocks = one int32 per row) are
  loaded straight into the accumulator's row / column layouts, a step before they are used: no
  layout conversion, no shared-memory round trip, no barrier per block.

With ``fuse_x`` (dispatched for small weights) there is no quantizer launch: the math warpgroup
loads X itself and quantizes step i+1 into one of two shared fp8 tiles while step i's wgmmas run
(``_math_fuse_x``); the loader streams W only. Same bytes, same sums. At M <= 8 a tile has 8
activation rows (wgmma n8), else 16.

Tiles: 128 weight rows per program (2 programs per SM) by the built-in rule, or 64 rows at 3-4
programs per SM where ``mxq tune`` (``kernels/tune.py``) measured that faster for the shape and
batch bucket on this GPU (``pick_decode_ws_config``).

Split-K as in ``gemm_decode`` (fp32 partials, an atomic ticket per N tile, the last split sums
the partials in split order and resets the ticket). Shapes: M <= 16, K % 128 == 0
(whole int32 scale words per step); other shapes take ``gemm_decode``. This module needs Gluon
(Triton >= 3.5) and runs only on a GPU: the Triton interpreter cannot run Gluon, so the CPU
tests compile it for sm_90 (tests/test_sass_dev.py) and the GPU tests compare it with the torch
reference and with ``mx_decode_gemm``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from mxq.formats import E4M3, ElemFormat, ScaleRule, as_elem_format, as_scale_rule
from mxq.kernels import gluon_api, launch, tune
from mxq.kernels.buffers import split_counters
from mxq.kernels.common import (
    RULE_ID,
    capability,
    check_gemm_args,
    e8m0_to_f32,
    gdc_launch_dependents,
    gdc_wait,
    hw_cvt,
    mx_fast_exponent,
    mx_scaled,
    operands_and_output,
    pdl_ok,
    sm_count,
)
from mxq.kernels.gluon_api import (
    cta_barrier,
    gl,
    gluon,
    hopper,
    tma_load,
)
from mxq.kernels.launch import Launch, PlanCache, cdiv, descriptor, on_input_device
from mxq.kernels.quantize import quantize_grid, quantize_launch
from mxq.kernels.splitk import split_k_epilogue, split_k_finish, split_k_sizes

BS = 32  # MX block = one fp8 wgmma's K
KB = 4  # blocks per step: one int32 scale word per row
# Largest M: the math warpgroup holds 2 x KB block products [BLOCK_N, 16] (in flight + being rescaled)
# and the accumulator, 144 of its ~232 registers at M <= 16; BLOCK_M 32 would spill.
WS_MAX_M = 16


if gluon_api.HAVE_GLUON:

    @gluon.jit
    def _e8m0(word, j: gl.constexpr):
        """Byte j of each int32 scale word -> fp32 2**(byte-127) (``common.e8m0_to_f32``)."""
        return e8m0_to_f32((word >> (8 * j)) & 0xFF)

    @gluon.jit
    def _x_step(x_ptr, rows3, cols3, mmask3, k0, K):
        """X [BLOCK_M, 4, 32] (one step: 128 K-columns as 4 MX blocks) from global, as stored;
        zeros past K (the step after a program's last, loaded ahead and never used)."""
        return gl.load(x_ptr + rows3 + (cols3 + k0), mask=mmask3 & (cols3 + k0 < K), other=0.0)

    @gluon.jit
    def _x_quantize(x, dst, sdst, x_l: gl.constexpr, EMAX: gl.constexpr, MBITS: gl.constexpr, MAXN: gl.constexpr,
                    RULE: gl.constexpr):  # fmt: skip
        """MX-quantize one step of X [BLOCK_M, 4, 32] (``quantize.quantize_rows_kernel``'s
        hardware-rounding path, amax rules): the fp8 elements go to the shared tile ``dst``
        [BLOCK_M, 128] that the step's wgmmas read, the 4 scale bytes as one int32 word per row
        (byte j = block j, 255 for a block with a NaN or Inf) to ``sdst`` [BLOCK_M]."""
        BLOCK_M: gl.constexpr = x.shape[0]
        xf = x.to(gl.float32)
        e, nonfinite = mx_fast_exponent(xf, EMAX, MBITS, RULE)
        q = mx_scaled(xf, e, MAXN, RULE).to(dst.dtype, fp_downcast_rounding="rtne")
        dst.store(gl.reshape(q, [BLOCK_M, 128]))
        sb = gl.where(nonfinite, 255, e + 127)
        j = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, x_l)))
        sdst.store(gl.sum(sb << (8 * j)[None, :], axis=1))

    @gluon.jit
    def _rescale(acc, p0, p1, p2, p3, sw, sx):
        """acc += Σ_j p_j · 2**sw_j[n] · 2**sx_j[m] for the KB = 4 block products of one step."""
        acc += p0 * (_e8m0(sw, 0)[:, None] * _e8m0(sx, 0)[None, :])
        acc += p1 * (_e8m0(sw, 1)[:, None] * _e8m0(sx, 1)[None, :])
        acc += p2 * (_e8m0(sw, 2)[:, None] * _e8m0(sx, 2)[None, :])
        acc += p3 * (_e8m0(sw, 3)[:, None] * _e8m0(sx, 3)[None, :])
        return acc

    @gluon.jit
    def _block(smem, slot, j: gl.constexpr, BOX: gl.constexpr):
        """Block j (32 K-columns) of stage ``slot``: its own tile (BOX = 32) or a 32-column slice
        of the stage's one [rows, 128] tile (BOX = 128, 128-byte swizzle)."""
        if BOX == 32:
            return smem.index(slot * 4 + j)
        else:
            return smem.index(slot).slice(j * 32, 32, dim=1)

    @gluon.jit
    def _issue(w_smem, x_smem, slot, xslot, zero, BOX: gl.constexpr):
        """The KB block products of one step, asynchronous (tokens; wait before reading): W's
        ring stage ``slot`` with X's tile ``xslot`` (the same stage, or with FUSE_X one of two)."""
        p0 = hopper.warpgroup_mma(_block(w_smem, slot, 0, BOX), _block(x_smem, xslot, 0, BOX).permute((1, 0)), zero, use_acc=False, is_async=True)
        p1 = hopper.warpgroup_mma(_block(w_smem, slot, 1, BOX), _block(x_smem, xslot, 1, BOX).permute((1, 0)), zero, use_acc=False, is_async=True)
        p2 = hopper.warpgroup_mma(_block(w_smem, slot, 2, BOX), _block(x_smem, xslot, 2, BOX).permute((1, 0)), zero, use_acc=False, is_async=True)
        p3 = hopper.warpgroup_mma(_block(w_smem, slot, 3, BOX), _block(x_smem, xslot, 3, BOX).permute((1, 0)), zero, use_acc=False, is_async=True)
        return p0, p1, p2, p3

    @gluon.jit
    def _loader(w_desc, x_desc, w_smem, x_smem, ready, empty, n0, k_lo, n_iter, STAGES: gl.constexpr, BOX: gl.constexpr,
                FUSE_X: gl.constexpr):  # fmt: skip
        """Loader warp: TMA tiles of W [BLOCK_N, BOX] and X [BLOCK_M, BOX], 128 K-columns per stage
        (W only with FUSE_X: the math warpgroup quantizes X itself)."""
        NBOX: gl.constexpr = 128 // BOX
        if FUSE_X:
            nbytes: gl.constexpr = NBOX * w_desc.block_type.nbytes
        else:
            nbytes: gl.constexpr = NBOX * (w_desc.block_type.nbytes + x_desc.block_type.nbytes)
        # The first STAGES steps' weight tiles go out before X exists: with programmatic
        # dependent launch this kernel starts while the X quantizer still runs.
        for i in gl.static_range(STAGES):
            if i < n_iter:
                hopper.mbarrier.expect(ready.index(i), nbytes)
                for j in gl.static_range(NBOX):
                    tma_load(w_desc, [n0, k_lo + i * 128 + j * BOX], ready.index(i), w_smem.index(i * NBOX + j))
        if not FUSE_X:
            gdc_wait()
            for i in gl.static_range(STAGES):
                if i < n_iter:
                    for j in gl.static_range(NBOX):
                        tma_load(x_desc, [0, k_lo + i * 128 + j * BOX], ready.index(i), x_smem.index(i * NBOX + j))
        for i in range(STAGES, n_iter):
            s = i % STAGES
            hopper.mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            hopper.mbarrier.expect(bar, nbytes)
            for j in gl.static_range(NBOX):
                k = k_lo + i * 128 + j * BOX
                tma_load(w_desc, [n0, k], bar, w_smem.index(s * NBOX + j))
                if not FUSE_X:
                    tma_load(x_desc, [0, k], bar, x_smem.index(s * NBOX + j))

    @gluon.jit
    def _math(
        w_smem, x_smem, ready, empty, s_ptr, xs_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr,
        M, N, stride_sn4, stride_xsm4, stride_ym, pid_n, pid_k, k_lo, n_iter,
        BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
        FUSED: gl.constexpr, HAS_BIAS: gl.constexpr, BOX: gl.constexpr,
    ):  # fmt: skip
        """Math warpgroup: block products of step i in flight while step i-1 is rescaled."""
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 32])
        row_l: gl.constexpr = gl.SliceLayout(1, acc_l)
        col_l: gl.constexpr = gl.SliceLayout(0, acc_l)
        offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=row_l)
        offs_m = gl.arange(0, BLOCK_M, layout=col_l)
        nmask = offs_n < N
        mmask = offs_m < M
        w0 = k_lo // 128
        s_ptrs = s_ptr + offs_n.to(gl.int64) * stride_sn4 + w0
        xs_ptrs = xs_ptr + offs_m * stride_xsm4 + w0
        zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, acc_l)
        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, acc_l)
        # scale words two steps ahead of their rescale (a load's latency is longer than a step);
        # the weight's first two before the wait: they do not come from the kernel before this one
        sw = gl.load(s_ptrs, mask=nmask, other=0x7F7F7F7F)
        sw1 = gl.load(s_ptrs + 1, mask=nmask & (n_iter > 1), other=0x7F7F7F7F)
        gdc_wait()  # the X scales below come from the quantizer
        sx = gl.load(xs_ptrs, mask=mmask, other=0x7F7F7F7F)
        sx1 = gl.load(xs_ptrs + 1, mask=mmask & (n_iter > 1), other=0x7F7F7F7F)

        hopper.mbarrier.wait(ready.index(0), 0)
        q0, q1, q2, q3 = _issue(w_smem, x_smem, 0, 0, zero, BOX)
        p0, p1, p2, p3 = hopper.warpgroup_mma_wait(num_outstanding=0, deps=(q0, q1, q2, q3))
        hopper.mbarrier.arrive(empty.index(0))
        for i in range(1, n_iter):
            s = i % STAGES
            hopper.mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            q0, q1, q2, q3 = _issue(w_smem, x_smem, s, s, zero, BOX)
            sw2 = gl.load(s_ptrs + (i + 1), mask=nmask & (i + 1 < n_iter), other=0x7F7F7F7F)
            sx2 = gl.load(xs_ptrs + (i + 1), mask=mmask & (i + 1 < n_iter), other=0x7F7F7F7F)
            acc = _rescale(acc, p0, p1, p2, p3, sw, sx)  # step i-1, while step i is on the tensor core
            p0, p1, p2, p3 = hopper.warpgroup_mma_wait(num_outstanding=0, deps=(q0, q1, q2, q3))
            hopper.mbarrier.arrive(empty.index(s))
            sw, sw1 = sw1, sw2
            sx, sx1 = sx1, sx2
        acc = _rescale(acc, p0, p1, p2, p3, sw, sx)
        split_k_epilogue(acc, zero, b_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, stride_ym, pid_n, pid_k, offs_n, offs_m, nmask,
                         mmask, SPLIT, FUSED, HAS_BIAS)  # fmt: skip

    @gluon.jit
    def _math_fuse_x(
        w_smem, x_smem, xs_smem, ready, empty, x_ptr, s_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr,
        M, N, K, stride_xm, stride_sn4, stride_ym, pid_n, pid_k, k_lo, n_iter,
        BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
        FUSED: gl.constexpr, HAS_BIAS: gl.constexpr,
        EMAX: gl.constexpr, MBITS: gl.constexpr, MAXN: gl.constexpr, RULE: gl.constexpr,
    ):  # fmt: skip
        """``_math`` with X quantized here, one step ahead: while step i's block products run on
        the tensor core, this warpgroup MX-quantizes step i+1's X (loaded from global a step
        before) into the other of two shared fp8 tiles (+ scale words), loads step i+2's X and
        rescales step i-1. One launch per call instead of the quantizer's and this kernel's;
        same bytes, same sums."""
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 32])
        row_l: gl.constexpr = gl.SliceLayout(1, acc_l)
        col_l: gl.constexpr = gl.SliceLayout(0, acc_l)
        # X steps [BLOCK_M, 4 blocks, 32]: 16-byte vectors, a block's 32 values in 4 threads of a warp
        x_l: gl.constexpr = gl.BlockedLayout([1, 1, 8], [2, 4, 4], [4, 1, 1], [2, 1, 0])
        offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=row_l)
        offs_m = gl.arange(0, BLOCK_M, layout=col_l)
        nmask = offs_n < N
        mmask = offs_m < M
        s_ptrs = s_ptr + offs_n.to(gl.int64) * stride_sn4 + k_lo // 128
        xm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, gl.SliceLayout(2, x_l)))
        xj = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, x_l)))
        xt = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, x_l)))
        rows3 = (xm.to(gl.int64) * stride_xm)[:, None, None]
        cols3 = (xj * 32)[None, :, None] + xt[None, None, :]
        mmask3 = (xm < M)[:, None, None]
        zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, acc_l)
        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, acc_l)

        # the weight's scale words two steps ahead of their rescale, the first two before anything waits
        sw = gl.load(s_ptrs, mask=nmask, other=0x7F7F7F7F)
        sw1 = gl.load(s_ptrs + 1, mask=nmask & (n_iter > 1), other=0x7F7F7F7F)
        gdc_wait()  # X comes from the kernel this one was launched behind
        xr = _x_step(x_ptr, rows3, cols3, mmask3, k_lo, K)
        _x_quantize(xr, x_smem.index(0), xs_smem.index(0), x_l, EMAX, MBITS, MAXN, RULE)
        xr = _x_step(x_ptr, rows3, cols3, mmask3, k_lo + 128, K)
        hopper.fence_async_shared()
        cta_barrier()  # every thread's part of X's tile is in shared memory before the wgmmas
        hopper.mbarrier.wait(ready.index(0), 0)
        q0, q1, q2, q3 = _issue(w_smem, x_smem, 0, 0, zero, 128)
        sx = xs_smem.index(0).load(col_l)
        _x_quantize(xr, x_smem.index(1), xs_smem.index(1), x_l, EMAX, MBITS, MAXN, RULE)
        xr = _x_step(x_ptr, rows3, cols3, mmask3, k_lo + 256, K)
        p0, p1, p2, p3 = hopper.warpgroup_mma_wait(num_outstanding=0, deps=(q0, q1, q2, q3))
        hopper.mbarrier.arrive(empty.index(0))
        for i in range(1, n_iter):
            hopper.fence_async_shared()
            cta_barrier()  # step i's X tile and scale words are written (one step ago)
            s = i % STAGES
            hopper.mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            q0, q1, q2, q3 = _issue(w_smem, x_smem, s, i % 2, zero, 128)
            sw2 = gl.load(s_ptrs + (i + 1), mask=nmask & (i + 1 < n_iter), other=0x7F7F7F7F)
            sx_next = xs_smem.index(i % 2).load(col_l)
            # the other tile: step i-1's, whose wgmmas were waited for and whose words are in sx
            _x_quantize(xr, x_smem.index((i + 1) % 2), xs_smem.index((i + 1) % 2), x_l, EMAX, MBITS, MAXN, RULE)
            xr = _x_step(x_ptr, rows3, cols3, mmask3, k_lo + (i + 2) * 128, K)
            acc = _rescale(acc, p0, p1, p2, p3, sw, sx)  # step i-1, while step i is on the tensor core
            p0, p1, p2, p3 = hopper.warpgroup_mma_wait(num_outstanding=0, deps=(q0, q1, q2, q3))
            hopper.mbarrier.arrive(empty.index(s))
            sw, sw1 = sw1, sw2
            sx = sx_next
        acc = _rescale(acc, p0, p1, p2, p3, sw, sx)
        split_k_epilogue(acc, zero, b_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, stride_ym, pid_n, pid_k, offs_n, offs_m, nmask,
                         mmask, SPLIT, FUSED, HAS_BIAS)  # fmt: skip

    @gluon.jit
    def mx_decode_ws_kernel(
        w_desc, x_desc, x_ptr, s_ptr, xs_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr,
        M, N, K, K_SPLIT, stride_xm, stride_sn4, stride_xsm4, stride_ym,
        BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
        FUSED: gl.constexpr, HAS_BIAS: gl.constexpr, LOADER_REGS: gl.constexpr, BOX: gl.constexpr,
        FUSE_X: gl.constexpr = False, X_FP8: gl.constexpr = None, X_LAYOUT: gl.constexpr = None,
        EMAX: gl.constexpr = 0, MBITS: gl.constexpr = 0, MAXN: gl.constexpr = 0.0, RULE: gl.constexpr = 1,
        PDL: gl.constexpr = False,
    ):  # fmt: skip
        """Yᵀ tile [BLOCK_N, BLOCK_M] over this program's K range (4 warps of math + 1 loader warp).
        FUSE_X: X is the raw activations (x_ptr; x_desc unused), quantized by the math warpgroup;
        otherwise X is the quantizer's fp8 (x_desc) and scales (xs_ptr). PDL: the kernel launched
        behind this one may start at once (it waits for this one before reading what it writes)."""
        if PDL:
            gdc_launch_dependents()
        pid_n = gl.program_id(0)
        pid_k = gl.program_id(1)
        k_lo = pid_k * K_SPLIT
        n_iter = gl.cdiv(gl.minimum(k_lo + K_SPLIT, K) - k_lo, 128)
        w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES * (128 // BOX), BLOCK_N, BOX], w_desc.layout)
        if FUSE_X:
            x_smem = gl.allocate_shared_memory(X_FP8, [2, BLOCK_M, 128], X_LAYOUT)
            xs_smem = gl.allocate_shared_memory(gl.int32, [2, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        else:
            x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES * (128 // BOX), BLOCK_M, BOX], x_desc.layout)
        ready, empty = gluon_api.ring_barriers(STAGES)
        if FUSE_X:
            gl.warp_specialize(
                [
                    (_math_fuse_x, (w_smem, x_smem, xs_smem, ready, empty, x_ptr, s_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr,
                                    M, N, K, stride_xm, stride_sn4, stride_ym, pid_n, pid_k, k_lo, n_iter,
                                    BLOCK_N, BLOCK_M, STAGES, SPLIT, FUSED, HAS_BIAS, EMAX, MBITS, MAXN, RULE)),
                    (_loader, (w_desc, x_desc, w_smem, x_smem, ready, empty, pid_n * BLOCK_N, k_lo, n_iter, STAGES, BOX, FUSE_X)),
                ],
                [1],
                [LOADER_REGS],
            )  # fmt: skip
        else:
            gl.warp_specialize(
                [
                    (_math, (w_smem, x_smem, ready, empty, s_ptr, xs_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr,
                             M, N, stride_sn4, stride_xsm4, stride_ym, pid_n, pid_k, k_lo, n_iter,
                             BLOCK_N, BLOCK_M, STAGES, SPLIT, FUSED, HAS_BIAS, BOX)),
                    (_loader, (w_desc, x_desc, w_smem, x_smem, ready, empty, pid_n * BLOCK_N, k_lo, n_iter, STAGES, BOX, FUSE_X)),
                ],
                [1],
                [LOADER_REGS],
            )  # fmt: skip
        gluon_api.invalidate_ring(ready, empty, STAGES)

else:  # pragma: no cover
    mx_decode_ws_kernel = gluon_api.unavailable("gemm_decode_ws")


@dataclass(frozen=True)
class DecodeWSConfig:
    """Tiles of ``mx_decode_ws_kernel``."""

    block_n: int = 128  # weight rows per program (the MMA's M side; 4 warps = one warpgroup)
    stages: int = 2  # ring depth in steps of 4 blocks (a step = BLOCK_N x 128 fp8 bytes of W)
    split_k: int = 1
    fused: bool = True
    # Registers: Triton launches 2 warpgroups (math + the loader's, padded) with ``maxnreg`` each,
    # then moves the loader's down to ``loader_regs`` and the math warpgroup up by the same amount.
    # 128 lets 2 programs share an SM (256 threads x 128 x 2 = the 64K register file).
    maxnreg: int = 128
    loader_regs: int = 24
    box: int = 128  # TMA box width in K bytes: 32 (a tile per block) or 128 (one tile per step, sliced)
    # Programmatic dependent launch: the kernel starts while the kernel writing X (the quantizer, a
    # producer, with ``fuse_x`` whatever came before) runs, streams its first weight tiles, then
    # waits for X (griddepcontrol); and it lets the kernel behind it start the same way. Off: the
    # launches serialize.
    pdl: bool = True
    # X quantized inside the math warpgroup (one launch, no quantizer): the amax scale rules with
    # the hardware fp8 conversion and box 128; ScaleRule.MSE or ``quantize.BIT_ROUNDING`` keep the
    # quantizer kernel. Faster only where the launch is a large part of the call
    # (``pick_decode_ws_config``): elsewhere the quantization on the math warpgroup's critical
    # path costs more than the quantizer that PDL hides (kernels/NOTES.md, "GEMM: decode fixed cost").
    fuse_x: bool = False
    # Activation rows per tile (the wgmma's N): None = 8 for M <= 8 (half the block products and
    # rescale work of 16), else 16.
    block_m: int | None = None


def takes(m: int, k: int, block_size: int) -> bool:
    """The shapes this kernel takes (on a Hopper GPU): Gluon usable (``gluon_api``), 1 <= M <= WS_MAX_M,
    K % 128 == 0 (whole scale words per step), MX block 32."""
    return gluon_api.usable("gemm_decode_ws") and 1 <= m <= WS_MAX_M and k % 128 == 0 and block_size == BS


def ws_supported(m: int, k: int, block_size: int, device: torch.device) -> bool:
    """``takes`` on a Hopper GPU (wgmma)."""
    return takes(m, k, block_size) and device.type == "cuda" and capability(device)[0] == 9


def _split_rule(n: int, k: int, block_n: int, per_sm: int, sms: int) -> int:
    """The most K splits (a power of two <= 16) that keep the programs within ``per_sm`` per SM
    and >= 4 steps of 128 per split."""
    tiles, steps, split = cdiv(n, block_n), k // 128, 1
    while split < 16 and steps // (split * 2) >= 4 and tiles * split * 2 <= per_sm * sms:
        split *= 2
    return split


def rule_decode_ws_config(m: int, n: int, k: int, device: torch.device) -> DecodeWSConfig:
    """The built-in rule: 128-row tiles, 2 stages of 128-byte-wide tiles, K split into the most
    pieces that keep the programs within two per SM (what fits: 2 x 256 threads x 128 registers)
    and >= 4 steps per split: the sweep's best split on 7 of the 8 Llama-3 8B/70B shapes at M = 1, 4
    and 16 (kernels/NOTES.md, "GEMM: the decode GEMM warp-specialized in Gluon"). X is quantized
    inside the kernel (``fuse_x``) for weights of at most 2**24 elements, where the second launch
    weighs most; larger weights are slower with it ("GEMM: decode fixed cost")."""
    split = _split_rule(n, k, 128, 2, sm_count(device))
    return DecodeWSConfig(block_n=128, stages=2, split_k=split, box=128, fuse_x=n * k <= 1 << 24)


def pick_decode_ws_config(m: int, n: int, k: int, device: torch.device) -> DecodeWSConfig:
    """The config ``mx_decode_gemm_ws`` runs without one: this device's tuned entry for the shape
    and M bucket (``mxq tune``, ``kernels/tune.py``) if there is one, else ``rule_decode_ws_config``."""
    return tune.lookup("decode_ws", device, m, n, k, DecodeWSConfig) or rule_decode_ws_config(m, n, k, device)


# Candidates besides the rule (kernels/NOTES.md, "GEMM: decode tiles per shape and `mxq tune`"): 64-row tiles at 80 / 64
# registers (3 / 4 programs per SM: 65536 registers / (256 threads x maxnreg)), 2 or 3 stages, the
# K split re-derived for that many programs per SM.
_TILE_CANDIDATES = ((64, 80, 2), (64, 80, 3), (64, 64, 2), (64, 64, 3))


def decode_ws_candidates(m: int, n: int, k: int, device: torch.device) -> list[DecodeWSConfig]:
    """The configs ``mxq tune`` times for this shape, the rule's first: the 64-row tiles above, the
    rule with half its K split, and the rule with ``fuse_x`` flipped."""
    base = rule_decode_ws_config(m, n, k, device)
    sms = sm_count(device)
    out = [base]
    for bn, reg, st in _TILE_CANDIDATES:
        split = _split_rule(n, k, bn, 65536 // (256 * reg), sms)
        out.append(dataclasses.replace(base, block_n=bn, maxnreg=reg, stages=st, split_k=split))
    if base.split_k > 1:
        out.append(dataclasses.replace(base, split_k=base.split_k // 2))
    out.append(dataclasses.replace(base, fuse_x=not base.fuse_x))
    return list(dict.fromkeys(out))


def describe(cfg: DecodeWSConfig) -> str:
    """A short name for tables: rows per tile, registers, stages, K split, X fused or not."""
    return f"bn{cfg.block_n} r{cfg.maxnreg} s{cfg.stages} split{cfg.split_k}" + (" fused-x" if cfg.fuse_x else "")


@on_input_device
def mx_decode_gemm_ws(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    act_elem: ElemFormat = E4M3,
    act_rule: ScaleRule = ScaleRule.RCEIL,
    out_dtype: torch.dtype | None = None,
    config: DecodeWSConfig | None = None,
    block_size: int = 32,
    x_mx: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """W8A8 Y [M, N] = MX(X) · dequant(W)ᵀ (+ bias), M <= 16, on a Hopper GPU (module doc).

    ``x_mx`` = (fp8 codes [M, K], scale bytes [M, K/32]): X already quantized by its producer
    (``producers``); the kernel reads them and X is not rounded again.

    X (bf16/fp16/fp32) is MX-quantized along K (``quantize_mx_rows``' kernel, any ScaleRule),
    then this kernel runs. Same result as ``gemm_decode.mx_decode_gemm`` up to fp32 accumulation
    order. Everything that depends only on shapes, dtypes, alignment and the options is worked
    out once per such combination (``_WSPlan``): an eager call costs one or two direct launches
    (``mxq.kernels.launch``) and two allocations of host time.
    """
    key = plan_key(x, weight, weight_scale, bias, act_elem, act_rule, out_dtype, config, block_size, x_mx is not None)
    plan = PLANS.get(key) if launch.FAST else None
    if plan is None:
        plan = _WSPlan(x, weight, weight_scale, bias, act_elem, act_rule, out_dtype, config, block_size, x_mx is not None)
        if launch.FAST:
            PLANS.put(key, plan)
    return plan(x, weight, weight_scale, bias, x_mx)


PLANS = PlanCache()


def tma_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself where TMA and the int32 scale view can read it (contiguous, 16-byte aligned), else a
    contiguous copy."""
    return t if t.is_contiguous() and t.data_ptr() % 16 == 0 else t.clone(memory_format=torch.contiguous_format)


def plan_key(x, weight, weight_scale, bias, act_elem, act_rule, out_dtype, config, block_size, pre) -> tuple:
    """What a ``_WSPlan`` is built from: shapes, strides, dtypes, 16-byte alignment, options."""
    dev = x.device
    return (
        x.shape, x.stride(), x.dtype, x.data_ptr() & 15, x.get_device(),
        weight.shape, weight.stride(), weight.dtype, weight.data_ptr() & 15,
        weight_scale.shape, weight_scale.stride(), weight_scale.dtype, weight_scale.data_ptr() & 15,
        None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.data_ptr() & 15),
        getattr(act_elem, "name", act_elem), act_rule, out_dtype, config, block_size, pdl_ok(dev), hw_cvt(dev), pre,
    )  # fmt: skip


class _WSPlan:
    """One ``mx_decode_gemm_ws`` call signature: checks, tiles, split, descriptors' block shapes
    and layouts, the quantizer's and the GEMM's launches. Holds no tensor (plans outlive models)."""

    def __init__(self, x, weight, weight_scale, bias, act_elem, act_rule, out_dtype, config, block_size, pre=False):
        m, k = check_gemm_args(x, weight, weight_scale, bias, block_size)
        n = weight.shape[0]
        if not ws_supported(m, k, block_size, x.device):
            raise ValueError(
                f"mx_decode_gemm_ws needs Gluon, a Hopper GPU, M <= {WS_MAX_M}, K % 128 == 0 and block 32; got M={m}, K={k}, "
                f"block {block_size} on {x.device}"
            )
        act_elem, act_rule = as_elem_format(act_elem), as_scale_rule(act_rule)
        self.m, self.n, self.k = m, n, k
        self.out_dtype = out_dtype or x.dtype
        self.trivial = not (n and k)  # the output is empty, zeros or the bias
        if self.trivial:
            return
        # unit inner strides; TMA needs 16-byte rows, the int32 scale view 4-byte ones
        self.copy_x = x.stride(1) != 1
        self.copy_w = weight.stride(1) != 1 or weight.stride(0) % 16 or weight.data_ptr() % 16
        self.copy_s = weight_scale.stride(1) != 1 or weight_scale.stride(0) % 4 or weight_scale.data_ptr() % 4
        cfg = config or pick_decode_ws_config(m, n, k, x.device)
        block_m = cfg.block_m or (8 if m <= 8 else 16)
        self.split, self.k_split, _ = split_k_sizes(k, cfg.split_k, KB * BS)
        split = self.split
        self.tiles = cdiv(n, cfg.block_n)
        self.want_fused = split > 1 and cfg.fused
        pdl = cfg.pdl and pdl_ok(x.device)
        w_gl = gl.float8e4nv if weight.dtype == torch.float8_e4m3fn else gl.float8e5
        self.x_dtype = act_elem.torch_dtype
        x_gl = gl.float8e4nv if self.x_dtype == torch.float8_e4m3fn else gl.float8e5
        self.w_block = [cfg.block_n, cfg.box]
        self.w_layout = gl.NVMMASharedLayout.get_default_for(self.w_block, w_gl)
        self.x_block = [block_m, cfg.box]
        self.x_layout = gl.NVMMASharedLayout.get_default_for(self.x_block, x_gl)
        # scratch: fp8 X [M, K], its scales [M, K/32] (both 16-byte aligned), fp32 split partials
        self.xs_off = m * k
        self.ws_off = cdiv(m * k + m * (k // BS), 16) * 16
        self.scratch = self.ws_off + (4 * split * m * n if split > 1 else 0)
        consts = dict(BLOCK_N=cfg.block_n, BLOCK_M=block_m, STAGES=cfg.stages, SPLIT=split, HAS_BIAS=bias is not None,
                      LOADER_REGS=cfg.loader_regs, BOX=cfg.box)  # fmt: skip
        self.pre = pre  # X arrives quantized (``x_mx``): no quantizer, nothing to fuse
        self.fuse_x = not pre and cfg.fuse_x and act_rule is not ScaleRule.MSE and cfg.box == 128 and hw_cvt(x.device)
        if self.fuse_x:
            consts.update(FUSE_X=True, X_FP8=x_gl, X_LAYOUT=self.x_layout, EMAX=act_elem.emax, MBITS=act_elem.mbits,
                          MAXN=act_elem.max_normal, RULE=RULE_ID[act_rule])  # fmt: skip
        elif not pre:
            self.quantize = quantize_launch(act_elem, act_rule, block_size, write_q=True, write_d=False,
                                            pdl=pdl, device=x.device)  # fmt: skip
            self.qgrid = quantize_grid(m, k, act_rule, block_size)
        # With PDL the GEMM is launched behind the kernel that writes X (the quantizer, a producer, or
        # whatever came before: it waits for it before reading X) and lets the one behind it start.
        consts["PDL"] = pdl
        opts = dict(num_warps=4, maxnreg=cfg.maxnreg, launch_pdl=pdl)
        self.gemm = {f: Launch(mx_decode_ws_kernel, dict(consts, FUSED=f), opts) for f in (False, True)}
        self.has_bias = bias is not None

    def args(self, x, s32, xs, bias, y, ws, counters, x_stride: int, xs_stride: int) -> tuple:
        """The GEMM kernel's arguments after its two descriptors, in its order: the one list that
        both this plan and a lane (``kernels/lanes.py``) launch with. ``s32``: the weight scales as
        int32; ``xs``: X's scales (read as int32 words, ``xs_stride`` of them a row); ``bias``,
        ``ws`` (split-K partials) and ``counters`` (fused split-K tickets) may be None."""
        return (x, s32, xs, bias if bias is not None else s32, y, ws if ws is not None else y,
                counters if counters is not None else s32, self.m, self.n, self.k, self.k_split, x_stride,
                s32.stride(0), xs_stride, self.n)  # fmt: skip

    def __call__(self, x, weight, weight_scale, bias, x_mx=None):
        m, n, k = self.m, self.n, self.k
        if self.trivial:
            return operands_and_output(x, weight, weight_scale, bias, self.out_dtype, n)[3]
        if self.copy_x:
            x = x.contiguous()
        if self.copy_w:
            weight = weight.contiguous()
        if self.copy_s:
            weight_scale = weight_scale.contiguous()
        dev = x.device
        y = torch.empty((m, n), dtype=self.out_dtype, device=dev)
        w_desc = descriptor(gluon_api.TensorDescriptor, weight, [n, k], [weight.stride(0), 1], self.w_block, self.w_layout)
        s32 = weight_scale.view(torch.int32)
        if self.fuse_x or self.pre:
            ws = torch.empty((self.split, m, n), dtype=torch.float32, device=dev) if self.split > 1 else None
            x_desc, xs32 = w_desc, s32  # fuse_x: unused, the kernel reads x and quantizes it itself
            if self.pre:  # the producer's codes; TMA needs 16-byte aligned rows, the int32 scale view 4-byte ones
                xq, xs = (t.reshape(m, -1) for t in x_mx)
                xq, xs = map(tma_rows, (xq, xs))
                x_desc = descriptor(gluon_api.TensorDescriptor, xq.view(self.x_dtype), [m, k], [k, 1], self.x_block, self.x_layout)
                xs32 = xs.view(torch.int32)
        else:
            buf = torch.empty(self.scratch, dtype=torch.uint8, device=dev)
            xq = buf[: self.xs_off].view(m, k)
            xs = buf[self.xs_off : self.xs_off + m * (k // BS)].view(m, k // BS)
            ws = buf[self.ws_off :].view(torch.float32).view(self.split, m, n) if self.split > 1 else None
            self.quantize(self.qgrid, x, xq, xs, x, m, k, k, k // BS, x.stride(0), k, k // BS, 0)
            x_desc = descriptor(gluon_api.TensorDescriptor, xq.view(self.x_dtype), [m, k], [k, 1], self.x_block, self.x_layout)
            xs32 = xs.view(torch.int32)
        counters = split_counters(dev, self.tiles) if self.want_fused else None
        fused = counters is not None
        self.gemm[fused]((self.tiles, self.split), w_desc, x_desc,
                         *self.args(x, s32, xs32, bias, y, ws, counters, x.stride(0), xs32.stride(0)))  # fmt: skip
        if self.split > 1 and not fused:
            split_k_finish(ws, y, bias, self.split)
        return y
