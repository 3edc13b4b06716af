"""Grouped MX GEMM for mixtures of experts: ``mx_grouped_linear`` and its registry ``GROUPED``.

Tokens arrive sorted by expert; ``group_end`` [E] holds each expert's cumulative row end (the
``offs`` of ``torch._grouped_mm``). Every path computes ``mx_grouped_linear_reference``
(``mxq.kernels.reference``): rows of expert e times expert e's MX weight [N, K] (blocks along K),
plus its bias; rows past ``group_end[-1]`` are zeros. The registry picks the path from host facts
only (shapes, dtypes, device), so a call never syncs and can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mxq.formats import ElemFormat, ScaleRule, as_elem_format, as_scale_rule
from mxq.kernels.reference import mx_grouped_linear_reference
from mxq.kernels.registry import KernelPath, Registry, check_kernels, default_kernels


class GroupedProblem(NamedTuple):
    """One ``mx_grouped_linear`` call as dispatch sees it (host facts only; hashable)."""

    s: int  # rows (token-expert pairs)
    e: int  # experts
    n: int
    k: int
    x_dtype: torch.dtype
    act_elem: ElemFormat | None
    act_rule: ScaleRule
    block_size: int
    device: torch.device
    triton: bool


def _reference_run(p: GroupedProblem, x, group_end, weight, weight_scale, bias):
    return mx_grouped_linear_reference(
        x, group_end, weight, weight_scale, bias, act_elem=p.act_elem, act_rule=p.act_rule, block_size=p.block_size
    ).to(x.dtype)


GROUPED = Registry("grouped", [
    KernelPath("reference", "torch reference (per-expert loop over dequantized weights)", lambda p: True, _reference_run),
])  # fmt: skip


def check_grouped_args(x, group_end, weight, weight_scale, bias, block_size: int) -> None:
    """One-line errors for operands that do not fit together."""
    if weight.dim() != 3 or weight.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"mx_grouped_linear: weight must be fp8 [E, N, K], got {weight.dtype}{list(weight.shape)}")
    e, n, k = weight.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"mx_grouped_linear: x must be [S, {k}], got {list(x.shape)}")
    if weight_scale.dtype != torch.uint8 or tuple(weight_scale.shape) != (e, n, k // block_size) or k % block_size:
        raise ValueError(f"mx_grouped_linear: weight_scale must be uint8 [{e}, {n}, {k // block_size}], got {weight_scale.dtype}{list(weight_scale.shape)}")
    if group_end.dim() != 1 or group_end.shape[0] != e or group_end.dtype.is_floating_point:
        raise ValueError(f"mx_grouped_linear: group_end must be an integer tensor [{e}], got {group_end.dtype}{list(group_end.shape)}")
    if bias is not None and tuple(bias.shape) != (e, n):
        raise ValueError(f"mx_grouped_linear: bias must be [{e}, {n}], got {list(bias.shape)}")


def mx_grouped_linear(
    x: torch.Tensor,
    group_end: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    act_elem: ElemFormat | None = None,
    act_rule: ScaleRule = ScaleRule.RCEIL,
    block_size: int = 32,
    kernels: str | None = None,
) -> torch.Tensor:
    """Grouped Y [S, N] = X · W[e]ᵀ (+ bias[e]) per expert group (module doc); ``kernels`` as for
    ``mx_linear`` ("auto", "reference" or path names)."""
    check_grouped_args(x, group_end, weight, weight_scale, bias, block_size)
    if act_elem is not None:
        act_elem, act_rule = as_elem_format(act_elem), as_scale_rule(act_rule)
    spec = check_kernels(kernels) if kernels is not None else default_kernels()
    e, n, k = weight.shape
    p = GroupedProblem(x.shape[0], e, n, k, x.dtype, act_elem, act_rule, block_size, x.device, x.device.type == "cuda")
    path = GROUPED.choose(p, spec)
    return path.run(p, x, group_end, weight, weight_scale, bias)


def grouped_path(p: GroupedProblem, kernels: str | None = None) -> KernelPath:
    """The path ``mx_grouped_linear`` takes for ``p`` (what benchmark tables print)."""
    return GROUPED.choose(p, kernels)
