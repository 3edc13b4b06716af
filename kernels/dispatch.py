"""Pick the MX linear implementation for the device at hand."""

from __future__ import annotations

import torch

from mxq.formats import ElemFormat, ScaleRule
from mxq.kernels.reference import mx_linear_reference


def mx_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    act_elem: ElemFormat | None = None,
    act_rule: ScaleRule = ScaleRule.RCEIL,
    block_size: int = 32,
) -> torch.Tensor:
    """Y = X · Wᵀ (+ bias) for an MX weight; see ``mx_linear_reference`` for the contract."""
    return mx_linear_reference(
        x, weight, weight_scale, bias, act_elem=act_elem, act_rule=act_rule, block_size=block_size
    )
