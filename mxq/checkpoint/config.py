"""The on-disk ``quantization_config``: what an mxq checkpoint's config says, and which layers a recipe quantizes.

This module imports no transformers (only the standard library, torch through ``mxq.checkpoint.files``,
``mxq.formats`` and ``mxq.recipe``), so writing, reading and checking a checkpoint's config never
needs the Hugging Face glue. ``mxq.hf.quantizer`` wraps ``NativeConfig`` as a transformers
``QuantizationConfigMixin`` and registers it.

Layer selection lives here too: ``select_layers`` works from names, weight shapes and dtypes and
a tied flag, so the in-memory path (``mxq.runtime.linear``) and the streaming converter (``mxq.convert.converter``,
which only has a meta-device skeleton and the checkpoint's index) apply the same rules.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from mxq.checkpoint.files import CheckpointError, read_index
from mxq.formats import E4M3, E5M2, ScaleRule
from mxq.recipe import Recipe, TensorSpec

QUANT_METHOD = "mxq"
FORMAT_VERSION = 1
QUANTIZABLE_DTYPES = ("F32", "F16", "BF16")  # safetensors names of the weight dtypes mxq quantizes


def mxq_version() -> str:
    """``mxq.__version__``, read from the package metadata (this module sits below ``mxq/__init__``)."""
    try:
        return version("mxq")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "0.0.0+unknown"


# --- the native config ---------------------------------------------------------------------------

def native_config(
    recipe: Recipe,
    layers: dict[str, tuple[TensorSpec, TensorSpec | None]],
    ignore: list[str],
    provenance: dict | None = None,
    calibration: dict | None = None,
    scale_dtype: str = "u8",
    tied: dict[str, tuple[str, TensorSpec | None]] | None = None,
    experts: dict[str, dict] | None = None,
) -> dict:
    """The ``quantization_config`` mxq writes: the recipe, every quantized layer's settings, the kept layers.

    ``scale_dtype``: how the E8M0 scales are stored, "u8" (uint8) or "e8m0" (float8_e8m0fnu); the same bits.
    ``layers`` may hold the input embedding (activations None: ``mxq.runtime.embedding``); ``tied``: output
    heads that read a quantized embedding's tensors instead of their own (head -> (embedding, the
    head's activations)), written as ``{"lm_head": {"to": "model.embed_tokens", "activations": ...}}``;
    ``experts``: experts module -> ``experts_entry``."""
    cfg = {
        "quant_method": QUANT_METHOD,
        "format_version": FORMAT_VERSION,
        "recipe": recipe.to_dict(),
        "block_size": recipe.block_size,
        "scale_dtype": scale_dtype,
        "layers": {
            name: {"weights": w.to_dict(), "activations": a.to_dict() if a else None}
            for name, (w, a) in sorted(layers.items())
        },
        "ignore": list(ignore),
        "attention": recipe.attention,
        "provenance": provenance or {"mxq_version": mxq_version(), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
    }
    if tied:
        cfg["tied"] = {h: {"to": e, "activations": a.to_dict() if a else None} for h, (e, a) in sorted(tied.items())}
    if experts:
        cfg["experts"] = dict(sorted(experts.items()))
    if calibration is not None:  # written by the calibrator: provenance, folded permutations, kept layers
        cfg["calibration"] = calibration
    return cfg


def experts_entry(layer, weights: TensorSpec, act: TensorSpec | None, stored: list[str] | None = None) -> dict:
    """The config's record of one quantized experts module (``layer``: ``mxq.runtime.experts.ExpertsLayer``).

    ``stored``: where its codes are on disk. Fused (the default, and what ``save_pretrained`` of a
    loaded model writes): ``<module>.<proj>`` fp8 [E, N, K] with ``<module>.<proj>_scale`` uint8
    [E, N, K/32]. Per expert (checkpoints whose source stores experts one by one): names with
    ``{e}`` for the expert index, each ``{name}.weight`` fp8 [N, K] with ``{name}.weight_scale``,
    as Linear layers are stored."""
    fused = [f"{layer.name}.{p}" for p in layer.projections]
    return {
        "weights": weights.to_dict(), "activations": act.to_dict() if act else None,
        "num_experts": layer.num_experts, "projections": list(layer.projections),
        "layout": "per_expert" if stored and stored != fused else "fused", "stored": stored or fused,
    }


class NativeConfig:
    """A native ``quantization_config`` read back (see ``native_config`` for its fields)."""

    def __init__(self, layers: dict | None = None, **kwargs):
        self.quant_method = QUANT_METHOD
        kwargs.pop("quant_method", None)
        self.format_version = kwargs.pop("format_version", FORMAT_VERSION)
        if type(self.format_version) is not int or self.format_version < 1:
            raise ValueError(f"quantization_config format_version: expected a positive integer, got {self.format_version!r}"[:300])
        if self.format_version > FORMAT_VERSION:
            raise ValueError(
                f"quantization_config format_version {self.format_version} is newer than this mxq "
                f"({mxq_version()}) reads; upgrade mxq"
            )
        self.recipe = kwargs.pop("recipe", None)
        self.block_size = kwargs.pop("block_size", 32)
        if type(self.block_size) is not int or self.block_size != 32:
            raise ValueError(f"quantization_config block_size: MX blocks are 32 elements, got {self.block_size!r}"[:300])
        self.layers = layers or {}
        self.ignore = kwargs.pop("ignore", [])
        self.attention = kwargs.pop("attention", None)
        self.provenance = kwargs.pop("provenance", {})
        if "tied" in kwargs:
            self.tied = _check_tied(kwargs.pop("tied"), self.layers)
        self.experts = _check_experts(kwargs.pop("experts", None) or {})
        for k, v in kwargs.items():  # keep anything a newer minor version added
            if k.startswith("_") or hasattr(type(self), k):  # never over a method of this class
                raise ValueError(f"quantization_config {k}: not a key this mxq reads"[:300])
            setattr(self, k, v)

    def layer_specs(self, name: str) -> tuple[TensorSpec, TensorSpec | None]:
        d = self.layers[name]
        act = d.get("activations")
        return TensorSpec.from_dict(d["weights"]), TensorSpec.from_dict(act) if act else None

    def experts_specs(self, name: str) -> tuple[TensorSpec, TensorSpec | None]:
        d = self.experts[name]
        act = d.get("activations")
        return TensorSpec.from_dict(d["weights"]), TensorSpec.from_dict(act) if act else None

    def tied_layers(self) -> dict[str, tuple[str, TensorSpec | None]]:
        """Heads that share a quantized embedding's tensors: head -> (embedding, head activations)."""
        out = {}
        for head, d in (getattr(self, "tied", None) or {}).items():
            act = d.get("activations")
            out[head] = (d["to"], TensorSpec.from_dict(act) if act else None)
        return out

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


