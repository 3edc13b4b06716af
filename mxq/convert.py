"""The converter: a Hugging Face model in, an MXFP8 safetensors checkpoint out, one tensor at a time.

Data path: resolve the source (local directory, hub id, GGUF file, embedded default) ->
build the model skeleton on the meta device to learn which tensors are Linear weights ->
plan every output tensor (with a calibration plan: its per-layer specs and kept layers) (quantized Linear weights become ``weight`` fp8 [N, K] plus
``weight_scale`` uint8 [N, K/32]; everything else passes through) -> stream: read a
tensor, fold the plan's channel permutations into it, quantize it, write it -> config, tokenizer and report -> rename into place.

All output goes to a temporary directory beside OUT that is renamed at the end; a failure or
an interrupt removes it, so OUT is either complete or absent.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from glob import escape as glob_escape
from pathlib import Path

import torch

import mxq
from mxq.checkpoint import (
    DTYPE_NAMES,
    INDEX_NAME,
    PlannedTensor,
    ShardWriter,
    TensorInfo,
    read_index,
    read_tensor,
)
from mxq.config import LayerSelectionError, LinearLayer, native_config, read_config, select_layers
from mxq.formats import quantize_mx, sqnr_db
from mxq.models import ModelSource, ModelSourceError, check_config, resolve_source
from mxq.progress import progress_bar, stage
from mxq.recipe import Recipe, TensorSpec, load_recipe
from mxq.validate import SCALE_DTYPES

FORMATS = ("mxq", "compressed-tensors")
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
)


class ConversionError(RuntimeError):
    """A conversion that cannot proceed; the message names the file, tensor or option."""


@dataclass
class LayerResult:
    name: str
    shape: tuple[int, int]
    sqnr_db: float
    bytes_before: int
    bytes_after: int


@dataclass
class ConversionReport:
    source: str
    out: str
    recipe: str
    format: str
    device: str
    quantized: list[LayerResult] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)
    bytes_before: int = 0
    bytes_after: int = 0
    seconds: float = 0.0
    n_tensors: int = 0
    shares: dict = field(default_factory=dict)  # parameters quantized: all, routed experts (``_shares``)
    tp_unshardable: dict = field(default_factory=dict)  # TP degree -> weights that would not shard (``mxq.tp``)

    @property
    def ratio(self) -> float:
        return self.bytes_before / max(self.bytes_after, 1)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ratio"] = self.ratio
        return d


# --- sources -------------------------------------------------------------------------------------

@dataclass
class TensorSource:
    """Tensors of a model, listed up front and read one at a time: what the converter streams.
    ``quantize_checkpoint`` opens one from a directory, a hub id or a GGUF file; a caller may pass
    its own, e.g. ``TensorSource.from_model(model)`` for a model in memory, or a reader that makes
    each tensor when it is asked for (a checkpoint larger than memory never exists whole)."""

    config: object  # transformers PretrainedConfig
    raw_config: dict
    tensors: list[tuple[str, str, tuple[int, ...]]]  # name, safetensors dtype, shape
    read: Callable[[str], torch.Tensor]
    files_dir: Path | None = None  # where generation config and tokenizer files live (HF directory)
    gguf: ModelSource | None = None
    generation_config: object = None
    label: str = "tensors in memory"

    @classmethod
    def from_model(cls, model, label: str = "") -> TensorSource:
        """The tensors of an in-memory transformers model (its ``state_dict``; a tied head is left
        to the loader, which re-ties it)."""
        sd = model.state_dict()
        if getattr(model.config.get_text_config(), "tie_word_embeddings", False):
            sd.pop("lm_head.weight", None)
        tensors = [(k, DTYPE_NAMES[v.dtype], tuple(v.shape)) for k, v in sd.items()]
        return cls(model.config, model.config.to_dict(), tensors, sd.__getitem__,
                   generation_config=getattr(model, "generation_config", None),
                   label=label or f"{type(model).__name__} in memory")  # fmt: skip


def _open_dir(path: Path) -> TensorSource:
    from transformers import AutoConfig

    raw = read_config(path)
    if raw.get("quantization_config"):
        qm = raw["quantization_config"].get("quant_method") if isinstance(raw["quantization_config"], dict) else None
        raise ConversionError(f"{path}: already quantized (quant_method {qm!r}); mxq quantize needs a bf16/fp16/fp32 model")
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - transformers' and huggingface_hub's many kinds: all a bad config.json
        raise ConversionError(f"{path}/config.json: {' '.join(str(e).split())[:300] or type(e).__name__}") from None
    infos: dict[str, TensorInfo] = read_index(path)
    return TensorSource(
        config, raw, [(i.name, i.dtype, i.shape) for i in infos.values()], lambda n: read_tensor(infos[n]), path
    )


def _open_gguf(src: ModelSource) -> TensorSource:
    from transformers import AutoModelForCausalLM

    # GGUF weights are block-quantized in their own formats: transformers dequantizes the
    # whole file, so this source holds the model in memory (small models only).
    model = AutoModelForCausalLM.from_pretrained(src.path, gguf_file=src.gguf_file, dtype=torch.bfloat16,
                                                 trust_remote_code=False)
    out = TensorSource.from_model(model)
    out.gguf, out.label = src, src.display
    return out


def _open_source(source: str | os.PathLike | TensorSource | None, progress: bool = False) -> tuple[ModelSource, TensorSource]:
    if isinstance(source, TensorSource):
        return ModelSource("memory", "", label=source.label), source
    try:
        src = resolve_source(source)
    except ModelSourceError as e:
        raise ConversionError(str(e)) from None
    if src.kind == "gguf":
        with stage(f"reading {src.display}", enabled=progress):  # transformers dequantizes it whole
            return src, _open_gguf(src)
    if src.kind == "hub":
        try:
            from huggingface_hub import snapshot_download

            local = snapshot_download(
                src.path, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
            )
        except Exception as e:  # noqa: BLE001 - network/auth errors of many kinds
            raise ConversionError(f"{src.path}: cannot fetch from the Hugging Face hub ({_line(e)}); pass a local directory") from None
        try:
            check_config(local)  # a local directory had it from resolve_source
        except ModelSourceError as e:
            raise ConversionError(str(e)) from None
        return src, _open_dir(Path(local))
    return src, _open_dir(Path(src.path))


# --- planning ------------------------------------------------------------------------------------

@dataclass
class _Plan:
    """What the conversion writes: the quantized Linear layers (``chosen``, with their ``specs``),
    the kept layers and matrices with their reasons, the output tensors in order (``layout``), the
    input embedding's choice, and the routed experts: each quantized expert tensor on disk ->
    ``_ExpertTensor``, and each experts module's config entry."""

    chosen: set[str]
    kept: dict[str, str]
    layout: list[PlannedTensor]
    specs: dict
    embedding: object = None
    expert_tensors: dict[str, _ExpertTensor] = field(default_factory=dict)
    experts: dict[str, dict] = field(default_factory=dict)
    experts_disk: dict[str, list[str]] = field(default_factory=dict)  # every experts module's source tensors


