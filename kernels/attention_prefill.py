"""MXFP8 attention prefill (FlashAttention-style, Triton) and its K/V operands.

What it computes: ``mx_attention_prefill`` is ``mxq.kernels.reference.mx_attention_reference``
(same arguments, same result to fp32 accumulation): Q and K MX-rounded along head_dim (1x32),
V along the keys (32x1 blocks from key 0, the last zero-padded), softmax attention in fp32.
``quantize_vt_pages`` writes the MXFP8 cache's V: the bytes of ``mxq.formats.quantize_mx(v, -2)``,
stored transposed (as rows of Vᵀ or in the cache's 32-key pages).

How the kernel stays exact on Hopper (sm_90 has no block-scaled MMA; kernels/NOTES.md, "Attention: prefill"):
- an MX value is fp8 x 2**e: at most 4 significant bits, so bf16 holds it exactly (unless the
  block sits at the very bottom of the fp32 range, amax below ~2**-120). The kernel therefore
  runs bf16 MMAs on MX-rounded operands: Q is rounded in registers as it is loaded (loaded once
  per program), K and V are rounded once by a pre-pass into bf16 copies (they are re-read by
  every query block): K by the row quantizer (``quantize.fake_quantize_mx_rows``), or with the
  Q/K rotation by ``attention_rotate.rotate_qk_rows``'s tile fused with its rounding, and V
  along the keys by rounding Vᵀ (``round_vt``), so it is stored transposed; with the rotation
  both in one launch (``prep_kv``). Products of two bf16-exact operands are exact in the fp32
  accumulator.
- the softmax runs in fp32. P is fp32; a single bf16 copy of P would add a 2**-9 relative
  error per weight, so P·V is computed as P_hi·V + P_lo·V with P_hi = P's top 16 bits (exact
  in bf16, no conversion), P_lo = bf16(P - P_hi) (``PV_SPLIT``): < 2**-16 relative, i.e.
  fp32-class. ``exact=False`` uses one bf16(P) product (FlashAttention's usual bf16 P) for speed.
  K and Vᵀ tiles come by TMA (host descriptors) where the layout allows it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from mxq.formats import E4M3, ElemFormat, ScaleRule, as_elem_format, as_scale_rule
from mxq.kernels.attention_rotate import (
    LOG2E,
    bf16_parts,
    mask_args,
    padded_head_dim,
    rotate_rows,
    rotate_tile,
    rotation_operand,
)
from mxq.kernels.common import (
    INTERPRET,
    SCALE_BIAS,
    SCALE_NAN,
    elem_bits,
    masked_max,
    mma,
    mx_fast_exponent,
    mx_round_consts,
    mx_round_dequant,
    mx_scaled,
    round_to_elem,
)
from mxq.kernels.launch import call, cdiv, next_pow2, on_input_device
from mxq.kernels.quantize import fake_quantize_mx_rows
from mxq.kernels.reference import hadamard_block
from mxq.kernels.toolchain import configure_ptxas

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton
    TensorDescriptor = None

BLOCK = 32  # MX block size; fixed by the format


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
    s = mma(q, tl.trans(k), tl.zeros([q.shape[0], k.shape[0]], tl.float32), INTERP)
    if MASKED:
        s = s * qk_scale
        ok = (cols < Sk)[None, :] & (offs_m < Sq)[:, None]
        if CAUSAL:
            ok = ok & (offs_m[:, None] + (Sk - Sq) >= cols[None, :])
        mv = 0
        if HAS_MASK:
            mv = tl.load(mask_ptrs + start_n * stride_mn, mask=ok, other=0)
        s, m_new, m_use = masked_max(s, ok, mv, m_i, 1, HAS_MASK, MASK_BOOL)
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
        acc = mma(p_hi, v, acc, INTERP)
        acc = mma(p_lo, v, acc, INTERP)
    else:
        acc = mma(p.to(v.dtype), v, acc, INTERP)
    return acc, m_new, l_i


@triton.jit
def prefill_kernel(
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
        qf = rotate_rows(q, ROT, offs_d, BLOCK_D, QPARTS, INTERP)
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


def round_k(k, elem, rule, block_d):
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
    (``rotate_tile``, NKB row blocks per batch entry), the rest round Vᵀ (``_round_vt_tile``,
    NVB key tiles per head)."""
    pid = tl.program_id(0)
    if pid < NK:
        rotate_tile(
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
    e, nonfinite = mx_fast_exponent(xf, EMAX, MBITS, RULE)
    if HW_CVT:
        qb = mx_scaled(xf, e, MAXN, RULE).to(FP8, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    else:
        qb = elem_bits(round_to_elem(xf, e, MAXN, MBITS, EMIN), MBITS, EMIN, EBIAS).to(tl.uint8)
    qb = tl.reshape(tl.where(nonfinite[:, :, None], NAN_BYTE, qb).to(tl.uint8), (BLOCK_D, BLOCK_S))
    bh = bh.to(tl.int64)
    cols = (offs_s // 32) * stride_qp + offs_s % 32
    qptr = QD + bh * stride_qbh + offs_d[:, None] * stride_qd + cols[None, :]
    tl.store(qptr, qb, mask=(offs_d < D)[:, None] & (offs_s < NP * 32)[None, :])
    pages = tl.program_id(0) * NBS + tl.arange(0, NBS)
    sb = tl.where(nonfinite, SCALE_NAN, e + SCALE_BIAS).to(tl.uint8)
    sptr = QS + bh * stride_sbh + offs_d[:, None] * stride_sd + pages[None, :] * stride_sp
    tl.store(sptr, sb, mask=(offs_d < D)[:, None] & (pages < NP)[None, :])


@on_input_device
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
    npg = cdiv(sk, 32)
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
            _quantize_vt_kernel, (cdiv(sk, block_s), b * h),
            (v, qd, qs, h, sk, d, npg, v.stride(0), v.stride(1), v.stride(2), *strides),
            dict(BLOCK_S=block_s, BLOCK_D=max(16, next_pow2(d)), EBIAS=elem.bias, NAN_BYTE=elem.nan_byte,
                 **mx_round_consts(elem, rule, v.device)), num_warps=4,
        )  # fmt: skip
    return qd.view(elem.torch_dtype), qs


def _vt_buffer(b, h, block_d, sk, device):
    """An uninitialized bf16 Vᵀ [b, h, block_d, sk]: a view of rows padded to a multiple of 8 keys
    (16 bytes: what a TMA descriptor needs; the padding is ``vt.stride(2)``)."""
    sp = -(-sk // 8) * 8
    return torch.empty((b, h, block_d, sp), dtype=torch.bfloat16, device=device)[..., :sk]


def round_vt(v, elem, rule, block_d):
    """V [B, H, S, D] -> Vᵀ MX-rounded along the keys, bf16 [B, H, block_d, S] (zero rows past D),
    rows padded as ``_vt_buffer``'s."""
    if v.stride(-1) != 1:
        v = v.contiguous()
    b, h, sk, d = v.shape
    vt = _vt_buffer(b, h, block_d, sk, v.device)
    sp = vt.stride(2)
    block_s = 64
    if vt.numel():
        configure_ptxas()
        _round_vt_kernel[(triton.cdiv(sk, block_s), b * h)](
            v, vt, h, sk, sp, d, v.stride(0), v.stride(1), v.stride(2),
            BLOCK_S=block_s, BLOCK_D=block_d, **mx_round_consts(elem, rule, v.device), num_warps=4,
        )  # fmt: skip
    return vt


def prep_kv(k, v, elem, rule, block_d):
    """(``rotate_qk_rows(k, round_to=(elem, rule))``, ``round_vt(v, ...)``) in one launch."""
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    b, h, sk, d = k.shape
    k_mx = torch.empty((b, h, sk, block_d), dtype=torch.bfloat16, device=k.device)
    vt = _vt_buffer(b, h, block_d, sk, v.device)
    sp = vt.stride(2)
    block_r = block_s = 64
    nkb, nvb = cdiv(h * sk, block_r), cdiv(sk, block_s)
    if k_mx.numel():
        call(
            _prep_kv_kernel, (nkb * b + nvb * b * h,),
            (k, rotation_operand(d, block_d, k.device), k_mx, v, vt, h, sk, sp, d, nkb, nkb * b, nvb,
             k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2)),
            dict(BLOCK_R=block_r, BLOCK_S=block_s, BLOCK_D=block_d, PARTS=bf16_parts(k.dtype),
                 **mx_round_consts(elem, rule, k.device), INTERP=INTERPRET), num_warps=4,
        )  # fmt: skip
    return k_mx, vt


def kv_descriptors(k_mx, vt_mx, block_n):
    """Host TMA descriptors of the prefill's K rows [B·H·S, BLOCK_D] and Vᵀ rows [B·H·BLOCK_D, S]
    (``prefill_kernel``'s TMA mode), or None where the layout does not allow them."""
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


@on_input_device
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
    bd = padded_head_dim(d)
    if out is None:
        out = torch.empty((b, sq, hq, d), dtype=q.dtype, device=q.device).transpose(1, 2)
    rot, qparts = q, 0  # the Q rotation runs inside the kernel, K's fused with its rounding
    if qk_rotation:
        rot, qparts, scale = rotation_operand(d, bd, q.device), bf16_parts(q.dtype), scale / hadamard_block(d)
    if qk_rotation and not k_rotated:  # K rotated and rounded, Vᵀ rounded: one launch
        k_mx, vt_mx = prep_kv(k, v, elem, rule, bd)
    else:
        k_mx, vt_mx = round_k(k, elem, rule, bd), round_vt(v, elem, rule, bd)
    if out.stride(-1) != 1:
        raise ValueError("out needs a unit stride along head_dim")
    mask, ms, mask_bool = mask_args(attention_mask, b, hq, sq, sk)
    block_m, block_n, warps, stages, *maxnreg = tile or _prefill_tile(bd, q.device)
    grid = (cdiv(sq, block_m), b * hq)
    descs = kv_descriptors(k_mx, vt_mx, block_n) if tma and sk else None
    if b * hq and sq:
        call(
            prefill_kernel, grid,
            (q, *(descs or (k_mx, vt_mx)), out, mask if mask is not None else q, rot,
             q.stride(0), q.stride(1), q.stride(2), q.stride(3),
             k_mx.stride(0), k_mx.stride(1), k_mx.stride(2),
             vt_mx.stride(0), vt_mx.stride(1), vt_mx.stride(2),
             out.stride(0), out.stride(1), out.stride(2),
             *ms,
             hq, hq // hkv, sq, sk, d, scale * LOG2E),
            dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=bd,
                 CAUSAL=causal, HAS_MASK=mask is not None, MASK_BOOL=mask_bool, PV_SPLIT=exact,
                 **mx_round_consts(elem, rule, q.device), INTERP=INTERPRET, QPARTS=qparts, TMA=descs is not None),
            num_warps=warps, num_stages=stages, **({"maxnreg": maxnreg[0]} if maxnreg and maxnreg[0] else {}),
        )  # fmt: skip
    return out


def _prefill_tile(block_d: int, device: torch.device) -> tuple[int, int, int, int]:
    if device.type != "cuda":
        return 16, 32, 4, 1
    # the tile sweep's best across S, causal or not, exact or bf16 P (kernels/NOTES.md, "Attention: prefill")
    return 64, 64, 4, 3
