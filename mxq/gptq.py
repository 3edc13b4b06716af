"""GPTQ rounding for MX weights: codes chosen jointly against the layer's inputs.

Round-to-nearest picks every fp8 code on its own. GPTQ (Frantar et al., 2022, arXiv 2210.17323)
quantizes a weight matrix W[N, K] one input column at a time and feeds each column's rounding
error into the columns not yet quantized, weighted by the inverse of H = XᵀX, the second moment
of the layer's calibration inputs; the output error ‖(W − Ŵ)Xᵀ‖² falls, the format does not change.

What MX changes: the 32 columns of a 1x32 block share one power-of-two scale per row. The scale
of a block is fixed when the sweep reaches the block's first column, from the weights as they are
then (already moved by the errors of earlier blocks), with the recipe's scale rule; every column
of the block is then rounded to the element grid under that scale. Each row of W is independent of
the others, so sibling projections that read the same input (q/k/v, gate/up) are one problem.

The result Ŵ holds values that are exactly MX-representable (an fp8 code times 2^e; exact in
bf16 too), and direct cast of Ŵ with the same recipe reproduces them bit for bit: a block's
amax is a code times 2^e, so RCEIL picks 2^e or a smaller power at which every element of the
block is again a code, and the MSE search finds that zero-error scale first
(``tests/test_gptq.py`` holds that). The checkpoint is therefore
the standard one; only the chosen codes differ. (Under the ``floor`` and ``even`` rules an E4M3
block whose largest code is 240 would be re-scaled one step lower and clip, so GPTQ takes
``rceil`` and ``mse``, the rules that never clip.)

``gptq_model`` runs the model's decoder layers in order on the calibration batches: each layer's
Hessians come from the outputs of the layers before it *as already rounded* (weights and, for
W8A8, activations), so later layers correct for earlier rounding. Only the layer being rounded
needs to be on the device (``offload=True`` keeps the rest on the host).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

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
from mxq.progress import progress_bar
from mxq.recipe import TensorSpec

__all__ = ["GPTQError", "GPTQResult", "gptq_mx", "gptq_model", "hessian"]

GPTQ_RULES = (ScaleRule.RCEIL, ScaleRule.MSE)
LAZY_BLOCK = 128  # columns updated together (a multiple of the MX block)


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


# --- the model, decoder layer by decoder layer -----------------------------------------------------

@dataclass
class GPTQResult:
    """What ``gptq_model`` did: per layer, the output error of GPTQ and of round-to-nearest."""

    layers: dict[str, dict] = field(default_factory=dict)  # name -> {"gptq_err", "rtn_err", "seconds"}
    seconds: float = 0.0
    tokens: int = 0

    def summary(self) -> dict:
        g = [v["gptq_err"] for v in self.layers.values()]
        r = [v["rtn_err"] for v in self.layers.values()]
        ratio = [a / b for a, b in zip(g, r) if b > 0]
        return {
            "layers": len(self.layers), "tokens": self.tokens, "seconds": round(self.seconds, 1),
            "mean_error_ratio_gptq_over_nearest": sum(ratio) / len(ratio) if ratio else None,
        }


class _Stop(Exception):
    pass


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise GPTQError(f"{type(model).__name__}: GPTQ runs decoder layers in order and found no model.layers")
    return layers


def _groups(layer: nn.Module, prefix: str, specs: dict) -> list[list[tuple[str, nn.Linear]]]:
    """The layer's rounded Linear modules, grouped by shared input (q/k/v, gate/up: one problem)."""
    from mxq.linear import SIBLINGS

    lins = {f"{prefix}.{n}": m for n, m in layer.named_modules() if isinstance(m, nn.Linear) and f"{prefix}.{n}" in specs}
    groups, done = [], set()
    for name, lin in lins.items():
        if name in done:
            continue
        parent, _, leaf = name.rpartition(".")
        group = [(name, lin)]
        for sib in SIBLINGS:
            if leaf == sib[0]:
                for other in sib[1:]:
                    o = f"{parent}.{other}"
                    if o in lins and specs[o] == specs[name]:
                        group.append((o, lins[o]))
        done.update(n for n, _ in group)
        groups.append(group)
    return groups


def _quantize_input_hook(act: TensorSpec):
    def hook(mod, args):
        x = args[0]
        return (fake_quantize_mx(x, -1, act.elem, 32, act.scale_rule), *args[1:])

    return hook


