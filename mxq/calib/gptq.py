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

Routed experts (``mxq.runtime.experts``: one module holding every expert as 3-D parameters) are rounded in
the same pass, expert by expert and projection by projection, each an [N, K] problem of its own:
``gate_up_proj`` (or ``up_proj``) on the hidden states of the tokens the model's own router sent
to that expert, then ``down_proj`` on those tokens' gated intermediate as the expert computes it
with its already rounded ``gate_up`` (W8A8: the input MX-rounded, as inference does). An expert's
projection that saw fewer than ``EXPERT_MIN_TOKENS``·K tokens is cast directly instead: with fewer
tokens than K its Hessian is singular and GPTQ fits the codes to the directions the few tokens
happened to span. Measured on SmolLM2-135M's MLP inputs (wikitext-2, GPTQ on n tokens, output
error on 4096 others): GPTQ's held-out error was 1.0-1.3x nearest's for n <= K (worst near K/2),
0.80-0.97x at 1.25·K and 0.56-0.94x at 1.5·K. ``experts_all_tokens`` builds every expert's
Hessians from every calibration token instead (the layer's output still follows the router), so
that no expert is starved.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from mxq.calib.gptq_core import (
    EXPERT_MIN_TOKENS,
    LAZY_BLOCK,
    GPTQError,
    Rounding,
    gptq_mx,
    hessian,
    output_errors,
)
from mxq.calib.gptq_experts import (
    ExpertsInputs,
    capture_experts,
    expert_codes,
    is_experts_module,
    round_experts,
    router_of,
    swap_in_mx_experts,
)
from mxq.formats import fake_quantize_mx
from mxq.progress import progress_bar
from mxq.recipe import TensorSpec

__all__ = ["GPTQError", "GPTQResult", "LayerInputs", "decoder_layers", "gptq_mx", "gptq_model", "hessian", "EXPERT_MIN_TOKENS"]



# --- the model, decoder layer by decoder layer -----------------------------------------------------

@dataclass
class GPTQResult:
    """What ``gptq_model`` did: per layer, the output error of GPTQ and of round-to-nearest; per
    experts module, what each expert received and how each of its projections was rounded."""

    layers: dict[str, dict] = field(default_factory=dict)  # name -> {"gptq_err", "rtn_err", "seconds"}
    seconds: float = 0.0
    tokens: int = 0
    # name -> {"tokens": routed tokens per expert, "hessian_tokens": per expert, "seconds",
    #          "projections": {proj: {"rounding": ["gptq" | "nearest"] per expert, "gptq_err", "rtn_err"}}}
    experts: dict[str, dict] = field(default_factory=dict)
    expert_min_tokens: float = EXPERT_MIN_TOKENS
    experts_all_tokens: bool = False

    def summary(self) -> dict:
        g = [v["gptq_err"] for v in self.layers.values()]
        r = [v["rtn_err"] for v in self.layers.values()]
        ratio = [a / b for a, b in zip(g, r) if b > 0]
        out = {
            "layers": len(self.layers), "tokens": self.tokens, "seconds": round(self.seconds, 1),
            "mean_error_ratio_gptq_over_nearest": sum(ratio) / len(ratio) if ratio else None,
        }
        if self.experts:
            out["experts"] = self.experts_summary()
        return out

    def experts_summary(self) -> dict:
        """How the routed experts were rounded: per projection, how many experts got GPTQ and how
        many were cast directly for want of tokens."""
        gptq: dict[str, int] = {}
        nearest: dict[str, int] = {}
        ratio, tokens = [], []
        for st in self.experts.values():
            tokens += st["tokens"]
            for proj, d in st["projections"].items():
                gptq[proj] = gptq.get(proj, 0) + d["rounding"].count("gptq")
                nearest[proj] = nearest.get(proj, 0) + d["rounding"].count("nearest")
                ratio += [a / b for a, b in zip(d["gptq_err"], d["rtn_err"]) if a is not None and b]
        tokens.sort()
        return {
            "modules": len(self.experts), "experts": len(tokens), "all_tokens": self.experts_all_tokens,
            "min_tokens_per_k": self.expert_min_tokens, "gptq": gptq, "nearest": nearest,
            "routed_tokens_per_expert": {"min": tokens[0], "median": tokens[len(tokens) // 2], "max": tokens[-1]} if tokens else None,
            "mean_error_ratio_gptq_over_nearest": sum(ratio) / len(ratio) if ratio else None,
        }


class _Stop(Exception):
    pass


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's decoder layers (``model.model.layers``), in order; refused in one line if absent."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise GPTQError(f"{type(model).__name__}: GPTQ runs decoder layers in order and found no model.layers")
    return layers


def _groups(layer: nn.Module, prefix: str, specs: dict) -> list[list[tuple[str, nn.Linear]]]:
    """The layer's rounded Linear modules, grouped by shared input (q/k/v, gate/up: one problem)."""
    from mxq.runtime.linear import SIBLINGS

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


def _quantize_input_hook(act: TensorSpec, block_size: int):
    def hook(mod, args):
        x = args[0]
        return (fake_quantize_mx(x, -1, act.elem, block_size, act.scale_rule), *args[1:])

    return hook


def _round_group(group: list[tuple[str, nn.Linear]], h: torch.Tensor, spec: TensorSpec, how: Rounding) -> dict[str, dict]:
    """GPTQ over Linear layers that read one input (their rows stacked), in place; per layer: the
    group's output errors, GPTQ and nearest, and its share of the time."""
    t0 = time.perf_counter()
    w = torch.cat([lin.weight.detach() for _, lin in group])  # in the model's dtype
    wq = gptq_mx(w, h, spec, block_size=how.block_size, damp=how.damp, act_order=how.act_order)
    g_err, r_err = output_errors(w, wq, h, spec, how.block_size)
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
    experts_all_tokens: bool = False,
    expert_min_tokens: float = EXPERT_MIN_TOKENS,
    block_size: int = 32,
) -> GPTQResult:
    """Round the weights of the Linear layers and experts modules in ``specs`` (name -> (weights,
    activations)) with GPTQ, in place: afterwards ``model`` holds the rounded values in its own
    dtype, and direct cast with the same specs (``mxq.quantize_model``, the converter) reproduces
    the GPTQ codes.

    Decoder layers run in order on ``batches`` (token ids [B, T]); a rounded layer's activations
    are MX-rounded as W8A8 inference would (``specs``' activations) when it produces the next
    layer's inputs. ``offload``: keep the decoder layers on the host and move one at a time to
    ``device`` (the device then holds one layer, its Hessians and working copy, the calibration
    activations, and the model's other modules: embedding, norm, head). An ``lm_head``
    in ``specs`` is rounded last, on the final normed hidden states. With ``offload`` the decoder
    layers are left on the host. ``quantized_inputs``: build each Hessian from the MX-rounded
    inputs the W8A8 layer will see (its activations spec) instead of the exact ones. ``act_order``:
    as in ``gptq_mx``. ``block_size``: the MX block (the recipe's).

    Experts modules (module doc): every expert's projection with at least ``expert_min_tokens``·K
    calibration tokens gets GPTQ, the others direct cast (``GPTQResult.experts`` says which);
    ``experts_all_tokens``: every expert's Hessians from every token. A rounded layer's output
    then comes from ``MXExperts`` over the rounded codes, as inference computes it. Memory, beyond
    the dense layers': the inputs each experts module received (the calibration tokens' hidden
    states in the model's dtype, as large as the layer activations held anyway, and their expert
    ids), one expert's rows and intermediate at a time, one K×K float32 Hessian at a time with
    ``gptq_mx``'s factors of it (about 4·K²·4 bytes: 64 MiB at K = 2048), and during the output
    pass the module's codes in MX (about half its bf16 size). Per-expert Hessians are never held
    together (E·K²·4 bytes would be 2 GiB for Qwen3-30B-A3B's 128 experts at K = 2048).
    """
    t0 = time.perf_counter()
    layers = decoder_layers(model)
    device = torch.device(device) if device is not None else next(layers[0].parameters()).device
    names = {id(m): n for n, m in model.named_modules()}
    _check_specs(model, specs)
    _place(model, layers, device, offload)
    inputs = LayerInputs.capture(model, layers[0], batches, device)
    how = Rounding(damp, act_order, quantized_inputs, expert_min_tokens, experts_all_tokens, block_size)
    result = GPTQResult(tokens=sum(b.numel() for b in batches), expert_min_tokens=expert_min_tokens,
                        experts_all_tokens=experts_all_tokens)
    with progress_bar("gptq {task.fields[layer]}", enabled=progress) as bar:
        task = bar.add_task("gptq", total=len(specs), layer="")
        run = _Pass(model, specs, how, inputs, result, lambda n, layer: bar.update(task, advance=n, layer=layer))
        for i, layer in enumerate(layers):
            if offload:
                layer.to(device)
            run.decoder_layer(layer, names[id(layer)])
            if offload:
                layer.to("cpu")
            if on_layer is not None:
                on_layer(i)
        run.head(names.get(id(model.get_output_embeddings())))
    result.seconds = time.perf_counter() - t0
    return result


def _check_specs(model: nn.Module, specs: dict) -> None:
    unknown = sorted(set(specs) - {n for n, m in model.named_modules() if isinstance(m, nn.Linear) or is_experts_module(m)})
    if unknown:
        raise GPTQError(f"GPTQ: {unknown[0]!r} is not a Linear layer or experts module of {type(model).__name__}")


def _place(model: nn.Module, layers: nn.ModuleList, device: torch.device, offload: bool) -> None:
    """The whole model on ``device``; with ``offload`` all but the decoder layers, which wait on the
    host for their turn."""
    if not offload:
        model.to(device)
        return
    for child in model.children():
        if child is not model.model:
            child.to(device)
    for child in model.model.children():
        if child is not layers:
            child.to(device)
    layers.to("cpu")


class LayerInputs:
    """The current decoder layer's inputs for every batch: the hidden states, replaced by each
    layer's outputs as the rounded model computes them, and the other arguments (mask, positions),
    which every decoder layer takes alike."""

    def __init__(self, captured: list[tuple[tuple, dict]]):
        self.hidden = [a[0] if a else k["hidden_states"] for a, k in captured]
        self.extra = [(a[1:], {kk: v for kk, v in k.items() if kk != "hidden_states"}) for a, k in captured]

    @classmethod
    def capture(cls, model: nn.Module, first: nn.Module, batches: list[torch.Tensor], device: torch.device) -> LayerInputs:
        """The inputs of decoder layer ``first`` for every batch (the rest of the forward is cut off)."""
        captured: list[tuple[tuple, dict]] = []

        def grab(mod, args, kwargs):
            captured.append((args, kwargs))
            raise _Stop

        hk = first.register_forward_pre_hook(grab, with_kwargs=True)
        try:
            for b in batches:
                try:
                    model(input_ids=b.to(device), use_cache=False)
                except _Stop:
                    pass
        finally:
            hk.remove()
        return cls(captured)

    def run(self, layer: nn.Module) -> None:
        """Every batch through ``layer``, for the hooks on it; the outputs are dropped."""
        for h, (a, k) in zip(self.hidden, self.extra):
            layer(h, *a, **k)

    def advance(self, layer: nn.Module) -> None:
        """``layer``'s outputs become the next layer's inputs."""
        for j, (h, (a, k)) in enumerate(zip(self.hidden, self.extra)):
            out = layer(h, *a, **k)
            self.hidden[j] = out[0] if isinstance(out, tuple) else out


def _accumulate_hessian(lin: nn.Linear, name: str, hs: dict[str, torch.Tensor], act: TensorSpec | None, block_size: int):
    """A hook adding XᵀX of ``lin``'s input (MX-rounded first under ``act``) to ``hs[name]``."""
    def acc(mod, args):
        x = args[0] if act is None else fake_quantize_mx(args[0], -1, act.elem, block_size, act.scale_rule)
        h = hessian(x)
        hs[name] = hs[name] + h if name in hs else h

    return lin.register_forward_pre_hook(acc)


@dataclass
class _Pass:
    """``gptq_model``'s pass over the decoder layers: what rounding one layer reads and writes."""

    model: nn.Module
    specs: dict[str, tuple[TensorSpec, TensorSpec | None]]
    how: Rounding
    inputs: LayerInputs
    result: GPTQResult
    advance: Callable[[int, str], None]  # the progress bar: how many layers done, the last one's name

    def decoder_layer(self, layer: nn.Module, prefix: str) -> None:
        """Round the layer's Linear layers and experts modules, then compute its outputs as rounded."""
        groups = _groups(layer, prefix, self.specs)
        experts = [(f"{prefix}.{n}", m) for n, m in layer.named_modules() if f"{prefix}.{n}" in self.specs and is_experts_module(m)]
        if groups or experts:
            self._round(layer, groups, experts)
        self._forward_rounded(layer, prefix, experts)

    def _round(self, layer: nn.Module, groups: list[list[tuple[str, nn.Linear]]], experts: list[tuple[str, nn.Module]]) -> None:
        """One run of the layer's inputs fills every Hessian (dense) and every expert's rows; then
        each group, then each experts module, is rounded."""
        hs: dict[str, torch.Tensor] = {}
        seen: dict[str, ExpertsInputs] = {}
        hooks = []
        for name, mod in experts:
            seen[name] = ExpertsInputs(int(mod._parameters["down_proj"].shape[0]), self.how.experts_all_tokens)
            hooks += capture_experts(mod, seen[name], router_of(self.model, name))
        for group in groups:
            name, lin = group[0]
            act = self.specs[name][1] if self.how.quantized_inputs else None
            hooks.append(_accumulate_hessian(lin, name, hs, act, self.how.block_size))
        try:
            self.inputs.run(layer)
        finally:
            for hk in hooks:
                hk.remove()
        for group in groups:
            name = group[0][0]
            self.result.layers.update(_round_group(group, hs.pop(name), self.specs[name][0], self.how))
            self.advance(len(group), group[-1][0])
        for name, mod in experts:
            self.result.experts[name] = round_experts(name, mod, seen.pop(name), self.specs[name], self.how)
            self.advance(1, name)

    def _forward_rounded(self, layer: nn.Module, prefix: str, experts: list[tuple[str, nn.Module]]) -> None:
        """This layer's outputs, as the rounded model computes them, feed the next layer."""
        specs, bs = self.specs, self.how.block_size
        act_hooks = [
            lin.register_forward_pre_hook(_quantize_input_hook(specs[f"{prefix}.{n}"][1], bs))
            for n, lin in layer.named_modules()
            if isinstance(lin, nn.Linear) and f"{prefix}.{n}" in specs and specs[f"{prefix}.{n}"][1] is not None
        ]
        swapped = swap_in_mx_experts(self.model, experts, specs, bs)
        try:
            self.inputs.advance(layer)
        finally:
            for hk in act_hooks:
                hk.remove()
            for name, mod in swapped:
                self.model.set_submodule(name, mod)

    def head(self, head_name: str | None) -> None:
        """An ``lm_head`` in ``specs``, rounded last on the final normed hidden states."""
        if head_name not in self.specs:
            return
        head = self.model.get_output_embeddings()
        emb = self.model.get_input_embeddings()
        if emb is not None and emb.weight is head.weight:
            raise GPTQError(f"{head_name}: tied to the input embedding; round it with the embedding or keep it in bf16")
        norm = getattr(self.model.model, "norm", None)
        h = None
        for x in self.inputs.hidden:
            x = norm(x) if norm is not None else x
            h = hessian(x) if h is None else h + hessian(x)
        self.result.layers.update(_round_group([(head_name, head)], h, self.specs[head_name][0], self.how))
        self.advance(1, head_name)


def round_plan(model: nn.Module, plan, batches: list[torch.Tensor], *, damp: float = 0.01,
               offload: bool = False, progress: bool = True, quantized_inputs: bool = False,
               act_order: bool = False, experts_all_tokens: bool = False,
               expert_min_tokens: float = EXPERT_MIN_TOKENS):  # fmt: skip
    """GPTQ over the layers and experts modules a calibration plan quantizes; the plan then carries
    their codes.

    ``model``: the bf16 model the plan was made from (its weights are overwritten with the rounded
    values; the plan's permutations are folded into it first). The codes and scales are stored in
    ``plan.rounded`` (name -> (fp8 codes, E8M0 bytes)) and, for experts, ``plan.rounded_experts``
    (module -> projection -> (fp8 codes [E, N, K], E8M0 bytes [E, N, K/32])), with each expert's
    rounding in ``plan.experts``; ``save_plan`` writes them beside the plan's JSON and the converter
    writes them instead of direct-cast codes. ``experts_all_tokens``, ``expert_min_tokens``: as in
    ``gptq_model``.
    """
    from mxq.calib.reorder import permute_model

    permute_model(model, plan.permutations)
    specs = {**plan.quantized, **plan.quantized_experts}
    bs = plan.recipe.block_size
    res = gptq_model(model, batches, specs, damp=damp, offload=offload, progress=progress,
                     quantized_inputs=quantized_inputs, act_order=act_order, experts_all_tokens=experts_all_tokens,
                     expert_min_tokens=expert_min_tokens, block_size=bs)  # fmt: skip
    mods = dict(model.named_modules())
    plan.rounded = _layer_codes(plan, mods, res, bs)
    plan.rounded_experts = _experts_codes(plan, mods, res, bs)
    plan.choices["rounding"] = "gptq"
    plan.choices["gptq"] = {"damp": damp, "lazy_block": LAZY_BLOCK, "quantized_inputs": quantized_inputs, "act_order": act_order,
                            **res.summary(),
                            "error_basis": "weights only, on the calibration inputs of each layer (as rounded before it)"}
    return plan


def _layer_codes(plan, mods: dict[str, nn.Module], res: GPTQResult, block_size: int) -> dict:
    """The plan's rounded Linear layers as codes and scales on the host (direct cast of the rounded
    values gives GPTQ's codes); each layer's weight SQNR, GPTQ and nearest, goes to its plan entry."""
    from mxq.formats import quantize_mx

    rounded = {}
    for name, (wspec, _act) in plan.quantized.items():
        q = quantize_mx(mods[name].weight.detach(), -1, wspec.elem, block_size, wspec.scale_rule)
        rounded[name] = (q.data.cpu(), q.scales.cpu())
        st = res.layers.get(name)
        if st is not None and name in plan.layers:
            lp = plan.layers[name]
            lp.sqnr_db["weights_nearest"] = _db(st["rtn_err"])
            lp.sqnr_db["weights_gptq"] = _db(st["gptq_err"])
    return rounded


def _experts_codes(plan, mods: dict[str, nn.Module], res: GPTQResult, block_size: int) -> dict:
    """The plan's rounded experts modules: per projection the codes [E, N, K] and scales on the
    host; the tokens each expert got, how it was rounded and its SQNRs go to the plan's entry."""
    from mxq.runtime.experts import canonical, experts_layer

    rounded = {}
    for name, (wspec, _act) in plan.quantized_experts.items():
        info = experts_layer(name, mods[name])
        rounded[name] = {}
        for proj in info.projections:
            codes, scales = expert_codes(canonical(mods[name]._parameters[proj].detach(), info.transposed), wspec, block_size)
            rounded[name][proj] = (codes.cpu(), scales.cpu())
        st = res.experts[name]
        ep = plan.experts[name]
        ep.tokens = list(st["tokens"])
        ep.rounding = {proj: list(d["rounding"]) for proj, d in st["projections"].items()}
        ep.sqnr_db = {proj: {"weights_nearest": [_db(v) if v is not None else None for v in d["rtn_err"]],
                             "weights_gptq": [_db(v) if v is not None else None for v in d["gptq_err"]]}
                      for proj, d in st["projections"].items()}  # fmt: skip
    return rounded


def _db(rel_err: float) -> float:
    import math

    return 10 * math.log10(1 / rel_err) if rel_err > 0 else math.inf
