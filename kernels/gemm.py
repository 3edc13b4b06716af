"""MX GEMM, Y = X·Wᵀ (+ bias), with W in MXFP8 ([N, K] fp8, [N, K/32] E8M0 scales).

Hopper (sm_90) has no block-scaled MMA, so the kernel computes the transposed product
Yᵀ = W·Xᵀ with the MX weight as the *left* operand: each [BLOCK_N, BLOCK_K] weight tile is
loaded as fp8, multiplied by its power-of-two scales and converted to the dot dtype in
registers (wgmma takes its left operand from registers, so the conversion never goes back
through shared memory), while the activation tile, already in the dot dtype, is the right
operand fed from shared memory. Both conversions are exact: an fp8 value times 2**e has at
most four significant bits, so bf16 holds it, and the fp32 accumulator sums exact products.
The result equals an fp32 product of the dequantized operands up to accumulation order.

- W8A16 (bf16 X): X goes in as is. fp16/fp32 X would lose bits in bf16, so they run the same
  kernel with fp32 operands and fp32 FMA (`input_precision="ieee"`): exact, slow.
- W8A8: X is first rounded to MX along K by ``quantize.fake_quantize_mx_rows`` into bf16
  (exact, see quantize.py), then multiplied as in W8A16.
- Small M (decode batches): the same kernel with a narrow activation tile (16..64) is a weight
  stream; when N / BLOCK_N programs leave SMs idle, K is split (fp32 partials summed with the
  bias by ``splitk.split_k_finish``). W8A8 up to ``GEMM_QUANT_MAX_M`` rows rounds X inside the
  kernel where ``pick_config`` says so (``quant_x``). Which M takes this kernel and which the
  decode kernels is ``dispatch``'s registry.

The Triton interpreter (CPU tests) computes bf16 dots wrongly and does not run
``tl.dot_scaled``; the dot dtype is a constexpr so the same kernel runs there with fp32.
Reference: ``mxq.kernels.reference.mx_linear_reference``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mxq.formats import ElemFormat, ScaleRule
from mxq.kernels import toolchain
from mxq.kernels.common import (
    INTERPRET,
    check_gemm_args,
    e8m0_to_f32,
    mx_round_consts,
    mx_round_dequant,
    operands_and_output,
    sm_count,
    tma_or_pointer,
)
from mxq.kernels.launch import call, next_pow2, on_input_device
from mxq.kernels.splitk import split_k_finish, split_k_plan

# Largest M whose W8A8 may round X inside this kernel (``GemmConfig.quant_x``).
GEMM_QUANT_MAX_M = 64


@dataclass(frozen=True)
class GemmConfig:
    block_m: int  # activation rows per program (the MMA's N side)
    block_n: int  # weight rows per program (the MMA's M side)
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    group: int = 8  # programs along M sharing one weight panel, for L2 reuse
    tma_x: bool = False  # activation tiles through the TMA copy engine (host descriptor)
    tma_w: bool = False  # weight tiles through TMA
    deq_bf16: bool = False  # apply the scale with a bf16 multiply instead of fp32 (bf16 dots only)
    peel: bool = True  # first K step before the loop (lets ptxas pipeline the wgmmas, see kernel)
    zero_dot: bool = False  # (peel=False) start the accumulator with a wgmma of zero tiles instead
    quant_x: bool = False  # W8A8: round X inside this kernel (dispatch), else a quantizer launch first


@triton.jit
def _mx_gemm_operands(
    x_ptr, w_ptr, s_ptrs, sc_next, w_ptrs, x_ptrs, i, k_lo, k_hi, pid_m, pid_n, offs_k, offs_b,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BS: tl.constexpr,
    DOT: tl.constexpr, EVEN_K: tl.constexpr, TMA_X: tl.constexpr, TMA_W: tl.constexpr,
    DEQ_BF16: tl.constexpr, QUANT: tl.constexpr, EMAX: tl.constexpr, MBITS: tl.constexpr, MAXN: tl.constexpr,
    EMIN: tl.constexpr, RULE: tl.constexpr, HW_CVT: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    """One K step's operands: the dequantized weight tile [BLOCK_N, BLOCK_K] (dot dtype, in
    registers) and the activation tile [BLOCK_K, BLOCK_M]; also the next step's scales."""
    NB: tl.constexpr = BLOCK_K // BS
    k = k_lo + i * BLOCK_K
    s_ptrs += i * NB
    if not TMA_W:
        w_ptrs += i * BLOCK_K
    if not TMA_X or QUANT:
        x_ptrs += i * BLOCK_K
    # TMA zero-fills out-of-bounds rows and columns; pointer loads mask the K tail.
    if TMA_W:
        w = w_ptr.load([pid_n * BLOCK_N, k])
    elif EVEN_K:
        w = tl.load(w_ptrs)
    else:
        w = tl.load(w_ptrs, mask=((k + offs_k) < k_hi)[None, :], other=0.0)
    if QUANT:
        # W8A8 with X rounded here (decode): [BLOCK_M, BLOCK_K] rows, MX blocks along K.
        if EVEN_K:
            xr = tl.load(x_ptrs)
        else:
            xr = tl.load(x_ptrs, mask=((k + offs_k) < k_hi)[None, :], other=0.0)
        xq = mx_round_dequant(tl.reshape(xr.to(tl.float32), (BLOCK_M, NB, BS)), EMAX, MBITS, MAXN, EMIN, RULE, HW_CVT, FP8)
        xt = tl.trans(tl.reshape(xq, (BLOCK_M, BLOCK_K)).to(DOT))
    elif TMA_X:
        xt = tl.trans(x_ptr.load([pid_m * BLOCK_M, k]))
    elif EVEN_K:
        xt = tl.load(x_ptrs)
    else:
        xt = tl.load(x_ptrs, mask=((k + offs_k) < k_hi)[:, None], other=0.0)
    # The scale load is not software-pipelined by Triton (it feeds the dot only through the
    # dequant): the next step's scales are loaded one iteration ahead.
    sc = sc_next
    sc_next = tl.load(s_ptrs + NB, mask=((k + BLOCK_K + offs_b * BS) < k_hi)[None, :], other=127)
    if DEQ_BF16:
        # fp8 -> bf16 is exact and a power-of-two product is exact in bf16 (same exponent
        # range as fp32): half the conversion work of the fp32 route.
        sb = e8m0_to_f32(sc).to(tl.bfloat16)
        wf = tl.reshape(w.to(tl.bfloat16), (BLOCK_N, NB, BS)) * sb[:, :, None]
        wd = tl.reshape(wf, (BLOCK_N, BLOCK_K)).to(DOT)
    else:
        wf = tl.reshape(w.to(tl.float32), (BLOCK_N, NB, BS)) * e8m0_to_f32(sc)[:, :, None]
        wd = tl.reshape(wf, (BLOCK_N, BLOCK_K)).to(DOT)
    return wd, xt.to(DOT), sc_next


