"""W8A8 decode GEMM on fp8 tensor cores: Y [M, N] = MX(X) · dequant(W)ᵀ for small M (Hopper).

The emulation in ``gemm.py`` converts every weight element to bf16 in registers before its
wgmma: at decode sizes that conversion, not the weight stream, bounds the kernel (kernels/NOTES.md,
"GEMM: the bounds"). Here no weight element is converted. The MX block is 32 wide along K, and so
is one fp8 wgmma (k32), so each 32-block's product is one MMA of raw fp8 bytes:

    Yᵀ[n, m] = Σ_b  2**sw[n, b] · 2**sx[m, b] · Σ_{k in block b} w[n, k] · q[m, k]

W's [BLOCK_N, 32] tiles go from memory (TMA) to the MMA untouched. X is MXFP8 too: quantized
by the quantizer kernel first (``quant_x``, the dispatched default: its fp8 tiles then also go
to the MMA as loaded) or rounded to fp8 block by block inside this kernel (the same exponent and
rounding as ``quantize.py``, bit for bit). Each block product, started from zero, is scaled by
the two powers of two (scale bytes read as one int32 word per row and 4 blocks, a step ahead)
and added to an fp32 accumulator. The only per-element work is on the accumulator
(BLOCK_N x M per block), not on the weight (BLOCK_N x 32).

Numerics: every product w·q is exact; the 32 products of one block are summed inside the
tensor core, which on Hopper keeps fewer bits than fp32 for fp8 inputs (about 2**-13 relative
to the block's largest term, measured in tests/test_gemm_decode.py on the GPU); the block sums
are accumulated in fp32. So the result equals the exact MX product up to accumulation order
and that in-block truncation — far below the bf16 output rounding (2**-9). The prefill path
(gemm.mx_gemm) stays exact; W8A16 (X not rounded) cannot take this route and stays there too.

Split-K: when N / BLOCK_N programs leave SMs idle, K is split; every split stores its fp32
partial, takes a ticket from an atomic counter per N tile, and the split whose ticket is the
last one sums all partials in split order (deterministic), adds the bias, writes Y and resets
the counter — one launch, no reduction kernel (the same protocol as the attention decode merge).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mxq.formats import E4M3, ElemFormat, ScaleRule
from mxq.kernels.buffers import split_counters
from mxq.kernels.common import (
    INTERPRET,
    check_gemm_args,
    e8m0_to_f32,
    gdc_follow,
    mx_fast_exponent,
    mx_round_consts,
    mx_scaled,
    operands_and_output,
    pdl_ok,
    pow2_f32,
    round_to_elem,
    sm_count,
    tma_or_pointer,
)
from mxq.kernels.launch import on_input_device
from mxq.kernels.quantize import quantize_mx_rows
from mxq.kernels.splitk import split_k_epilogue, split_k_finish, split_k_plan
from mxq.kernels.toolchain import configure_ptxas


@triton.jit
def mx_decode_f8_kernel(
    x_ptr, xs_ptr, w_ptr, s_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr,
    M, N, K, K_SPLIT,
    stride_xm, stride_xsm4, stride_wn, stride_sn, stride_sn4, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KB: tl.constexpr, BS: tl.constexpr, S32: tl.constexpr, QX: tl.constexpr,
    SPLIT: tl.constexpr, FUSED: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    TMA_W: tl.constexpr,
    EMAX: tl.constexpr, MBITS: tl.constexpr, MAXN: tl.constexpr, EMIN: tl.constexpr,
    RULE: tl.constexpr, HW_CVT: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Yᵀ tile [BLOCK_N, BLOCK_M] over this program's K range, KB 32-blocks per loop step. PDL: first
    thing, the kernel behind this one may launch, and this one waits for the kernel it was launched
    behind (it wrote X)."""
    if PDL:
        gdc_follow()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    rn = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    rm = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    offs_b = tl.arange(0, BS)
    k_lo = pid_k * K_SPLIT
    k_hi = min(k_lo + K_SPLIT, K)
    n_iter = tl.cdiv(k_hi - k_lo, KB * BS)
    w_ptrs = w_ptr
    if not TMA_W:
        w_ptrs = w_ptr + rn[:, None] * stride_wn + (k_lo + offs_b)[None, :]
    x_ptrs = x_ptr + rm[:, None] * stride_xm + (k_lo + offs_b)[None, :]
    s_ptrs = s_ptr + rn * stride_sn + k_lo // BS
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if S32:
        # The KB = 4 scale bytes of a step as one int32 word per row, loaded one step ahead: a
        # plain load in the loop would put a full memory latency before every block's rescale.
        s32 = s_ptr.to(tl.pointer_type(tl.int32)) + rn * stride_sn4 + k_lo // (4 * BS)
        sv = tl.load(s32)
    else:
        sv = tl.zeros((BLOCK_N,), dtype=tl.int32)
    if QX:  # X's scale bytes likewise (QX implies S32)
        xs32 = xs_ptr.to(tl.pointer_type(tl.int32)) + rm * stride_xsm4 + k_lo // (4 * BS)
        xv = tl.load(xs32)
    else:
        xv = tl.zeros((BLOCK_M,), dtype=tl.int32)
    for i in range(n_iter):
        if S32:
            cur = sv
            nxt = (i + 1) < n_iter
            sv = tl.load(s32 + (i + 1), mask=nxt & (offs_n >= 0), other=0x7F7F7F7F)
        if QX:
            xcur = xv
            xv = tl.load(xs32 + (i + 1), mask=((i + 1) < n_iter) & (offs_m >= 0), other=0x7F7F7F7F)
        # All KB block products first, then the rescale.
        ps = ()
        sxs = ()
        for j in tl.static_range(KB):
            k = k_lo + (i * KB + j) * BS
            kmask = (k + offs_b) < k_hi
            if TMA_W:
                w = w_ptr.load([pid_n * BLOCK_N, k])  # zero fill past K (only the last split)
            elif EVEN_K:
                w = tl.load(w_ptrs + (i * KB + j) * BS)
            else:
                w = tl.load(w_ptrs + (i * KB + j) * BS, mask=kmask[None, :], other=0.0)
            if EVEN_K:
                x = tl.load(x_ptrs + (i * KB + j) * BS)
            else:
                x = tl.load(x_ptrs + (i * KB + j) * BS, mask=kmask[None, :], other=0.0)
            if QX:  # X already MX (quantizer launch): its fp8 tile goes to the MMA as loaded
                q = x
                sxs = sxs + (e8m0_to_f32((xcur >> (8 * j)) & 0xFF),)
            else:
                # X's block to MX: the exponent from the amax bits, the elements rounded to fp8.
                xf = tl.reshape(x.to(tl.float32), (BLOCK_M, 1, BS))
                e, nonfinite = mx_fast_exponent(xf, EMAX, MBITS, RULE)
                if HW_CVT:
                    q = mx_scaled(xf, e, MAXN, RULE).to(FP8, fp_downcast_rounding="rtne")
                else:  # interpreter: exact grid values by arithmetic, then an exact cast
                    q = round_to_elem(xf, e, MAXN, MBITS, EMIN).to(FP8)
                q = tl.reshape(q, (BLOCK_M, BS))
                sxs = sxs + (tl.reshape(tl.where(nonfinite, float("nan"), pow2_f32(e)), (BLOCK_M,)),)
            ps = ps + (tl.dot(w, tl.trans(q), out_dtype=tl.float32),)  # [BLOCK_N, BLOCK_M], raw fp8 bytes
        for j in tl.static_range(KB):
            if S32:
                sw = e8m0_to_f32((cur >> (8 * j)) & 0xFF)
            else:
                k = k_lo + (i * KB + j) * BS
                sw = e8m0_to_f32(tl.load(s_ptrs + i * KB + j, mask=(k < k_hi) & (offs_n >= 0), other=127))
            acc += (ps[j] * sw[:, None]) * sxs[j][None, :]

    split_k_epilogue(acc, tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), b_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, stride_ym,
                     pid_n, pid_k, offs_n, offs_m, offs_n < N, offs_m < M, SPLIT, FUSED, HAS_BIAS)  # fmt: skip