@dataclass(frozen=True)
class _ExpertTensor:
    module: str
    spec: TensorSpec
    transposed: bool  # a fused [E, K, N] tensor, written [E, N, K]
    scale_name: str


def _skeleton(config):
    """The model built on the meta device: its weight-matrix layers by role (``mxq.experts.structure``),
    its experts modules, the name of its output head, its input embedding
    (``mxq.embedding.EmbeddingLayer`` with the tied head, or None) and every parameter name."""
    from transformers import AutoModelForCausalLM

    from mxq.embedding import embedding_layer
    from mxq.experts import experts_layers, structure

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as e:  # noqa: BLE001 - a config.json the architecture cannot be built from fails in many ways
        raise ConversionError(f"architecture {getattr(config, 'model_type', '?')!r} is not a causal LM transformers can build ({_line(e)})") from None
    head = model.get_output_embeddings()
    heads = [n for n, m in model.named_modules() if m is head]
    emb = model.get_input_embeddings()
    return structure(model, getattr(emb, "weight", None)), experts_layers(model), heads, embedding_layer(model)


def _experts_on_disk(info, weights: dict) -> tuple[str, list[str]] | None:
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


def _plan(src: TensorSource, recipe: Recipe, warn: Callable[[str], None], cplan=None) -> _Plan:
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
    plan = _Plan(chosen, kept, [], {m: specs[m] for m in chosen}, emb_choice)
    plan.experts_disk = {m: where[1] for m, where in on_disk.items() if not isinstance(where, str)}
    for m in chosen_experts:
        _plan_experts(plan, moe[m], on_disk[m], recipe)
    plan.layout = _layout(src, plan, recipe)
    _warn_uncovered(src, plan, structure, moe, heads, emb, warn)
    return plan


