"""The GPTQ algorithm for MX weights, one [N, K] matrix at a time (``gptq_mx``), and what every
caller shares: the Hessian of a layer's inputs (``hessian``), the output errors of GPTQ and of
round-to-nearest (``output_errors``) and the settings of a pass (``Rounding``). ``mxq.calib.gptq`` runs it
over a model's decoder layers, ``mxq.calib.gptq_experts`` over routed experts; ``mxq.calib.gptq``'s module doc
has the method and what MX changes in it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mxq.formats import (
    E8M0_MAX_EXP,
    E8M0_MIN_EXP,
    ElemFormat,
    ScaleRule,
    cast_elements,
    exp2_f32,
    fake_quantize_mx,
    shared_exponents,
)
from mxq.recipe import TensorSpec

__all__ = ["GPTQ_RULES", "LAZY_BLOCK", "EXPERT_MIN_TOKENS", "GPTQError", "Rounding", "hessian", "gptq_mx", "output_errors"]

GPTQ_RULES = (ScaleRule.RCEIL, ScaleRule.MSE)
LAZY_BLOCK = 128  # columns updated together (a multiple of the MX block)
EXPERT_MIN_TOKENS = 1.5  # tokens per unit of K an expert's projection needs for GPTQ (module doc)


class GPTQError(ValueError):
    """A layer or model GPTQ cannot round; the message names it."""


def _round_column(w: torch.Tensor, e: torch.Tensor, elem: ElemFormat) -> torch.Tensor:
    """w[N] rounded to ``elem`` under the per-row scale 2**e[N]: the element cast of ``quantize_mx``
    (saturating, nearest even) on blocks of one element."""
    return cast_elements(w.view(-1, 1, 1), e.view(-1, 1), elem).float().view(-1) * exp2_f32(e)


def hessian(x: torch.Tensor) -> torch.Tensor:
    """XᵀX (float32) of inputs x[..., K] — accumulate it over batches with ``+=``."""
    x = x.reshape(-1, x.shape[-1]).float()
    return x.t() @ x


def gptq_mx(
    w: torch.Tensor,
    h: torch.Tensor,
    spec: TensorSpec,
    *,
    block_size: int = 32,
    damp: float = 0.01,
    lazy_block: int = LAZY_BLOCK,
    act_order: bool = False,
) -> torch.Tensor:
    """GPTQ-rounded values of ``w`` [N, K] (float32, each an fp8 code times its block's 2**e).

    ``h`` [K, K]: Σ xᵀx of the layer's calibration inputs (any positive multiple). ``damp``: added
    to the diagonal as a fraction of its mean. Columns never seen active (zero diagonal) are
    rounded like the others but receive no error and pass none on. ``act_order``: visit the 1x32
    blocks by decreasing Hessian diagonal (their sum), and the columns of each block likewise;
    blocks stay whole, so the stored layout is unchanged and only the order of rounding moves.
    """
    w_in = w
    n, k = w.shape
    if spec.scale_rule not in GPTQ_RULES:
        raise GPTQError(f"GPTQ rounding takes scale_rule rceil or mse, got {spec.scale_rule.value!r}")
    if k % block_size:
        raise GPTQError(f"GPTQ needs K divisible by {block_size}, got K = {k}")
    if h.shape != (k, k):
        raise GPTQError(f"Hessian of shape {tuple(h.shape)} for a weight of shape {(n, k)}")
    lazy_block = max(block_size, lazy_block // block_size * block_size)
    w = w.detach().float()
    w = w.clone() if w.data_ptr() == w_in.data_ptr() else w  # a float32 input is not modified
    h = h.detach().float().clone()
    perm = None
    if act_order:
        diag = torch.diagonal(h).reshape(-1, block_size)
        blocks = torch.argsort(diag.sum(1), descending=True, stable=True)
        inner = torch.argsort(diag, dim=1, descending=True, stable=True)
        perm = (blocks.unsqueeze(1) * block_size + inner[blocks]).reshape(-1)
        w, h = w[:, perm], h[perm][:, perm]
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    d = torch.diagonal(h)
    d += damp * d.mean()
    hinv = _inverse_cholesky_upper(h)
    del h, d

    elem = spec.elem
    out = torch.empty_like(w)
    for i1 in range(0, k, lazy_block):
        i2 = min(i1 + lazy_block, k)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        e = None
        for j in range(i2 - i1):
            if j % block_size == 0:
                blk = w1[:, j : j + block_size].unsqueeze(1)  # [N, 1, 32]: the block as it is now
                e = shared_exponents(blk, elem, spec.scale_rule)[0].squeeze(1)
                e = e.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)
            col = w1[:, j]
            q = _round_column(col, e, elem)
            out[:, i1 + j] = q
            err = (col - q) / hinv1[j, j]
            w1[:, j:] -= err.unsqueeze(1) * hinv1[j, j:].unsqueeze(0)
            err1[:, j] = err
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    if perm is not None:
        out[:, perm] = out.clone()
    return out


def _inverse_cholesky_upper(h: torch.Tensor) -> torch.Tensor:
    """Upper Cholesky factor of H⁻¹, with more damping if H is not positive definite."""
    mean = float(torch.diagonal(h).mean())
    for extra in (0.0, 1e-3, 1e-2, 1e-1, 1.0):
        hd = h
        if extra:
            hd = h.clone()
            torch.diagonal(hd).add_(extra * mean)
        l_, info = torch.linalg.cholesky_ex(hd)
        del hd
        if int(info) == 0:
            hinv = torch.cholesky_inverse(l_)
            del l_
            u, info = torch.linalg.cholesky_ex(hinv, upper=True)
            if int(info) == 0:
                return u
    raise GPTQError("the calibration Hessian is not positive definite even with 100 % damping")


@dataclass(frozen=True)
class Rounding:
    """How ``gptq_model`` rounds (its arguments of that name; ``expert_min_tokens`` and
    ``experts_all_tokens`` for the experts)."""

    damp: float
    act_order: bool
    quantized_inputs: bool
    expert_min_tokens: float
    experts_all_tokens: bool
    block_size: int


def output_errors(w: torch.Tensor, wq: torch.Tensor, h: torch.Tensor, spec: TensorSpec, block_size: int,
            rows: int = 2048) -> tuple[float, float]:  # fmt: skip
    """‖(W − Ŵ)Xᵀ‖² / ‖WXᵀ‖² from H = XᵀX, for GPTQ's Ŵ and for round-to-nearest, a few rows at a
    time in float32 (MX rounding is per row, so the chunks change no value; memory stays bounded)."""
    def err(wi: torch.Tensor, q: torch.Tensor) -> float:
        d = wi - q
        return float(((d @ h) * d).sum())

    g = r = den = 0.0
    for i in range(0, w.shape[0], rows):
        wi = w[i : i + rows].float()
        den += float(((wi @ h) * wi).sum())
        g += err(wi, wq[i : i + rows])
        r += err(wi, fake_quantize_mx(wi, -1, spec.elem, block_size, spec.scale_rule))
    return (g / den, r / den) if den > 0 else (0.0, 0.0)
