"""The on-disk ``quantization_config``: what an mxq checkpoint's config says, and which layers a recipe quantizes.

This module imports no transformers (only the standard library, torch through ``mxq.checkpoint``,
``mxq.formats`` and ``mxq.recipe``), so writing, reading and checking a checkpoint's config never
needs the Hugging Face glue. ``mxq.hf`` wraps ``NativeConfig`` as a transformers
``QuantizationConfigMixin`` and registers it.

Layer selection lives here too: ``select_layers`` works from names, weight shapes and dtypes and
a tied flag, so the in-memory path (``mxq.linear``) and the streaming converter (``mxq.convert``,
which only has a meta-device skeleton and the checkpoint's index) apply the same rules.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from mxq.checkpoint import read_index
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
) -> dict:
    """The ``quantization_config`` mxq writes: the recipe, every quantized layer's settings, the kept layers."""
    cfg = {
        "quant_method": QUANT_METHOD,
        "format_version": FORMAT_VERSION,
        "recipe": recipe.to_dict(),
        "block_size": recipe.block_size,
        "layers": {
            name: {"weights": w.to_dict(), "activations": a.to_dict() if a else None}
            for name, (w, a) in sorted(layers.items())
        },
        "ignore": list(ignore),
        "attention": recipe.attention,
        "provenance": provenance or {"mxq_version": mxq_version(), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
    }
    if calibration is not None:  # written by the calibrator: provenance, folded permutations, kept layers
        cfg["calibration"] = calibration
    return cfg


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
        for k, v in kwargs.items():  # keep anything a newer minor version added
            setattr(self, k, v)

    def layer_specs(self, name: str) -> tuple[TensorSpec, TensorSpec | None]:
        d = self.layers[name]
        act = d.get("activations")
        return TensorSpec.from_dict(d["weights"]), TensorSpec.from_dict(act) if act else None

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


# --- reading a checkpoint's config ---------------------------------------------------------------

def read_config(path: str | os.PathLike) -> dict:
    p = Path(path) / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"{path}: missing config.json (not a Hugging Face model directory)")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not valid JSON ({e})") from None


def checkpoint_format(config: dict) -> str:
    """'mxq', 'compressed-tensors', 'mxfp8' (transformers) or 'none'."""
    qc = config.get("quantization_config") or {}
    method = qc.get("quant_method")
    if method is None:
        return "none"
    if method == QUANT_METHOD:
        return "mxq"
    if method == "compressed-tensors":
        fmt = qc.get("format")
        groups = qc.get("config_groups") or {}
        fmts = {fmt} | {g.get("format") for g in groups.values()} - {None}
        if fmts == {"mxfp8-quantized"}:
            return "compressed-tensors"
        raise ValueError(f"compressed-tensors checkpoint in format {sorted(fmts)}; mxq reads only 'mxfp8-quantized'")
    if method == "mxfp8":
        return "mxfp8"
    raise ValueError(f"quantization method {method!r} is not MXFP8; mxq reads mxq, compressed-tensors mxfp8-quantized and mxfp8 checkpoints")


def foreign_to_native(path: str | os.PathLike, config: dict) -> dict:
    """Native quantization_config for a compressed-tensors mxfp8 or transformers mxfp8 checkpoint."""
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
    layers = {}
    for name in tensors:
        if name.endswith(scale_suffix):
            mod = name[: -len(scale_suffix)]
            w = tensors.get(mod + ".weight")
            wdtype = w.dtype if w is not None else ""
            elem = {"F8_E4M3": E4M3, "F8_E5M2": E5M2}.get(wdtype)
            if elem is None:
                raise ValueError(f"{path}: tensor {mod}.weight has dtype {wdtype or 'missing'}, expected F8_E4M3 or F8_E5M2")
            layers[mod] = (TensorSpec(elem, ScaleRule.RCEIL), act)
    if not layers:
        raise ValueError(f"{path}: {fmt} checkpoint without any {scale_suffix} tensor")
    recipe = Recipe(name=f"imported-{fmt}", weights=TensorSpec(E4M3, ScaleRule.RCEIL), activations=act)
    ignore = qc.get("ignore") or qc.get("modules_to_not_convert") or []
    prov = {"mxq_version": mxq_version(), "imported_from": fmt}
    return native_config(recipe, layers, list(ignore), prov)


# --- which layers a recipe quantizes -------------------------------------------------------------

class LayerSelectionError(ValueError):
    """A Linear layer the recipe selects whose weight mxq cannot quantize."""


@dataclass(frozen=True)
class LinearLayer:
    """One Linear layer as layer selection sees it.

    ``shape``: its weight's shape ([N, K]); ``dtype``: the weight's safetensors dtype name, or None
    for an in-memory floating-point weight (nothing to check); ``tied``: why the weight is not the
    layer's own (it is tied to another tensor), "" when it is.
    """

    name: str
    shape: tuple[int, ...] = ()
    dtype: str | None = None
    tied: str = ""


def select_layers(
    layers: Iterable[LinearLayer], recipe: Recipe, warn: Callable[[str], None] | None = None
) -> tuple[list[str], dict[str, str]]:
    """Names of the Linear layers the recipe quantizes, and the kept ones with the reason.

    Rules, in order: the recipe's include/exclude; a tied weight stays as it is (quantizing it
    would add a second copy); K must be a multiple of the block size (else kept, with a warning);
    a selected weight in a dtype other than F32/F16/BF16 raises ``LayerSelectionError``.
    """
    chosen: list[str] = []
    kept: dict[str, str] = {}
    for layer in layers:
        name, shape = layer.name, layer.shape
        if not recipe.selects(name):
            kept[name] = "excluded by recipe"
        elif layer.tied:
            kept[name] = layer.tied
        elif len(shape) != 2 or shape[-1] % recipe.block_size:
            kept[name] = f"K={shape[-1] if shape else '?'} is not a multiple of {recipe.block_size}"
            if warn:
                warn(f"keeping {name} in its original dtype: {kept[name]}")
        elif layer.dtype is not None and layer.dtype not in QUANTIZABLE_DTYPES:
            raise LayerSelectionError(
                f"tensor {name}.weight: unsupported dtype {layer.dtype} (mxq quantizes F32, F16 and BF16 weights)"
            )
        else:
            chosen.append(name)
    return chosen, kept
