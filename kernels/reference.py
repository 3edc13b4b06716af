"""Torch references: the functions every fast path must compute (MX linear, MX attention)."""

from __future__ import annotations

import math

import torch

from mxq.formats import (
    E4M3,
    E5M2,
    ElemFormat,
    MXTensor,
    ScaleRule,
    as_elem_format,
    as_scale_rule,
    fake_quantize_mx,
    quantize_mx,
)


def mx_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    act_elem: ElemFormat | None = None,
    act_rule: ScaleRule = ScaleRule.RCEIL,
    block_size: int = 32,
) -> torch.Tensor:
    """Y = X · Wᵀ (+ bias) with W in MX ([N, K] fp8, [N, K/bs] uint8 scales, blocks along K).

    With ``act_elem`` set, X is first rounded to MX along K (1x32 tiles, W8A8); otherwise X is
    used as given (W8A16). The product is computed in float32 and cast to ``x.dtype``.
    """
    n, k = weight.shape
    w = MXTensor(weight, weight_scale, torch.Size((n, k)), 1, block_size, elem_of(weight)).dequantize()
    xf = x.to(torch.float32)
    if act_elem is not None:
        xf = fake_quantize_mx(xf, -1, act_elem, block_size, act_rule)
    y = xf @ w.t()
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)


def elem_of(weight: torch.Tensor) -> ElemFormat:
    """The element format of an MX weight, from its fp8 dtype."""
    if weight.dtype == torch.float8_e4m3fn:
        return E4M3
    if weight.dtype == torch.float8_e5m2:
        return E5M2
    raise TypeError(f"MX weight must be float8_e4m3fn or float8_e5m2, got {weight.dtype}")


def quantize_mx_rows(
    x: torch.Tensor, elem: ElemFormat | str, rule: ScaleRule | str = ScaleRule.RCEIL, block_size: int = 32
) -> tuple[torch.Tensor, torch.Tensor]:
    """X [..., K] -> (fp8 data [..., Kp], uint8 scales [..., K/bs]): what quantize.py computes."""
    t = quantize_mx(x, -1, elem, block_size, rule)
    return t.data, t.scales


