"""Hugging Face integration: ``quant_method: "mxq"`` so ``from_pretrained`` builds ``MXLinear`` layers.

Importing this module (``import mxq`` does) registers the config and the quantizer with
transformers. Checkpoints written by other MXFP8 tools — compressed-tensors
``mxfp8-quantized`` and transformers' own ``quant_method: "mxfp8"`` — load through the same
quantizer: ``mxq.load`` rewrites their ``quantization_config`` into the native one in memory
(the tensors already carry the names and layout MXLinear uses; ``weight_scale_inv`` is
renamed to ``weight_scale`` while loading).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

import mxq
from mxq.formats import E4M3, E5M2, ScaleRule
from mxq.linear import MXLinear
from mxq.recipe import Recipe, TensorSpec

QUANT_METHOD = "mxq"
FORMAT_VERSION = 1


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
        "provenance": provenance or {"mxq_version": mxq.__version__, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
    }
    if calibration is not None:  # written by the calibrator: provenance, folded permutations, kept layers
        cfg["calibration"] = calibration
    return cfg


class MXQConfig(QuantizationConfigMixin):
    """The native mxq quantization config (see ``native_config`` for its fields)."""

    def __init__(self, layers: dict | None = None, **kwargs):
        self.quant_method = QUANT_METHOD
        kwargs.pop("quant_method", None)
        self.format_version = kwargs.pop("format_version", FORMAT_VERSION)
        if self.format_version > FORMAT_VERSION:
            raise ValueError(
                f"quantization_config format_version {self.format_version} is newer than this mxq "
                f"({mxq.__version__}) reads; upgrade mxq"
            )
        self.recipe = kwargs.pop("recipe", None)
        self.block_size = kwargs.pop("block_size", 32)
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


class MXQHfQuantizer(HfQuantizer):
    """Loads pre-quantized mxq checkpoints: swaps the listed Linear layers for ``MXLinear``."""

    requires_calibration = True  # quantizing on the fly is mxq.quantize_model / mxq quantize

    def validate_environment(self, *args, **kwargs):
        return None

    def update_dtype(self, dtype):
        return dtype or torch.bfloat16

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        return False

    def _process_model_before_weight_loading(self, model, **kwargs):
        cfg: MXQConfig = self.quantization_config
        dtype = kwargs.get("dtype") or model.dtype
        for name in cfg.layers:
            try:
                lin = model.get_submodule(name)
            except AttributeError:
                raise ValueError(f"quantization_config lists layer {name!r}, which {type(model).__name__} does not have") from None
            if not isinstance(lin, torch.nn.Linear):
                raise ValueError(f"quantization_config lists {name!r}, a {type(lin).__name__}, not a Linear layer")
            w, a = cfg.layer_specs(name)
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            with torch.device("meta"):
                new = MXLinear(
                    lin.in_features, lin.out_features, lin.bias is not None,
                    elem=w.elem, act=a, block_size=cfg.block_size, dtype=dtype,
                )
            setattr(parent, child, new)
        if cfg.attention == "mxfp8":
            import mxq.attention  # noqa: F401  (registers the "mxfp8" attention implementation)

            model.set_attn_implementation("mxfp8")
        return model

    def update_weight_conversions(self, weight_conversions, *args, **kwargs):
        """Prepend the ``weight_scale_inv`` -> ``weight_scale`` renaming to what the base quantizer
        returns. The hook's signature is transformers' to choose (5.17 passes the conversions,
        5.23 also the model): whatever this release passes goes to its own base implementation
        unchanged, so no version is named here."""
        from transformers.core_model_loading import WeightRenaming

        conversions = super().update_weight_conversions(weight_conversions, *args, **kwargs)
        # transformers' own "mxfp8" checkpoints name the E8M0 scales weight_scale_inv.
        rename = WeightRenaming(source_patterns=r"^(.+)\.weight_scale_inv$", target_patterns=r"\1.weight_scale")
        return [rename, *conversions]

    def is_serializable(self, safe_serialization=None):
        return True

    @property
    def is_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        # MXLinear compiles through the custom op torch.ops.mxq.mx_linear (no graph breaks, no
        # host syncs), so generate(cache_implementation="static") may compile the forward.
        return True


def _register() -> None:
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(MXQConfig)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(MXQHfQuantizer)


_register()


# --- checkpoints written by other tools ---------------------------------------------------------

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
    from mxq.checkpoint import read_index

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
    prov = {"mxq_version": mxq.__version__, "imported_from": fmt}
    return native_config(recipe, layers, list(ignore), prov)


def load(path: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16):
    """Load an MXFP8 checkpoint (mxq, compressed-tensors mxfp8-quantized or transformers mxfp8)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = read_config(path)
    fmt = checkpoint_format(config)
    if fmt in ("mxq", "none"):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    else:
        cfg = AutoConfig.from_pretrained(path)
        cfg.quantization_config = foreign_to_native(path, config)
        model = AutoModelForCausalLM.from_pretrained(path, config=cfg, dtype=dtype)
    return model.to(device).eval()
