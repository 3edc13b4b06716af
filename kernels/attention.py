"""MXFP8 attention: prefill (FlashAttention-style) and decode over an MXFP8 KV cache.

Tiles (docs/ARCHITECTURE.md): Q and K are MX-blocked along head_dim (1x32 tiles of [S, D]);
V is MX-blocked along the key sequence (32x1 tiles of [S, D]), because P·V reduces over keys.
A V block holds 32 consecutive keys starting at key 0; when the key count is not a multiple
of 32 the last block is padded with zero keys (the padding takes part in the block's amax as
zeros, i.e. not at all, and is dropped). Masked keys (padding masks) still belong to their V
block: the mask acts on the softmax only, exactly as it does on the cached V bytes.

The function every path computes is ``mx_attention_reference``: MX-round Q, K, V, then
softmax attention in float32 (fully masked query rows give zeros).

How the Hopper kernels stay exact (sm_90 has no block-scaled MMA; docs/ANCHORS.md):
- an MX value is fp8 x 2**e: at most 4 significant bits, so bf16 holds it exactly (unless the
  block sits at the very bottom of the fp32 range, amax below ~2**-120). The prefill kernel
  therefore runs bf16 MMAs on MX-rounded operands: Q is rounded in registers as it is loaded
  (loaded once per program), K and V are rounded once by the row quantizer
  (``quantize.fake_quantize_mx_rows``) into bf16 copies (they are re-read by every query
  block); V is rounded along the keys by quantizing rows of Vᵀ, so it is stored transposed.
  Products of two bf16-exact operands are exact in the fp32 accumulator.
- the softmax runs in fp32. P is fp32; a single bf16 copy of P would add a 2**-9 relative
  error per weight, so P·V is computed as P_hi·V + P_lo·V with P_hi = P's top 16 bits (exact
  in bf16, no conversion), P_lo = bf16(P - P_hi) (``PV_SPLIT``): < 2**-16 relative, i.e.
  fp32-class. ``exact=False`` uses one bf16(P) product (FlashAttention's usual bf16 P) for speed.
  K and Vᵀ tiles come by TMA (host descriptors) where the layout allows it.
- the decode kernel reads the cache as it is stored: fp8 elements + E8M0 bytes, 1 + 1/32
  bytes per element, dequantizes in registers (exact in bf16, as above), splits the context
  over programs (split-KV), and a second kernel merges the partial softmaxes.

Q/K rotation (``qk_rotation=True``, what ``mxq.attention`` uses): Q and K are multiplied by
``reference.qk_rotation(D)`` (±1 entries) before rounding and the scores divided by its block
size. The kernels compute x·R as MMAs on bf16 pieces of x (1 piece for bf16 input, 2 for fp16,
3 for fp32), so every product is exact and only the fp32 accumulation rounds: Q inside the
prefill and decode kernels, K in ``rotate_qk_rows`` fused with its MX rounding (the prefill's
K operand) or before it enters the cache.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from mxq.formats import (
    E4M3,
    ElemFormat,
    ScaleRule,
    as_elem_format,
    as_scale_rule,
)
from mxq.kernels.buffers import persistent
from mxq.kernels.launch import call
from mxq.kernels.launch import cdiv as _cdiv
from mxq.kernels.quantize import (
    _RULE_ID,
    _SCALE_BIAS,
    _SCALE_NAN,
    INTERPRET,
    _elem_bits,
    _mx_fast_exponent,
    _mx_scaled,
    _pow2_f32,
    _round_to_elem,
    fake_quantize_mx_rows,
    fp8_dtype,
    hw_cvt,
    mx_round_codes,
    mx_round_dequant,
)
from mxq.kernels.reference import (
    hadamard_block,
    mx_attention_reference,  # noqa: F401  (re-export)
    qk_rotation,
    sylvester_hadamard,
)

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton
    TensorDescriptor = None

LOG2E = 1.4426950408889634
BLOCK = 32  # MX block size; fixed by the format


# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------

# The reference lives in kernels/reference.py (importable without Triton).


# ---------------------------------------------------------------------------------------------
# Q/K rotation
# ---------------------------------------------------------------------------------------------

@triton.jit
def _rotate_rows(x, R, offs_d, BLOCK_D: tl.constexpr, PARTS: tl.constexpr, INTERP: tl.constexpr):
    """x [M, BLOCK_D] (any float dtype, M >= 16) times R [BLOCK_D, BLOCK_D] (±1 and 0, bf16) in fp32.

    x is split into PARTS bf16 pieces (1 for bf16, 2 for fp16, 3 for fp32: together exactly x),
    so every product is exact and only the fp32 accumulation rounds.
    """
    r = tl.load(R + offs_d[:, None] * BLOCK_D + offs_d[None, :])
    xf = x.to(tl.float32)
    acc = tl.zeros([x.shape[0], BLOCK_D], tl.float32)
    for _ in tl.static_range(PARTS):
        part = xf.to(tl.bfloat16)
        acc = _mma(part, r, acc, INTERP)
        xf = xf - part.to(tl.float32)
    return acc


@triton.jit
def _rotate_rows_factored(x, RF, offs_d, BLOCK_D: tl.constexpr, NB: tl.constexpr, PARTS: tl.constexpr, INTERP: tl.constexpr):
    """``_rotate_rows`` for Hadamard blocks of n = 32·NB >= 32, from a 2 KB operand instead of R.

    Sylvester's H_n[i, j] = (-1)^popcount(i & j) = H_NB[i // 32, j // 32]·H_32[i % 32, j % 32], so
    x·diag(s)·blockdiag(H_n) is: signs, an MMA of the 32-column pieces against H_32, then per
    group of NB pieces the ±1 combination H_NB (adds in fp32). RF: bf16 H_32 (32 x 32) followed by
    the BLOCK_D signs (0 past D). The same products as the full MMA; the sums in another order.
    """
    A: tl.constexpr = BLOCK_D // 32
    M: tl.constexpr = x.shape[0]
    offs32 = tl.arange(0, 32)
    h32 = tl.load(RF + offs32[:, None] * 32 + offs32[None, :])
    sg = tl.load(RF + 1024 + offs_d).to(tl.float32)
    xf = tl.reshape(x.to(tl.float32) * sg[None, :], (M * A, 32))
    acc = tl.zeros([M * A, 32], tl.float32)
    for _ in tl.static_range(PARTS):
        part = xf.to(tl.bfloat16)
        acc = _mma(part, h32, acc, INTERP)
        xf = xf - part.to(tl.float32)
    y1 = tl.reshape(acc, (M, A, 32))
    offs_a = tl.arange(0, A)
    t = offs_a[:, None] & offs_a[None, :] & (NB - 1)
    par = (t ^ (t >> 1) ^ (t >> 2) ^ (t >> 3)) & 1  # popcount parity (NB <= 16)
    same = (offs_a[:, None] // NB) == (offs_a[None, :] // NB)
    ha = tl.where(same, tl.where(par == 1, -1.0, 1.0), 0.0)  # [A (from), A (to)]: I ⊗ H_NB
    y = tl.sum(y1[:, :, None, :] * ha[None, :, :, None], axis=1)
    return tl.reshape(y, (M, BLOCK_D))


@triton.jit
def _rotate_tile(
    X, R, Y, rb, b, H, S, D, OUT_D, stride_xb, stride_xh, stride_xs,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, PARTS: tl.constexpr, ROUND: tl.constexpr,
    EMAX: tl.constexpr, MBITS: tl.constexpr, MAXN: tl.constexpr, EMIN: tl.constexpr,
    RULE: tl.constexpr, HW_CVT: tl.constexpr, FP8: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """Y[row, :OUT_D] = X[row]·R for rows rb·BLOCK_R.. (h, s) of batch entry b (int64) of X
    [B, H, S, D] (unit last stride).

    ROUND: Y gets the MX-rounded values (1x32 blocks along the padded head_dim) of the fp32
    product, in Y's dtype (bf16: exact); otherwise the fp32 product itself.
    """
    rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    src = b * stride_xb + (rows // S).to(tl.int64) * stride_xh + (rows % S).to(tl.int64) * stride_xs
    rok = rows < H * S
    x = tl.load(X + src[:, None] + offs_d[None, :], mask=rok[:, None] & (offs_d < D)[None, :], other=0.0)
    y = _rotate_rows(x, R, offs_d, BLOCK_D, PARTS, INTERP)
    if ROUND:
        y = mx_round_dequant(tl.reshape(y, (BLOCK_R, BLOCK_D // 32, 32)), EMAX, MBITS, MAXN, EMIN, RULE, HW_CVT, FP8)
        y = tl.reshape(y, (BLOCK_R, BLOCK_D))
    dst = Y + (b * H * S + rows[:, None]) * OUT_D + offs_d[None, :]
    tl.store(dst, y.to(Y.dtype.element_ty), mask=rok[:, None] & (offs_d < OUT_D)[None, :])


@triton.jit
def _rotate_kernel(
    X, R, Y, H, S, D, OUT_D, stride_xb, stride_xh, stride_xs,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, PARTS: tl.constexpr, ROUND: tl.constexpr,
    EMAX: tl.constexpr, MBITS: tl.constexpr, MAXN: tl.constexpr, EMIN: tl.constexpr,
    RULE: tl.constexpr, HW_CVT: tl.constexpr, FP8: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """``_rotate_tile`` over the grid (row blocks, B)."""
    _rotate_tile(
        X, R, Y, tl.program_id(0), tl.program_id(1).to(tl.int64), H, S, D, OUT_D, stride_xb, stride_xh, stride_xs,
        BLOCK_R, BLOCK_D, PARTS, ROUND, EMAX, MBITS, MAXN, EMIN, RULE, HW_CVT, FP8, INTERP,
    )  # fmt: skip


_ROTATIONS: dict = {}
FACTORED_ROTATION = True  # decode: q·R from H_32 and the signs (2 KB) instead of R (32 KB at D=128)


def _rotation_operand(d: int, block_d: int, device: torch.device) -> torch.Tensor:
    key = (d, block_d, str(device))
    if key not in _ROTATIONS:
        r = torch.zeros(block_d, block_d, dtype=torch.bfloat16)
        r[:d, :d] = qk_rotation(d)
        kept = persistent(lambda: r.to(device), device)
        if kept is None:  # under stream capture: made per call, inside the graph
            return r.to(device)
        _ROTATIONS[key] = kept
    return _ROTATIONS[key]


def _rotation_factored(d: int, block_d: int, device: torch.device) -> tuple[int, torch.Tensor | None]:
    """(NB, operand) for ``_rotate_rows_factored``: Hadamard blocks of 32·NB columns; (0, None)
    when the blocks are narrower than 32 (head_dim 40, 80: the full R then)."""
    n = hadamard_block(d)
    if n < 32:
        return 0, None
    key = ("factored", d, block_d, str(device))
    if key not in _ROTATIONS:
        r = qk_rotation(d)
        rows = torch.arange(d)
        signs = torch.zeros(block_d)
        signs[:d] = r[rows, rows // n * n]  # R[i, first column of i's block] = s[i]·H[., 0] = s[i]
        host = torch.cat([sylvester_hadamard(32).flatten(), signs]).to(torch.bfloat16)
        kept = persistent(lambda: host.to(device), device)
        if kept is None:  # under stream capture: made per call, inside the graph
            return n // 32, host.to(device)
        _ROTATIONS[key] = kept
    return n // 32, _ROTATIONS[key]


def _parts(dtype: torch.dtype) -> int:
    return {torch.bfloat16: 1, torch.float16: 2}.get(dtype, 3)


def rotate_qk_rows(
    x: torch.Tensor, *, round_to: tuple[ElemFormat, ScaleRule] | None = None, block_d: int | None = None
) -> torch.Tensor:
    """x [B, H, S, D] (any strides, unit last stride) -> x·``qk_rotation(D)``, contiguous.

    Default: float32 [B, H, S, D]. ``round_to=(elem, rule)``: the MX-rounded rotated values
    (1x32 along head_dim) as bf16 [B, H, S, block_d], zero-padded: the prefill kernel's K operand.
    """
    if x.stride(-1) != 1:
        x = x.contiguous()
    b, h, s, d = x.shape
    bd = block_d or _block_d(d)
    out_d = bd if round_to else d
    y = torch.empty((b, h, s, out_d), dtype=torch.bfloat16 if round_to else torch.float32, device=x.device)
    elem, rule = round_to or (E4M3, ScaleRule.RCEIL)
    block_r = 64
    if y.numel():
        call(
            _rotate_kernel, (_cdiv(h * s, block_r), b),
            (x, _rotation_operand(d, bd, x.device), y, h, s, d, out_d, x.stride(0), x.stride(1), x.stride(2)),
            dict(BLOCK_R=block_r, BLOCK_D=bd, PARTS=_parts(x.dtype), ROUND=round_to is not None,
                 **_fmt(elem, rule, x.device), INTERP=INTERPRET), num_warps=4,
        )  # fmt: skip
    return y


# ---------------------------------------------------------------------------------------------
# Prefill
# ---------------------------------------------------------------------------------------------

@triton.jit
def _mma(a, b, acc, INTERP: tl.constexpr):
    """acc + a @ b for bf16-exact operands. The interpreter's bf16 dot is wrong (Triton 3.6) and
    its fp32 dot defaults to tf32, so there the same exact values go through an ieee fp32 dot."""
    if INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _prefill_block(
    acc, m_i, l_i, q, K, VT, k_ptrs, vt_ptrs, k_row, vt_row, mask_ptrs, offs_m, offs_n, start_n,
    Sq, Sk, qk_scale, stride_kn, stride_vn, stride_mn,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr,
    PV_SPLIT: tl.constexpr, TMA: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    cols = start_n + offs_n
    if TMA:  # K rows past this head's keys are the next head's (or zeros): masked below
        k = K.load([k_row + start_n, 0])
        vt = VT.load([vt_row, start_n])  # zeros past Sk
    elif MASKED:
        kin = cols < Sk
        k = tl.load(k_ptrs + start_n * stride_kn, mask=kin[:, None], other=0.0)
        vt = tl.load(vt_ptrs + start_n * stride_vn, mask=kin[None, :], other=0.0)
    else:
        k = tl.load(k_ptrs + start_n * stride_kn)
        vt = tl.load(vt_ptrs + start_n * stride_vn)
    s = _mma(q, tl.trans(k), tl.zeros([q.shape[0], k.shape[0]], tl.float32), INTERP)
    if MASKED:
        s = s * qk_scale
        ok = (cols < Sk)[None, :] & (offs_m < Sq)[:, None]
        if CAUSAL:
            ok = ok & (offs_m[:, None] + (Sk - Sq) >= cols[None, :])
        if HAS_MASK:
            mv = tl.load(mask_ptrs + start_n * stride_mn, mask=ok, other=0)
            if MASK_BOOL:
                ok = ok & (mv != 0)
            else:
                s = s + mv.to(tl.float32) * 1.4426950408889634
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_use[:, None])
    else:  # the scale folded into the exponent's argument: one FMA an element
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_use = m_new
        p = tl.math.exp2(s * qk_scale - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    v = tl.trans(vt)
    if PV_SPLIT:  # P = P_hi + P_lo: P_hi = P's top 16 bits (exact in bf16, a byte permute instead
        # of a conversion), P_lo = bf16(P - P_hi) (< 2**-7 P, so its rounding is < 2**-16 P)
        pb = p.to(tl.uint32, bitcast=True)
        p_hi = (pb >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        p_lo = (p - (pb & 0xFFFF0000).to(tl.float32, bitcast=True)).to(tl.bfloat16)
        acc = _mma(p_hi, v, acc, INTERP)
        acc = _mma(p_lo, v, acc, INTERP)
    else:
        acc = _mma(p.to(v.dtype), v, acc, INTERP)
    return acc, m_new, l_i


@triton.jit
def _prefill_kernel(
    Q, K, VT, Out, M, ROT,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vd,
    stride_ob, stride_oh, stride_om,
    stride_mb, stride_mh, stride_mm, stride_mn,
    Hq, GROUP, Sq, Sk, D, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, PV_SPLIT: tl.constexpr,
    EMAX: tl.constexpr, MBITS: tl.constexpr, MAXN: tl.constexpr, EMIN: tl.constexpr,
    RULE: tl.constexpr, HW_CVT: tl.constexpr, FP8: tl.constexpr, INTERP: tl.constexpr,
    QPARTS: tl.constexpr = 0, TMA: tl.constexpr = False,
):  # fmt: skip
    """K and VT: pointers, or with ``TMA`` host descriptors of K as [B·Hkv·Sk, BLOCK_D] rows and
    of Vᵀ as [B·Hkv·BLOCK_D, Sk] rows (stride_kb/stride_vb then unused)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hq
    h = pid_bh % Hq
    hk = h // GROUP
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)

    q_ptrs = Q + b.to(tl.int64) * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=(offs_m < Sq)[:, None] & (offs_d < D)[None, :], other=0.0)
    if QPARTS > 0:  # Q·R (the Q/K rotation), exact products, fp32 accumulation
        qf = _rotate_rows(q, ROT, offs_d, BLOCK_D, QPARTS, INTERP)
    else:
        qf = q.to(tl.float32)
    # Q rounded to MX along head_dim in registers; exact in bf16.
    qr = mx_round_dequant(
        tl.reshape(qf, (BLOCK_M, BLOCK_D // 32, 32)), EMAX, MBITS, MAXN, EMIN, RULE, HW_CVT, FP8
    )
    q = tl.reshape(qr, (BLOCK_M, BLOCK_D)).to(tl.bfloat16)

    k_row = (b * (Hq // GROUP) + hk) * Sk
    vt_row = (b * (Hq // GROUP) + hk) * BLOCK_D
    if TMA:
        k_ptrs = K
        vt_ptrs = VT
    else:
        k_ptrs = K + b.to(tl.int64) * stride_kb + hk * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :]
        vt_ptrs = VT + b.to(tl.int64) * stride_vb + hk * stride_vh + offs_d[:, None] * stride_vd + offs_n[None, :]
    mask_ptrs = M + b.to(tl.int64) * stride_mb + h * stride_mh + offs_m[:, None] * stride_mm + offs_n[None, :] * stride_mn

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    if CAUSAL:
        hi = tl.minimum(Sk, start_m + BLOCK_M + Sk - Sq)
        hi = tl.maximum(hi, 0)
        n_full = tl.minimum(tl.maximum(start_m + Sk - Sq + 1, 0), Sk) // BLOCK_N * BLOCK_N
    else:
        hi = Sk
        n_full = Sk // BLOCK_N * BLOCK_N
    if HAS_MASK:
        n_full = 0
    for start_n in range(0, n_full, BLOCK_N):
        acc, m_i, l_i = _prefill_block(
            acc, m_i, l_i, q, K, VT, k_ptrs, vt_ptrs, k_row, vt_row, mask_ptrs, offs_m, offs_n, start_n,
            Sq, Sk, qk_scale, stride_kn, 1, stride_mn,
            False, CAUSAL, HAS_MASK, MASK_BOOL, PV_SPLIT, TMA, INTERP,
        )  # fmt: skip
    for start_n in range(n_full, hi, BLOCK_N):
        acc, m_i, l_i = _prefill_block(
            acc, m_i, l_i, q, K, VT, k_ptrs, vt_ptrs, k_row, vt_row, mask_ptrs, offs_m, offs_n, start_n,
            Sq, Sk, qk_scale, stride_kn, 1, stride_mn,
            True, CAUSAL, HAS_MASK, MASK_BOOL, PV_SPLIT, TMA, INTERP,
        )  # fmt: skip

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = Out + b.to(tl.int64) * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=(offs_m < Sq)[:, None] & (offs_d < D)[None, :])


def _block_d(d: int) -> int:
    return max(32, 1 << max(0, d - 1).bit_length())  # (triton.next_power_of_2 costs ~2 µs from Python)


def _fmt(elem: ElemFormat, rule: ScaleRule, device: torch.device) -> dict:
    """The element format's constexprs for ``mx_round_dequant`` (every kernel here that rounds)."""
    return dict(
        EMAX=elem.emax, MBITS=elem.mbits, MAXN=elem.max_normal, EMIN=1 - elem.bias,
        RULE=_RULE_ID[rule], HW_CVT=hw_cvt(device), FP8=fp8_dtype(elem),
    )  # fmt: skip


def _round_k(k, elem, rule, block_d):
    """K MX-rounded along head_dim, zero-padded to ``block_d`` (the format's own block padding): bf16."""
    d = k.shape[-1]
    kp = F.pad(k, (0, block_d - d)) if block_d != d else k.contiguous()
    return fake_quantize_mx_rows(kp, elem, rule, BLOCK, out_dtype=torch.bfloat16)


@triton.jit
def _vt_blocks(V, sb, bh, H, S, D, stride_vb, stride_vh, stride_vs, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Tile sb of V [B, H, S, D] (keys sb·BLOCK_S..) of head bh = b·H + h as Vᵀ in fp32
    [BLOCK_D, BLOCK_S/32, 32]: 32-key blocks, zeros outside. Returns it with the key and channel
    offsets."""
    s0 = sb * BLOCK_S
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_s = s0 + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (offs_s < S)[:, None] & (offs_d < D)[None, :]
    v = tl.load(V + b * stride_vb + h * stride_vh + offs_s[:, None].to(tl.int64) * stride_vs + offs_d[None, :], mask=ok, other=0.0)
    return tl.reshape(tl.trans(v.to(tl.float32)), (BLOCK_D, BLOCK_S // 32, 32)), offs_s, offs_d


@triton.jit
def _round_vt_tile(
    V, VT, sb, bh, H, S, SP, D, stride_vb, stride_vh, stride_vs,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    EMAX: tl.constexpr, MBITS: tl.constexpr, MAXN: tl.constexpr, EMIN: tl.constexpr,
    RULE: tl.constexpr, HW_CVT: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    """VT[b, h, :, s] = V[b, h, s, :] MX-rounded along the keys (32x1 blocks from key 0, zero-padded),
    bf16, head_dim zero-padded to BLOCK_D, rows SP apart, for the keys of tile sb of head bh:
    one read of V, one write of Vᵀ."""
    vt, offs_s, offs_d = _vt_blocks(V, sb, bh, H, S, D, stride_vb, stride_vh, stride_vs, BLOCK_S, BLOCK_D)
    r = tl.reshape(mx_round_dequant(vt, EMAX, MBITS, MAXN, EMIN, RULE, HW_CVT, FP8), (BLOCK_D, BLOCK_S))
    dst = VT + (bh.to(tl.int64) * BLOCK_D + offs_d[:, None]) * SP + offs_s[None, :]
    tl.store(dst, r.to(tl.bfloat16), mask=(offs_s < S)[None, :])


@triton.jit
def _prep_kv_kernel(
    K, R, KY, V, VT, H, S, SP, D, NKB, NK, NVB,
    stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PARTS: tl.constexpr,
    EMAX: tl.constexpr, MBITS: tl.constexpr, MAXN: tl.constexpr, EMIN: tl.constexpr,
    RULE: tl.constexpr, HW_CVT: tl.constexpr, FP8: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """The prefill's K and V operands in one launch: programs [0, NK) rotate and round K rows
    (``_rotate_tile``, NKB row blocks per batch entry), the rest round Vᵀ (``_round_vt_tile``,
    NVB key tiles per head)."""
    pid = tl.program_id(0)
    if pid < NK:
        _rotate_tile(
            K, R, KY, pid % NKB, (pid // NKB).to(tl.int64), H, S, D, BLOCK_D, stride_kb, stride_kh, stride_ks,
            BLOCK_R, BLOCK_D, PARTS, True, EMAX, MBITS, MAXN, EMIN, RULE, HW_CVT, FP8, INTERP,
        )  # fmt: skip
    else:
        pv = pid - NK
        _round_vt_tile(
            V, VT, pv % NVB, pv // NVB, H, S, SP, D, stride_vb, stride_vh, stride_vs,
            BLOCK_S, BLOCK_D, EMAX, MBITS, MAXN, EMIN, RULE, HW_CVT, FP8,
        )  # fmt: skip


@triton.jit
def _round_vt_kernel(
    V, VT, H, S, SP, D, stride_vb, stride_vh, stride_vs,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    EMAX: tl.constexpr, MBITS: tl.constexpr, MAXN: tl.constexpr, EMIN: tl.constexpr,
    RULE: tl.constexpr, HW_CVT: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    """``_round_vt_tile`` over the grid (key tiles, B·H)."""
    _round_vt_tile(
        V, VT, tl.program_id(0), tl.program_id(1), H, S, SP, D, stride_vb, stride_vh, stride_vs,
        BLOCK_S, BLOCK_D, EMAX, MBITS, MAXN, EMIN, RULE, HW_CVT, FP8,
    )  # fmt: skip


@triton.jit
def _quantize_vt_kernel(
    V, QD, QS, H, S, D, NP, stride_vb, stride_vh, stride_vs,
    stride_qbh, stride_qd, stride_qp, stride_sbh, stride_sd, stride_sp,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    EMAX: tl.constexpr, MBITS: tl.constexpr, MAXN: tl.constexpr, EMIN: tl.constexpr, EBIAS: tl.constexpr,
    NAN_BYTE: tl.constexpr, RULE: tl.constexpr, HW_CVT: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    """V [B, H, S, D] -> Vᵀ as MX (32x1 blocks along the keys), one read of V, no transposed copy.
    Key s of channel d goes to QD + bh·stride_qbh + d·stride_qd + (s // 32)·stride_qp + s % 32 (the
    last page zero-padded), its page's E8M0 byte to QS + bh·stride_sbh + d·stride_sd + (s // 32)·stride_sp."""
    NBS: tl.constexpr = BLOCK_S // 32
    bh = tl.program_id(1)
    xf, offs_s, offs_d = _vt_blocks(V, tl.program_id(0), bh, H, S, D, stride_vb, stride_vh, stride_vs, BLOCK_S, BLOCK_D)
    e, nonfinite = _mx_fast_exponent(xf, EMAX, MBITS, RULE)
    if HW_CVT:
        qb = _mx_scaled(xf, e, MAXN, RULE).to(FP8, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    else:
        qb = _elem_bits(_round_to_elem(xf, e, MAXN, MBITS, EMIN), MBITS, EMIN, EBIAS).to(tl.uint8)
    qb = tl.reshape(tl.where(nonfinite[:, :, None], NAN_BYTE, qb).to(tl.uint8), (BLOCK_D, BLOCK_S))
    bh = bh.to(tl.int64)
    cols = (offs_s // 32) * stride_qp + offs_s % 32
    qptr = QD + bh * stride_qbh + offs_d[:, None] * stride_qd + cols[None, :]
    tl.store(qptr, qb, mask=(offs_d < D)[:, None] & (offs_s < NP * 32)[None, :])
    pages = tl.program_id(0) * NBS + tl.arange(0, NBS)
    sb = tl.where(nonfinite, _SCALE_NAN, e + _SCALE_BIAS).to(tl.uint8)
    sptr = QS + bh * stride_sbh + offs_d[:, None] * stride_sd + pages[None, :] * stride_sp
    tl.store(sptr, sb, mask=(offs_d < D)[:, None] & (pages < NP)[None, :])


def quantize_vt_pages(
    v: torch.Tensor, elem: ElemFormat, rule: ScaleRule, *, paged: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """V [B, H, S, D] -> the bytes of ``quantize_mx(v, -2)`` stored transposed, in one pass:
    (fp8 [B, H, D, 32·pages], uint8 [B, H, D, pages]) as rows of Vᵀ, or with ``paged`` the MXFP8
    cache's layout, one [D, 32] block per 32-key page: (fp8 [B, H, pages, D, 32], uint8 [B, H, pages, D])."""
    if rule is ScaleRule.MSE:
        raise ValueError("attention scale_rule 'mse' is a weight search; use rceil, floor or even")
    if v.stride(-1) != 1:
        v = v.contiguous()
    b, h, sk, d = v.shape
    npg = _cdiv(sk, 32)
    if paged:
        qd = torch.empty((b, h, npg, d, 32), dtype=torch.uint8, device=v.device)
        qs = torch.empty((b, h, npg, d), dtype=torch.uint8, device=v.device)
        strides = (npg * d * 32, 32, d * 32, npg * d, 1, d)
    else:
        qd = torch.empty((b, h, d, npg * 32), dtype=torch.uint8, device=v.device)
        qs = torch.empty((b, h, d, npg), dtype=torch.uint8, device=v.device)
        strides = (d * npg * 32, npg * 32, 32, d * npg, npg, 1)
    block_s = 64
    if qd.numel():
        call(
            _quantize_vt_kernel, (_cdiv(sk, block_s), b * h),
            (v, qd, qs, h, sk, d, npg, v.stride(0), v.stride(1), v.stride(2), *strides),
            dict(BLOCK_S=block_s, BLOCK_D=max(16, _pow2(d)), EBIAS=elem.bias, NAN_BYTE=elem.nan_byte,
                 **_fmt(elem, rule, v.device)), num_warps=4,
        )  # fmt: skip
    return qd.view(elem.torch_dtype), qs


def _vt_buffer(b, h, block_d, sk, device):
    """An uninitialized bf16 Vᵀ [b, h, block_d, sk]: a view of rows padded to a multiple of 8 keys
    (16 bytes: what a TMA descriptor needs; the padding is ``vt.stride(2)``)."""
    sp = -(-sk // 8) * 8
    return torch.empty((b, h, block_d, sp), dtype=torch.bfloat16, device=device)[..., :sk]


def _round_vt(v, elem, rule, block_d):
    """V [B, H, S, D] -> Vᵀ MX-rounded along the keys, bf16 [B, H, block_d, S] (zero rows past D),
    rows padded as ``_vt_buffer``'s."""
    if v.stride(-1) != 1:
        v = v.contiguous()
    b, h, sk, d = v.shape
    vt = _vt_buffer(b, h, block_d, sk, v.device)
    sp = vt.stride(2)
    block_s = 64
    if vt.numel():
        _round_vt_kernel[(triton.cdiv(sk, block_s), b * h)](
            v, vt, h, sk, sp, d, v.stride(0), v.stride(1), v.stride(2),
            BLOCK_S=block_s, BLOCK_D=block_d, **_fmt(elem, rule, v.device), num_warps=4,
        )  # fmt: skip
    return vt


def _prep_kv(k, v, elem, rule, block_d):
    """(``rotate_qk_rows(k, round_to=(elem, rule))``, ``_round_vt(v, ...)``) in one launch."""
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    b, h, sk, d = k.shape
    k_mx = torch.empty((b, h, sk, block_d), dtype=torch.bfloat16, device=k.device)
    vt = _vt_buffer(b, h, block_d, sk, v.device)
    sp = vt.stride(2)
    block_r = block_s = 64
    nkb, nvb = _cdiv(h * sk, block_r), _cdiv(sk, block_s)
    if k_mx.numel():
        call(
            _prep_kv_kernel, (nkb * b + nvb * b * h,),
            (k, _rotation_operand(d, block_d, k.device), k_mx, v, vt, h, sk, sp, d, nkb, nkb * b, nvb,
             k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2)),
            dict(BLOCK_R=block_r, BLOCK_S=block_s, BLOCK_D=block_d, PARTS=_parts(k.dtype),
                 **_fmt(elem, rule, k.device), INTERP=INTERPRET), num_warps=4,
        )  # fmt: skip
    return k_mx, vt


def _kv_descriptors(k_mx, vt_mx, block_n):
    """Host TMA descriptors of the prefill's K rows [B·H·S, BLOCK_D] and Vᵀ rows [B·H·BLOCK_D, S]
    (``_prefill_kernel``'s TMA mode), or None where the layout does not allow them."""
    b, h, sk, bd = k_mx.shape
    sp = vt_mx.stride(2)
    if (
        TensorDescriptor is None or not k_mx.is_contiguous() or vt_mx.stride(-1) != 1
        or vt_mx.stride(1) != bd * sp or vt_mx.stride(0) != h * bd * sp or sp % 8
        or k_mx.data_ptr() % 16 or vt_mx.data_ptr() % 16
    ):  # fmt: skip
        return None
    kd = TensorDescriptor(k_mx, [b * h * sk, bd], [bd, 1], [block_n, bd])
    vd = TensorDescriptor(vt_mx, [b * h * bd, sk], [sp, 1], [bd, block_n])
    return kd, vd


def _mask_args(attention_mask, b, hq, sq, sk):
    if attention_mask is None:
        return None, (0, 0, 0, 0), False
    m = attention_mask
    if m.dim() != 4:
        raise ValueError(f"attention_mask must be 4-D [B|1, H|1, Sq, Sk], got shape {tuple(m.shape)}")
    if m.dtype == torch.bool:
        m = m.view(torch.uint8)
    m = m.expand(b, hq, sq, sk)
    strides = tuple(m.stride(i) if m.shape[i] > 1 else 0 for i in range(4))
    return m, strides, attention_mask.dtype == torch.bool


def mx_attention_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    attention_mask: torch.Tensor | None = None,
    scale: float | None = None,
    elem: ElemFormat | str = E4M3,
    rule: ScaleRule | str = ScaleRule.RCEIL,
    qk_rotation: bool = False,
    k_rotated: bool = False,
    exact: bool = True,
    out: torch.Tensor | None = None,
    tile: tuple[int, ...] | None = None,
    tma: bool = True,
) -> torch.Tensor:
    """The Triton prefill path of ``mx_attention_reference`` (same arguments, same result).

    ``out``: optional output [B, Hq, Sq, D] (any strides with a unit last stride; HF wants a
    [B, Sq, Hq, D] tensor seen through a transpose). ``exact=False``: a bf16 P for P·V.
    ``qk_rotation``/``k_rotated``: as in the reference (Q rotated in the kernel, K by
    ``rotate_qk_rows`` fused with its MX rounding). ``tma=False``: K and Vᵀ tiles by pointer
    loads instead of the TMA copy engine (same result; for A/B measurements). ``tile``:
    (BLOCK_M, BLOCK_N, warps, stages[, maxnreg]) instead of the per-device default.
    """
    elem, rule = as_elem_format(elem), as_scale_rule(rule)
    if rule is ScaleRule.MSE:
        raise ValueError("attention scale_rule 'mse' is a weight search; use rceil, floor or even")
    b, hq, sq, d = q.shape
    _, hkv, sk, _ = k.shape
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} key/value heads")
    if v.shape != k.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must both be [{b}, Hkv, Sk, {d}]")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    bd = _block_d(d)
    if out is None:
        out = torch.empty((b, sq, hq, d), dtype=q.dtype, device=q.device).transpose(1, 2)
    rot, qparts = q, 0  # the Q rotation runs inside the kernel, K's fused with its rounding
    if qk_rotation:
        rot, qparts, scale = _rotation_operand(d, bd, q.device), _parts(q.dtype), scale / hadamard_block(d)
    if qk_rotation and not k_rotated:  # K rotated and rounded, Vᵀ rounded: one launch
        k_mx, vt_mx = _prep_kv(k, v, elem, rule, bd)
    else:
        k_mx, vt_mx = _round_k(k, elem, rule, bd), _round_vt(v, elem, rule, bd)
    if out.stride(-1) != 1:
        raise ValueError("out needs a unit stride along head_dim")
    mask, ms, mask_bool = _mask_args(attention_mask, b, hq, sq, sk)
    block_m, block_n, warps, stages, *maxnreg = tile or _prefill_tile(bd, q.device)
    grid = (_cdiv(sq, block_m), b * hq)
    descs = _kv_descriptors(k_mx, vt_mx, block_n) if tma and sk else None
    if b * hq and sq:
        call(
            _prefill_kernel, grid,
            (q, *(descs or (k_mx, vt_mx)), out, mask if mask is not None else q, rot,
             q.stride(0), q.stride(1), q.stride(2), q.stride(3),
             k_mx.stride(0), k_mx.stride(1), k_mx.stride(2),
             vt_mx.stride(0), vt_mx.stride(1), vt_mx.stride(2),
             out.stride(0), out.stride(1), out.stride(2),
             *ms,
             hq, hq // hkv, sq, sk, d, scale * LOG2E),
            dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=bd,
                 CAUSAL=causal, HAS_MASK=mask is not None, MASK_BOOL=mask_bool, PV_SPLIT=exact,
                 **_fmt(elem, rule, q.device), INTERP=INTERPRET, QPARTS=qparts, TMA=descs is not None),
            num_warps=warps, num_stages=stages, **({"maxnreg": maxnreg[0]} if maxnreg and maxnreg[0] else {}),
        )  # fmt: skip
    return out


def _prefill_tile(block_d: int, device: torch.device) -> tuple[int, int, int, int]:
    if device.type != "cuda":
        return 16, 32, 4, 1
    # H200 sweep at S=4096, D=128 (2026-11-21): 64x64/4 warps/3 stages 245 (exact) and 308 (bf16-P)
    # TFLOP/s non-causal, 205/245 causal; 128x64/8/2 gave 194/257 and 162/199.
    return 64, 64, 4, 3


# ---------------------------------------------------------------------------------------------
# Decode over the MXFP8 cache
# ---------------------------------------------------------------------------------------------

@triton.jit
def _decode_kernel(
    Q, KD, KS, VD, VS, ML, ACC, MASK,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kn,
    stride_ksb, stride_ksh, stride_ksn,
    stride_vb, stride_vh, stride_vd,
    stride_vsb, stride_vsh, stride_vsd,
    stride_mb, stride_mh, stride_mn,
    stride_vp, stride_vsp,
    Hkv, GROUP, L, D, DP, CHUNK, NSPLIT, qk_scale,
    G_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr,
    EMAX: tl.constexpr, MBITS: tl.constexpr, MAXN: tl.constexpr, EMIN: tl.constexpr,
    RULE: tl.constexpr, HW_CVT: tl.constexpr, FP8: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)  # (batch, kv head)
    split = tl.program_id(1)
    b = pid // Hkv
    hk = pid % Hkv
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = hk * GROUP + offs_g
    gmask = offs_g < GROUP

    q = tl.load(
        Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=gmask[:, None] & (offs_d < D)[None, :], other=0.0,
    )  # fmt: skip
    qr = mx_round_dequant(
        tl.reshape(q.to(tl.float32), (G_PAD, BLOCK_D // 32, 32)), EMAX, MBITS, MAXN, EMIN, RULE, HW_CVT, FP8
    )
    q = tl.reshape(qr, (G_PAD, BLOCK_D)).to(tl.bfloat16)

    kbase = KD + b.to(tl.int64) * stride_kb + hk * stride_kh
    ksbase = KS + b.to(tl.int64) * stride_ksb + hk * stride_ksh
    vbase = VD + b.to(tl.int64) * stride_vb + hk * stride_vh
    vsbase = VS + b.to(tl.int64) * stride_vsb + hk * stride_vsh
    offs_kb = tl.arange(0, BLOCK_D // 32)
    offs_vb = tl.arange(0, BLOCK_N // 32)

    m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, BLOCK_D], dtype=tl.float32)
    lo = split * CHUNK
    hi = tl.minimum(lo + CHUNK, L)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kin = cols < L
        k8 = tl.load(kbase + cols[:, None] * stride_kn + offs_d[None, :], mask=kin[:, None] & (offs_d < DP)[None, :], other=0.0)
        ke = tl.load(ksbase + cols[:, None] * stride_ksn + offs_kb[None, :], mask=kin[:, None] & (offs_kb < DP // 32)[None, :], other=127)
        ksc = ((ke.to(tl.int32)) << 23).to(tl.float32, bitcast=True)
        k = tl.reshape(tl.reshape(k8.to(tl.float32), (BLOCK_N, BLOCK_D // 32, 32)) * ksc[:, :, None], (BLOCK_N, BLOCK_D))
        s = _mma(q, tl.trans(k.to(tl.bfloat16)), tl.zeros([G_PAD, BLOCK_N], tl.float32), INTERP) * qk_scale
        ok = kin[None, :] & gmask[:, None]
        if HAS_MASK:
            mv = tl.load(MASK + b.to(tl.int64) * stride_mb + heads[:, None] * stride_mh + cols[None, :] * stride_mn, mask=ok, other=0)
            if MASK_BOOL:
                ok = ok & (mv != 0)
            else:
                s = s + mv.to(tl.float32) * 1.4426950408889634
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_use)
        p = tl.math.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]

        vcols = (cols // 32) * stride_vp + cols % 32
        v8 = tl.load(vbase + offs_d[:, None] * stride_vd + vcols[None, :], mask=(offs_d < D)[:, None] & kin[None, :], other=0.0)
        pages = start_n // 32 + offs_vb
        ve = tl.load(vsbase + offs_d[:, None] * stride_vsd + pages[None, :] * stride_vsp, mask=(offs_d < D)[:, None] & (pages * 32 < L)[None, :], other=127)
        vsc = ((ve.to(tl.int32)) << 23).to(tl.float32, bitcast=True)
        vt = tl.reshape(tl.reshape(v8.to(tl.float32), (BLOCK_D, BLOCK_N // 32, 32)) * vsc[:, :, None], (BLOCK_D, BLOCK_N))
        v = tl.trans(vt.to(tl.bfloat16))
        p_hi = p.to(tl.bfloat16)
        acc = _mma(p_hi, v, acc, INTERP)
        acc = _mma((p - p_hi.to(tl.float32)).to(tl.bfloat16), v, acc, INTERP)
        m_i = m_new

    row = (b * Hkv * GROUP + heads) * NSPLIT + split
    tl.store(ML + row * 2, m_i, mask=gmask)
    tl.store(ML + row * 2 + 1, l_i, mask=gmask)
    tl.store(ACC + row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=gmask[:, None])


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
    ksc = (ke.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    r = _mma(k8.to(tl.float16), qb, tl.zeros([BLOCK_N, GP * DB], tl.float32), INTERP)
    r = tl.reshape(r, (BLOCK_N, GP, DB))
    s = tl.sum(r * (ksc[:, None, :] * cq[None, :, :]), axis=2) * qk_scale  # [BLOCK_N, GP]
    ok = (offs_g < GROUP_C)[None, :]
    if MASKED:
        ok = ok & kin[:, None]
    if HAS_MASK:
        mv = tl.load(mbase + offs_g[None, :] * stride_mh + cols[:, None] * stride_mn, mask=ok, other=0)
        if MASK_BOOL:
            ok = ok & (mv != 0)
        else:
            s = s + mv.to(tl.float32) * 1.4426950408889634
    s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 0))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
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
    vsc = (ve.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    t = _mma(v8.to(tl.float16), pb, tl.zeros([BLOCK_D, GP * PP * 2], tl.float32), INTERP)
    t = tl.sum(tl.reshape(t, (BLOCK_D, GP, PP, 2)), axis=3)
    acc = acc * alpha[None, :] + tl.sum(t * vsc[:, None, :], axis=2)
    return acc, m_new, l_i


@triton.jit
def _decode_q(
    Q, ROT, b, hk, stride_qb, stride_qh, stride_qd, D,
    GROUP_C: tl.constexpr, GP: tl.constexpr, BLOCK_D: tl.constexpr, DB: tl.constexpr,
    EMAX: tl.constexpr, MBITS: tl.constexpr, MAXN: tl.constexpr, EMIN: tl.constexpr,
    RULE: tl.constexpr, HW_CVT: tl.constexpr, FP8: tl.constexpr, INTERP: tl.constexpr,
    QPARTS: tl.constexpr, QM: tl.constexpr, ROT_NB: tl.constexpr,
):  # fmt: skip
    """The decode kernel's query operand: ``_decode_qn``'s blocks laid block-diagonally over the
    D blocks: qb [BLOCK_D, GP * DB] fp16, cq [GP, DB]."""
    qn, cq = _decode_qn(
        Q, ROT, b, hk, stride_qb, stride_qh, stride_qd, D, GROUP_C, GP, BLOCK_D, DB,
        EMAX, MBITS, MAXN, EMIN, RULE, HW_CVT, FP8, INTERP, QPARTS, QM, ROT_NB,
    )  # fmt: skip
    offs_d = tl.arange(0, BLOCK_D)
    offs_j = tl.arange(0, DB)
    qb = tl.where((offs_d // 32)[:, None, None] == offs_j[None, None, :], tl.trans(qn)[:, :, None], 0.0)
    qb = tl.reshape(qb, (BLOCK_D, GP * DB)).to(tl.float16)  # [D, (g, j)] block-diagonal
    return qb, cq


@triton.jit
def _decode_qn(
    Q, ROT, b, hk, stride_qb, stride_qh, stride_qd, D,
    GROUP_C: tl.constexpr, GP: tl.constexpr, BLOCK_D: tl.constexpr, DB: tl.constexpr,
    EMAX: tl.constexpr, MBITS: tl.constexpr, MAXN: tl.constexpr, EMIN: tl.constexpr,
    RULE: tl.constexpr, HW_CVT: tl.constexpr, FP8: tl.constexpr, INTERP: tl.constexpr,
    QPARTS: tl.constexpr, QM: tl.constexpr, ROT_NB: tl.constexpr, CODES: tl.constexpr = False,
):  # fmt: skip
    """The GROUP_C query heads of kv head ``hk`` (rotated if QPARTS), MX-rounded along head_dim,
    each 32-block normalized by a power of two: qn [GP, BLOCK_D] fp32 (exact in fp16), cq [GP, DB].
    CODES: qn the MX elements themselves (exact in the element format) and cq = 2**scale (NaN for
    a block with a NaN or Inf, whose elements are then 0)."""
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, BLOCK_D)
    heads = hk * GROUP_C + offs_g
    gmask = offs_g < GROUP_C
    if QPARTS > 0:  # Q·R (the Q/K rotation) on QM >= 16 rows (an MMA's minimum), then the GP used
        offs_r = tl.arange(0, QM)
        q = tl.load(
            Q + b.to(tl.int64) * stride_qb + (hk * GROUP_C + offs_r)[:, None] * stride_qh + offs_d[None, :] * stride_qd,
            mask=(offs_r < GROUP_C)[:, None] & (offs_d < D)[None, :], other=0.0,
        )  # fmt: skip
        if ROT_NB > 0:  # ROT is the 2 KB factored operand
            y = _rotate_rows_factored(q, ROT, offs_d, BLOCK_D, ROT_NB, QPARTS, INTERP)
        else:
            y = _rotate_rows(q, ROT, offs_d, BLOCK_D, QPARTS, INTERP)
        if QM == GP:
            qf = y
        else:
            qf = tl.sum(tl.where(offs_r[None, :, None] == offs_g[:, None, None], y[None, :, :], 0.0), axis=1)
    else:
        q = tl.load(
            Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
            mask=gmask[:, None] & (offs_d < D)[None, :], other=0.0,
        )  # fmt: skip
        qf = q.to(tl.float32)
    if CODES:
        r, e, nonfinite = mx_round_codes(tl.reshape(qf, (GP, DB, 32)), EMAX, MBITS, MAXN, EMIN, RULE, HW_CVT, FP8)
        cq = tl.where(nonfinite, float("nan"), _pow2_f32(e))
        qn = tl.where(nonfinite[:, :, None], 0.0, r)
    else:
        qr = mx_round_dequant(tl.reshape(qf, (GP, DB, 32)), EMAX, MBITS, MAXN, EMIN, RULE, HW_CVT, FP8)
        # Normalize each Q block by a power of two so its MX values are exact in fp16 (|x| < 2;
        # e4m3 spans < 2^18 inside a block, fp16 subnormals reach 2^-24); cq undoes it after the dot.
        cbits = tl.max(qr.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=2) & 0x7F800000
        cbits = tl.where(cbits == 0, 0x3F800000, cbits)
        cq = cbits.to(tl.float32, bitcast=True)  # [GP, DB]
        qn = qr / cq[:, :, None]
    return tl.reshape(qn, (GP, BLOCK_D)), cq


@triton.jit
def _decode_q_prep_kernel(
    Q, ROT, QN, CQ, Hkv, stride_qb, stride_qh, stride_qd, D,
    GROUP_C: tl.constexpr, GP: tl.constexpr, BLOCK_D: tl.constexpr, DB: tl.constexpr,
    EMAX: tl.constexpr, MBITS: tl.constexpr, MAXN: tl.constexpr, EMIN: tl.constexpr,
    RULE: tl.constexpr, HW_CVT: tl.constexpr, FP8: tl.constexpr, INTERP: tl.constexpr,
    QPARTS: tl.constexpr, QM: tl.constexpr, ROT_NB: tl.constexpr, PDL: tl.constexpr, CODES: tl.constexpr = False,
):  # fmt: skip
    """``_decode_qn`` for one (batch, kv head) into QN [B*Hkv*GP, BLOCK_D] (fp16, or the element
    format's fp8 with CODES), CQ [B*Hkv*GP, DB]."""
    if PDL:
        # launched behind the kernel that wrote q and the cache (or not: then the wait returns at once):
        # wait for it, and only then let the decode kernel launched behind this one start streaming
        # the cache, which that kernel may still have been writing before the wait
        tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    pid = tl.program_id(0)
    qn, cq = _decode_qn(
        Q, ROT, pid // Hkv, pid % Hkv, stride_qb, stride_qh, stride_qd, D, GROUP_C, GP, BLOCK_D, DB,
        EMAX, MBITS, MAXN, EMIN, RULE, HW_CVT, FP8, INTERP, QPARTS, QM, ROT_NB, CODES,
    )  # fmt: skip
    rows = pid * GP + tl.arange(0, GP)
    tl.store(QN + rows[:, None] * BLOCK_D + tl.arange(0, BLOCK_D)[None, :], qn.to(QN.dtype.element_ty))
    tl.store(CQ + rows[:, None] * DB + tl.arange(0, DB)[None, :], cq)


def decode_query_blocks(
    q: torch.Tensor, hkv: int, *, gp: int = 8, elem: ElemFormat | str = E4M3, rule: ScaleRule | str = ScaleRule.RCEIL,
    qk_rotation: bool = False, pdl: bool = False, codes: bool = False, launch_pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode query as the warp-specialized decode kernel reads it (``attention_decode_ws``):
    q [B, Hq, 1, D] -> qn fp16 [B*Hkv*gp, BLOCK_D], cq fp32 [B*Hkv*gp, BLOCK_D/32] with
    qn·cq (per 32-block) = the MX-rounded (and, with ``qk_rotation``, rotated) query; rows of
    a kv head's gp slots past its Hq/Hkv query heads are zero. ``codes``: qn holds the MX
    elements in the element format's fp8 dtype and cq = 2**scale (the fp8 MMA's operand);
    otherwise each block is normalized to max |qn| in [1, 2) (cq a power of two, 1 for a zero block).
    ``pdl``: the kernel lets the decode kernel behind it start (after waiting for its own predecessor);
    ``launch_pdl`` (with ``pdl``): it is itself launched with PDL behind that predecessor."""
    elem, rule = as_elem_format(elem), as_scale_rule(rule)
    b, hq, _, d = q.shape
    group = hq // hkv
    if group > gp:
        raise ValueError(f"decode_query_blocks: {group} query heads per kv head, more than gp={gp}")
    bd = _block_d(d)
    qdt = (torch.float8_e4m3fn if elem.mbits == 3 else torch.float8_e5m2) if codes else torch.float16
    qn = torch.empty((b * hkv * gp, bd), dtype=qdt, device=q.device)
    cq = torch.empty((b * hkv * gp, bd // 32), dtype=torch.float32, device=q.device)
    rot_nb, rot = _rotation_factored(d, bd, q.device) if qk_rotation and FACTORED_ROTATION else (0, None)
    if rot is None:
        rot = _rotation_operand(d, bd, q.device) if qk_rotation else q
    _decode_q_prep_kernel[(b * hkv,)](
        q, rot, qn, cq, hkv, q.stride(0), q.stride(1), q.stride(3), d,
        GROUP_C=group, GP=gp, BLOCK_D=bd, DB=bd // 32, **_fmt(elem, rule, q.device), INTERP=INTERPRET,
        QPARTS=_parts(q.dtype) if qk_rotation else 0, QM=max(16, gp), ROT_NB=rot_nb, PDL=pdl, CODES=codes, num_warps=4,
        **({"launch_pdl": True} if launch_pdl and pdl else {}),
    )  # fmt: skip
    return qn, cq


@triton.jit
def _decode_gqa_kernel(
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
    qb, cq = _decode_q(
        Q, ROT, b, hk, stride_qb, stride_qh, stride_qd, D, GROUP_C, GP, BLOCK_D, DB,
        EMAX, MBITS, MAXN, EMIN, RULE, HW_CVT, FP8, INTERP, QPARTS, QM, ROT_NB,
    )  # fmt: skip

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


@triton.jit
def _decode_merge_kernel(
    ML, ACC, Out, Hq, D, NSPLIT,
    stride_ob, stride_oh,
    SPLIT_PAD: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    if PDL:  # launched behind the decode kernel (programmatic dependent launch): wait for its partials
        tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    pid = tl.program_id(0)  # b * Hq + h
    b = pid // Hq
    h = pid % Hq
    offs_s = tl.arange(0, SPLIT_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    smask = offs_s < NSPLIT
    row = pid * NSPLIT + offs_s
    m = tl.load(ML + row * 2, mask=smask, other=float("-inf"))
    ls = tl.load(ML + row * 2 + 1, mask=smask, other=0.0)
    acc = tl.load(ACC + row[:, None] * BLOCK_D + offs_d[None, :], mask=smask[:, None], other=0.0)
    mx = tl.max(m, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.math.exp2(m - mx)
    lt = tl.sum(ls * w, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(lt > 0, lt, 1.0)
    tl.store(Out + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=offs_d < D)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def check_counters(counters: torch.Tensor, n: int, device: torch.device) -> None:
    """A fused split merge's tickets as given by the caller: int32, on ``device``, >= n of them."""
    if counters.dtype != torch.int32 or counters.numel() < n or counters.device != device:
        raise ValueError(f"counters must be int32 on {device} with at least {n} elements")


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

    ``variant``: "ws" (default on Hopper under CUDA-graph capture where
    ``attention_decode_ws.takes`` the call: the warp-specialized Gluon kernel, TMA loader warp +
    wgmma; ``MXQ_ATTN_WS=0`` turns it off), "gqa" (default elsewhere: fp16 MMAs on the raw fp8
    tiles, scales applied per block after the products) or "dequant" (the first kernel: every element scaled, bf16 MMAs). The tuning
    arguments below and ``merge`` belong to "gqa"/"dequant" ("ws" takes its own
    ``DecodeAttnWSConfig``; ``counters`` serve its opt-in fused merge too). ``block_n``,
    ``chunk`` (keys per split), ``num_warps``, ``num_stages``, ``maxnreg`` (register cap per
    thread, so more programs fit on an SM): tuning, defaults from the H200 sweep.

    ``merge``: how the split-KV partials are combined: "fused" (the split that finishes last for a
    (batch, kv head) merges them inside the decode kernel: one launch) or "kernel" (a second
    kernel). Default: "kernel" while a CUDA graph is being captured (0.5-2 µs less GPU time per
    call on an H200), "fused" otherwise (eager calls are launch-bound: one Triton launch fewer,
    ~20 µs of CPU). ``counters``: int32 zeros, at least B*Hkv of them, for the fused merge's
    arrival counts (each call leaves them at zero again); the cache layer owns one per layer so
    CUDA graphs replay it. Without it a zeroed one is allocated per call. Two calls running at
    the same time on different streams need different counters.
    """
    elem, rule = as_elem_format(elem), as_scale_rule(rule)
    b, hq, sq, d = q.shape
    # The warp-specialized Gluon kernel (Hopper): by default only under CUDA-graph capture, where GPU
    # time decides (3-4 % less than gqa on an H100); eager calls are launch-bound and gqa is one
    # launch, ws three (kernels/NOTES.md, "Attention: decode warp-specialized in Gluon")
    in_graph = variant is None and q.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if variant == "ws" or (in_graph and os.environ.get("MXQ_ATTN_WS", "1") != "0"):
        from mxq.kernels import attention_decode_ws as _ws

        if variant == "ws":
            return _ws.mx_attention_decode_ws(
                q, k_data, k_scale, v_data, v_scale, length, scale=scale, elem=elem, rule=rule, out=out,
                qk_rotation=qk_rotation, counters=counters,
            )  # fmt: skip
        if _ws.takes(q, k_data, k_scale, v_data, v_scale, attention_mask):
            from mxq.kernels import gluon_api

            return gluon_api.run_or_fall_back(
                "attention_decode_ws",
                lambda: _ws.mx_attention_decode_ws(
                    q, k_data, k_scale, v_data, v_scale, length, scale=scale, elem=elem, rule=rule, out=out,
                    qk_rotation=qk_rotation, counters=counters,
                ),
                lambda: mx_attention_decode(
                    q, k_data, k_scale, v_data, v_scale, length, attention_mask=attention_mask, scale=scale,
                    elem=elem, rule=rule, out=out, qk_rotation=qk_rotation, counters=counters, variant="gqa",
                ),
            )  # fmt: skip
    paged = v_data.dim() == 5
    if paged:  # [B, Hkv, P, D, 32] pages: address V as (page, channel, slot) through the strides
        vp, vsp = v_data.stride(2), v_scale.stride(2)
        v_data, v_scale = v_data.transpose(2, 3), v_scale.transpose(2, 3)  # [B, Hkv, D, P, 32], [B, Hkv, D, P]
    else:
        vp, vsp = 32, v_scale.stride(3)
    if sq != 1:
        raise ValueError(f"mx_attention_decode takes one query token, got {sq}")
    hkv = k_data.shape[1]
    dp = k_data.shape[-1]
    group = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    bd = _block_d(d)
    on_gpu = q.device.type == "cuda"
    variant = variant or "gqa"
    if variant not in ("gqa", "dequant"):
        raise ValueError(f"unknown decode variant {variant!r} (gqa, dequant, ws)")
    cfg = _decode_config(variant, on_gpu)
    block_n = block_n or cfg[0]
    num_warps = num_warps or cfg[1]
    num_stages = num_stages or cfg[2]
    if chunk is None:
        want = max(1, cfg[3] // max(1, b * hkv)) if on_gpu else 4
        chunk = max(block_n, _cdiv(_cdiv(length, want), block_n) * block_n)
    if chunk % block_n:
        raise ValueError(f"chunk {chunk} is not a multiple of block_n {block_n}")
    nsplit = max(1, _cdiv(length, chunk))
    if merge is None:  # under CUDA-graph capture GPU time decides, eagerly the CPU time of a launch
        capturing = on_gpu and torch.cuda.is_current_stream_capturing()
        merge = "fused" if variant == "gqa" and not capturing else "kernel"
    if merge not in ("fused", "kernel") or (merge == "fused" and variant != "gqa"):
        raise ValueError(f"merge={merge!r} with variant={variant!r}: 'fused' needs the gqa kernel, or use 'kernel'")
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
    if qk_rotation:
        scale = scale / hadamard_block(d)
        if variant != "gqa":  # the gqa kernel rotates q itself
            q = rotate_qk_rows(q)
    mask, ms, mask_bool = _mask_args(attention_mask, b, hq, 1, length)
    common = (
        k_data.stride(0), k_data.stride(1), k_data.stride(2),
        k_scale.stride(0), k_scale.stride(1), k_scale.stride(2),
        v_data.stride(0), v_data.stride(1), v_data.stride(2),
        v_scale.stride(0), v_scale.stride(1), v_scale.stride(2),
        ms[0], ms[1], ms[3],
    )  # fmt: skip
    fmt = dict(**_fmt(elem, rule, q.device), INTERP=INTERPRET)
    if variant == "gqa":
        if block_n % 32:
            raise ValueError("the gqa decode kernel needs block_n a multiple of 32")
        db, pp = bd // 32, block_n // 32
        gp = max(_pow2(group), _cdiv(16, db), _cdiv(16, 2 * pp))
        rot_nb, rot = _rotation_factored(d, bd, q.device) if qk_rotation and FACTORED_ROTATION else (0, None)
        if rot is None:
            rot = _rotation_operand(d, bd, q.device) if qk_rotation else q
        call(
            _decode_gqa_kernel, (b * hkv, nsplit),
            (q, k_data, k_scale, v_data, v_scale, ml, acc, mask if mask is not None else q, rot,
             q.stride(0), q.stride(1), q.stride(3), *common, vp, vsp,
             hkv, length, d, dp, chunk, nsplit, scale * LOG2E,
             counters if fused else ml, out, out.stride(0), out.stride(1)),  # COUNT, Out, stride_ob, stride_oh
            dict(GROUP_C=group, GP=gp, BLOCK_N=block_n, BLOCK_D=bd, MASK_D=bd != d,
                 HAS_MASK=mask is not None, MASK_BOOL=mask_bool, **fmt,
                 QPARTS=_parts(q.dtype) if qk_rotation else 0, QM=max(16, gp), ROT_NB=rot_nb,
                 FUSE_MERGE=fused, MERGE_CHUNK=min(16, _pow2(nsplit))),
            num_warps=num_warps, num_stages=num_stages, **({"maxnreg": maxnreg} if maxnreg and on_gpu else {}),
        )  # fmt: skip
    else:
        _decode_kernel[(b * hkv, nsplit)](
            q, k_data, k_scale, v_data, v_scale, ml, acc, mask if mask is not None else q,
            q.stride(0), q.stride(1), q.stride(3), *common, vp, vsp,
            hkv, group, length, d, dp, chunk, nsplit, scale * LOG2E,
            G_PAD=max(16, _pow2(group)), BLOCK_N=block_n, BLOCK_D=bd,
            HAS_MASK=mask is not None, MASK_BOOL=mask_bool, **fmt,
            num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
    if not fused:
        call(
            _decode_merge_kernel, (b * hq,), (ml, acc, out, hq, d, nsplit, out.stride(0), out.stride(1)),
            dict(SPLIT_PAD=_pow2(nsplit), BLOCK_D=bd), num_warps=4,
        )  # fmt: skip
    return out


def _decode_config(variant: str, on_gpu: bool) -> tuple[int, int, int, int]:
    """(block_n, num_warps, num_stages, programs wanted over the whole grid)."""
    if not on_gpu:
        return 32, 4, 1, 4
    if variant == "dequant":  # the first kernel's settings
        return 64, 4, 3, 528
    # H200 sweeps, B=4 Hkv=8 D=128 (2026-11-21): block_n {32, 64, 128} x warps {1, 2, 4, 8} x stages
    # {1..6} x {264..2112} programs. Best at every context 1k-32k: 64 keys, 2 warps, 3 stages,
    # 528 programs (4 per SM): 16k 72.9 -> 52.8 µs (0.90x -> 1.24x bf16 SDPA). Small programs
    # let more of them share an SM, which hides the latency of the per-tile instruction chain
    # (Nsight: 2 warps per scheduler issued 0.27 instructions/cycle with 4-warp programs).
    # Re-checked after the scales-ahead loads and the paged V (H200 sweep, 2026-11-21): still
    # best at 16k and 32k; register caps (maxnreg 128/168) with more programs per SM are slower.
    return 64, 2, 3, 528