def _errors(w: torch.Tensor, wq: torch.Tensor, h: torch.Tensor, spec: TensorSpec, rows: int = 2048) -> tuple[float, float]:
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
        r += err(wi, fake_quantize_mx(wi, -1, spec.elem, 32, spec.scale_rule))
    return (g / den, r / den) if den > 0 else (0.0, 0.0)


def _round_group(group: list[tuple[str, nn.Linear]], h: torch.Tensor, spec: TensorSpec, damp: float,
                 act_order: bool) -> dict[str, dict]:  # fmt: skip
    """GPTQ over Linear layers that read one input (their rows stacked), in place; per layer: the
    group's output errors, GPTQ and nearest, and its share of the time."""
    t0 = time.perf_counter()
    w = torch.cat([lin.weight.detach() for _, lin in group])  # in the model's dtype
    wq = gptq_mx(w, h, spec, damp=damp, act_order=act_order)
    g_err, r_err = _errors(w, wq, h, spec)
    del w
    row = 0
    for _, lin in group:
        lin.weight.data.copy_(wq[row : row + lin.out_features].to(lin.weight.dtype))
        row += lin.out_features
    secs = round((time.perf_counter() - t0) / len(group), 3)
    return {name: {"gptq_err": g_err, "rtn_err": r_err, "seconds": secs} for name, _ in group}


@torch.inference_mode()
def gptq_model(
    model: nn.Module,
    batches: list[torch.Tensor],
    specs: dict[str, tuple[TensorSpec, TensorSpec | None]],
    *,
    device: torch.device | str | None = None,
    damp: float = 0.01,
    offload: bool = False,
    progress: bool = True,
    on_layer: Callable[[int], None] | None = None,
    quantized_inputs: bool = False,
    act_order: bool = False,
) -> GPTQResult:
    """Round the weights of the Linear layers in ``specs`` (name -> (weights, activations)) with
    GPTQ, in place: afterwards ``model`` holds the rounded values in its own dtype, and direct cast
    with the same specs (``mxq.quantize_model``, the converter) reproduces the GPTQ codes.

    Decoder layers run in order on ``batches`` (token ids [B, T]); a rounded layer's activations
    are MX-rounded as W8A8 inference would (``specs``' activations) when it produces the next
    layer's inputs. ``offload``: keep the decoder layers on the host and move one at a time to
    ``device`` (the device then holds one layer, its Hessians and working copy, the calibration
    activations, and the model's other modules: embedding, norm, head). An ``lm_head``
    in ``specs`` is rounded last, on the final normed hidden states. With ``offload`` the decoder
    layers are left on the host. ``quantized_inputs``: build each Hessian from the MX-rounded
    inputs the W8A8 layer will see (its activations spec) instead of the exact ones. ``act_order``:
    as in ``gptq_mx``.
    """
    t0 = time.perf_counter()
    layers = _decoder_layers(model)
    device = torch.device(device) if device is not None else next(layers[0].parameters()).device
    names = {id(m): n for n, m in model.named_modules()}
    unknown = sorted(set(specs) - {n for n, m in model.named_modules() if isinstance(m, nn.Linear)})
    if unknown:
        raise GPTQError(f"GPTQ: {unknown[0]!r} is not a Linear layer of {type(model).__name__}")
    if offload:
        for child in model.children():
            if child is not model.model:
                child.to(device)
        for child in model.model.children():
            if child is not layers:
                child.to(device)
        layers.to("cpu")
    else:
        model.to(device)

    # Inputs of decoder layer 0 for every batch (the rest of the forward is cut off).
    inputs: list[tuple[tuple, dict]] = []

    def grab(mod, args, kwargs):
        inputs.append((args, kwargs))
        raise _Stop

    hk = layers[0].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        for b in batches:
            try:
                model(input_ids=b.to(device), use_cache=False)
            except _Stop:
                pass
    finally:
        hk.remove()
    hidden = [a[0] if a else k["hidden_states"] for a, k in inputs]
    extra = [(a[1:], {kk: v for kk, v in k.items() if kk != "hidden_states"}) for a, k in inputs]

    result = GPTQResult(tokens=sum(b.numel() for b in batches))
    total = len(specs)
    with progress_bar("gptq {task.fields[layer]}", enabled=progress) as bar:
        task = bar.add_task("gptq", total=total, layer="")
        for i, layer in enumerate(layers):
            if offload:
                layer.to(device)
            prefix = names[id(layer)]
            groups = _groups(layer, prefix, specs)
            hooks = []
            if groups:
                hs: dict[str, torch.Tensor] = {}
                for group in groups:
                    name, lin = group[0]
                    act = specs[name][1] if quantized_inputs else None

                    def acc(mod, args, name=name, hs=hs, act=act):
                        x = args[0] if act is None else fake_quantize_mx(args[0], -1, act.elem, 32, act.scale_rule)
                        h = hessian(x)
                        hs[name] = hs[name] + h if name in hs else h

                    hooks.append(lin.register_forward_pre_hook(acc))
                try:
                    for h_, (a, k) in zip(hidden, extra):
                        layer(h_, *a, **k)
                finally:
                    for hk in hooks:
                        hk.remove()
                for group in groups:
                    result.layers.update(_round_group(group, hs.pop(group[0][0]), specs[group[0][0]][0], damp, act_order))
                    bar.update(task, advance=len(group), layer=group[-1][0])
                del hs
            # This layer's outputs, as the rounded model computes them, feed the next layer.
            act_hooks = [
                lin.register_forward_pre_hook(_quantize_input_hook(specs[f"{prefix}.{n}"][1]))
                for n, lin in layer.named_modules()
                if isinstance(lin, nn.Linear) and f"{prefix}.{n}" in specs and specs[f"{prefix}.{n}"][1] is not None
            ]
            try:
                for j, (h_, (a, k)) in enumerate(zip(hidden, extra)):
                    out = layer(h_, *a, **k)
                    hidden[j] = out[0] if isinstance(out, tuple) else out
            finally:
                for hk in act_hooks:
                    hk.remove()
            if offload:
                layer.to("cpu")
            if on_layer is not None:
                on_layer(i)

        head = model.get_output_embeddings()
        head_name = names.get(id(head))
        if head_name in specs:
            emb = model.get_input_embeddings()
            if emb is not None and emb.weight is head.weight:
                raise GPTQError(f"{head_name}: tied to the input embedding; round it with the embedding or keep it in bf16")
            norm = getattr(model.model, "norm", None)
            h = None
            for x in hidden:
                x = norm(x) if norm is not None else x
                h = hessian(x) if h is None else h + hessian(x)
            result.layers.update(_round_group([(head_name, head)], h, specs[head_name][0], damp, act_order))
            bar.update(task, advance=1, layer=head_name)
    result.seconds = time.perf_counter() - t0
    return result