def _check_experts(experts: object) -> dict:
    """The ``experts`` section: module -> {weights, activations, num_experts, projections, layout, stored}."""
    if not isinstance(experts, dict):
        raise ValueError(f"quantization_config experts: expected a mapping of module names to entries, got {type(experts).__name__}")
    for name, d in experts.items():
        where = f"quantization_config experts[{name!r}]"[:200]
        if not isinstance(d, dict) or not isinstance(d.get("weights"), dict):
            raise ValueError(f"{where}: expected {{'weights', 'activations', 'num_experts', 'projections', 'layout', 'stored'}}")
        n, projs, stored = d.get("num_experts"), d.get("projections"), d.get("stored")
        if type(n) is not int or not 0 < n <= 1 << 16:
            raise ValueError(f"{where}.num_experts: expected a positive integer, got {n!r}"[:300])
        if d.get("layout") not in ("fused", "per_expert"):
            raise ValueError(f"{where}.layout: expected 'fused' or 'per_expert', got {d.get('layout')!r}"[:300])
        ok = isinstance(projs, list) and projs in (["gate_up_proj", "down_proj"], ["up_proj", "down_proj"])
        if not ok:
            raise ValueError(f"{where}.projections: expected ['gate_up_proj', 'down_proj'] or ['up_proj', 'down_proj'], got {projs!r}"[:300])
        if not isinstance(stored, list) or not all(isinstance(t, str) for t in stored) or not stored:
            raise ValueError(f"{where}.stored: expected a list of tensor names"[:300])
        try:
            TensorSpec.from_dict(d["weights"])
            if d.get("activations") is not None:
                TensorSpec.from_dict(d["activations"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{where}: bad weights/activations spec ({e})"[:300]) from None
    return experts


def _check_tied(tied: object, layers: object) -> dict:
    """The ``tied`` section: head -> {"to": a listed layer (the embedding), "activations": spec or null}."""
    if not isinstance(tied, dict):
        raise ValueError(f"quantization_config tied: expected a mapping of head names to {{'to', 'activations'}}, got {type(tied).__name__}")
    for head, d in tied.items():
        where = f"quantization_config tied[{head!r}]"[:200]
        if not isinstance(d, dict) or set(d) - {"to", "activations"} or not isinstance(d.get("to"), str):
            raise ValueError(f"{where}: expected {{'to': embedding name, 'activations': {{elem, scale_rule}} or null}}"[:300])
        if not isinstance(layers, dict) or d["to"] not in layers:
            raise ValueError(f"{where}.to: {d['to']!r} is not one of the quantization_config's layers"[:300])
        if isinstance(layers, dict) and head in layers:
            raise ValueError(f"{where}: {head!r} is also listed under layers (a tied head has no tensors of its own)"[:300])
        act = d.get("activations")
        if act is not None:
            try:
                TensorSpec.from_dict(act)
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                raise ValueError(f"{where}.activations: expected {{elem, scale_rule}} or null ({e})"[:300]) from None
    return tied


# --- reading a checkpoint's config ---------------------------------------------------------------

# Mixture-of-experts keys of config.json (the families of transformers 5 mxq knows, their aliases
# included). transformers takes them as given: a negative or zero expert count quietly builds dense
# MLPs (``num_experts > 0`` decides), a top-k above the count or a zero step fails deep in a forward
# or a division, and a huge count has every per-expert structure (names, modules) built before any
# check can look at the checkpoint.
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_TOP_K_KEYS = ("num_experts_per_tok", "experts_per_token")
_POSITIVE_KEYS = ("moe_intermediate_size", "shared_expert_intermediate_size", "intermediate_size_mlp",
                  "decoder_sparse_step", "interleave_moe_layer_step", "n_group", "topk_group")  # fmt: skip
_NON_NEGATIVE_KEYS = ("n_shared_experts", "first_k_dense_replace")
_LAYER_LIST_KEYS = ("mlp_only_layers", "moe_layers")


def check_moe_config(
    cfg: dict, where: str | os.PathLike = "config.json", checkpoint: str | os.PathLike | None = None
) -> None:
    """Refuse mixture-of-experts settings that are nonsense, naming ``where`` (config.json) and the
    key: expert counts that are not positive integers, a top-k outside 1..experts, non-positive
    widths and steps, expert groups that do not divide the experts, layer lists with indices the
    model does not have. A composite config's ``text_config`` is checked the same way. Keys set to
    null are left to the family (several read null as "no experts"). With ``checkpoint`` (its
    directory), an expert count is also bounded by the tensors the checkpoint's headers list: each
    expert needs a tensor of its own (per-expert layout) or a slice of a fused [E, ...] tensor."""
    counts = _check_moe_keys(cfg, str(where), "")
    text = cfg.get("text_config")
    if isinstance(text, dict):
        counts += _check_moe_keys(text, str(where), "text_config.")
    if counts and checkpoint is not None:
        _check_expert_bound(counts, str(where), checkpoint)


def _check_moe_keys(cfg: dict, where: str, at: str) -> list[tuple[str, int]]:
    """``check_moe_config`` on one level of the config; the expert counts it sets, by key."""

    def bad(key: str, expected: str):
        raise ValueError(f"{where}: {at}{key} is {_shown(cfg[key])}; expected {expected}")

    def is_int(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)  # JSON true is no count

    counts = []
    for key in EXPERT_COUNT_KEYS:
        v = cfg.get(key)
        if v is not None:
            if not is_int(v) or v < 1:
                bad(key, "a positive integer (the number of routed experts)")
            counts.append((at + key, v))
    most = max((v for _, v in counts), default=None)
    top_k = f"an integer from 1 to the number of experts ({most})" if most else "a positive integer"
    for key in _TOP_K_KEYS:
        v = cfg.get(key)
        if v is not None and (not is_int(v) or v < 1 or (most is not None and v > most)):
            bad(key, top_k)
    for key in _POSITIVE_KEYS:  # ernie4_5_vl_moe: a list of widths
        v = cfg.get(key)
        widths = v if isinstance(v, list) and v else [v]
        if v is not None and not all(is_int(x) and x >= 1 for x in widths):
            bad(key, "a positive integer")
    for key in _NON_NEGATIVE_KEYS:
        v = cfg.get(key)
        if v is not None and not (is_int(v) and v >= 0):
            bad(key, "a non-negative integer")
    groups, routed = cfg.get("n_group"), cfg.get("n_routed_experts")
    if is_int(groups) and is_int(cfg.get("topk_group")) and cfg["topk_group"] > groups:
        bad("topk_group", f"at most n_group ({groups})")
    if is_int(groups) and is_int(routed) and routed % groups:
        bad("n_group", f"a divisor of n_routed_experts ({routed}): the router makes equal groups")
    layers = cfg.get("num_hidden_layers")
    for key in _LAYER_LIST_KEYS:
        v = cfg.get(key)
        if v is None:
            continue
        if not isinstance(v, list) or not all(is_int(x) for x in v):
            bad(key, "a list of layer indices")
        if is_int(layers) and any(not 0 <= x < layers for x in v):
            bad(key, f"layer indices from 0 to num_hidden_layers - 1 ({layers - 1})")
    return counts


def _check_expert_bound(counts: list[tuple[str, int]], where: str, checkpoint) -> None:
    """An expert count no larger than the checkpoint can hold: its tensor count (one tensor or more
    per expert when stored per expert) or the leading size of its largest 3-D tensor (fused
    [E, N, K]). The headers are bounded by the files' sizes, so this bounds every per-expert
    structure built later. A checkpoint whose headers cannot be read is left to the reader, which
    names what is wrong with it."""
    from mxq.checkpoint.files import CheckpointError, read_index

    try:
        infos = read_index(checkpoint)
    except (CheckpointError, OSError):
        return
    if not infos:
        return
    fused = max((i.shape[0] for i in infos.values() if len(i.shape) == 3), default=0)
    for key, n in counts:
        if n > max(len(infos), fused):
            raise ValueError(
                f"{where}: {key} is {n}, more experts than the checkpoint holds: {len(infos)} tensors, "
                f"{f'its fused 3-D tensors {fused} experts' if fused else 'none of them a fused 3-D experts tensor'} "
                "(each expert needs a tensor of its own or a slice of a fused one)"
            )


def _shown(v) -> str:
    """A config value as config.json spells it (true, null), cut to fit one line."""
    import json

    s = json.dumps(v)
    return s if len(s) <= 60 else s[:57] + "..."



def read_config(path: str | os.PathLike) -> dict:
    p = Path(path) / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"{path}: missing config.json (not a Hugging Face model directory)")
    try:
        config = json.loads(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise CheckpointError(f"{p}: not UTF-8 text") from None
    except (json.JSONDecodeError, RecursionError, ValueError) as e:
        raise CheckpointError(f"{p}: not valid JSON ({str(e).splitlines()[0] if str(e) else type(e).__name__})"[:400]) from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{p}: expected a JSON object, got {type(config).__name__}")
    return config


# --- compressed-tensors mxfp8-quantized: one description for the writer and the reader ------------

CT_METHOD, CT_FORMAT = "compressed-tensors", "mxfp8-quantized"
CT_BLOCK = 32  # the layout's group_size: MX blocks of 32 along K, uint8 E8M0 scales, E4M3 codes


def ct_args(dynamic: bool) -> dict:
    """A config group's weight or input-activation arguments in this layout."""
    return {
        "num_bits": 8, "type": "float", "symmetric": True, "group_size": CT_BLOCK, "strategy": "group",
        "dynamic": dynamic, "scale_dtype": "torch.uint8",
    }


def ct_config(recipe: Recipe, ignore: list[str], embeddings: bool = False) -> dict:
    """The compressed-tensors ``quantization_config`` that vLLM serves for ``recipe``: one config
    group targeting Linear layers (and the input embedding, "Embedding", when ``embeddings``), the
    kept layers under ``ignore``. ValueError where the layout cannot hold the recipe (E5M2, MX
    attention). ``foreign_to_native`` and ``compressed_tensors_layers`` read it back."""
    if recipe.weights.elem.name != "e4m3" or (recipe.activations and recipe.activations.elem.name != "e4m3"):
        raise ValueError(f"recipe {recipe.name!r} uses E5M2; the {CT_FORMAT} format is E4M3 only")
    if recipe.attention:
        raise ValueError(f"recipe {recipe.name!r} uses attention {recipe.attention!r}, a runtime-only mxq feature")
    return {
        "quant_method": CT_METHOD,
        "format": CT_FORMAT,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear", "Embedding"] if embeddings else ["Linear"],
                "weights": ct_args(False),
                "input_activations": ct_args(True) if recipe.activations else None,
                "output_activations": None,
                "format": CT_FORMAT,
            }
        },
        "ignore": sorted(ignore),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }


