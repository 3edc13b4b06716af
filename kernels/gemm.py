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
- Decode (small M): the same kernel with a narrow activation tile (16..64) is a weight
  stream; when N / BLOCK_N programs leave SMs idle, K is split and fp32 partials are summed
  (with the bias and the cast) by ``_splitk_reduce_kernel``.
  W8A8 at 3 <= M <= 16 runs on fp8 tensor cores instead (``gemm_decode.py``, no weight
  conversion); M <= 2 on the CUDA-core kernel ``_mx_gemv_kernel`` below.
- sm_100+: ``_dot_scaled_kernel`` uses ``tl.dot_scaled``, the native MX MMA there. On Hopper
  Triton emulates it by upcasting both operands (slow); it is kept as a baseline.

The Triton interpreter (CPU tests) computes bf16 dots wrongly and does not run
``tl.dot_scaled``; the dot dtype is a constexpr so the same kernel runs there with fp32.
Reference: ``mxq.kernels.reference.mx_linear_reference``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # older triton: pointer loads only
    TensorDescriptor = None

from mxq.formats import E4M3, E5M2, ElemFormat, ScaleRule
from mxq.kernels import toolchain as _toolchain
from mxq.kernels.launch import call, cdiv, next_pow2
from mxq.kernels.quantize import _RULE_ID, fp8_dtype, hw_cvt, mx_round_dequant

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
if not INTERPRET:
    _toolchain.prefer_fixed_ptxas()  # a ptxas >= 13.3 where installed (see kernels/toolchain.py)
# Load the next K step's scales (and, in the decode kernel, weights) one iteration ahead.
PREFETCH = os.environ.get("MXQ_PREFETCH", "1") == "1"


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
    scale_gather: bool = False  # scales loaded per element instead of broadcast by reshape
    deq_bf16: bool = False  # apply the scale with a bf16 multiply instead of fp32 (bf16 dots only)
    deq_bits: bool = False  # fp8 -> bf16 by bit moves (no conversion instruction), see _fp8_bits_dequant
    peel: bool = True  # first K step before the loop (lets ptxas pipeline the wgmmas, see kernel)
    zero_dot: bool = False  # (peel=False) start the accumulator with a wgmma of zero tiles instead
    quant_x: bool = False  # W8A8: round X inside this kernel (dispatch), else a quantizer launch first


@triton.jit
def _e8m0_to_f32(s):
    """Biased E8M0 bytes -> fp32 2**(s-127); byte 0 -> 2**-127, 255 -> NaN (as mxq.formats)."""
    si = s.to(tl.int32)
    f = (si << 23).to(tl.float32, bitcast=True)
    f = tl.where(si == 0, 5.877471754111438e-39, f)
    return tl.where(si == 255, float("nan"), f)


# fp8 -> bf16 bit moves for _fp8_bits_dequant, 2 elements per call ($1: 2 fp8 bytes as loaded,
# element 0 in the low byte; $0: both as bf16x2). PRMT puts byte i at bits 8..15 of 16-bit lane i
# (x = b << 8), then lane = (x & 0x8000) | ((x >> 4) & 0x07F0): E4M3 eeee.mmm lands in bf16
# exponent bits 10..7 and mantissa bits 6..4, a bf16 worth the fp8 value times 2**-120 (E5M2:
# >> 3, 0x0FE0, times 2**-112). Pairs, not quads: the 2-byte shared-memory loads of the wgmma
# operand layout feed it as they are (4-byte packing cost ~50 PRMT per 64-wide K step, sm_90 SASS).
_E4M3_ASM = """{
.reg .b32 a, t;
cvt.u32.u16 a, $1;
prmt.b32 a, a, 0, 0x1404;
shr.b32 t, a, 4;
and.b32 t, t, 0x07F007F0;
and.b32 a, a, 0x80008000;
or.b32 $0, a, t;
}"""
E4M3_TO_BF16_ASM = tl.constexpr(_E4M3_ASM)
E5M2_TO_BF16_ASM = tl.constexpr(_E4M3_ASM.replace("t, a, 4", "t, a, 3").replace("0x07F007F0", "0x0FE00FE0"))


