"""``mxq inspect``: describe an MXFP8 checkpoint and validate it tensor by tensor."""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from mxq.checkpoint import TensorInfo
from mxq.validate import check_checkpoint


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


def inspect_checkpoint(path: str | os.PathLike) -> InspectReport:
    """Describe the checkpoint at ``path``; its problems are the ones ``mxq.load`` refuses
    (``mxq.validate.check_checkpoint``, the same validator)."""
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
    by_dtype: dict[str, int] = defaultdict(int)
    for i in rep.tensors:
        by_dtype[i.dtype] += i.nbytes
    rep.bytes_by_dtype = dict(by_dtype)
    scales = ("_scale", "_scale_inv")
    params = [i for i in rep.tensors if not i.name.endswith(scales)]
    total = sum(_numel(i.shape) for i in params)
    rep.mx_share = sum(_numel(i.shape) for i in params if i.dtype in ("F8_E4M3", "F8_E5M2")) / max(total, 1)
    return rep


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


__all__ = ["InspectReport", "inspect_checkpoint"]