def fake_quantize_mx_rows(
    x: torch.Tensor,
    elem: ElemFormat | str,
    rule: ScaleRule | str = ScaleRule.RCEIL,
    block_size: int = 32,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The MX-rounded values of X (blocks along K) in ``out_dtype`` (default x.dtype)."""
    return fake_quantize_mx(x.to(torch.float32), -1, elem, block_size, rule).to(out_dtype or x.dtype)


def _mx_rounded(v: torch.Tensor, elem: ElemFormat, block_size: int):
    """(v MX-rounded with RCEIL in v's dtype, fp8 codes [M, K], scale bytes [M, K/bs]), blocks along the last axis."""
    t = quantize_mx(v.reshape(-1, v.shape[-1]).float(), -1, elem, block_size, ScaleRule.RCEIL)
    return t.dequantize(torch.float32).to(v.dtype).reshape(v.shape).clone(), t.data.clone(), t.scales.clone()


def rmsnorm_mx_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, elem: ElemFormat, block_size: int = 32):
    """transformers' RMSNorm (Llama, Mistral, Qwen2, Qwen3), its output MX-rounded: ``producers.rmsnorm_mx``."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return _mx_rounded(weight * h.to(x.dtype), elem, block_size)


def add_rmsnorm_mx_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                             elem: ElemFormat, block_size: int = 32):  # fmt: skip
    """A decoder layer's ``residual + x`` and the RMSNorm after it: (the sum, then
    ``rmsnorm_mx_reference`` of it): ``producers.add_rmsnorm_mx``."""
    h = residual + x
    return (h, *rmsnorm_mx_reference(h, weight, eps, elem, block_size))


def silu_mul_mx_reference(gu: torch.Tensor, elem: ElemFormat, block_size: int = 32):
    """SiLU(gate) · up of a fused gate/up output [..., 2I], MX-rounded: ``producers.silu_mul_mx``."""
    g, u = gu.chunk(2, dim=-1)
    return _mx_rounded(torch.nn.functional.silu(g) * u, elem, block_size)


ROTATION_SEED = 0x6D7871  # "mxq": the random signs of the Q/K rotation are part of the format


def hadamard_block(d: int) -> int:
    """Size of the Hadamard blocks of the Q/K rotation for head_dim ``d``: its largest power-of-two divisor."""
    return d & -d


def sylvester_hadamard(n: int) -> torch.Tensor:
    """Sylvester's Hadamard matrix of size n (a power of two), float32: H[i, j] = (-1)^popcount(i & j)."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def qk_rotation(d: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The Q/K rotation for head_dim ``d``: a float32 [d, d] matrix of ±1 and 0, R·Rᵀ = n·I.

    R = diag(s)·blockdiag(H_n, ..., H_n): H_n the Sylvester Hadamard matrix of size
    n = ``hadamard_block(d)`` (n = d for the usual 64 and 128) and s fixed random signs
    (``ROTATION_SEED``). (qR)·(kR) = n·(q·k), so attention on rotated Q and K equals attention
    on Q and K with the scores divided by n: exact in real arithmetic, and the entries ±1 make
    each product exact in floating point. MX-rounding the rotated vectors instead of the raw
    ones spreads outlier channels over the whole block before the shared scale is chosen,
    which is what makes FP8 Q·K accurate (FlashAttention-3's "incoherent processing").
    """
    n = hadamard_block(d)
    with torch.device("cpu"):  # the seeded CPU generator's signs, whatever the caller's default device
        h = sylvester_hadamard(n)
        g = torch.Generator().manual_seed(ROTATION_SEED)
        signs = torch.randint(0, 2, (d,), generator=g).float() * 2 - 1
        r = signs[:, None] * torch.block_diag(*[h] * (d // n))
    return r.to(device) if device is not None else r


def rotate_qk(x: torch.Tensor) -> torch.Tensor:
    """x [..., d] -> x·R in float32 (``qk_rotation``), accumulated in float64 (exact to fp32 rounding)."""
    r = qk_rotation(x.shape[-1], x.device)
    return (x.double() @ r.double()).float()


def mx_attention_reference(
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
) -> torch.Tensor:
    """Softmax attention on MX-rounded Q, K, V, in float32; returns q.dtype [B, Hq, Sq, D].

    q [B, Hq, Sq, D], k and v [B, Hkv, Sk, D] (Hq a multiple of Hkv: GQA/MQA).
    ``causal``: query i sees keys j <= i + Sk - Sq (bottom-right aligned, as with a KV cache).
    ``attention_mask``: bool (True = attend) or additive float, broadcastable to [B, Hq, Sq, Sk].
    ``qk_rotation``: Q and K are multiplied by ``qk_rotation(D)`` before MX rounding and the
    scores divided by its block size (same attention in exact arithmetic, smaller FP8 error);
    ``k_rotated``: K is already rotated (an MXFP8 cache's K), only Q is.
    Rows with every key masked give zeros.
    """
    elem, rule = as_elem_format(elem), as_scale_rule(rule)
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if qk_rotation:
        q, scale = rotate_qk(q), scale / hadamard_block(d)
        k = k if k_rotated else rotate_qk(k)
    qf = fake_quantize_mx(q.float(), -1, elem, 32, rule)
    kf = fake_quantize_mx(k.float(), -1, elem, 32, rule)
    vf = fake_quantize_mx(v.float(), -2, elem, 32, rule)  # 32x1 along the keys, zero-padded
    kf = kf.repeat_interleave(hq // hkv, dim=1)
    vf = vf.repeat_interleave(hq // hkv, dim=1)
    s = (qf @ kf.transpose(-1, -2)) * scale
    allowed = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if causal:
        allowed = torch.arange(sq, device=q.device)[:, None] + (sk - sq) >= torch.arange(sk, device=q.device)[None, :]
    s = s.masked_fill(~allowed, float("-inf"))
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            s = s.masked_fill(~attention_mask, float("-inf"))
        else:
            s = s + attention_mask.float()
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    l_sum = p.sum(-1, keepdim=True)
    out = (p @ vf) / torch.where(l_sum > 0, l_sum, torch.ones_like(l_sum))
    return out.to(q.dtype)


def mx_grouped_linear_reference(
    x: torch.Tensor,
    group_end: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    **options,
) -> torch.Tensor:
    """Grouped Y = X · W[e]ᵀ (+ bias[e]) for experts in MX: rows ``group_end[e-1] <= r < group_end[e]``
    of X [S, K] use expert e's weight (fp8 [E, N, K], uint8 scales [E, N, K/bs], blocks along K) and
    bias [E, N]: ``mx_linear_reference`` per expert, with its keyword ``options`` (``act_elem``,
    ``act_rule``, ``block_size``). ``group_end`` [E] holds cumulative row ends (int,
    non-decreasing, last <= S): the ``offs`` of ``torch._grouped_mm``. Rows at or past
    ``group_end[-1]`` are zeros. W8A8 rounds X to MX along K first (``act_elem``; rows are
    independent, so the grouping does not change it)."""
    e_count, n, _ = weight.shape
    y = x.new_zeros(x.shape[0], n)
    ends = [int(v) for v in group_end.tolist()]
    start = 0
    for e in range(e_count):
        end = ends[e]
        if end > start:
            b = bias[e] if bias is not None else None
            y[start:end] = mx_linear_reference(x[start:end], weight[e], weight_scale[e], b, **options)
        start = max(start, end)
    return y
