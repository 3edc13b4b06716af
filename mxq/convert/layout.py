"""The converter's layout: every output tensor planned before a byte is written.

``plan_layout`` builds the model on the meta device to learn its Linear layers, experts modules,
head and input embedding, matches them to the source's tensors (``experts_on_disk``: fused 3-D or
numbered per-expert tensors), selects them by the recipe, applies a calibration plan's per-layer
choices, and lists the output tensors in source order (``ConversionLayout``). ``check_format`` refuses
what an output format cannot hold; ``warn_unshardable`` and ``parameter_shares`` feed the report.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mxq.checkpoint.config import LayerSelectionError, LinearLayer, select_layers
from mxq.checkpoint.files import DTYPE_NAMES, PlannedTensor
from mxq.convert.source import ConversionError, TensorSource, error_line
from mxq.recipe import Recipe, TensorSpec

__all__ = ["ConversionLayout", "ExpertTensor", "plan_layout", "check_format", "experts_on_disk",
           "warn_unshardable", "parameter_shares"]  # fmt: skip

@dataclass
class ConversionLayout:
    """What the conversion writes: the quantized Linear layers (``chosen``, with their ``specs``),
    the kept layers and matrices with their reasons, the output tensors in order (``layout``), the
    input embedding's choice, and the routed experts: each quantized expert tensor on disk ->
    ``ExpertTensor``, and each experts module's config entry."""

    chosen: set[str]
    kept: dict[str, str]
    layout: list[PlannedTensor]
    specs: dict
    embedding: object = None
    expert_tensors: dict[str, ExpertTensor] = field(default_factory=dict)
    experts: dict[str, dict] = field(default_factory=dict)
    experts_disk: dict[str, list[str]] = field(default_factory=dict)  # every experts module's source tensors


@dataclass(frozen=True)
class ExpertTensor:
    module: str
    spec: TensorSpec
    transposed: bool  # a fused [E, K, N] tensor, written [E, N, K]
    scale_name: str


def _skeleton(config):
    """The model built on the meta device: its weight-matrix layers by role (``mxq.runtime.experts.structure``),
    its experts modules, the name of its output head, its input embedding
    (``mxq.runtime.embedding.EmbeddingLayer`` with the tied head, or None) and every parameter name."""
    from transformers import AutoModelForCausalLM

    from mxq.runtime.embedding import embedding_layer
    from mxq.runtime.experts import experts_layers, structure

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as e:  # noqa: BLE001 - a config.json the architecture cannot be built from fails in many ways
        raise ConversionError(f"architecture {getattr(config, 'model_type', '?')!r} is not a causal LM transformers can build ({error_line(e)})") from None
    head = model.get_output_embeddings()
    heads = [n for n, m in model.named_modules() if m is head]
    emb = model.get_input_embeddings()
    return structure(model, getattr(emb, "weight", None)), experts_layers(model), heads, embedding_layer(model)