@dataclass(frozen=True)
class DecodeF8Config:
    """Tiles of ``mx_decode_f8_kernel``."""

    block_n: int = 128  # weight rows per program (the MMA's M side: 64 per warpgroup)
    kb: int = 4  # 32-wide K blocks per loop step
    num_warps: int = 4
    num_stages: int = 2
    split_k: int = 1
    tma_w: bool = True
    fused: bool = True  # split-K partials summed by the last split (else a reduction launch)
    quant_x: bool = False  # X MX-quantized by a quantizer launch first (else rounded in the kernel)
    # launched behind its predecessor (programmatic dependent launch, sm_90+): off, slower in the
    # decode chain (kernels/NOTES.md, "GEMM: the portable decode paths in the chain")
    pdl: bool = False


# Largest M the kernel takes: the MMA's N side is max(16, next_pow2(M)), at most 64. Which M the
# dispatch sends here is its own threshold (``dispatch.DECODE_F8_MAX_M``).
MAX_M = 64


def pick_decode_f8_config(m: int, n: int, k: int, device: torch.device) -> DecodeF8Config:
    """Tiles from the shape alone (the sweeps: kernels/NOTES.md, "GEMM: W8A8 decode on fp8 tensor
    cores"). X quantized first; K split into the most pieces (<= 16, a power of two) that keep >= 8
    steps of 128 per split and <= 4 programs per SM (the best split on all 8 Llama-3 8B/70B shapes);
    3 stages when that is at most one program per SM, else 2 (more programs fit)."""
    if INTERPRET or device.type != "cuda":
        return DecodeF8Config(block_n=64, kb=4, split_k=2 if k >= 256 else 1, tma_w=False, quant_x=True)
    sms = sm_count(device)
    block_n, kb = 128, 4
    tiles = triton.cdiv(n, block_n)
    steps = triton.cdiv(k, kb * 32)
    split = 1
    while split < 16 and steps // (split * 2) >= 8 and tiles * split * 2 <= 4 * sms:
        split *= 2
    stages = 3 if tiles * split <= sms else 2
    return DecodeF8Config(block_n=block_n, kb=kb, num_stages=stages, split_k=split, quant_x=True)