def _check_format(fmt: str, recipe: Recipe, plan: _Plan) -> None:
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
    each experts module's tensors are on disk (``_experts_on_disk``; a reason string where mxq
    cannot read them, and the module then stays as it is)."""
    from mxq.config import ROLE_EXPERTS

    layers, on_disk = [], {}
    for lay in structure:
        if lay.role == ROLE_EXPERTS:
            where = _experts_on_disk(moe[lay.name], weights)
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


def _plan_experts(plan: _Plan, info, where: tuple[str, list[str]], recipe: Recipe) -> None:
    """One quantized experts module: each of its source tensors and the config entry."""
    from mxq.config import experts_entry

    layout_kind, names = where
    transposed = info.transposed and layout_kind == "fused"  # per-expert tensors are [N, K] already
    for n in names:
        plan.expert_tensors[n] = _ExpertTensor(info.name, recipe.weights, transposed, n + "_scale")
    stored = None if layout_kind == "fused" else sorted({re.sub(r"\.(\d+)\.([^.]+)\.weight$", r".{e}.\2", n) for n in names})
    plan.experts[info.name] = experts_entry(info, recipe.weights, recipe.activations, stored)


def _layout(src: TensorSource, plan: _Plan, recipe: Recipe) -> list[PlannedTensor]:
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


def _warn_uncovered(src: TensorSource, plan: _Plan, layers, moe, heads, emb, warn) -> None:
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
    """The input embedding's choice (``mxq.embedding.select_embedding``; None without one in the
    source): whether it is quantized (its ``layers()``, no activations), why not (``kept``), and the
    heads tied to it (``tied()``: they share its tensors). ``_plan`` applies it."""
    from mxq.embedding import EmbeddingLayer, select_embedding

    if emb is None or emb.name + ".weight" not in weights:
        return None
    dtype, shape = weights[emb.name + ".weight"]
    try:
        return select_embedding(EmbeddingLayer(emb.name, tuple(shape), dtype, emb.head), recipe, warn)
    except LayerSelectionError as e:
        raise ConversionError(str(e)) from None


def _warn_unshardable(src: TensorSource, layout: list[PlannedTensor], warn) -> dict[int, list[str]]:
    """Tensor parallelism of degree 2, 4 or 8 that some quantized weight would not survive (a
    row-parallel K whose per-rank slice breaks a 32-element block, ``mxq.tp``): one warning per
    degree naming the weights; the same lists for the report."""
    from mxq.tp import failures

    text = src.config.get_text_config() if hasattr(src.config, "get_text_config") else src.config
    plan = getattr(text, "base_model_tp_plan", None)
    weights = {t.name: t.shape for t in layout if t.dtype in ("F8_E4M3", "F8_E5M2")}
    out = {}
    for tp, bad in failures(weights, plan).items():
        names = ", ".join(f"{b.name} ({b.why})" for b in bad[:3]) + (f", ... ({len(bad)} in all)" if len(bad) > 3 else "")
        warn(f"tensor parallelism {tp} would not shard {len(bad)} quantized weight(s) in serving engines: {names}")
        out[tp] = [b.name for b in bad]
    return out


def _shares(src: TensorSource, plan: _Plan) -> dict:
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


# --- configs -------------------------------------------------------------------------------------

def compressed_tensors_config(recipe: Recipe, ignore: list[str], embeddings: bool = False) -> dict:
    """The compressed-tensors ``quantization_config`` for ``recipe`` (``mxq.config.ct_config``: one
    description of the layout for the writer here and the reader), as a ConversionError naming
    --format where the layout cannot hold the recipe."""
    from mxq.config import ct_config

    try:
        return ct_config(recipe, ignore, embeddings)
    except ValueError as e:
        raise ConversionError(f"--format compressed-tensors: {e}") from None


# --- the conversion ------------------------------------------------------------------------------

def quantize_checkpoint(
    source: str | os.PathLike | TensorSource | None,
    out: str | os.PathLike,
    recipe: Recipe | str | None = None,
    *,
    fmt: str = "mxq",
    device: str = "cpu",
    force: bool = False,
    max_shard_bytes: int = 2 * 1024**3,
    progress: bool = True,
    warn: Callable[[str], None] | None = None,
    plan=None,
    scale_dtype: str = "u8",
    allow_nonfinite: bool = False,
) -> ConversionReport:
    """Quantize a model checkpoint to MXFP8 and write it to ``out`` (see the module docstring).
    ``source``: a directory, hub id, GGUF file, None (the embedded default), or a ``TensorSource``
    (tensors read one at a time from anywhere: a model in memory, a generator).

    ``allow_nonfinite``: a NaN or Inf in a tensor kept in high precision is copied with a warning
    naming it, instead of stopping the run (weights being quantized never may hold one).

    ``scale_dtype``: how the E8M0 scales are stored: "u8" (uint8, the default) or "e8m0"
    (float8_e8m0fnu, as transformers' own MXFP8 checkpoints); the bits are the same.

    ``plan``: a calibration plan (``mxq.plan.Plan`` or the path of its JSON file). Its recipe
    is used (``recipe`` must then be None or the same name), its permutations are folded into the
    tensors as they stream, its per-layer specs replace the recipe's, and its kept layers stay bf16.
    """
    t0 = time.perf_counter()
    warn = warn or (lambda m: None)
    _check_options(fmt, scale_dtype, device)
    recipe, cplan = _recipe_and_plan(recipe, plan)
    out = _check_target(out, recipe, fmt, force)

    msrc, src = _open_source(source, progress)
    _check_out(out, msrc, force)
    job = _Job(src, recipe, device, allow_nonfinite, warn, cplan, _geometry(src, cplan))
    job.plan = _plan(src, recipe, warn, cplan)
    _check_format(fmt, recipe, job.plan)
    report = ConversionReport(msrc.display, str(out), recipe.name, fmt, device, kept=dict(sorted(job.plan.kept.items())))
    layout = _scales_stored_as(job.plan.layout, scale_dtype)

    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(out)
    tmp = out.parent / f".{out.name}.mxq-tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    writer = ShardWriter(tmp, layout, max_shard_bytes, {"mxq_version": mxq.__version__, "recipe": recipe.name})
    try:
        for name, tensor in _progress(src, progress):
            _convert_tensor(job, name, tensor, writer, report)
        writer.close()
        p = job.plan
        with stage("writing the configs and the tokenizer", enabled=progress):
            _write_configs(tmp, src, recipe, p.specs, p.kept, fmt, msrc, cplan, scale_dtype, embedding=p.embedding, experts=p.experts)
        report.shares = _shares(src, p)
        report.tp_unshardable = _warn_unshardable(src, layout, warn)
        report.seconds = time.perf_counter() - t0
        (tmp / "quantization_report.json").write_text(json.dumps(report.to_dict(), indent=1) + "\n")
        _replace(tmp, out, force)
    except OSError as e:
        writer.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        if e.errno == errno.ENOSPC:
            raise ConversionError(f"{out}: no space left on device while writing; nothing was written") from None
        raise ConversionError(f"{out}: {e.strerror or e}; nothing was written") from None
    except BaseException:
        writer.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return report


def check_source(
    source: str | os.PathLike | None, out: str | os.PathLike, recipe: Recipe | str | None = None, *,
    fmt: str = "mxq", device: str = "cpu", force: bool = False, scale_dtype: str = "u8",
) -> None:  # fmt: skip
    """What ``quantize_checkpoint`` refuses before it converts a tensor, checked without a
    calibration plan and without writing anything: the options, OUT, the source's config and
    checkpoint headers, the plan of every output tensor and what the format cannot hold.
    ``mxq quantize --calibrate`` runs it before calibrating, so that a conversion bound to fail
    fails before minutes of calibration. A GGUF source is only resolved here (its reader
    dequantizes the whole file; the calibration loads it next and the conversion plans it)."""
    _check_options(fmt, scale_dtype, device)
    recipe = recipe if isinstance(recipe, Recipe) else load_recipe(recipe)
    out = _check_target(out, recipe, fmt, force)
    try:
        msrc = resolve_source(source)
    except ModelSourceError as e:
        raise ConversionError(str(e)) from None
    if msrc.kind != "gguf":
        msrc, src = _open_source(source)
        plan = _plan(src, recipe, lambda m: None)  # its warnings come with the conversion
        _check_format(fmt, recipe, plan)
    _check_out(out, msrc, force)


def _check_target(out: str | os.PathLike, recipe: Recipe, fmt: str, force: bool) -> Path:
    """OUT as an absolute path, refused if it exists (without ``force``); a recipe the format
    cannot hold is refused here too, before any work."""
    out = Path(out).expanduser().absolute()
    if out.exists() and not force:
        raise ConversionError(f"{out}: already exists (pass --force to replace it)")
    if fmt == "compressed-tensors":
        compressed_tensors_config(recipe, [])
    return out


@dataclass
class _Job:
    """One conversion's settings and its plan, as every tensor sees them."""

    src: TensorSource
    recipe: Recipe
    device: str
    allow_nonfinite: bool
    warn: Callable[[str], None]
    cplan: object = None  # the calibration plan (mxq.plan.Plan), or None
    geometry: object = None  # mxq.reorder.Geometry of the source, with a calibration plan
    plan: _Plan | None = None


def _check_options(fmt: str, scale_dtype: str, device: str) -> None:
    if fmt not in FORMATS:
        raise ConversionError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    if scale_dtype not in SCALE_DTYPES:
        raise ConversionError(f"--scale-dtype {scale_dtype!r}: expected one of {', '.join(SCALE_DTYPES)}")
    if scale_dtype != "u8" and fmt == "compressed-tensors":
        raise ConversionError(f"--scale-dtype {scale_dtype}: the compressed-tensors layout stores uint8 scales; use --format mxq")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConversionError(f"--device {device}: CUDA is not available on this machine")


def _recipe_and_plan(recipe: Recipe | str | None, plan) -> tuple[Recipe, object]:
    """The recipe to apply and the calibration plan (loaded from its file if a path): a plan brings
    its own recipe; a GPTQ recipe needs a plan with rounded codes."""
    from mxq.plan import Plan, PlanError, load_plan

    if plan is not None and not isinstance(plan, Plan):
        try:
            plan = load_plan(plan)
        except PlanError as e:
            raise ConversionError(str(e)) from None
    if plan is not None:
        name = recipe.name if isinstance(recipe, Recipe) else recipe
        if name is not None and name != plan.recipe.name:
            raise ConversionError(f"--recipe {name!r}: the plan was made for recipe {plan.recipe.name!r}; pass one or the other")
        recipe = plan.recipe
    recipe = recipe if isinstance(recipe, Recipe) else load_recipe(recipe)
    if recipe.rounding != "nearest" and (plan is None or (plan.rounded is None and plan.rounded_file is None)):
        raise ConversionError(
            f"recipe {recipe.name!r}: weights.rounding {recipe.rounding} needs calibration text: "
            f"pass --calibrate --dataset D (or --plan with a plan made by `mxq calibrate --rounding {recipe.rounding}`)"
        )
    return recipe, plan


def _geometry(src: TensorSource, cplan):
    """The source's geometry, checked against the plan's (its permutations fold into these shapes)."""
    if cplan is None:
        return None
    from mxq.reorder import Geometry

    geom = Geometry.from_config(src.config)
    if geom != cplan.geometry:
        raise ConversionError(f"plan: model: made for {cplan.geometry.to_dict()}, the source is {geom.to_dict()}")
    return geom


def _scales_stored_as(layout: list[PlannedTensor], scale_dtype: str) -> list[PlannedTensor]:
    """The writer stores the uint8 scale bytes as ``scale_dtype`` (the same bits)."""
    if scale_dtype == "u8":
        return layout
    return [
        PlannedTensor(t.name, SCALE_DTYPES[scale_dtype], t.shape) if t.name.endswith("_scale") and t.dtype == "U8" else t
        for t in layout
    ]


def _convert_tensor(job: _Job, name: str, tensor: torch.Tensor, writer: ShardWriter, report: ConversionReport) -> None:
    """One source tensor to its output: permuted by the plan, then quantized (a selected Linear
    weight or an expert tensor, with its scales) or copied (checked finite)."""
    p, bs = job.plan, job.recipe.block_size
    mod = name[: -len(".weight")] if name.endswith(".weight") else None
    nbytes = tensor.numel() * tensor.element_size()
    report.bytes_before += nbytes
    report.n_tensors += 1
    if job.cplan is not None:
        from mxq.reorder import ReorderError, permute_tensor

        try:
            tensor = permute_tensor(name, tensor, job.cplan.permutations, job.geometry)
        except ReorderError as e:
            raise ConversionError(f"plan: permutations: {e}") from None
    et = p.expert_tensors.get(name)
    if et is not None:
        from mxq.experts import canonical

        w = canonical(tensor, et.transposed) if tensor.dim() == 3 else tensor
        got = _rounded_expert_weight(name, w, et, job.cplan, bs) if job.cplan is not None else None
        data, scales, sqnr = got if got is not None else _quantize_weight(name, w, et.spec, bs, job.device)
        layer, scale_name = name, et.scale_name
    elif mod in p.chosen:
        rounded = job.cplan.rounded_weight(mod) if job.cplan is not None else None
        spec = p.specs[mod][0]
        if rounded is not None:
            data, scales, sqnr = _rounded_weight(name, tensor, rounded, spec, bs)
        else:
            data, scales, sqnr = _quantize_weight(name, tensor, spec, bs, job.device)
        layer, scale_name = mod, mod + ".weight_scale"
    else:
        _check_finite(name, tensor, job.allow_nonfinite, job.warn)
        writer.write(name, tensor)
        report.bytes_after += nbytes
        return
    writer.write(name, data)
    writer.write(scale_name, scales)
    after = data.numel() + scales.numel()
    report.quantized.append(LayerResult(layer, tuple(data.shape), sqnr, nbytes, after))
    report.bytes_after += after


def _progress(src: TensorSource, enabled: bool) -> Iterator[tuple[str, torch.Tensor]]:
    from mxq.checkpoint import itemsize

    total = sum(torch.Size(s).numel() * itemsize(d) for _, d, s in src.tensors)
    label = "converting {task.fields[n]}/{task.fields[of]} tensors"
    with progress_bar(label, enabled=enabled, transfer=True) as bar:
        task = bar.add_task("quantize", total=total, n=0, of=len(src.tensors))
        for i, (name, _dtype, _shape) in enumerate(src.tensors):
            t = src.read(name)
            yield name, t
            bar.update(task, advance=t.numel() * t.element_size(), n=i + 1)


def _quantize_weight(name: str, w: torch.Tensor, spec: TensorSpec, block_size: int, device: str):
    w = w.to(device)
    bad = ~torch.isfinite(w)
    if bad.any():
        idx = [int(i) for i in bad.nonzero()[0]]
        val = w[tuple(idx)].item()
        *lead, r, c = idx
        b = c // block_size
        where = f"expert {lead[0]}, " if lead else ""
        raise ConversionError(
            f"tensor {name}: non-finite value {val} at {where}row {r}, block {b} "
            f"(columns {b * block_size}-{(b + 1) * block_size - 1})"
        )
    q = quantize_mx(w, -1, spec.elem, block_size, spec.scale_rule)
    sqnr = sqnr_db(w.float(), q.dequantize())
    return q.data.cpu(), q.scales.cpu(), sqnr


def _check_finite(name: str, t: torch.Tensor, allow: bool, warn) -> None:
    """A tensor copied as it is must hold no NaN/Inf: it would reach every output unnoticed."""
    if not t.is_floating_point() or t.dtype.itemsize < 2:
        return
    bad = ~torch.isfinite(t)
    if not bad.any():
        return
    idx = [int(i) for i in bad.nonzero()[0]]
    msg = f"tensor {name}: {int(bad.sum())} NaN/Inf value(s), the first {t[tuple(idx)].item()} at index {idx}"
    if not allow:
        raise ConversionError(f"{msg}; nothing was written (--allow-nonfinite copies it with a warning)")
    warn(f"{msg}: copied as it is (--allow-nonfinite)")


def _rounded_weight(name: str, w: torch.Tensor, rounded, spec: TensorSpec, block_size: int):
    """The plan's GPTQ codes for ``name`` (checked against the source tensor's shape and the spec)."""
    from mxq.formats import MXTensor

    data, scales = rounded
    n, k = w.shape
    if data.dtype != spec.elem.torch_dtype or tuple(data.shape) != (n, k) or scales.dtype != torch.uint8 \
            or tuple(scales.shape) != (n, k // block_size):
        raise ConversionError(
            f"plan: GPTQ codes of {name}: {data.dtype}{list(data.shape)} / {scales.dtype}{list(scales.shape)} "
            f"do not fit the source tensor {list(w.shape)} ({spec.elem.name}); a plan for another model?"
        )
    deq = MXTensor(data, scales, data.shape, 1, block_size, spec.elem).dequantize()
    return data, scales, sqnr_db(w.float(), deq)


_PER_EXPERT = re.compile(r"\.(\d+)\.([^.]+)\.weight$")
# a per-expert tensor's rows in its module's codes: gate_up rows [:I] are gate_proj/w1, [I:] up_proj/w3
_PER_EXPERT_ROWS = {"gate_proj": ("gate_up_proj", 0), "w1": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
                    "w3": ("gate_up_proj", 1), "down_proj": ("down_proj", None), "w2": ("down_proj", None)}  # fmt: skip


def _rounded_expert_weight(name: str, w: torch.Tensor, et: _ExpertTensor, cplan, block_size: int):
    """The plan's GPTQ codes for the expert tensor ``name`` (``w``: its source values, [E, N, K] for
    a fused tensor, [N, K] for one expert's), or None where the plan has none (direct cast): a
    fused tensor takes its projection's codes whole, a per-expert one the rows of its expert."""
    from mxq.formats import MXTensor

    m = _PER_EXPERT.search(name)
    if w.dim() == 3:
        proj, e, half = name.rpartition(".")[2], None, None
    elif m is not None and m.group(2) in _PER_EXPERT_ROWS:
        (proj, half), e = _PER_EXPERT_ROWS[m.group(2)], int(m.group(1))
    elif any(cplan.rounded_expert_weight(et.module, p) is not None for p in ("gate_up_proj", "up_proj", "down_proj")):
        raise ConversionError(f"plan: GPTQ codes of {et.module}: no rule maps the expert tensor {name} to them")
    else:
        return None
    rounded = cplan.rounded_expert_weight(et.module, proj)
    if rounded is None and proj == "gate_up_proj":  # experts without a gate: up_proj is the whole first projection
        rounded, half = cplan.rounded_expert_weight(et.module, "up_proj"), None
    if rounded is None:
        return None
    data, scales = rounded
    if e is not None:
        if e >= data.shape[0]:
            raise ConversionError(f"plan: GPTQ codes of {et.module}.{proj} hold {data.shape[0]} experts; {name} is expert {e}")
        data, scales = data[e], scales[e]
        if half is not None:
            rows = data.shape[0] // 2
            data, scales = data[half * rows : (half + 1) * rows], scales[half * rows : (half + 1) * rows]
    if data.dtype != et.spec.elem.torch_dtype or data.shape != w.shape or scales.dtype != torch.uint8 \
            or tuple(scales.shape) != (*w.shape[:-1], w.shape[-1] // block_size):
        raise ConversionError(
            f"plan: GPTQ codes of {name}: {data.dtype}{list(data.shape)} / {scales.dtype}{list(scales.shape)} "
            f"do not fit the source tensor {list(w.shape)} ({et.spec.elem.name}); a plan for another model?"
        )
    data, scales = data.contiguous(), scales.contiguous()
    deq = MXTensor(data, scales, data.shape, data.dim() - 1, block_size, et.spec.elem).dequantize()
    return data, scales, sqnr_db(w.float(), deq)


def _write_configs(
    tmp: Path, src: TensorSource, recipe: Recipe, specs: dict, kept: dict, fmt: str, msrc: ModelSource, cplan=None,
    scale_dtype: str = "u8", embedding=None, experts: dict | None = None,
) -> None:
    tied = embedding.tied() if embedding is not None else {}
    if src.gguf is not None:
        src.config.save_pretrained(tmp)
        cfg = json.loads((tmp / "config.json").read_text())
        if src.generation_config is not None:
            src.generation_config.save_pretrained(tmp)
        from mxq.models import load_tokenizer

        load_tokenizer(src.gguf).save_pretrained(tmp)
    else:
        cfg = dict(src.raw_config)
        if src.generation_config is not None and src.files_dir is None:
            src.generation_config.save_pretrained(tmp)
        for f in ("generation_config.json", *TOKENIZER_FILES) if src.files_dir is not None else ():
            if (src.files_dir / f).is_file():
                shutil.copy2(src.files_dir / f, tmp / f)
    if fmt == "compressed-tensors":
        embs = set(embedding.layers()) if embedding is not None else set()
        # a tied head computing with bf16 activations is "ignored": its weight is the embedding's anyway
        ignore = list(kept) + [h for h, (_, a) in tied.items() if a is None]
        cfg["quantization_config"] = compressed_tensors_config(recipe, ignore, embeddings=bool(embs))
    else:
        layers = dict(specs)
        prov = {
            "mxq_version": mxq.__version__,
            "source": msrc.display,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "torch_version": torch.__version__,
        }
        calib = cplan.config_section() if cplan is not None else None
        cfg["quantization_config"] = native_config(recipe, layers, sorted(kept), prov, calibration=calib, scale_dtype=scale_dtype,
                                                   tied=tied, experts=experts)  # fmt: skip
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _replace(tmp: Path, out: Path, force: bool) -> None:
    """Move the finished directory into place. Without --force, an OUT that appeared while this
    run worked (another mxq run, say) stays; with it, only a previous mxq output is replaced,
    and only after the new one is complete."""
    if out.exists() or out.is_symlink():
        if not force:
            raise ConversionError(f"{out}: appeared while converting (another run?); it was left as it is")
        _check_replaceable(out)
        old = out.parent / f".{out.name}.mxq-old-{os.getpid()}"
        out.rename(old)
        tmp.rename(out)
        if old.is_symlink() or not old.is_dir():
            old.unlink(missing_ok=True)
        else:
            shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)  # onto a directory made in the last instant this fails unless it is empty


# what an mxq output holds; --force replaces a directory only if it holds nothing else
_OUTPUT_FILES = {"config.json", "generation_config.json", "quantization_report.json", INDEX_NAME, *TOKENIZER_FILES}


def _check_out(out: Path, msrc: ModelSource, force: bool) -> None:
    """OUT is never the source, a directory that contains it, or (with --force) anything but a
    previous mxq output."""
    if msrc.kind in ("dir", "gguf"):
        src = Path(msrc.path).resolve()
        if msrc.kind == "gguf":
            src = src / str(msrc.gguf_file)
        real = out.resolve()
        if real == src or src.is_relative_to(real):
            raise ConversionError(f"{out}: is the source model or contains it ({src}); choose another OUT")
    if force and (out.exists() or out.is_symlink()):
        _check_replaceable(out)


def _check_replaceable(out: Path) -> None:
    target = out.resolve()
    if not target.is_dir():
        raise ConversionError(f"{out}: exists and is not a directory written by mxq; --force replaces only mxq output")
    foreign = sorted(p.name for p in target.iterdir() if p.name not in _OUTPUT_FILES and p.suffix != ".safetensors")
    if foreign or not (target / "quantization_report.json").is_file():
        why = f"holds {foreign[0]!r}" if foreign else "has no quantization_report.json"
        raise ConversionError(f"{out}: not a directory written by mxq ({why}); --force replaces only mxq output")


def _remove_stale(out: Path) -> None:
    """Temporary directories beside OUT left by runs that were killed (their process is gone)."""
    for p in out.parent.glob(f".{glob_escape(out.name)}.mxq-*-*"):
        kind, _, pid = p.name[len(out.name) + 1 :].rpartition("-")
        if kind not in (".mxq-tmp", ".mxq-old") or not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # that run is still going
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError):
            continue
        if p.is_symlink() or not p.is_dir():
            p.unlink(missing_ok=True)
        else:
            shutil.rmtree(p, ignore_errors=True)


def _line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__
