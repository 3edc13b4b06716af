"""``mxq inspect``: describe an MXFP8 checkpoint and validate it tensor by tensor."""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from mxq.checkpoint.files import TensorInfo
from mxq.checkpoint.validate import check_checkpoint


@dataclass
class InspectReport:
    format: str
    recipe: str | None
    architecture: str
    tensors: list[TensorInfo] = field(default_factory=list)
    n_quantized: int = 0
    bytes_by_dtype: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    mx_share: float = 0.0  # parameters stored as fp8 MX codes, of all parameters (scales not counted)
    shards: list = field(default_factory=list)  # with a TP degree: mxq.runtime.tp.Shard per quantized weight


def inspect_checkpoint(path: str | os.PathLike, tp: int | None = None) -> InspectReport:
    """Describe the checkpoint at ``path``; its problems are the ones ``mxq.load`` refuses: the
    validator's (``mxq.checkpoint.validate.check_checkpoint``), then, where it finds none, whatever a load onto
    the meta device refuses (``mxq.hf.quantizer.check_loads``: the model built from config.json against the
    tensors, every parameter written). ``tp``: also judge every quantized
    weight against tensor parallelism of that degree (``mxq.runtime.tp``: ``shards``)."""
    v = check_checkpoint(Path(path), scan_float=True)
    qc = v.config.get("quantization_config")
    recipe = qc.get("recipe") if isinstance(qc, dict) else None
    name = recipe.get("name") if isinstance(recipe, dict) else None
    archs = v.config.get("architectures")
    rep = InspectReport(
        format=v.format if v.format != "none" else "unquantized",
        recipe=name if v.format == "mxq" and isinstance(name, str) else None,
        architecture=",".join(map(str, archs)) if isinstance(archs, list) and archs else str(v.config.get("model_type", "?")),
        tensors=sorted(v.tensors.values(), key=lambda i: i.name),
        n_quantized=len(v.layers),
        problems=v.problems,
    )
    if not v.problems and v.format != "none":  # what only building the model shows: load it onto the meta device
        from mxq.hf.quantizer import check_loads

        problem = check_loads(path)
        if problem:
            rep.problems.append(problem)
    by_dtype: dict[str, int] = defaultdict(int)
    for i in rep.tensors:
        by_dtype[i.dtype] += i.nbytes
    rep.bytes_by_dtype = dict(by_dtype)
    scales = ("_scale", "_scale_inv")
    params = [i for i in rep.tensors if not i.name.endswith(scales)]
    total = sum(_numel(i.shape) for i in params)
    rep.mx_share = sum(_numel(i.shape) for i in params if i.dtype in ("F8_E4M3", "F8_E5M2")) / max(total, 1)
    if tp is not None:
        from mxq.runtime.tp import shard_report

        weights = {i.name: tuple(i.shape) for i in rep.tensors if i.dtype in ("F8_E4M3", "F8_E5M2")}
        rep.shards = shard_report(weights, _tp_plan(v.config), tp)
    return rep


def _tp_plan(config: dict) -> dict | None:
    """The family's tensor-parallel plan (transformers' ``base_model_tp_plan`` for its model_type),
    None where transformers does not know the family (the rule then goes by projection names)."""
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.for_model(config.get("model_type", ""))
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        return getattr(text, "base_model_tp_plan", None)
    except (ValueError, KeyError, TypeError, AttributeError, ImportError):
        return None


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


__all__ = ["InspectReport", "inspect_checkpoint"]
