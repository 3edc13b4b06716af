"""MX GEMM for prefill (large M) on Hopper, warp-specialized (Gluon, sm_90).

The same function as ``gemm.mx_gemm_kernel`` (read its module doc first): Y = X · dequant(W)ᵀ
with X in bf16 (W8A8 callers round X to MX first, exactly, into bf16) and each weight element
converted to bf16 as fp8 · 2**scale (exact: four significant bits), products summed in fp32 by
bf16 wgmma. What differs is the schedule, which plain Triton cannot express:

- a **loader warp** streams X [256, 64] bf16, W [128, 64] fp8 and the step's scales (transposed:
  ``scales_kn``) through a 4-stage TMA ring with mbarriers;
- two **MMA warpgroups** (64 weight rows each, two partitions that release their ring stages
  independently) turn their fp8 rows into bf16 · 2**scale in registers (byte moves + two exact
  bf16 products, ``_rs_block``) and issue wgmmas with that as the left operand (Yᵀ = W·Xᵀ),
  converting step i+1 while step i's wgmmas run and issuing step i+1 before waiting for step i.
  The loop is unrolled by two with two operand register sets taking turns, so no operand of an
  in-flight wgmma is copied at the back edge (ptxas would let the copy overwrite registers a
  running wgmma reads; kernels/NOTES.md, "GEMM: the register-operand prefill kernel").

Shapes: any M, N; K % 32 == 0 (MX block 32; the ragged last step is zero-filled by TMA, its
scales masked); X bf16 with 16-byte rows. Dispatched on Hopper at M >= 1024 where the 256 x 128
tiles fill the SMs (``dispatch``). Needs Gluon (``gluon_api``) and a Hopper GPU; the Triton
interpreter cannot run Gluon, so CPU tests compile it for sm_90 (tests/test_sass_dev.py) and GPU
tests compare it with the torch reference.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import triton

from mxq.kernels import gluon_api
from mxq.kernels.buffers import persistent
from mxq.kernels.common import capability, check_gemm_args, fp8_bits_asm, operands_and_output
from mxq.kernels.gluon_api import (
    gl,
    gluon,
    hopper,
    smem_view,
    tma_load,
)
from mxq.kernels.launch import Launch, PlanCache, cdiv, descriptor, on_input_device

BS = 32  # MX block along K


@dataclass(frozen=True)
class PrefillRSConfig:
    """Tiles of ``mx_prefill_rs_kernel`` (the weight as wgmma's register operand)."""

    block_x: int = 256  # X rows per program: the wgmma's N (m64n256k16)
    block_w: int = 128  # weight rows per program: 2 MMA warpgroups x 64
    block_k: int = 64  # K per step (two MX blocks)
    stages: int = 4  # X + fp8 W + scales ring (40.25 KB a stage; 5 fit; 4 beat 3, 5 ties: NOTES)
    group: int = 8  # row tiles per L2 group
    maxnreg: int = 168  # registers per thread at launch; the workers give theirs back (setmaxnreg)
    loader_regs: int = 24
    mma_regs: int = 240  # the worker MMA warpgroup's registers after setmaxnreg


if gluon_api.HAVE_GLUON:
    _BITS_E4M3 = gl.constexpr(fp8_bits_asm(4, 0x07F007F0))  # (code & 0x7F) << 4: x · 2**-120
    _BITS_E5M2 = gl.constexpr(fp8_bits_asm(3, 0x0FE00FE0))  # (code & 0x7F) << 5: x · 2**-112

    @gluon.jit
    def _tile_coords(M, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP: gl.constexpr):
        """This program's tile, in grouped order: GROUP row tiles of X walk the same weight columns
        (L2 reuse of W)."""
        pid = gl.program_id(0)
        tiles_m = gl.cdiv(M, BLOCK_M)
        tiles_n = gl.cdiv(N, BLOCK_N)
        per_group = GROUP * tiles_n
        first_m = (pid // per_group) * GROUP
        rows = gl.minimum(tiles_m - first_m, GROUP)
        pid_m = first_m + (pid % per_group) % rows
        pid_n = (pid % per_group) // rows
        return pid_m * BLOCK_M, pid_n * BLOCK_N

    @gluon.jit
    def _fp8_bits_bf16(v, MSH: gl.constexpr):
        """fp8 codes (uint8) -> bf16 with bits (sign << 15) | (code & 0x7F) << MSH, a pair of codes
        (one 16-bit shared load) per register: a byte permute, a shift and two masks (Triton's
        integer ops on the unpacked codes took ~3x the instructions)."""
        if MSH == 4:
            asm: gl.constexpr = _BITS_E4M3
        else:
            asm: gl.constexpr = _BITS_E5M2
        return gl.inline_asm_elementwise(asm, "=r,r", [v], dtype=gl.bfloat16, is_pure=True, pack=2)

    @gluon.jit
    def _bf16_exp2(e):
        """bf16 2**e for int32 e in [-126, 127] (bits (e + 127) << 7)."""
        return ((e + 127) << 7).to(gl.int16).to(gl.bfloat16, bitcast=True)

    @gluon.jit
    def _rs_block(w8_tile, s_flat, j: gl.constexpr, a_l: gl.constexpr, ROW0: gl.constexpr):
        """MX block j (32 K-columns) of the weight tile as the wgmma's register operand:
        bf16(fp8) · 2**scale in bf16 (exact: a power-of-two product of a 4-bit significand).

        The fp8 byte's sign and exponent-mantissa bits are moved into a bf16 pattern (E4M3:
        x · 2**-120, E5M2: x · 2**-112, subnormal codes included, as bf16 has the exponent range),
        then two exact bf16 products restore 2**(scale - 127) (one would overflow the bf16
        exponent for scale bytes above 134). Triton's fp8 -> bf16 conversion instead costs a
        quarter-rate F2F per element on sm_90."""
        ROWS: gl.constexpr = w8_tile.type.shape[0]  # this warpgroup's rows, from ROW0 of the program's tile
        BLOCK_W: gl.constexpr = s_flat.type.shape[0] // 2
        w = w8_tile.slice(j * 32, 32, dim=1).load(a_l)
        sb = s_flat.slice(j * BLOCK_W + ROW0, ROWS).load(gl.SliceLayout(1, a_l)).to(gl.int32)
        E5: gl.constexpr = w8_tile.dtype == gl.float8e5
        SHIFT: gl.constexpr = 112 if E5 else 120
        MSH: gl.constexpr = 5 if E5 else 4
        wb = _fp8_bits_bf16(w.to(gl.uint8, bitcast=True), MSH)
        e = sb - 127 + SHIFT
        e_lo = gl.minimum(e, 127)
        f_hi = gl.where(sb == 255, float("nan"), _bf16_exp2(e - e_lo).to(gl.float32)).to(gl.bfloat16)
        return wb * _bf16_exp2(e_lo)[:, None] * f_hi[:, None]

    @gluon.jit
    def _ring_loader(x_desc, w_desc, s_desc, x_smem, w8_smem, s_smem, ready, empty, off_m, off_n, n_k,
                     STAGES: gl.constexpr):  # fmt: skip
        """Loader warp: ``_ring_fill`` of this program's tile from ring step 0."""
        _ring_fill(x_desc, w_desc, s_desc, x_smem, w8_smem, s_smem, ready, empty, off_m, off_n, n_k, 0, STAGES)

    @gluon.jit
    def _ring_fill(x_desc, w_desc, s_desc, x_smem, w8_smem, s_smem, ready, empty, off_m, off_n, n_k, base,
                   STAGES: gl.constexpr):  # fmt: skip
        """TMA X [BLOCK_M, BLOCK_K], W [BLOCK_N, BLOCK_K] and the step's scales [BLOCK_K / 32,
        BLOCK_N] (transposed) of one tile's n_k steps into the ring, step i in ring step base + i
        (stage (base + i) % STAGES), once that stage is empty."""
        BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
        nbytes: gl.constexpr = x_desc.block_type.nbytes + w_desc.block_type.nbytes + s_desc.block_type.nbytes
        for i in range(n_k):
            r = base + i
            s = r % STAGES
            # a fresh barrier counts as having completed the phase before 0: the first round passes
            hopper.mbarrier.wait(empty.index(s), ((r // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            hopper.mbarrier.expect(bar, nbytes)
            tma_load(x_desc, [off_m, i * BLOCK_K], bar, x_smem.index(s))
            tma_load(w_desc, [off_n, i * BLOCK_K], bar, w8_smem.index(s))
            tma_load(s_desc, [i * (BLOCK_K // 32), off_n], bar, s_smem.index(s))

    @gluon.jit
    def _rs_operands(w8_smem, s_smem, r, a_l: gl.constexpr, ROW0: gl.constexpr,
                     ROWS: gl.constexpr, ready, STAGES: gl.constexpr):  # fmt: skip
        """Ring step r's two MX blocks of this warpgroup's weight rows as wgmma register operands
        (waits for the stage to be loaded)."""
        BLOCK_W: gl.constexpr = w8_smem.type.shape[1]
        flat_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        s = r % STAGES
        hopper.mbarrier.wait(ready.index(s), (r // STAGES) & 1)
        s_flat = smem_view(s_smem.index(s), gl.uint8, [2 * BLOCK_W], flat_l)
        w8 = w8_smem.index(s).slice(ROW0, ROWS, dim=0)
        return _rs_block(w8, s_flat, 0, a_l, ROW0), _rs_block(w8, s_flat, 1, a_l, ROW0)

    @gluon.jit
    def _rs_issue(b0, b1, x_smem, r, acc, use_acc, STAGES: gl.constexpr):
        """Ring step r's wgmmas (two commit groups): acc += b0 · X[:, :32]ᵀ + b1 · X[:, 32:]ᵀ."""
        x = x_smem.index(r % STAGES)
        acc = hopper.warpgroup_mma(b0, x.slice(0, 32, dim=1).permute((1, 0)), acc, use_acc=use_acc, is_async=True)
        return hopper.warpgroup_mma(b1, x.slice(32, 32, dim=1).permute((1, 0)), acc, is_async=True)

    @gluon.jit
    def _rs_tile(x_smem, w8_smem, s_smem, ready, empty, n_k, base, NUM_WARPS: gl.constexpr,
                 STAGES: gl.constexpr, ROW0: gl.constexpr):  # fmt: skip
        """One tile's K loop on this warpgroup's weight rows (ring steps base .. base + n_k - 1):
        accᵀ [rows, BLOCK_X] = (W · 2**s) X tileᵀ. Each stage goes back to the loader once the
        wgmmas reading it have retired.

        Step i+1's register operands are converted while step i's wgmmas run. The operands a
        wgmma reads must stay in their registers until it retires: a loop-carried operand that
        the back edge copies while its wgmma is in flight gets overwritten (ptxas 13.5 does not
        stop that: sass_dev's hazard check found such writes in the first build and the GPU gave
        wrong sums; kernels/NOTES.md, "GEMM: the register-operand prefill kernel"). So the loop is unrolled by two with an a and a b operand pair taking turns,
        step i+1 issued before step i is waited for, so the wgmma queue never runs dry; the pair
        in flight at the back edge is only rewritten after the wait that retires it, so its
        registers stay put (the hazard count checks it)."""
        BLOCK_X: gl.constexpr = x_smem.type.shape[1]
        ROWS: gl.constexpr = 16 * NUM_WARPS
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, BLOCK_X, 16])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
        acc = gl.zeros([ROWS, BLOCK_X], gl.float32, acc_l)
        b0, b1 = _rs_operands(w8_smem, s_smem, base, a_l, ROW0, ROWS, ready, STAGES)
        a0 = b0
        a1 = b1
        acc = _rs_issue(a0, a1, x_smem, base, acc, False, STAGES)
        acc = hopper.warpgroup_mma_wait(num_outstanding=2, deps=(acc,))  # no wait: a tensor for the loop
        for j in range((n_k - 1) // 2):
            r = base + 2 * j + 1
            b0, b1 = _rs_operands(w8_smem, s_smem, r, a_l, ROW0, ROWS, ready, STAGES)
            acc = _rs_issue(b0, b1, x_smem, r, acc, True, STAGES)
            acc, a0, a1 = hopper.warpgroup_mma_wait(num_outstanding=2, deps=(acc, a0, a1))  # step r-1 retired
            hopper.mbarrier.arrive(empty.index((r - 1) % STAGES))
            a0, a1 = _rs_operands(w8_smem, s_smem, r + 1, a_l, ROW0, ROWS, ready, STAGES)
            acc = _rs_issue(a0, a1, x_smem, r + 1, acc, True, STAGES)
            acc, b0, b1 = hopper.warpgroup_mma_wait(num_outstanding=2, deps=(acc, b0, b1))  # step r retired
            hopper.mbarrier.arrive(empty.index(r % STAGES))
        r = base + n_k - 1
        if n_k % 2 == 0:  # the last step on the b pair
            b0, b1 = _rs_operands(w8_smem, s_smem, r, a_l, ROW0, ROWS, ready, STAGES)
            acc = _rs_issue(b0, b1, x_smem, r, acc, True, STAGES)
            acc, a0, a1 = hopper.warpgroup_mma_wait(num_outstanding=2, deps=(acc, a0, a1))
            hopper.mbarrier.arrive(empty.index((r - 1) % STAGES))
            acc, b0, b1 = hopper.warpgroup_mma_wait(num_outstanding=0, deps=(acc, b0, b1))
        else:
            acc, a0, a1 = hopper.warpgroup_mma_wait(num_outstanding=0, deps=(acc, a0, a1))
        hopper.mbarrier.arrive(empty.index(r % STAGES))
        return acc

    @gluon.jit
    def _rs_store(acc, b_ptr, y_ptr, M, N, stride_ym, off_m, off_n, HAS_BIAS: gl.constexpr, ROW0: gl.constexpr):
        """Y [off_m:, off_n + ROW0:] = accᵀ (+ bias), masked to M x N."""
        acc_l: gl.constexpr = acc.type.layout
        ROWS: gl.constexpr = acc.type.shape[0]
        BLOCK_X: gl.constexpr = acc.type.shape[1]
        NUM_WARPS: gl.constexpr = ROWS // 16
        offs_w = off_n + ROW0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_l))
        if HAS_BIAS:  # along the accumulator's rows, before any layout change (gemm.py's lesson)
            acc += gl.load(b_ptr + offs_w, mask=offs_w < N, other=0.0).to(gl.float32)[:, None]
        if y_ptr.dtype.element_ty.primitive_bitwidth == 16:
            # Y [M, N] is accᵀ: store through a layout whose threads run along W (Y's contiguous
            # dim), 16 bytes each (the layout change goes through 64 KB of shared memory)
            st_l: gl.constexpr = gl.BlockedLayout([8, 1], [16, 2], [1, NUM_WARPS], [0, 1])
            out = gl.convert_layout(acc.to(y_ptr.dtype.element_ty), st_l)
            ow = off_n + ROW0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, st_l))
            ox = off_m + gl.arange(0, BLOCK_X, layout=gl.SliceLayout(0, st_l))
            mask = (ow < N)[:, None] & (ox < M)[None, :]
            gl.store(y_ptr + ox.to(gl.int64)[None, :] * stride_ym + ow[:, None], out, mask=mask)
        else:  # fp32 out: 128 KB would not fit beside the ring; store from the MMA layout
            ox = off_m + gl.arange(0, BLOCK_X, layout=gl.SliceLayout(0, acc_l))
            mask = (offs_w < N)[:, None] & (ox < M)[None, :]
            gl.store(y_ptr + ox.to(gl.int64)[None, :] * stride_ym + offs_w[:, None], acc.to(y_ptr.dtype.element_ty), mask=mask)

    @gluon.jit
    def _rs_mma(x_smem, w8_smem, s_smem, ready, empty, b_ptr, y_ptr, M, N, stride_ym, off_m, off_n, n_k,
                STAGES: gl.constexpr, HAS_BIAS: gl.constexpr, NUM_WARPS: gl.constexpr, ROW0: gl.constexpr):  # fmt: skip
        """MMA warps, one tile per program (NUM_WARPS / 4 warpgroups, 64 weight rows each, from
        row ROW0 of the program's weight tile)."""
        acc = _rs_tile(x_smem, w8_smem, s_smem, ready, empty, n_k, 0, NUM_WARPS, STAGES, ROW0)
        _rs_store(acc, b_ptr, y_ptr, M, N, stride_ym, off_m, off_n, HAS_BIAS, ROW0)

    @gluon.jit
    def mx_prefill_rs_kernel(
        x_desc, w_desc, s_desc, b_ptr, y_ptr, M, N, K, stride_ym,
        STAGES: gl.constexpr, GROUP: gl.constexpr, HAS_BIAS: gl.constexpr, LOADER_REGS: gl.constexpr,
        MMA_REGS: gl.constexpr,
    ):  # fmt: skip
        """Yᵀ tile [BLOCK_W, BLOCK_X]: two MMA warpgroups (64 weight rows each, the weight as the
        register operand) as two partitions -- the default one and a worker -- each releasing its
        ring stages on its own (no barrier between them per step), and a loader warp."""
        BLOCK_X: gl.constexpr = x_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
        BLOCK_W: gl.constexpr = w_desc.block_type.shape[0]
        gl.static_assert(BLOCK_K == 64, "64-wide K steps: two MX blocks")
        gl.static_assert(BLOCK_W == 128, "two warpgroups of 64 weight rows")
        off_m, off_n = _tile_coords(M, N, BLOCK_X, BLOCK_W, GROUP)
        n_k = gl.cdiv(K, BLOCK_K)
        x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_X, BLOCK_K], x_desc.layout)
        w8_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_W, BLOCK_K], w_desc.layout)
        s_smem = gl.allocate_shared_memory(s_desc.dtype, [STAGES] + s_desc.block_type.shape, s_desc.layout)
        ready, empty = gluon_api.ring_barriers(STAGES, 2)  # empty: one arrival per MMA warpgroup
        gl.warp_specialize(
            [
                (_rs_mma, (x_smem, w8_smem, s_smem, ready, empty, b_ptr, y_ptr, M, N, stride_ym, off_m, off_n, n_k,
                           STAGES, HAS_BIAS, 4, 0)),
                (_rs_mma, (x_smem, w8_smem, s_smem, ready, empty, b_ptr, y_ptr, M, N, stride_ym, off_m, off_n, n_k,
                           STAGES, HAS_BIAS, 4, 64)),
                (_ring_loader, (x_desc, w_desc, s_desc, x_smem, w8_smem, s_smem, ready, empty, off_m, off_n, n_k, STAGES)),
            ],
            [4, 1],
            [MMA_REGS, LOADER_REGS],
        )  # fmt: skip
        gluon_api.invalidate_ring(ready, empty, STAGES)

else:  # pragma: no cover
    mx_prefill_rs_kernel = gluon_api.unavailable("gemm_prefill_ws")


def takes(m: int, k: int, block_size: int) -> bool:
    """The shapes this kernel takes (on a Hopper GPU): Gluon usable (``gluon_api``), M >= 1, MX block 32."""
    return gluon_api.usable("gemm_prefill_ws") and m >= 1 and k % BS == 0 and block_size == BS


def ws_supported(m: int, k: int, block_size: int, device: torch.device) -> bool:
    """``takes`` on a Hopper GPU (wgmma, TMA)."""
    return takes(m, k, block_size) and capability(device)[0] == 9


def pick_prefill_rs_config(m: int, n: int, k: int, device: torch.device) -> PrefillRSConfig:
    """One tile: 128 weight rows x 256 X rows x 64, 4 stages, one step in flight, the two MMA
    warpgroups as two partitions: each faster on the Llama-3 rows at M = 2048 in interleaved A/B runs
    (kernels/NOTES.md, "GEMM: the register-operand prefill kernel")."""
    del m, n, k, device
    return PrefillRSConfig()


def scales_kn(weight_scale: torch.Tensor) -> torch.Tensor:
    """The scales transposed, [K/32, N] with rows padded to 16 bytes (what the loader's TMA reads:
    one [BLOCK_K/32, BLOCK_N] box per step). N x K/32 bytes, 1/32 of the weight, made per call:
    ~1 % of a prefill GEMM's time."""
    n, kb = weight_scale.shape
    st = torch.empty((kb, triton.cdiv(n, 16) * 16), dtype=torch.uint8, device=weight_scale.device)
    st[:, :n].copy_(weight_scale.t())
    return st


SCALES_KN_CACHE: dict = {}  # id(weight_scale) -> (weakref to it, its _version, scales_kn of it)


def scales_kn_cached(weight_scale: torch.Tensor) -> torch.Tensor:
    """``scales_kn`` once per weight: a model's scales are fixed, so the transposed copy (a torch
    kernel and ~40 µs of host time per call) is made on the first call and kept while the scales
    tensor lives and is not written in place. Kept copies are made outside any CUDA-graph memory
    pool (``buffers``); under stream capture the copy is made per call, inside the graph."""
    hit = SCALES_KN_CACHE.get(id(weight_scale))
    if hit is not None and hit[0]() is weight_scale and hit[1] == weight_scale._version:
        return hit[2]
    st = persistent(lambda: scales_kn(weight_scale), weight_scale.device) if weight_scale.is_cuda else None
    if st is None:
        return scales_kn(weight_scale)
    key = id(weight_scale)
    SCALES_KN_CACHE[key] = (weakref.ref(weight_scale, lambda _r, key=key: SCALES_KN_CACHE.pop(key, None)), weight_scale._version, st)
    return st


class _RSPlan:
    """One ``mx_prefill_gemm_ws`` call signature on the register-operand kernel: grid, the
    descriptors' block shapes and layouts, and the launch (``launch.Launch``: no JIT binding per
    call). The key it is kept under fixes what Triton specializes on (module ``launch``). Holds
    no tensor."""

    def __init__(self, m: int, n: int, k: int, w_dtype: torch.dtype, has_bias: bool, cfg: PrefillRSConfig,
                 device: torch.device):  # fmt: skip
        bx, bw, bk = cfg.block_x, cfg.block_w, cfg.block_k
        w_gl = gl.float8e4nv if w_dtype == torch.float8_e4m3fn else gl.float8e5
        self.x_block, self.w_block, self.s_block = [bx, bk], [bw, bk], [bk // BS, bw]
        self.x_layout = gl.NVMMASharedLayout.get_default_for(self.x_block, gl.bfloat16)
        self.w_layout = gl.NVMMASharedLayout.get_default_for(self.w_block, w_gl)
        # unswizzled: the MMA warps read the [2, BLOCK_W] box as flat bytes
        self.s_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
        tiles = cdiv(m, bx) * cdiv(n, bw)
        self.grid = (tiles,)
        consts = dict(STAGES=cfg.stages, GROUP=cfg.group, HAS_BIAS=has_bias, LOADER_REGS=cfg.loader_regs,
                      MMA_REGS=cfg.mma_regs)  # fmt: skip
        # the default partition is one MMA warpgroup (4 warps); the workers are added by warp_specialize
        self.launch = Launch(mx_prefill_rs_kernel, consts, dict(num_warps=4, maxnreg=cfg.maxnreg))

    def __call__(self, x, weight, st, bias, y) -> None:
        m, k = x.shape
        n = weight.shape[0]
        x_desc = descriptor(gluon_api.TensorDescriptor, x, [m, k], [x.stride(0), 1], self.x_block, self.x_layout)
        w_desc = descriptor(gluon_api.TensorDescriptor, weight, [n, k], [weight.stride(0), 1], self.w_block, self.w_layout)
        s_desc = descriptor(gluon_api.TensorDescriptor, st, [k // BS, n], [st.stride(0), 1], self.s_block, self.s_layout)
        self.launch(self.grid, x_desc, w_desc, s_desc, bias if bias is not None else y, y, m, n, k, n)


_RS_PLANS = PlanCache()


@on_input_device
def mx_prefill_gemm_ws(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
    config: PrefillRSConfig | None = None,
    block_size: int = 32,
) -> torch.Tensor:
    """Y [M, N] = X [M, K] · dequant(W)ᵀ (+ bias), X bf16 used as given (module doc).

    W8A8 callers round X to MX first (``quantize.fake_quantize_mx_rows``, bf16 out: exact).
    Same result as ``gemm.mx_gemm`` with bf16 X up to fp32 accumulation order.
    """
    m, k = check_gemm_args(x, weight, weight_scale, bias, block_size)
    n = weight.shape[0]
    if x.dtype != torch.bfloat16:
        raise TypeError(f"mx_prefill_gemm_ws takes bf16 X (round W8A8 activations into bf16 first), got {x.dtype}")
    if not ws_supported(m, k, block_size, x.device):
        raise ValueError(
            f"mx_prefill_gemm_ws needs Gluon, a Hopper GPU and MX block 32; got block {block_size} on {x.device}"
        )
    x, weight, weight_scale, y, done = operands_and_output(x, weight, weight_scale, bias, out_dtype, n)
    if done:
        return y
    # TMA: 16-byte aligned base and row strides
    if x.stride(0) % 8 or x.data_ptr() % 16:
        x = x.contiguous()
    if weight.stride(0) % 16 or weight.data_ptr() % 16:
        weight = weight.contiguous()
    cfg = config or pick_prefill_rs_config(m, n, k, x.device)
    key = (m, n, k, weight.dtype, y.dtype, bias is not None and (bias.dtype, bias.data_ptr() % 16 == 0), cfg,
           x.device.index)  # fmt: skip
    plan = _RS_PLANS.get(key)
    if plan is None:
        plan = _RS_PLANS.put(key, _RSPlan(m, n, k, weight.dtype, bias is not None, cfg, x.device))
    plan(x, weight, scales_kn_cached(weight_scale), bias, y)
    return y


__all__ = ["PrefillRSConfig", "mx_prefill_gemm_ws", "pick_prefill_rs_config", "takes", "ws_supported"]