@triton.jit
def mx_gemm_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr,
    M, N, K, K_SPLIT, M_BUCKET,
    stride_xm, stride_wn, stride_sn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BS: tl.constexpr,
    GROUP: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
    TMA_X: tl.constexpr = False, TMA_W: tl.constexpr = False,
    DEQ_BF16: tl.constexpr = False, PEEL: tl.constexpr = True,
    ZERO_DOT: tl.constexpr = False,
    QUANT: tl.constexpr = False, EMAX: tl.constexpr = 8, MBITS: tl.constexpr = 3, MAXN: tl.constexpr = 448.0,
    EMIN: tl.constexpr = -6, RULE: tl.constexpr = 1, HW_CVT: tl.constexpr = False,
    FP8: tl.constexpr = tl.float8e4nv,
):  # fmt: skip
    """Yᵀ tile [BLOCK_N, BLOCK_M] = dequant(W) tile · Xᵀ tile over this program's K range.

    PEEL: the first K step runs before the loop and starts the accumulator with its MMA, so
    the loop never carries a zero-initialised accumulator. With a loop that may run zero
    times, the zero-trip path writes the accumulator registers with plain moves and ptxas
    then serializes every wgmma (C7515: one MMA in flight, each waited for before the next).
    QUANT: X is MX-rounded along K inside the kernel (W8A8 in one launch; not MSE).
    """
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # Grouped order: GROUP consecutive programs walk M under one weight panel.
    per_group = GROUP * num_n
    first_m = (pid // per_group) * GROUP
    group_m = min(num_m - first_m, GROUP)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    # Out-of-range rows/cols read row 0 instead of being masked: their results are never stored.
    rn = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    rm = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    NB: tl.constexpr = BLOCK_K // BS
    offs_k = tl.arange(0, BLOCK_K)
    offs_b = tl.arange(0, NB)

    k_lo = pid_k * K_SPLIT
    k_hi = min(k_lo + K_SPLIT, K)
    n_iter = tl.cdiv(k_hi - k_lo, BLOCK_K)  # >= 1: every split holds at least one K step
    w_ptrs = w_ptr
    x_ptrs = x_ptr
    if not TMA_W:
        w_ptrs = w_ptr + rn[:, None] * stride_wn + (k_lo + offs_k)[None, :]
    if QUANT:
        x_ptrs = x_ptr + rm[:, None] * stride_xm + (k_lo + offs_k)[None, :]
    elif not TMA_X:
        x_ptrs = x_ptr + rm[None, :] * stride_xm + (k_lo + offs_k)[:, None]
    s_ptrs = s_ptr + rn[:, None] * stride_sn + (k_lo // BS + offs_b)[None, :]
    sc_next = tl.load(s_ptrs, mask=((k_lo + offs_b * BS) < k_hi)[None, :], other=127)
    if PEEL:
        wd, xt, sc_next = _mx_gemm_operands(
            x_ptr, w_ptr, s_ptrs, sc_next, w_ptrs, x_ptrs, 0, k_lo, k_hi, pid_m, pid_n, offs_k, offs_b,
            BLOCK_M, BLOCK_N, BLOCK_K, BS, DOT, EVEN_K, TMA_X, TMA_W, DEQ_BF16,
            QUANT, EMAX, MBITS, MAXN, EMIN, RULE, HW_CVT, FP8,
        )  # fmt: skip
        acc = tl.dot(wd, xt, input_precision=PRECISION, out_dtype=tl.float32)
        first = 1
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        if ZERO_DOT:
            # The accumulator starts as the product of zero tiles: a wgmma defines it, not moves.
            acc = tl.dot(tl.zeros((BLOCK_N, BLOCK_K), DOT), tl.zeros((BLOCK_K, BLOCK_M), DOT), acc, input_precision=PRECISION)
        first = 0
    for i in range(first, n_iter):
        wd, xt, sc_next = _mx_gemm_operands(
            x_ptr, w_ptr, s_ptrs, sc_next, w_ptrs, x_ptrs, i, k_lo, k_hi, pid_m, pid_n, offs_k, offs_b,
            BLOCK_M, BLOCK_N, BLOCK_K, BS, DOT, EVEN_K, TMA_X, TMA_W, DEQ_BF16,
            QUANT, EMAX, MBITS, MAXN, EMIN, RULE, HW_CVT, FP8,
        )  # fmt: skip
        acc = tl.dot(wd, xt, acc, input_precision=PRECISION)

    if SPLIT_K == 1:
        # The bias goes in while acc is still in the MMA layout ([BLOCK_N, BLOCK_M], bias along
        # rows): adding it after tl.trans gave inf/garbage at 256x128 tiles with N % 16 != 0.
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
        out = tl.trans(acc.to(y_ptr.dtype.element_ty))  # [BLOCK_M, BLOCK_N]
        mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        y_offs = offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptr + y_offs, out, mask=mask)
    else:
        # fp32 partials stored straight from the accumulator layout (transposed addresses, no
        # tl.trans / layout-conversion scratch): the trans route left unwritten partials (inf)
        # with 128x128 tiles, 8 warps, split-K 2 at M = 256.
        mask_t = (offs_n < N)[:, None] & (offs_m < M)[None, :]
        y_offs_t = offs_m.to(tl.int64)[None, :] * stride_ym + offs_n[:, None]
        tl.store(y_ptr + pid_k.to(tl.int64) * M * N + y_offs_t, acc, mask=mask_t)


# --------------------------------------------------------------------------------------
# Python side
# --------------------------------------------------------------------------------------

# How the prefill (TMA activation) configs start their accumulator. The old loop (accumulator
# zeroed before it) makes ptxas serialize every wgmma (C7515), which hides a register hazard: with
# the wgmmas in flight (zero-tile start or first K step peeled), ptxas < 13.3 lets the next K
# step's dequant overwrite the registers of a wgmma still reading them (triton-lang/triton#9433:
# inf/garbage). With ptxas >= 13.3 the zero-tile start is right on every tested shape and faster
# (kernels/NOTES.md, "GEMM: the wgmma register hazard and the pipelined prefill loop"), so it is
# used when Triton assembles with such a ptxas (kernels/toolchain.py).
PREFILL_LOOP = dict(peel=False, zero_dot=False)
PREFILL_ASYNC = dict(peel=False, zero_dot=True)


def _prefill_loop() -> dict:
    return PREFILL_ASYNC if toolchain.wgmma_async_ok() else PREFILL_LOOP


def pick_config(m: int, n: int, k: int, device: torch.device) -> GemmConfig:
    """Tile shape and split-K from the shape alone (no device sync, no timing)."""
    if INTERPRET or device.type != "cuda":
        split = 2 if k >= 128 else 1
        return GemmConfig(block_m=16, block_n=32, block_k=64, num_warps=4, num_stages=1, split_k=split)
    sms = sm_count(device)
    if m <= 64:
        # Weight streaming (kernels/NOTES.md, "GEMM: the exact emulation kernel"): weight tiles through
        # TMA, K split until the N tiles x splits cover the SMs twice. M <= 16, W8A8: N <= 4096 fastest
        # as 128x128 tiles with X rounded inside; large N fastest with the quantizer launch first
        # (every program would round X again).
        block_m = max(16, triton.next_power_of_2(m))
        quant_x, peel = False, False
        if m <= 16 and n <= 4096:
            block_n, block_k, warps, stages, quant_x, peel = 128, 128, 4, 4, True, True
        elif m <= 16 and n > 8192:
            block_n, block_k, warps, stages, peel = 128, 128, 4, 4, True
        elif m <= 16:
            block_n, block_k, warps, stages = 64, 128, 4, 6  # qkv: faster with the old loop (NOTES)
        else:
            block_n, block_k, warps, stages = 128, 128, 4, 4  # M 17..64: peeling not measured here
        tiles = triton.cdiv(n, block_n)
        split = 1
        while tiles * split < 2 * sms and k // (split * 2) >= 4 * block_k and split < 8:
            split *= 2
        return GemmConfig(block_m, block_n, block_k, warps, stages, split_k=split, tma_w=True, quant_x=quant_x, peel=peel)
    loop = _prefill_loop()
    if 128 < m <= 512 and loop is PREFILL_ASYNC:
        # Pipelined loop (ptxas >= 13.3), the M = 256 sweep's best (kernels/NOTES.md, "GEMM: the exact
        # emulation kernel"): 256x128 tiles with K split until the tiles x splits fill the SMs once.
        tiles = triton.cdiv(m, 256) * triton.cdiv(n, 128)
        split = 1
        while tiles * split * 2 <= sms and k // (split * 2) >= 8 * 64 and split < 8:
            split *= 2
        return GemmConfig(block_m=256, block_n=128, block_k=64, num_warps=8, num_stages=3, split_k=split,
                          tma_x=True, tma_w=True, deq_bf16=True, **loop)  # fmt: skip
    if m <= 512 and n < 16384:
        # 256x128 tiles leave most SMs idle here (N/128 programs); 128x64 won the M = 256 sweep with the
        # serialized loop (NOTES). M 65..128 keeps it with either loop (not swept since).
        return GemmConfig(block_m=128, block_n=64, block_k=64, num_warps=4, num_stages=4, tma_x=True, tma_w=True, deq_bf16=True, **loop)
    if n % 128 == 0 or loop is PREFILL_ASYNC:
        return GemmConfig(block_m=256, block_n=128, block_k=64, num_warps=8, num_stages=3, tma_x=True, tma_w=True, deq_bf16=True, **loop)
    # N not a multiple of 128 with the serialized loop (ptxas < 13.3): the 8-warp tiles give wrong
    # sums there (256 x 128, and 128 x 128 with a bias, bf16 output and N % 16 != 0); both are right
    # with ptxas >= 13.3 and the zero-tile start. The 4-warp 128 x 64 tile was right on every shape
    # (kernels/NOTES.md, "GEMM: the exact emulation kernel", wrong-result configurations).
    return GemmConfig(block_m=128, block_n=64, block_k=64, num_warps=4, num_stages=4, tma_x=True, tma_w=True, deq_bf16=True, **loop)


@on_input_device
def mx_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
    config: GemmConfig | None = None,
    block_size: int = 32,
    act_elem: ElemFormat | None = None,
    act_rule: ScaleRule = ScaleRule.RCEIL,
) -> torch.Tensor:
    """Y [M, N] = X [M, K] · dequant(W)ᵀ (+ bias), X used as given (bf16 / fp16 / fp32).

    The emulation kernel above. With ``act_elem`` (W8A8) X is MX-rounded along K inside the
    kernel (not ScaleRule.MSE; pointer loads for X, meant for small M where the rounding is
    repeated per weight panel cheaply); otherwise W8A8 callers round X first (dispatch.mx_linear).
    """
    m, k = check_gemm_args(x, weight, weight_scale, bias, block_size)
    n = weight.shape[0]
    if act_elem is not None and act_rule is ScaleRule.MSE:
        raise ValueError("mx_gemm rounds X itself only for FLOOR/RCEIL/EVEN; round MSE first")
    quant = act_elem is not None
    x, weight, weight_scale, y, done = operands_and_output(x, weight, weight_scale, bias, out_dtype, n)
    if done:
        return y
    cfg = config or pick_config(m, n, k, x.device)
    if config is None and x.dtype != torch.bfloat16 and not quant and cfg.block_m > 64:
        # fp32 operands (exact W8A16 for fp16/fp32 X): fp32 tiles need 2x the shared memory.
        cfg = GemmConfig(block_m=64, block_n=128, block_k=32, num_warps=4, num_stages=3)
    if config is None and cfg.num_warps == 8 and y.dtype == torch.float32 and not cfg.zero_dot:
        # The 8-warp prefill epilogues (256x128x64 and 128x128x64) give inf/garbage with a float32
        # output and the serialized loop (tests/test_e2e.py::test_gpu_mx_linear_model_shapes; like the
        # bias case; kernels/NOTES.md, "GEMM: the exact emulation kernel"); the 4-warp 128x64x64 tile was
        # right on every shape, and so was the pipelined loop (zero_dot, ptxas >= 13.3).
        cfg = GemmConfig(block_m=128, block_n=64, block_k=64, num_warps=4, num_stages=4, tma_x=cfg.tma_x,
                         tma_w=cfg.tma_w, deq_bf16=cfg.deq_bf16, **_prefill_loop())  # fmt: skip
    if cfg.block_k % block_size:
        raise ValueError(f"block_k={cfg.block_k} must be a multiple of block_size={block_size}")
    if INTERPRET or (x.dtype != torch.bfloat16 and not quant):
        dot, precision = tl.float32, "ieee"
        if INTERPRET and x.dtype == torch.bfloat16:
            x = x.float()
    else:
        # bf16 operands; in-kernel W8A8 rounding writes bf16 too (exact: see the module doc).
        dot, precision = tl.bfloat16, "tf32"  # precision is ignored for bf16 operands
    split, k_split, even_k, target = split_k_plan(y, k, cfg.split_k, cfg.block_k)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), split)
    tma_x, x_arg = tma_or_pointer(x, [cfg.block_m, cfg.block_k], cfg.tma_x and not quant)
    tma_w, w_arg = tma_or_pointer(weight, [cfg.block_n, cfg.block_k], cfg.tma_w)
    # through launch.call: the prefill path runs this for every projection too narrow for the
    # register-operand kernel, where the JIT's per-call binding made the model's forward host-bound
    call(
        mx_gemm_kernel, grid,
        (x_arg, w_arg, weight_scale, bias if bias is not None else weight_scale, target,
         m, n, k, k_split, next_pow2(m), x.stride(0), weight.stride(0), weight_scale.stride(0), n),
        dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BS=block_size,
             GROUP=cfg.group, DOT=dot, PRECISION=precision,
             HAS_BIAS=bias is not None, SPLIT_K=split, EVEN_K=even_k,
             TMA_X=tma_x, TMA_W=tma_w, DEQ_BF16=cfg.deq_bf16 and dot == tl.bfloat16, PEEL=cfg.peel,
             ZERO_DOT=cfg.zero_dot and not cfg.peel,
             QUANT=quant, **mx_round_consts(act_elem, act_rule, x.device)),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return split_k_finish(target, y, bias, split)


__all__ = ["GEMM_QUANT_MAX_M", "GemmConfig", "mx_gemm", "pick_config"]
