"""Torch references: the functions every fast path must compute (MX linear, MX attention)."""

from __future__ import annotations

import math

import torch

from mxq.formats import (
    E4M3,
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
    w = MXTensor(weight, weight_scale, torch.Size((n, k)), 1, block_size, _elem_of(weight)).dequantize()
    xf = x.to(torch.float32)
    if act_elem is not None:
        xf = fake_quantize_mx(xf, -1, act_elem, block_size, act_rule)
    y = xf @ w.t()
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)


def _elem_of(weight: torch.Tensor) -> ElemFormat:
    from mxq.formats import E4M3, E5M2

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
) -> torch.Tensor:
    """Softmax attention on MX-rounded Q, K, V, in float32; returns q.dtype [B, Hq, Sq, D].

    q [B, Hq, Sq, D], k and v [B, Hkv, Sk, D] (Hq a multiple of Hkv: GQA/MQA).
    ``causal``: query i sees keys j <= i + Sk - Sq (bottom-right aligned, as with a KV cache).
    ``attention_mask``: bool (True = attend) or additive float, broadcastable to [B, Hq, Sq, Sk].
    Rows with every key masked give zeros.
    """
    elem, rule = as_elem_format(elem), as_scale_rule(rule)
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
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