def round_plan(model: nn.Module, plan, batches: list[torch.Tensor], *, damp: float = 0.01,
               offload: bool = False, progress: bool = True, quantized_inputs: bool = False,
               act_order: bool = False):  # fmt: skip
    """GPTQ over the layers a calibration plan quantizes; the plan then carries their codes.

    ``model``: the bf16 model the plan was made from (its weights are overwritten with the rounded
    values; the plan's permutations are folded into it first). The codes and scales are stored in
    ``plan.rounded`` (name -> (fp8 codes, E8M0 bytes)); ``save_plan`` writes them beside the
    plan's JSON and the converter writes them instead of direct-cast codes.
    """
    from mxq.formats import quantize_mx
    from mxq.reorder import permute_model

    permute_model(model, plan.permutations)
    specs = plan.quantized
    res = gptq_model(model, batches, specs, damp=damp, offload=offload, progress=progress,
                     quantized_inputs=quantized_inputs, act_order=act_order)
    mods = dict(model.named_modules())
    rounded = {}
    for name, (wspec, _act) in specs.items():
        q = quantize_mx(mods[name].weight.detach(), -1, wspec.elem, 32, wspec.scale_rule)
        rounded[name] = (q.data.cpu(), q.scales.cpu())
        st = res.layers.get(name)
        if st is not None and name in plan.layers:
            lp = plan.layers[name]
            lp.sqnr_db["weights_nearest"] = _db(st["rtn_err"])
            lp.sqnr_db["weights_gptq"] = _db(st["gptq_err"])
    plan.rounded = rounded
    plan.choices["rounding"] = "gptq"
    plan.choices["gptq"] = {"damp": damp, "lazy_block": LAZY_BLOCK, "quantized_inputs": quantized_inputs, "act_order": act_order,
                            **res.summary(),
                            "error_basis": "weights only, on the calibration inputs of each layer (as rounded before it)"}
    return plan


def _db(rel_err: float) -> float:
    import math

    return 10 * math.log10(1 / rel_err) if rel_err > 0 else math.inf