def checkpoint_format(config: dict) -> str:
    """'mxq', 'compressed-tensors', 'mxfp8' (transformers' ``mxfp8``, and its ``fp8`` with 1x32 blocks
    and E8M0 scales: the same tensors) or 'none'."""
    qc = config.get("quantization_config")
    if qc is None:
        return "none"
    if not isinstance(qc, dict):  # transformers would take any value but null for a quantization config
        raise ValueError(f"quantization_config: expected a JSON object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method is None:
        raise ValueError("quantization_config quant_method: missing (a quantization_config without a method)")
    if method == QUANT_METHOD:
        return "mxq"
    if method == CT_METHOD:
        fmt = qc.get("format")
        groups = qc.get("config_groups") or {}
        if not isinstance(groups, dict) or not all(isinstance(g, dict) for g in groups.values()):
            raise ValueError("quantization_config config_groups: expected a mapping of group names to groups")
        fmts = {fmt} | {g.get("format") for g in groups.values()} - {None}
        if fmts == {CT_FORMAT}:
            return "compressed-tensors"
        raise ValueError(f"compressed-tensors checkpoint in format {sorted(fmts)}; mxq reads only {CT_FORMAT!r}")
    if method == "mxfp8":
        return "mxfp8"
    if method == "fp8":  # transformers' FineGrainedFP8Config: MXFP8 when its blocks are 1x32 with E8M0 scales
        block, fmt = qc.get("weight_block_size"), qc.get("scale_fmt", "float")
        if isinstance(block, list) and block == [1, 32] and fmt == "ue8m0":
            return "mxfp8"
        raise ValueError(
            f"quantization method 'fp8' with weight_block_size {block!r} and scale_fmt {fmt!r} is not MXFP8; "
            "mxq reads it with weight_block_size [1, 32] and scale_fmt 'ue8m0'"[:300]
        )
    raise ValueError(f"quantization method {method!r} is not MXFP8; mxq reads mxq, compressed-tensors mxfp8-quantized and mxfp8 checkpoints")


def foreign_to_native(
    path: str | os.PathLike, config: dict, modules: dict[str, str] | None = None, ties: dict[str, str] | None = None,
    experts: dict[str, tuple[int, tuple[str, ...]]] | None = None,
) -> dict:
    """Native quantization_config for a compressed-tensors mxfp8 or transformers mxfp8 checkpoint.

    ``modules``: the model's Linear and Embedding layers (name -> "Linear" or "Embedding", from a
    meta-device skeleton) and ``ties`` (tied head -> input embedding). With them a compressed-tensors
    checkpoint's layers are the ones its config_groups' targets and its ignore quantize
    (``compressed_tensors_layers``), an embedding is a layer without activations (``MXEmbedding``)
    and a head tied to a quantized embedding shares its tensors (``tied``). Without them the layers
    are the ones with scales. ``experts``: the model's experts modules (name -> (experts,
    projections)); their per-expert tensors with scales (``experts.N.gate_proj.weight`` +
    ``weight_scale``, as llm-compressor writes them) become the native config's ``experts``."""
    fmt = checkpoint_format(config)
    qc = config["quantization_config"]
    tensors = read_index(path)
    scale_suffix = ".weight_scale_inv" if fmt == "mxfp8" else ".weight_scale"
    if fmt == "compressed-tensors":
        groups = list((qc.get("config_groups") or {}).values())
        has_act = any(g.get("input_activations") for g in groups)
    else:
        has_act = qc.get("activation_scheme", "dynamic") == "dynamic"
    act = TensorSpec(E4M3, ScaleRule.RCEIL) if has_act else None
    ignore = qc.get("ignore") or qc.get("modules_to_not_convert") or []
    kinds, ties = modules or {}, ties or {}
    try:
        moe, claimed = _per_expert_entries(tensors, experts or {}, scale_suffix, act)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    if fmt == "compressed-tensors" and modules is not None:
        wanted = compressed_tensors_layers(path, qc, modules, tensors, claimed)
    else:
        wanted = {n[: -len(scale_suffix)]: act for n in tensors if n.endswith(scale_suffix) and n[: -len(scale_suffix)] not in claimed}
        for head in ties:  # a tied head has no scales of its own: its activations follow the ignore list
            if isinstance(ignore, list) and head not in ignore:
                wanted.setdefault(head, act)
    layers = {}
    scale_dtype = None
    for mod, mod_act in wanted.items():
        w, s = tensors.get(mod + ".weight"), tensors.get(mod + scale_suffix)
        if mod in ties and s is None:
            continue  # tied: it reads the embedding's tensors (below)
        wdtype = w.dtype if w is not None else ""
        elem = {"F8_E4M3": E4M3, "F8_E5M2": E5M2}.get(wdtype)
        if elem is None:
            raise ValueError(f"{path}: tensor {mod}.weight has dtype {wdtype or 'missing'}, expected F8_E4M3 or F8_E5M2")
        if s is None:
            raise ValueError(f"{path}: tensor {mod}{scale_suffix}: missing (the quantization_config quantizes {mod})")
        layers[mod] = (TensorSpec(elem, ScaleRule.RCEIL), None if kinds.get(mod) == "Embedding" else mod_act)
        # the first scale's storage; the validator refuses scales stored otherwise
        scale_dtype = scale_dtype or ("e8m0" if s.dtype == "F8_E8M0" else "u8")
    if not layers and not moe:
        raise ValueError(f"{path}: {fmt} checkpoint without any {scale_suffix} tensor")
    tied = {head: (emb, wanted.get(head)) for head, emb in ties.items() if emb in layers and head not in layers}
    recipe = Recipe(name=f"imported-{fmt}", weights=TensorSpec(E4M3, ScaleRule.RCEIL), activations=act)
    prov = {"mxq_version": mxq_version(), "imported_from": fmt}
    return native_config(recipe, layers, list(ignore), prov, scale_dtype=scale_dtype or "u8", tied=tied, experts=moe)


def _per_expert_entries(tensors: dict, experts: dict, scale_suffix: str, act: TensorSpec | None) -> tuple[dict, set[str]]:
    """Experts modules stored one expert at a time with scales: their native ``experts`` entries,
    and the per-expert layer names they claim. A module's tensors are the numbered ones under its
    decoder layer with any block name (Mixtral's ``block_sparse_moe``, as the converter reads them)."""
    entries, claimed = {}, set()
    for name, (n_experts, projections) in experts.items():
        layer, _, leaf = name.rpartition(".")
        pat = re.compile(rf"^{re.escape(layer.rpartition('.')[0])}\.[^.]+\.{re.escape(leaf)}\.(\d+)\.([^.]+)\.weight$")
        bases = sorted(n[: -len(".weight")] for n in tensors if pat.match(n) and n[: -len(".weight")] + scale_suffix in tensors)
        per_expert = len(projections) + (1 if projections[0] == "gate_up_proj" else 0)
        if not bases:
            continue
        indices = {int(pat.match(b + ".weight").group(1)) for b in bases}
        if len(indices) != n_experts:
            raise ValueError(
                f"{name}: config.json gives {n_experts} experts, but the checkpoint stores {len(indices)} one by one "
                f"(experts {min(indices)}..{max(indices)})"[:300]
            )
        if len(bases) != n_experts * per_expert:
            continue
        elem = {"F8_E4M3": E4M3, "F8_E5M2": E5M2}.get(tensors[bases[0] + ".weight"].dtype)
        if elem is None:
            continue
        stored = sorted({re.sub(r"\.(\d+)\.([^.]+)$", r".{e}.\2", b) for b in bases})
        entries[name] = {
            "weights": TensorSpec(elem, ScaleRule.RCEIL).to_dict(), "activations": act.to_dict() if act else None,
            "num_experts": n_experts, "projections": list(projections), "layout": "per_expert", "stored": stored,
        }
        claimed.update(bases)
    return entries, claimed


def compressed_tensors_layers(path, qc: dict, modules: dict[str, str], tensors: dict,
                              claimed: set[str] = frozenset()) -> dict[str, TensorSpec | None]:  # fmt: skip
    """The layers a compressed-tensors ``quantization_config`` quantizes -> each one's activation spec.

    A layer is quantized when a config group's ``targets`` match it and no ``ignore`` entry does,
    with compressed-tensors' patterns: ``re:`` + a regular expression matched from the start of the
    module name, else an exact module name or class name ("Linear", "Embedding"). One ambiguity is
    settled by the checkpoint: a group targeting "Linear" (or nothing) means every Linear layer to
    the writers that walk a model (llm-compressor's ``oneshot``, ``mxq quantize``), but every weight
    except the norms to the name-based ``model_free_ptq``, which so quantizes the input embedding
    too. An embedding under such a group (not ignored, not targeted by name or as "Embedding") is
    quantized when its weight is stored in fp8. A scale tensor of any other layer is an error."""
    ignore = qc.get("ignore") or []
    groups = qc.get("config_groups") or {}
    if not isinstance(ignore, list) or not all(isinstance(p, str) for p in ignore):
        raise ValueError("quantization_config ignore: expected a list of module names or re: patterns")
    for gname, g in groups.items():
        t = g.get("targets")
        if t is not None and (not isinstance(t, list) or not all(isinstance(p, str) for p in t)):
            raise ValueError(f"quantization_config config_groups[{gname!r}].targets: expected a list of module names, class names or re: patterns"[:300])
    out: dict[str, TensorSpec | None] = {}
    for name, kind in modules.items():
        if kind not in ("Linear", "Embedding") or any(_ct_match(p, name, kind) for p in ignore):
            continue
        for g in groups.values():
            targets = g.get("targets") or []
            act = TensorSpec(E4M3, ScaleRule.RCEIL) if g.get("input_activations") else None
            w = tensors.get(name + ".weight")
            if any(_ct_match(t, name, kind) for t in targets) or (
                kind == "Embedding" and ("Linear" in targets or not targets) and w is not None and w.dtype in ("F8_E4M3", "F8_E5M2")
            ):
                out[name] = act
                break
    for n in tensors:
        if n.endswith(".weight_scale") and n[: -len(".weight_scale")] not in out and n[: -len(".weight_scale")] not in claimed:
            mod = n[: -len(".weight_scale")]
            kind = modules.get(mod)
            why = "which the model does not have" if kind is None else (
                f"but {mod} is a {kind}, not a Linear layer (routers stay in high precision)") if kind not in ("Linear", "Embedding") else (
                "which the quantization_config's config_groups targets and ignore leave unquantized")
            raise ValueError(f"{path}: tensor {n}: a scale for {mod}, {why}")
    return out


def _ct_match(pattern: str, name: str, kind: str) -> bool:
    if pattern.startswith("re:"):
        try:
            return re.match(pattern[3:], name) is not None
        except re.error as e:
            raise ValueError(f"quantization_config: bad regular expression {pattern!r} ({e})"[:300]) from None
    return pattern in (name, kind)


# --- which layers a recipe quantizes -------------------------------------------------------------

class LayerSelectionError(ValueError):
    """A Linear layer the recipe selects whose weight mxq cannot quantize."""


# Roles of the weight matrices selection sees: a Linear layer, a module of routed experts (3-D
# parameters), or a matrix that stays in high precision whatever the recipe says, with its reason.
ROLE_LINEAR, ROLE_EXPERTS = "linear", "experts"
KEPT_ROLES = {
    "router": "router (which experts a token reaches stays in high precision)",
    "shared_expert_gate": "shared-expert gate (stays in high precision)",
    "custom_linear": "a Linear subclass with its own forward (an MX layer would change what it returns)",
}


@dataclass(frozen=True)
class LinearLayer:
    """One weight-matrix layer as layer selection sees it.

    ``shape``: its weight's shape ([N, K]; for experts [E, N, K] of the first projection);
    ``dtype``: the weight's safetensors dtype name, or None for an in-memory floating-point weight
    (nothing to check); ``tied``: why the weight is not the layer's own (it is tied to another
    tensor), "" when it is; ``role``: ``ROLE_LINEAR``, ``ROLE_EXPERTS`` or a key of ``KEPT_ROLES``;
    ``ks``: for experts, the K of every projection.
    """

    name: str
    shape: tuple[int, ...] = ()
    dtype: str | None = None
    tied: str = ""
    role: str = ROLE_LINEAR
    ks: tuple[int, ...] = ()


def select_layers(
    layers: Iterable[LinearLayer], recipe: Recipe, warn: Callable[[str], None] | None = None
) -> tuple[list[str], dict[str, str]]:
    """Names of the layers the recipe quantizes (Linear layers and experts modules), and the kept
    ones with the reason.

    Rules, in order: routers and shared-expert gates stay (``KEPT_ROLES``); the recipe's include/exclude; a tied weight stays as it is (quantizing it
    would add a second copy); K must be a multiple of the block size (else kept, with a warning);
    a selected weight in a dtype other than F32/F16/BF16 raises ``LayerSelectionError``.
    """
    chosen: list[str] = []
    kept: dict[str, str] = {}
    for layer in layers:
        name, shape = layer.name, layer.shape
        ks = layer.ks if layer.role == ROLE_EXPERTS else (shape[-1:] if len(shape) == 2 else ())
        if layer.role in KEPT_ROLES:
            kept[name] = KEPT_ROLES[layer.role]
        elif not recipe.selects(name):
            kept[name] = "excluded by recipe"
        elif layer.tied:
            kept[name] = layer.tied
        elif not ks or any(k % recipe.block_size for k in ks):
            bad = [k for k in ks if k % recipe.block_size] or ["?"]
            kept[name] = f"K={bad[0]} is not a multiple of {recipe.block_size}"
            if warn:
                warn(f"keeping {name} in its original dtype: {kept[name]}")
        elif layer.dtype is not None and layer.dtype not in QUANTIZABLE_DTYPES:
            raise LayerSelectionError(
                f"tensor {name}.weight: unsupported dtype {layer.dtype} (mxq quantizes F32, F16 and BF16 weights)"
            )
        else:
            chosen.append(name)
    return chosen, kept
