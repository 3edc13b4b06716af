"""Torch reference for the MX linear layer: the function every fast path must compute."""

from __future__ import annotations

import torch

from mxq.formats import ElemFormat, MXTensor, ScaleRule, fake_quantize_mx, quantize_mx


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