def experts_on_disk(info, weights: dict) -> tuple[str, list[str]] | None:
    """Where an experts module's weights are in the source: ("fused", [3-D tensor per projection])
    or ("per_expert", [2-D tensor names ending in .weight]); None when neither layout is there.
    Per-expert names are found under the module's decoder layer with any block name (Mixtral's
    checkpoints say ``block_sparse_moe`` where the model says ``mlp``). Both layouts at once is
    refused, as is an incomplete one: the converter would write one and copy the other, and
    transformers fails to load the two side by side or drops one of them without a word (which
    one is meant cannot be told). Every
    check costs what the checkpoint lists, never what the config's expert count says (that count
    may be wrong: a per-expert name set built from it would be as large as it says)."""
    fused = [f"{info.name}.{p}" for p in info.projections]
    layer, _, rest = info.name.rpartition(".")
    layer = layer.rpartition(".")[0]
    pat = re.compile(rf"^{re.escape(layer)}\.[^.]+\.{re.escape(rest)}\.(\d+)\.([^.]+)\.weight$")
    found = sorted(n for n in weights if pat.match(n))
    present = [n for n in fused if n in weights]
    if present and found:
        raise ConversionError(f"{info.name}: the checkpoint holds these experts in two layouts, fused {present[0]} and "
                              f"per expert {found[0]}; keep one of them")  # fmt: skip
    if present:
        if len(present) < len(fused):
            missing = next(n for n in fused if n not in weights)
            why = f"the checkpoint's fused experts are incomplete: {present[0]} without {missing}"
            raise ConversionError(f"{info.name}: {why}")
        for n, (nn_, k) in zip(fused, info.shapes, strict=True):
            want = (info.num_experts, k, nn_) if info.transposed else (info.num_experts, nn_, k)
            if tuple(weights[n][1]) != want:
                raise ConversionError(f"tensor {n}: shape {list(weights[n][1])}, but the model's config makes it {list(want)}")
        return "fused", fused
    if not found:
        return None
    gated = info.projections[0] == "gate_up_proj"
    (n_up, k_up), (n_down, k_down) = info.shapes
    shapes = {(n_up // 2 if gated else n_up, k_up), (n_down, k_down)}
    projs, experts = set(), set()
    for n in found:
        e, proj = pat.match(n).groups()
        projs.add(proj)
        experts.add(int(e))
        if tuple(weights[n][1]) not in shapes:
            raise ConversionError(f"tensor {n}: shape {list(weights[n][1])}, but the model's config makes an expert's "
                                  f"projections {' or '.join(str(list(x)) for x in sorted(shapes))}")  # fmt: skip
    prefix = f"{layer}.{found[0][len(layer) + 1 :].split('.')[0]}.{rest}."
    n_experts, names = info.num_experts, set(found)
    def outside(n: str) -> bool:  # under another block, or an expert past the config's count
        return not n.startswith(prefix) or int(pat.match(n).group(1)) >= n_experts

    extra = next((n for n in found if outside(n)), None)
    missing = None
    if extra is None and len(found) < n_experts * len(projs):
        # every name found is an expected one, so one is missing among the first len(found) experts
        missing = next(f"{prefix}{e}.{p}.weight" for e in range(n_experts) for p in sorted(projs)
                       if f"{prefix}{e}.{p}.weight" not in names)  # fmt: skip
    if missing or extra or len(projs) != len(info.projections) + gated:
        why = (f"missing {missing}" if missing else f"{extra} is not one of its {n_experts} experts" if extra
               else f"projections {sorted(projs)}, expected {len(info.projections) + gated}")  # fmt: skip
        if len(experts) != n_experts:
            why += f" (the model's config makes {n_experts} experts, the checkpoint holds {len(experts)})"
        raise ConversionError(f"{info.name}: the checkpoint's experts are incomplete or inconsistent: {why}")
    return "per_expert", found


def plan_layout(src: TensorSource, recipe: Recipe, warn: Callable[[str], None], cplan=None) -> ConversionLayout:
    """Every output tensor of the conversion: the layers from the model's structure (built on the
    meta device) matched to the source's tensors, selected by the recipe, adjusted by the
    calibration plan, then the input embedding and the routed experts; the layout in source order."""
    structure, moe, heads, emb = _skeleton(src.config)
    weights = {name: (dtype, shape) for name, dtype, shape in src.tensors}
    fp8 = next((n for n, (d, _s) in weights.items() if d.startswith("F8_")), None)
    if fp8 is not None:  # an fp8 tensor would be copied without scales, a router among them
        raise ConversionError(f"tensor {fp8}: already stored as {weights[fp8][0]}; mxq quantize needs a bf16/fp16/fp32 model")
    layers, on_disk = _layers_on_disk(structure, moe, weights, warn)
    if not any(lay.role in ("linear", "experts") and lay.name not in heads for lay in layers):
        raise ConversionError(
            f"architecture {getattr(src.config, 'model_type', '?')!r} has no torch.nn.Linear layers or experts "
            "besides its output head: nothing to quantize"
        )
    try:
        selected, kept = select_layers(layers, recipe, warn)
    except LayerSelectionError as e:
        raise ConversionError(str(e)) from None
    kept.update({name: why for name, why in on_disk.items() if isinstance(why, str)})
    chosen_experts = [n for n in selected if n in moe]
    chosen = set(selected) - set(chosen_experts)
    if not chosen and not chosen_experts:
        raise ConversionError("no Linear layer or experts module is selected for quantization (check the recipe's include/exclude)")
    specs = {m: (recipe.weights, recipe.activations) for m in chosen}
    if cplan is not None:
        _apply_calibration(cplan, {lay.name for lay in structure if lay.role == "linear"}, chosen, kept, specs)
    emb_choice = _plan_embedding(emb, recipe, warn, weights)
    if emb_choice is not None:
        if emb_choice.kept:
            kept[emb.name] = emb_choice.kept
        chosen.update(emb_choice.layers())
        specs.update(emb_choice.layers())
        for head in emb_choice.tied():  # a tied head shares the embedding's tensors: one copy, not kept
            kept.pop(head, None)
            src.tensors = [t for t in src.tensors if t[0] != head + ".weight"]
    plan = ConversionLayout(chosen, kept, [], {m: specs[m] for m in chosen}, emb_choice)
    plan.experts_disk = {m: where[1] for m, where in on_disk.items() if not isinstance(where, str)}
    for m in chosen_experts:
        _plan_experts(plan, moe[m], on_disk[m], recipe)
    plan.layout = _layout(src, plan, recipe)
    _warn_uncovered(src, plan, structure, moe, heads, emb, warn)
    return plan


def check_format(fmt: str, recipe: Recipe, plan: ConversionLayout) -> None:
    """What the output format cannot hold of a finished plan, refused before any tensor is
    converted: compressed-tensors records one format for every layer and stores experts as one
    Linear per expert, so per-layer formats and fused 3-D experts need --format mxq."""
    if fmt != "compressed-tensors":
        return
    embs = set(plan.embedding.layers()) if plan.embedding is not None else set()
    if any(w.elem != recipe.weights.elem or (a != recipe.activations and m not in embs) for m, (w, a) in plan.specs.items()):
        raise ConversionError("--format compressed-tensors: the plan sets per-layer formats, which that layout cannot record; use --format mxq")
    fused = sorted(m for m, d in plan.experts.items() if d["layout"] == "fused")
    if fused:
        raise ConversionError(
            f"--format compressed-tensors: {fused[0]} holds its experts as fused 3-D tensors, which that layout "
            "stores only one Linear per expert; use --format mxq"
        )


def _layers_on_disk(structure, moe, weights: dict, warn) -> tuple[list[LinearLayer], dict]:
    """The model's layers as selection sees them, with the source's shapes and dtypes, and where
    each experts module's tensors are on disk (``experts_on_disk``; a reason string where mxq
    cannot read them, and the module then stays as it is)."""
    from mxq.checkpoint.config import ROLE_EXPERTS

    layers, on_disk = [], {}
    for lay in structure:
        if lay.role == ROLE_EXPERTS:
            where = experts_on_disk(moe[lay.name], weights)
            if where is None:
                why = "experts stored in a layout mxq does not read (neither fused 3-D nor numbered per-expert tensors)"
                warn(f"keeping {lay.name} in its original dtype: {why}")
                on_disk[lay.name] = why
                layers.append(LinearLayer(lay.name, lay.shape, role="custom_linear"))
            else:
                on_disk[lay.name] = where
                layers.append(LinearLayer(lay.name, lay.shape, weights[where[1][0]][0], role=ROLE_EXPERTS, ks=lay.ks))
        elif lay.role != "linear" or lay.tied:
            layers.append(lay)
        elif lay.name + ".weight" in weights:
            dtype, shape = weights[lay.name + ".weight"]
            layers.append(LinearLayer(lay.name, tuple(shape), dtype))
        else:
            layers.append(LinearLayer(lay.name, tied="tied to another tensor (not in the checkpoint)"))
    return layers, on_disk


def _apply_calibration(cplan, linears: set[str], chosen: set, kept: dict, specs: dict) -> None:
    """The calibration plan's per-layer choices: its specs replace the recipe's, its kept layers
    leave ``chosen`` for ``kept``; a plan that names a layer the model lacks is refused."""
    for m in sorted(chosen):
        lp = cplan.layers.get(m)
        if lp is None:
            raise ConversionError(f"plan: layers: no entry for {m!r}, which the recipe quantizes (a plan for another model?)")
        if lp.keep_bf16:
            chosen.discard(m)
            kept[m] = f"kept in bf16 by the calibration plan: {lp.reason}"
        else:
            specs[m] = (lp.weights, lp.activations)
    for m in cplan.layers:
        if m not in linears:
            raise ConversionError(f"plan: layers[{m!r}]: the model has no Linear layer of this name")


def _plan_experts(plan: ConversionLayout, info, where: tuple[str, list[str]], recipe: Recipe) -> None:
    """One quantized experts module: each of its source tensors and the config entry."""
    from mxq.checkpoint.config import experts_entry

    layout_kind, names = where
    transposed = info.transposed and layout_kind == "fused"  # per-expert tensors are [N, K] already
    for n in names:
        plan.expert_tensors[n] = ExpertTensor(info.name, recipe.weights, transposed, n + "_scale")
    stored = None if layout_kind == "fused" else sorted({re.sub(r"\.(\d+)\.([^.]+)\.weight$", r".{e}.\2", n) for n in names})
    plan.experts[info.name] = experts_entry(info, recipe.weights, recipe.activations, stored)


def _layout(src: TensorSource, plan: ConversionLayout, recipe: Recipe) -> list[PlannedTensor]:
    """The output tensors in source order: a quantized weight becomes fp8 codes plus its scales
    (a fused experts tensor [E, N, K], K last), everything else keeps its dtype and shape."""
    layout = []
    for name, dtype, shape in src.tensors:
        mod = name[: -len(".weight")] if name.endswith(".weight") else None
        et = plan.expert_tensors.get(name)
        if mod in plan.chosen:
            n, k = shape
            layout.append(PlannedTensor(name, DTYPE_NAMES[plan.specs[mod][0].elem.torch_dtype], (n, k)))
            layout.append(PlannedTensor(mod + ".weight_scale", "U8", (n, k // recipe.block_size)))
        elif et is not None:
            shape = (shape[0], shape[2], shape[1]) if et.transposed else tuple(shape)
            layout.append(PlannedTensor(name, DTYPE_NAMES[et.spec.elem.torch_dtype], shape))
            layout.append(PlannedTensor(et.scale_name, "U8", (*shape[:-1], shape[-1] // recipe.block_size)))
        else:
            layout.append(PlannedTensor(name, dtype, tuple(shape)))
    return layout


_PROJECTION = re.compile(r"proj|^w\d+$|^fc\d*$|dense|linear")


def _warn_uncovered(src: TensorSource, plan: ConversionLayout, layers, moe, heads, emb, warn) -> None:
    """Every floating-point matrix that no rule covers (not a Linear layer, experts module, router,
    gate, head or embedding) stays in its dtype and is listed as kept with the reason, so the
    summary and the report name it; one that looks like a projection (by its module's name) is
    also a warning: a layer mxq may be missing."""
    covered = {lay.name for lay in layers} | set(heads) | set(moe)
    if emb is not None:
        covered.add(emb.name)
    experts_disk = {n for names in plan.experts_disk.values() for n in names}
    routers = ("gate", "router")  # a router's name on disk can differ from the model's (Mixtral)
    for name, dtype, shape in src.tensors:
        if len(shape) < 2 or dtype not in ("F32", "F16", "BF16") or name in plan.expert_tensors or name in experts_disk:
            continue
        mod = name.rpartition(".")[0] if name.endswith((".weight", ".bias")) else name
        leaf = mod.rpartition(".")[2]
        if mod in covered or any(name.startswith(m + ".") for m in moe) or (moe and leaf in routers):
            continue
        if _PROJECTION.search(leaf):
            why = "looks like a projection, but no rule covers it (not a Linear layer, experts module, router or embedding)"
            warn(f"keeping {name} {list(shape)} in {dtype}: {why}")
        else:
            why = "not a Linear layer, experts module or embedding: kept as it is"
        plan.kept[name] = why


def _plan_embedding(emb, recipe: Recipe, warn, weights: dict):
    """The input embedding's choice (``mxq.runtime.embedding.select_embedding``; None without one in the
    source): whether it is quantized (its ``layers()``, no activations), why not (``kept``), and the
    heads tied to it (``tied()``: they share its tensors). ``plan_layout`` applies it."""
    from mxq.runtime.embedding import EmbeddingLayer, select_embedding

    if emb is None or emb.name + ".weight" not in weights:
        return None
    dtype, shape = weights[emb.name + ".weight"]
    try:
        return select_embedding(EmbeddingLayer(emb.name, tuple(shape), dtype, emb.head), recipe, warn)
    except LayerSelectionError as e:
        raise ConversionError(str(e)) from None


def warn_unshardable(src: TensorSource, layout: list[PlannedTensor], warn) -> dict[int, list[str]]:
    """Tensor parallelism of degree 2, 4 or 8 that some quantized weight would not survive (a
    row-parallel K whose per-rank slice breaks a 32-element block, ``mxq.runtime.tp``): one warning per
    degree naming the weights; the same lists for the report."""
    from mxq.runtime.tp import failures

    text = src.config.get_text_config() if hasattr(src.config, "get_text_config") else src.config
    plan = getattr(text, "base_model_tp_plan", None)
    weights = {t.name: t.shape for t in layout if t.dtype in ("F8_E4M3", "F8_E5M2")}
    out = {}
    for tp, bad in failures(weights, plan).items():
        names = ", ".join(f"{b.name} ({b.why})" for b in bad[:3]) + (f", ... ({len(bad)} in all)" if len(bad) > 3 else "")
        warn(f"tensor parallelism {tp} would not shard {len(bad)} quantized weight(s) in serving engines: {names}")
        out[tp] = [b.name for b in bad]
    return out


def parameter_shares(src: TensorSource, plan: ConversionLayout) -> dict:
    """The share of the model's parameters written in MX, of all and of the routed experts'."""
    sizes = {name: torch.Size(shape).numel() for name, _d, shape in src.tensors}
    experts = sum(sizes[n] for names in plan.experts_disk.values() for n in names)
    experts_q = sum(sizes[n] for n in plan.expert_tensors)
    quantized = experts_q + sum(sizes.get(m + ".weight", 0) for m in plan.chosen)
    total = sum(sizes.values())
    return {
        "parameters": total, "quantized": quantized, "quantized_share": quantized / max(total, 1),
        "expert_parameters": experts, "experts_quantized_share": experts_q / experts if experts else None,
    }