@on_input_device
def mx_decode_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    act_elem: ElemFormat = E4M3,
    act_rule: ScaleRule = ScaleRule.RCEIL,
    out_dtype: torch.dtype | None = None,
    config: DecodeF8Config | None = None,
    block_size: int = 32,
    x_mx: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """W8A8 Y [M, N] = MX(X) · dequant(W)ᵀ (+ bias) for M <= 64 on fp8 tensor cores (module doc).

    X (bf16/fp16/fp32) is MX-rounded along K with ``act_elem`` / ``act_rule``: inside the kernel,
    or (``config.quant_x``, and always for ScaleRule.MSE) by ``quantize.quantize_mx_rows`` first,
    whose fp8 tiles then go to the MMA as loaded. ``x_mx``: X was rounded by its producer (x holds
    the rounded values; ``dispatch.mx_linear``'s doc): its fp8 codes and scale bytes go to the MMA
    as they are, with no quantizer launch, where their layout allows (else X is rounded again,
    which gives back the same codes).
    """
    m, k = check_gemm_args(x, weight, weight_scale, bias, block_size)
    n = weight.shape[0]
    if block_size != 32:
        raise ValueError(f"mx_decode_gemm needs block_size=32 (one fp8 MMA per block), got {block_size}")
    if m > MAX_M:
        raise ValueError(f"mx_decode_gemm is for M <= {MAX_M}, got M={m}")
    x, weight, weight_scale, y, done = operands_and_output(x, weight, weight_scale, bias, out_dtype, n)
    if done:
        return y
    cfg = config or pick_decode_f8_config(m, n, k, x.device)
    split, k_split, even_k, ws = split_k_plan(y, k, cfg.split_k, cfg.kb * block_size)
    tiles = triton.cdiv(n, cfg.block_n)
    counters = split_counters(x.device, tiles) if split > 1 and cfg.fused else None
    fused = counters is not None
    tma_w, w_arg = tma_or_pointer(weight, [cfg.block_n, block_size], cfg.tma_w)
    # Scales as one int32 word per row and step where every step's bytes are whole aligned words.
    s32 = cfg.kb == 4 and even_k and weight_scale.stride(0) % 4 == 0 and weight_scale.data_ptr() % 4 == 0
    qx = (cfg.quant_x or act_rule is ScaleRule.MSE or x_mx is not None) and s32
    if act_rule is ScaleRule.MSE and not qx:
        raise ValueError("mx_decode_gemm takes ScaleRule.MSE only with kb=4 and K % 128 == 0 (X quantized first)")
    pdl = cfg.pdl and pdl_ok(x.device)
    if qx and x_mx is not None and _codes_usable(x_mx, x, act_elem):
        x, xs = x_mx
    elif qx:  # [M, K] fp8 + [M, K/32] scales; the GEMM launched behind the quantizer
        x, xs = quantize_mx_rows(x, act_elem, act_rule, block_size, pdl=pdl)
    else:
        xs = weight_scale
    configure_ptxas()
    mx_decode_f8_kernel[(tiles, split)](
        x, xs, w_arg, weight_scale, bias if bias is not None else weight_scale, y, ws,
        counters if fused else weight_scale,
        m, n, k, k_split,
        x.stride(0), xs.stride(0) // 4, weight.stride(0), weight_scale.stride(0), weight_scale.stride(0) // 4, n,
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=cfg.block_n, KB=cfg.kb, BS=block_size, S32=s32, QX=qx,
        SPLIT=split, FUSED=fused, HAS_BIAS=bias is not None, EVEN_K=even_k, TMA_W=tma_w,
        **mx_round_consts(act_elem, act_rule, x.device), PDL=pdl,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl,
    )  # fmt: skip
    if split > 1 and not fused:
        split_k_finish(ws, y, bias, split)
    return y


def _codes_usable(x_mx, x: torch.Tensor, act_elem: ElemFormat) -> bool:
    """The producer's codes [M, K] and scale bytes [M, K/32] as the kernel reads them: ``act_elem``'s
    fp8 dtype, unit inner strides, scale rows as whole aligned int32 words."""
    q, s = x_mx
    return (
        q.dtype == act_elem.torch_dtype and q.shape == x.shape and q.stride(1) == 1 and s.dtype == torch.uint8
        and s.shape == (x.shape[0], x.shape[1] // 32) and s.stride(1) == 1 and s.stride(0) % 4 == 0
        and s.data_ptr() % 4 == 0
    )  # fmt: skip