@triton.jit
def _fp8_bits_dequant(w, sc, BLOCK_N: tl.constexpr, NB: tl.constexpr, BS: tl.constexpr, E5M2: tl.constexpr, DOT: tl.constexpr):
    """fp8 tile [BLOCK_N, NB*BS] times its E8M0 scales [BLOCK_N, NB] -> DOT, without an fp8
    conversion instruction: the fp8 sign, exponent and mantissa bits are moved into bf16 fields
    (a bf16 whose value is the fp8 value times 2**-(127 - fp8 bias); fp8 subnormals land on bf16
    subnormals), then two exact power-of-two multiplies apply 2**(s - 127 + 127 - bias): the first
    for scale bytes up to 127 + bias - 120 (every real weight), the second (1 there) for larger
    bytes, NaN for byte 255. Equal to w * 2**(s - 127) computed in fp32 (the fp32 route), up to
    bf16 subnormal results (blocks scaled below ~2**-120). An fp8 NaN code under a finite scale
    decodes as a finite value here (mxq.formats writes NaN only as a whole block, scale byte 255).
    Replaces cvt e4m3 -> f16 -> bf16 (one slow-pipe F2F per element on sm_90), but measured equal or
    slower on the dispatched tiles (more issue slots; kernels/NOTES.md, "GEMM: the wgmma register hazard and the pipelined prefill loop"): a config option,
    not dispatched."""
    s = sc.to(tl.uint16)
    # f1 = 2**(s - 127 + 127 - bias) as bf16 bits for s <= 254 - (127 - bias); f2 the rest.
    if E5M2:
        f1 = (tl.minimum(s, 142) + 112) << 7
        f2 = (tl.maximum(s, 142) - 15) << 7
    else:
        f1 = (tl.minimum(s, 134) + 120) << 7
        f2 = (tl.maximum(s, 134) - 7) << 7
    f1 = f1.to(tl.uint16)
    f2 = tl.where(s == 255, 0x7FC0, f2).to(tl.uint16)
    b = w.to(tl.uint8, bitcast=True)
    if DOT == tl.bfloat16:
        if E5M2:
            v = tl.inline_asm_elementwise(E5M2_TO_BF16_ASM, "=r,h", [b], dtype=tl.bfloat16, is_pure=True, pack=2)
        else:
            v = tl.inline_asm_elementwise(E4M3_TO_BF16_ASM, "=r,h", [b], dtype=tl.bfloat16, is_pure=True, pack=2)
        v = tl.reshape(v, (BLOCK_N, NB, BS))
        wf = v * f1.to(tl.bfloat16, bitcast=True)[:, :, None] * f2.to(tl.bfloat16, bitcast=True)[:, :, None]
    else:
        # fp32 dots (the interpreter, which runs no PTX; fp16/fp32 X): the same bit moves in plain
        # integer ops, widened to fp32 (bf16 = the upper half of an fp32; the interpreter's bf16
        # emulation mishandles subnormals) and multiplied exactly in fp32.
        b = b.to(tl.uint32)
        if E5M2:
            bits = ((b & 0x7F) << 5) | ((b & 0x80) << 8)
        else:
            bits = ((b & 0x7F) << 4) | ((b & 0x80) << 8)
        v = tl.reshape((bits << 16).to(tl.float32, bitcast=True), (BLOCK_N, NB, BS))
        g1 = (f1.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        g2 = (f2.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        wf = v * g1[:, :, None] * g2[:, :, None]
    return tl.reshape(wf, (BLOCK_N, NB * BS)).to(DOT)


@triton.jit
def _mx_gemm_operands(
    x_ptr, w_ptr, s_ptrs, sc_next, w_ptrs, x_ptrs, i, k_lo, k_hi, pid_m, pid_n, offs_k, offs_b,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BS: tl.constexpr,
    DOT: tl.constexpr, EVEN_K: tl.constexpr, TMA_X: tl.constexpr, TMA_W: tl.constexpr,
    SCALE_GATHER: tl.constexpr, DEQ_BF16: tl.constexpr, DEQ_BITS: tl.constexpr, W_E5M2: tl.constexpr,
    PREFETCH_S: tl.constexpr, QUANT: tl.constexpr, EMAX: tl.constexpr, MBITS: tl.constexpr, MAXN: tl.constexpr,
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
    if SCALE_GATHER:
        if EVEN_K:
            sc = tl.load(s_ptrs)
        else:
            sc = tl.load(s_ptrs, mask=((k + offs_k) < k_hi)[None, :], other=127)
        wd = (w.to(tl.float32) * _e8m0_to_f32(sc)).to(DOT)
    else:
        if PREFETCH_S:
            # The scale load is not software-pipelined by Triton (it feeds the dot only
            # through the dequant): load the next step's scales one iteration ahead.
            sc = sc_next
            sc_next = tl.load(s_ptrs + NB, mask=((k + BLOCK_K + offs_b * BS) < k_hi)[None, :], other=127)
        elif EVEN_K:
            sc = tl.load(s_ptrs)
        else:
            sc = tl.load(s_ptrs, mask=((k + offs_b * BS) < k_hi)[None, :], other=127)
        if DEQ_BITS:
            wd = _fp8_bits_dequant(w, sc, BLOCK_N, NB, BS, W_E5M2, DOT)
        elif DEQ_BF16:
            # fp8 -> bf16 is exact and a power-of-two product is exact in bf16 (same exponent
            # range as fp32): half the conversion work of the fp32 route.
            sb = _e8m0_to_f32(sc).to(tl.bfloat16)
            wf = tl.reshape(w.to(tl.bfloat16), (BLOCK_N, NB, BS)) * sb[:, :, None]
            wd = tl.reshape(wf, (BLOCK_N, BLOCK_K)).to(DOT)
        else:
            wf = tl.reshape(w.to(tl.float32), (BLOCK_N, NB, BS)) * _e8m0_to_f32(sc)[:, :, None]
            wd = tl.reshape(wf, (BLOCK_N, BLOCK_K)).to(DOT)
    return wd, xt.to(DOT), sc_next


@triton.jit
def _mx_gemm_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr,
    M, N, K, K_SPLIT, M_BUCKET,
    stride_xm, stride_wn, stride_sn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BS: tl.constexpr,
    GROUP: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
    TMA_X: tl.constexpr = False, TMA_W: tl.constexpr = False, SCALE_GATHER: tl.constexpr = False,
    DEQ_BF16: tl.constexpr = False, DEQ_BITS: tl.constexpr = False, W_E5M2: tl.constexpr = False,
    PREFETCH_S: tl.constexpr = False, PEEL: tl.constexpr = True,
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
    if SCALE_GATHER:
        s_ptrs = s_ptr + rn[:, None] * stride_sn + (k_lo + offs_k)[None, :] // BS
    else:
        s_ptrs = s_ptr + rn[:, None] * stride_sn + (k_lo // BS + offs_b)[None, :]
    sc_next = tl.zeros((BLOCK_N, NB), dtype=tl.uint8)
    if PREFETCH_S and not SCALE_GATHER:
        sc_next = tl.load(s_ptrs, mask=((k_lo + offs_b * BS) < k_hi)[None, :], other=127)
    if PEEL:
        wd, xt, sc_next = _mx_gemm_operands(
            x_ptr, w_ptr, s_ptrs, sc_next, w_ptrs, x_ptrs, 0, k_lo, k_hi, pid_m, pid_n, offs_k, offs_b,
            BLOCK_M, BLOCK_N, BLOCK_K, BS, DOT, EVEN_K, TMA_X, TMA_W, SCALE_GATHER, DEQ_BF16,
            DEQ_BITS, W_E5M2, PREFETCH_S, QUANT, EMAX, MBITS, MAXN, EMIN, RULE, HW_CVT, FP8,
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
            BLOCK_M, BLOCK_N, BLOCK_K, BS, DOT, EVEN_K, TMA_X, TMA_W, SCALE_GATHER, DEQ_BF16,
            DEQ_BITS, W_E5M2, PREFETCH_S, QUANT, EMAX, MBITS, MAXN, EMIN, RULE, HW_CVT, FP8,
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


@triton.jit
def _mx_gemv_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr,
    M, N, K, K_SPLIT,
    stride_xm, stride_wn, stride_sn, stride_ym,
    M_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BS: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
    TMA_W: tl.constexpr, QUANT: tl.constexpr,
    EMAX: tl.constexpr, MBITS: tl.constexpr, MAXN: tl.constexpr, EMIN: tl.constexpr,
    RULE: tl.constexpr, HW_CVT: tl.constexpr, FP8: tl.constexpr, PREFETCH: tl.constexpr = False,
):  # fmt: skip
    """Decode (M <= 16) on CUDA cores: a weight stream with no MMA and no operand layouts.

    Each program streams a [BLOCK_N, BLOCK_K] fp8 tile per step, converts it to fp32 and
    applies the block scales once, then for each of the M_ROWS activation rows does one fp32
    FMA per weight and a row reduction. fp8 x 2**e times a bf16/fp16 value is exact in fp32.
    With QUANT the activation row is MX-rounded here (per K tile, in registers): W8A8 decode is
    one launch, no quantizer kernel and no bf16 round trip of X.
    """
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
    if PREFETCH:
        w_next = tl.load(w_ptrs, mask=((k_lo + offs_k) < k_hi)[None, :], other=0.0)
        sc_next = tl.load(s_ptrs, mask=((k_lo + offs_b * BS) < k_hi)[None, :], other=127)
    for i in range(n_iter):
        k = k_lo + i * BLOCK_K
        kmask = (k + offs_k) < k_hi
        if PREFETCH:
            # Register double buffer: the next step's weight and scale loads are in flight
            # while this step computes (Triton does not pipeline these plain loads).
            w = w_next
            sc = sc_next
            w_next = tl.load(w_ptrs + BLOCK_K, mask=((k + BLOCK_K + offs_k) < k_hi)[None, :], other=0.0)
            sc_next = tl.load(s_ptrs + NB, mask=((k + BLOCK_K + offs_b * BS) < k_hi)[None, :], other=127)
        else:
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
        wf = tl.reshape(w.to(tl.float32), (BLOCK_N, NB, BS)) * _e8m0_to_f32(sc)[:, :, None]
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

    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    y_offs = offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + y_offs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(y_ptr + pid_k.to(tl.int64) * M * N + y_offs, acc, mask=mask)


@triton.jit
def _mx_gemv_rows_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr,
    M, N, K, K_SPLIT,
    stride_xm, stride_wn, stride_sn, stride_ym,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr,
    BS: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
    PREFETCH: tl.constexpr, LOAD2D: tl.constexpr = False,
):  # fmt: skip
    """Decode for 3 <= M <= 16 on CUDA cores, the K reduction deferred to after the K loop.

    The weight tile is [BLOCK_N, BLOCK_K / VEC, VEC]: each thread owns VEC contiguous K values
    (one 16/32-byte load) of a few weight rows, converts them to fp32 and applies their block
    scale once (VEC divides BS, so a chunk has one scale). Per activation row it does VEC FMAs
    per weight row into a thread-local partial sum; the partials of each row live in registers
    as a [BLOCK_N, BLOCK_K / VEC] tensor (a tuple of ROWS of them), so there is no cross-lane
    reduction, select or layout conversion inside the loop; one reduction per row at the end.
    Exact products as in _mx_gemv_kernel; X is used as given (W8A8 callers round X first).
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    KC: tl.constexpr = BLOCK_K // VEC
    offs_c = tl.arange(0, KC)
    offs_k2 = offs_c[:, None] * VEC + tl.arange(0, VEC)[None, :]  # [KC, VEC]
    k_lo = tl.multiple_of(pid_k * K_SPLIT, BLOCK_K)  # K_SPLIT is a multiple of BLOCK_K
    k_hi = min(k_lo + K_SPLIT, K)
    n_iter = tl.cdiv(k_hi - k_lo, BLOCK_K)
    if LOAD2D:
        # 2-D pointer tile: coalescing puts the lanes along K (as in _mx_gemv_kernel); the tile is
        # reshaped to [BLOCK_N, KC, VEC] after the load.
        offs_k = tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + rn[:, None] * stride_wn + (k_lo + offs_k)[None, :]
    else:
        w_ptrs = w_ptr + rn[:, None, None] * stride_wn + (k_lo + offs_k2)[None, :, :]
    s_ptrs = s_ptr + rn[:, None] * stride_sn + ((k_lo + offs_c * VEC) // BS)[None, :]
    x_ptrs = x_ptr + k_lo + offs_k2
    accs = (tl.zeros((BLOCK_N, KC), dtype=tl.float32),) * ROWS
    if PREFETCH:
        w_next = tl.load(w_ptrs, mask=((k_lo + offs_k2) < k_hi)[None, :, :], other=0.0)
        sc_next = tl.load(s_ptrs, mask=((k_lo + offs_c * VEC) < k_hi)[None, :], other=127)
    for i in range(n_iter):
        k = k_lo + i * BLOCK_K
        kmask = (k + offs_k2) < k_hi
        if PREFETCH:
            w = w_next
            sc = sc_next
            w_next = tl.load(w_ptrs + BLOCK_K, mask=((k + BLOCK_K + offs_k2) < k_hi)[None, :, :], other=0.0)
            sc_next = tl.load(s_ptrs + BLOCK_K // BS, mask=((k + BLOCK_K + offs_c * VEC) < k_hi)[None, :], other=127)
        elif EVEN_K:
            w = tl.load(w_ptrs)
            sc = tl.load(s_ptrs)
        elif LOAD2D:
            w = tl.load(w_ptrs, mask=((k + offs_k) < k_hi)[None, :], other=0.0)
            sc = tl.load(s_ptrs, mask=((k + offs_c * VEC) < k_hi)[None, :], other=127)
        else:
            w = tl.load(w_ptrs, mask=kmask[None, :, :], other=0.0)
            sc = tl.load(s_ptrs, mask=((k + offs_c * VEC) < k_hi)[None, :], other=127)
        if LOAD2D:
            w = tl.reshape(w, (BLOCK_N, KC, VEC))
        wf = w.to(tl.float32) * _e8m0_to_f32(sc)[:, :, None]
        for m in tl.static_range(ROWS):
            if EVEN_K:
                xm = tl.load(x_ptrs + m * stride_xm)
            else:
                xm = tl.load(x_ptrs + m * stride_xm, mask=kmask, other=0.0)
            part = tl.sum(wf * xm.to(tl.float32)[None, :, :], axis=2)
            accs = accs[:m] + (accs[m] + part,) + accs[m + 1 :]
        w_ptrs += BLOCK_K
        s_ptrs += BLOCK_K // BS
        x_ptrs += BLOCK_K

    nmask = offs_n < N
    if SPLIT_K == 1 and HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)
    for m in tl.static_range(ROWS):
        r = tl.sum(accs[m], axis=1)
        if SPLIT_K == 1:
            if HAS_BIAS:
                r += bias
            tl.store(y_ptr + m * stride_ym + offs_n, r.to(y_ptr.dtype.element_ty), mask=nmask)
        else:
            tl.store(y_ptr + pid_k.to(tl.int64) * M * N + m * stride_ym + offs_n, r, mask=nmask)


@triton.jit
def _splitk_reduce_kernel(
    p_ptr, b_ptr, y_ptr, MN, N,
    SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in tl.static_range(SPLIT_K):
        acc += tl.load(p_ptr + i * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def split_k_sizes(k: int, split_k: int, block_k: int) -> tuple[int, int, bool]:
    """(splits, K per split (a multiple of block_k), whether no K tile is partial) for at most
    ``split_k`` splits of K."""
    split = max(1, min(split_k, cdiv(k, block_k)))
    k_split = cdiv(cdiv(k, split), block_k) * block_k
    return cdiv(k, k_split), k_split, k % block_k == 0 and k_split % block_k == 0


def _split_k_plan(y: torch.Tensor, k: int, split_k: int, block_k: int):
    """``split_k_sizes`` and where the kernel writes: y itself, or float32 partials
    [splits, M, N] for ``_split_k_finish``."""
    split, k_split, even_k = split_k_sizes(k, split_k, block_k)
    target = y if split == 1 else torch.empty((split, *y.shape), dtype=torch.float32, device=y.device)
    return split, k_split, even_k, target


def _tma(t: torch.Tensor, block: list[int], wanted: bool):
    """(used, kernel argument): a host TMA descriptor of ``t`` where asked for and possible
    (16-byte aligned base and row stride, not the interpreter), else ``t`` for pointer loads."""
    ok = (
        wanted and TensorDescriptor is not None and not INTERPRET
        and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
    )  # fmt: skip
    return ok, (TensorDescriptor.from_tensor(t, block) if ok else t)


def _split_k_finish(target: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None, split: int) -> torch.Tensor:
    """Sum the split-K partials (+ bias) into y; nothing to do without a split."""
    if split > 1:
        block, mn = 1024, y.numel()
        _splitk_reduce_kernel[(triton.cdiv(mn, block),)](
            target, bias if bias is not None else target, y, mn, y.shape[1],
            SPLIT_K=split, BLOCK=block, HAS_BIAS=bias is not None, num_warps=4,
        )  # fmt: skip
    return y


@triton.jit
def _dot_scaled_kernel(
    x_ptr, xs_ptr, w_ptr, s_ptr, b_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_xsm, stride_wn, stride_sn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    X_FMT: tl.constexpr, W_FMT: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    rn = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    offs_b = tl.arange(0, BLOCK_K // 32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        kmask = (k + offs_k) < K
        bmask = (k + offs_b * 32) < K
        a = tl.load(x_ptr + rm[:, None] * stride_xm + (k + offs_k)[None, :], mask=kmask[None, :], other=0.0)
        b = tl.load(w_ptr + rn[None, :] * stride_wn + (k + offs_k)[:, None], mask=kmask[:, None], other=0.0)
        bs = tl.load(s_ptr + rn[:, None] * stride_sn + (k // 32 + offs_b)[None, :], mask=bmask[None, :], other=127)
        if X_FMT == "bf16" or X_FMT == "fp16":
            acc = tl.dot_scaled(a, None, X_FMT, b, bs, W_FMT, acc)
        else:
            xs = tl.load(xs_ptr + rm[:, None] * stride_xsm + (k // 32 + offs_b)[None, :], mask=bmask[None, :], other=127)
            acc = tl.dot_scaled(a, xs, X_FMT, b, bs, W_FMT, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------
# Python side
# --------------------------------------------------------------------------------------

_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


# How the prefill (TMA activation) configs start their accumulator. The old loop (accumulator
# zeroed before it) makes ptxas serialize every wgmma (C7515), which hides a register hazard: with
# the wgmmas in flight (zero-tile start or first K step peeled), ptxas < 13.3 lets the next K
# step's dequant overwrite the registers of a wgmma still reading them (triton-lang/triton#9433;
# inf/garbage at M = 2048 and at N = 14336, H200, 2026-11-21). With ptxas >= 13.3 the zero-tile
# start is right on every tested shape and 16-24 % faster at M = 2048 (kernels/NOTES.md, "GEMM: the wgmma register hazard and the pipelined prefill loop"),
# so it is used when Triton assembles with such a ptxas (kernels/toolchain.py).
PREFILL_LOOP = dict(peel=False, zero_dot=False)
PREFILL_ASYNC = dict(peel=False, zero_dot=True)


def _prefill_loop() -> dict:
    return PREFILL_ASYNC if _toolchain.wgmma_async_ok() else PREFILL_LOOP


def pick_config(m: int, n: int, k: int, device: torch.device) -> GemmConfig:
    """Tile shape and split-K from the shape alone (no device sync, no timing)."""
    if INTERPRET or device.type != "cuda":
        split = 2 if k >= 128 else 1
        return GemmConfig(block_m=16, block_n=32, block_k=64, num_warps=4, num_stages=1, split_k=split)
    sms = _sm_count(device)
    if m <= 64:
        # Weight streaming (H200 sweeps, kernels/NOTES.md, "GEMM, first pass: outcomes" to "GEMM: unserialized wgmma for small M, X rounded inside the MMA kernel"): weight tiles through
        # TMA, K split until the N tiles x splits cover the SMs twice. H200, 2026-11-21, M <= 16, W8A8:
        # N <= 4096 fastest as 128x128 tiles with X rounded inside (8B o 19.1 -> 15.7 µs, down
        # 42.7 -> 32.4); large N fastest with the quantizer launch first (gate_up 68 -> 53-59).
        block_m = max(16, triton.next_power_of_2(m))
        quant_x, peel = False, False
        if m <= 16 and n <= 4096:
            block_n, block_k, warps, stages, quant_x, peel = 128, 128, 4, 4, True, True
        elif m <= 16 and n > 8192:
            block_n, block_k, warps, stages, peel = 128, 128, 4, 4, True
        elif m <= 16:
            block_n, block_k, warps, stages = 64, 128, 4, 6  # qkv: the old loop measured ~3 % faster
        else:
            block_n, block_k, warps, stages = 128, 128, 4, 4  # M 17..64: peeling not measured here
        tiles = triton.cdiv(n, block_n)
        split = 1
        while tiles * split < 2 * sms and k // (split * 2) >= 4 * block_k and split < 8:
            split *= 2
        return GemmConfig(block_m, block_n, block_k, warps, stages, split_k=split, tma_w=True, quant_x=quant_x, peel=peel)
    loop = _prefill_loop()
    if 128 < m <= 512 and loop is PREFILL_ASYNC:
        # Pipelined loop (ptxas >= 13.3), M = 256 sweep (H200, 2026-11-21): 256x128 tiles with K split
        # until the tiles x splits fill the SMs once: 8B down 110.6 -> 64.0 µs (128x64 -> 256x128
        # split 4), o 36.4 -> 29.7, qkv 45.9 -> 40.6 (split 2); gate_up (224 tiles) unsplit.
        tiles = triton.cdiv(m, 256) * triton.cdiv(n, 128)
        split = 1
        while tiles * split * 2 <= sms and k // (split * 2) >= 8 * 64 and split < 8:
            split *= 2
        return GemmConfig(block_m=256, block_n=128, block_k=64, num_warps=8, num_stages=3, split_k=split,
                          tma_x=True, tma_w=True, deq_bf16=True, **loop)  # fmt: skip
    if m <= 512 and n < 16384:
        # 256x128 tiles leave most SMs idle here (N/128 programs); 128x64 won the M=256 sweep on the
        # H200, 2026-11-21 (serialized loop). M 65..128 keeps it with either loop (not swept since).
        return GemmConfig(block_m=128, block_n=64, block_k=64, num_warps=4, num_stages=4, tma_x=True, tma_w=True, deq_bf16=True, **loop)
    if n % 128 == 0 or loop is PREFILL_ASYNC:
        return GemmConfig(block_m=256, block_n=128, block_k=64, num_warps=8, num_stages=3, tma_x=True, tma_w=True, deq_bf16=True, **loop)
    # 256-wide activation tiles with the serialized loop gave wrong results when N is not a
    # multiple of BLOCK_N (H200, triton 3.6 + ptxas 12.8; right with ptxas 13.5 and the zero-tile
    # start, H200 2026-11-21): 128-wide tiles there.
    return GemmConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4, tma_x=True, tma_w=True, deq_bf16=True, **loop)


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
    m, k = _check_gemm_args(x, weight, weight_scale, bias, block_size)
    n = weight.shape[0]
    if act_elem is not None and act_rule is ScaleRule.MSE:
        raise ValueError("mx_gemm rounds X itself only for FLOOR/RCEIL/EVEN; round MSE first")
    quant = act_elem is not None
    x, weight, weight_scale, y, done = _operands_and_output(x, weight, weight_scale, bias, out_dtype, n)
    if done:
        return y
    cfg = config or pick_config(m, n, k, x.device)
    if config is None and x.dtype != torch.bfloat16 and not quant and cfg.block_m > 64:
        # fp32 operands (exact W8A16 for fp16/fp32 X): fp32 tiles need 2x the shared memory.
        cfg = GemmConfig(block_m=64, block_n=128, block_k=32, num_warps=4, num_stages=3)
    if config is None and cfg.num_warps == 8 and y.dtype == torch.float32 and not cfg.zero_dot:
        # The 8-warp prefill epilogues (256x128x64 and 128x128x64) give inf/garbage with a float32
        # output at M=2048 (H200, triton 3.6, tests/test_e2e.py::test_gpu_mx_linear_model_shapes;
        # like the bias case, NOTES.md item 7); the 4-warp 128x64x64 tile was right on every shape.
        # The pipelined loop (zero_dot, ptxas >= 13.3) was right with fp32 output there (H200, 2026-11-21).
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
    split, k_split, even_k, target = _split_k_plan(y, k, cfg.split_k, cfg.block_k)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), split)
    tma_x, x_arg = _tma(x, [cfg.block_m, cfg.block_k], cfg.tma_x and not quant)
    tma_w, w_arg = _tma(weight, [cfg.block_n, cfg.block_k], cfg.tma_w)
    ae = act_elem or E4M3
    # through launch.call: the prefill path runs this for every projection too narrow for the
    # register-operand kernel, where the JIT's per-call binding made the model's forward host-bound
    call(
        _mx_gemm_kernel, grid,
        (x_arg, w_arg, weight_scale, bias if bias is not None else weight_scale, target,
         m, n, k, k_split, next_pow2(m), x.stride(0), weight.stride(0), weight_scale.stride(0), n),
        dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BS=block_size,
             GROUP=cfg.group, DOT=dot, PRECISION=precision,
             HAS_BIAS=bias is not None, SPLIT_K=split, EVEN_K=even_k,
             TMA_X=tma_x, TMA_W=tma_w, SCALE_GATHER=cfg.scale_gather, DEQ_BF16=cfg.deq_bf16 and dot == tl.bfloat16,
             DEQ_BITS=cfg.deq_bits, W_E5M2=weight.dtype == torch.float8_e5m2, PREFETCH_S=PREFETCH, PEEL=cfg.peel,
             ZERO_DOT=cfg.zero_dot and not cfg.peel,
             QUANT=quant, EMAX=ae.emax, MBITS=ae.mbits, MAXN=ae.max_normal, EMIN=1 - ae.bias,
             RULE=_RULE_ID[act_rule], HW_CVT=hw_cvt(x.device), FP8=fp8_dtype(ae)),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return _split_k_finish(target, y, bias, split)


@dataclass(frozen=True)
class GemvConfig:
    """Tiles of the CUDA-core decode kernel (``_mx_gemv_kernel``)."""

    block_n: int = 32
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    tma_w: bool = False


# Largest M that takes the CUDA-core decode kernel on a GPU (kernels/NOTES.md, H200 sweep).
GEMV_MAX_M = 2
# Largest M whose W8A8 rounds X inside the MMA kernel (dispatch.mx_linear_triton).
GEMM_QUANT_MAX_M = 64


def pick_gemv_config(m: int, n: int, k: int, device: torch.device) -> GemvConfig:
    """Decode tiles from the shape alone (no sync). K is split until the grid covers the SMs."""
    if INTERPRET or device.type != "cuda":
        return GemvConfig(block_n=16, block_k=64, num_warps=4, num_stages=1, split_k=2 if k >= 128 else 1)
    sms = _sm_count(device)
    cfg = GemvConfig(block_n=32, block_k=256, num_warps=4, num_stages=3)
    # H200 sweep (kernels/NOTES.md, "GEMM, first pass: outcomes"): best at 512-800 programs (8B o: split 4, gate_up: 1).
    tiles = cdiv(n, cfg.block_n)
    split = 1
    while tiles * split * 2 <= 6 * sms and k // (split * 2) >= 2 * cfg.block_k and split < 8:
        split *= 2
    return GemvConfig(cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages, split, cfg.tma_w)


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
    m, k = _check_gemm_args(x, weight, weight_scale, bias, block_size)
    n = weight.shape[0]
    if act_elem is not None and act_rule is ScaleRule.MSE:
        raise ValueError("mx_gemv rounds X itself only for FLOOR/RCEIL/EVEN; round MSE first")
    if m > 64:
        raise ValueError(f"mx_gemv is for small M (unrolled over rows), got M={m}")
    x, weight, weight_scale, y, done = _operands_and_output(x, weight, weight_scale, bias, out_dtype, n)
    if done:
        return y
    cfg = config or pick_gemv_config(m, n, k, x.device)
    if cfg.block_k % block_size:
        raise ValueError(f"block_k={cfg.block_k} must be a multiple of block_size={block_size}")
    split, k_split, even_k, target = _split_k_plan(y, k, cfg.split_k, cfg.block_k)
    tma_w, w_arg = _tma(weight, [cfg.block_n, cfg.block_k], cfg.tma_w)
    ae = act_elem or E4M3
    call(
        _mx_gemv_kernel, (cdiv(n, cfg.block_n), split),
        (x, w_arg, weight_scale, bias if bias is not None else weight_scale, target,
         m, n, k, k_split, x.stride(0), weight.stride(0), weight_scale.stride(0), n),
        dict(M_ROWS=m, BLOCK_M=next_pow2(m), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
             BS=block_size, HAS_BIAS=bias is not None, SPLIT_K=min(split, 2), EVEN_K=even_k, TMA_W=tma_w,
             QUANT=act_elem is not None, EMAX=ae.emax, MBITS=ae.mbits, MAXN=ae.max_normal,
             EMIN=1 - ae.bias, RULE=_RULE_ID[act_rule], HW_CVT=hw_cvt(x.device), FP8=fp8_dtype(ae),
             PREFETCH=False),  # prefetch measured slower at M=1 (H200: gate_up 35.7 -> 52.4 µs); kept as an option
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return _split_k_finish(target, y, bias, split)


@dataclass(frozen=True)
class GemvRowsConfig:
    """Tiles of the deferred-reduction decode kernel (``_mx_gemv_rows_kernel``)."""

    block_n: int = 32
    block_k: int = 256
    vec: int = 16  # K values per thread and load (divides the MX block size)
    num_warps: int = 4
    split_k: int = 1
    prefetch: bool = False  # register double buffer of the next weight tile (3-D loads only)
    load2d: bool = False  # load the weight as a 2-D [BLOCK_N, BLOCK_K] tile, reshape after


# Largest M for the deferred-reduction decode kernel. H200 sweep (kernels/NOTES.md, "GEMM: decode gemv and tile work"):
# 1.5-10x slower than the MMA path at M = 4..16 (lanes along N: uncoalesced weight loads), so it
# is not dispatched (M <= GEMV_MAX_M goes to mx_gemv first); kept, tested, for the next layout.
GEMV_ROWS_MAX_M = 2


def pick_gemv_rows_config(m: int, n: int, k: int, device: torch.device) -> GemvRowsConfig:
    """Decode tiles for 3 <= M <= 16 from the shape alone; K split until ~4 programs per SM."""
    if INTERPRET or device.type != "cuda":
        return GemvRowsConfig(block_n=16, block_k=64, vec=16, split_k=2 if k >= 128 else 1)
    sms = _sm_count(device)
    cfg = GemvRowsConfig(block_n=128, block_k=64, vec=16)
    tiles = cdiv(n, cfg.block_n)
    split = 1
    while tiles * split * 2 <= 4 * sms and k // (split * 2) >= 4 * cfg.block_k and split < 16:
        split *= 2
    return GemvRowsConfig(cfg.block_n, cfg.block_k, cfg.vec, cfg.num_warps, split, cfg.prefetch, cfg.load2d)


def mx_gemv_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
    config: GemvRowsConfig | None = None,
    block_size: int = 32,
) -> torch.Tensor:
    """Y [M, N] = X [M, K] · dequant(W)ᵀ (+ bias) for 1 <= M <= 16 on CUDA cores, X as given."""
    m, k = _check_gemm_args(x, weight, weight_scale, bias, block_size)
    n = weight.shape[0]
    if m > 16:
        raise ValueError(f"mx_gemv_rows keeps one accumulator per row: M <= 16, got M={m}")
    x, weight, weight_scale, y, done = _operands_and_output(x, weight, weight_scale, bias, out_dtype, n)
    if done:
        return y
    cfg = config or pick_gemv_rows_config(m, n, k, x.device)
    if cfg.block_k % block_size or block_size % cfg.vec:
        raise ValueError(f"block_k={cfg.block_k} must be a multiple of block_size={block_size}, which vec={cfg.vec} must divide")
    split, k_split, even_k, target = _split_k_plan(y, k, cfg.split_k, cfg.block_k)
    call(
        _mx_gemv_rows_kernel, (cdiv(n, cfg.block_n), split),
        (x, weight, weight_scale, bias if bias is not None else weight_scale, target,
         m, n, k, k_split, x.stride(0), weight.stride(0), weight_scale.stride(0), n),
        dict(ROWS=m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, VEC=cfg.vec, BS=block_size,
             HAS_BIAS=bias is not None, SPLIT_K=min(split, 2), EVEN_K=even_k,
             PREFETCH=cfg.prefetch and not cfg.load2d, LOAD2D=cfg.load2d),
        num_warps=cfg.num_warps, num_stages=1,
    )  # fmt: skip
    return _split_k_finish(target, y, bias, split)


def _operands_and_output(x, weight, weight_scale, bias, out_dtype, n):
    """Unit-stride operands and the [M, N] output; ``done`` when M, N or K is 0 (the output is
    then final: empty, or the bias / zeros)."""
    x, weight, weight_scale = (t if t.stride(1) == 1 else t.contiguous() for t in (x, weight, weight_scale))
    m, k = x.shape
    y = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m and n and not k:
        y.zero_() if bias is None else y.copy_(bias.to(y.dtype).expand(m, n))
    return x, weight, weight_scale, y, not (m and n and k)


def _check_gemm_args(x, weight, weight_scale, bias, block_size):
    if x.dim() != 2:
        raise ValueError(f"mx_gemm takes X as [M, K], got shape {tuple(x.shape)}")
    if x.dtype not in _TL_DTYPE:
        raise TypeError(f"X must be bfloat16, float16 or float32, got {x.dtype}")
    if weight.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"MX weight must be float8_e4m3fn or float8_e5m2, got {weight.dtype}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight must be [N, K={x.shape[1]}], got {tuple(weight.shape)}")
    m, k = x.shape
    n = weight.shape[0]
    if k % block_size:
        raise ValueError(f"K={k} must be a multiple of block_size={block_size}")
    if weight_scale.dtype != torch.uint8 or tuple(weight_scale.shape) != (n, k // block_size):
        raise ValueError(
            f"weight_scale must be uint8 [{n}, {k // block_size}], got {weight_scale.dtype} {tuple(weight_scale.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    return m, k


_FMT = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2", torch.bfloat16: "bf16", torch.float16: "fp16"}


def mx_gemm_dot_scaled(
    x: torch.Tensor,
    x_scale: torch.Tensor | None,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    block_m: int = 128,
    block_n: int = 128,
    block_k: int = 128,
    num_warps: int = 8,
    num_stages: int = 3,
) -> torch.Tensor:
    """Y = X·Wᵀ through ``tl.dot_scaled``: X MXFP8 (data + [M, K/32] scales) or bf16/fp16.

    Native block-scaled MMA on sm_100+; on sm_90 Triton emulates it (the baseline to beat).
    """
    if x.dtype not in _FMT or weight.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"unsupported dtypes for dot_scaled: X {x.dtype}, W {weight.dtype}")
    m, k = x.shape
    n = weight.shape[0]
    if k % 32 or weight.shape[1] != k or tuple(weight_scale.shape) != (n, k // 32):
        raise ValueError(f"shape mismatch: X {tuple(x.shape)}, W {tuple(weight.shape)}, scales {tuple(weight_scale.shape)}")
    is_mx = x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if is_mx and (x_scale is None or tuple(x_scale.shape) != (m, k // 32)):
        raise ValueError(f"MX activations need x_scale [{m}, {k // 32}]")
    x, weight, weight_scale = x.contiguous(), weight.contiguous(), weight_scale.contiguous()
    xs = x_scale.contiguous() if is_mx else weight_scale
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _dot_scaled_kernel[grid](
        x, xs, weight, weight_scale, bias if bias is not None else weight_scale, y,
        m, n, k,
        x.stride(0), xs.stride(0), weight.stride(0), weight_scale.stride(0), n,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        X_FMT=_FMT[x.dtype], W_FMT=_FMT[weight.dtype], HAS_BIAS=bias is not None,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return y


@dataclass(frozen=True)
class PackedMXWeight:
    """An MX weight arranged for ``mx_linear``: what ``pack_weight`` returns.

    Pass it in place of ``weight`` (with ``weight_scale=None``). Today the layout is the
    checkpoint's own ([N, K] fp8 row-major, [N, K/32] scales), made contiguous once, so
    packing costs nothing per call; the type exists so a kernel-specific layout can be
    introduced without touching callers.
    """

    data: torch.Tensor  # fp8 [N, K]
    scales: torch.Tensor  # uint8 [N, K / block_size]
    block_size: int = 32

    @property
    def shape(self) -> torch.Size:
        return self.data.shape


def pack_weight(weight: torch.Tensor, weight_scale: torch.Tensor, block_size: int = 32) -> PackedMXWeight:
    """Arrange an MX weight once for repeated ``mx_linear`` calls (checks shapes and dtypes)."""
    elem_of(weight)
    if weight.dim() != 2 or weight.shape[1] % block_size:
        raise ValueError(f"weight must be [N, K] with K a multiple of {block_size}, got {tuple(weight.shape)}")
    n, k = weight.shape
    if weight_scale.dtype != torch.uint8 or tuple(weight_scale.shape) != (n, k // block_size):
        raise ValueError(
            f"weight_scale must be uint8 [{n}, {k // block_size}], got {weight_scale.dtype} {tuple(weight_scale.shape)}"
        )
    if weight_scale.device != weight.device:
        raise ValueError(f"weight on {weight.device} but weight_scale on {weight_scale.device}")
    return PackedMXWeight(weight.contiguous(), weight_scale.contiguous(), block_size)


def elem_of(weight: torch.Tensor) -> ElemFormat:
    if weight.dtype == torch.float8_e4m3fn:
        return E4M3
    if weight.dtype == torch.float8_e5m2:
        return E5M2
    raise TypeError(f"MX weight must be float8_e4m3fn or float8_e5m2, got {weight.dtype}")


__all__ = ["GemmConfig", "GemvConfig", "GemvRowsConfig", "mx_gemv_rows", "PackedMXWeight", "mx_gemm", "mx_gemv", "mx_gemm_dot_scaled", "pack_weight", "pick_config"]
