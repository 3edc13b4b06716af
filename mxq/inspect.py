"""``mxq inspect``: describe an MXFP8 checkpoint and validate it tensor by tensor."""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from mxq.checkpoint import CheckpointError, TensorInfo, checkpoint_files, read_header, read_tensor
from mxq.config import checkpoint_format, read_config

FP8 = {"F8_E4M3": "e4m3", "F8_E5M2": "e5m2"}


@dataclass
class InspectReport:
    format: str
    recipe: str | None
    architecture: str
    tensors: list[TensorInfo] = field(default_factory=list)
    n_quantized: int = 0
    bytes_by_dtype: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def inspect_checkpoint(path: str | os.PathLike) -> InspectReport:
    path = Path(path)
    config = read_config(path)
    fmt = checkpoint_format(config)
    qc = config.get("quantization_config") or {}
    rep = InspectReport(
        format=fmt if fmt != "none" else "unquantized",
        recipe=(qc.get("recipe") or {}).get("name") if fmt == "mxq" else None,
        architecture=",".join(config.get("architectures") or [config.get("model_type", "?")]),
    )
    infos: dict[str, TensorInfo] = {}
    for f in checkpoint_files(path):
        try:
            h, _ = read_header(f)
        except CheckpointError as e:
            rep.problems.append(str(e))
            continue
        infos.update(h)
    rep.tensors = sorted(infos.values(), key=lambda i: i.name)
    by_dtype: dict[str, int] = defaultdict(int)
    for i in rep.tensors:
        by_dtype[i.dtype] += i.nbytes
    rep.bytes_by_dtype = dict(by_dtype)

    if fmt == "mxq":
        expected = {name: d["weights"]["elem"] for name, d in (qc.get("layers") or {}).items()}
        suffix = ".weight_scale"
    else:
        suffix = ".weight_scale_inv" if fmt == "mxfp8" else ".weight_scale"
        expected = {n[: -len(suffix)]: None for n in infos if n.endswith(suffix)}
    block = int(qc.get("block_size", 32)) if fmt == "mxq" else 32
    for mod, elem in sorted(expected.items()):
        rep.problems.extend(_check_layer(mod, elem, suffix, block, infos))
    rep.n_quantized = len(expected)
    if fmt == "mxq":
        orphans = [n for n in infos if n.endswith(suffix) and n[: -len(suffix)] not in expected]
        rep.problems.extend(f"tensor {n}: a scale for a layer the quantization_config does not list" for n in orphans)
    return rep


def _check_layer(mod: str, elem: str | None, suffix: str, block: int, infos: dict[str, TensorInfo]) -> list[str]:
    w, s = infos.get(mod + ".weight"), infos.get(mod + suffix)
    if w is None:
        return [f"tensor {mod}.weight: missing"]
    if s is None:
        return [f"tensor {mod}{suffix}: missing"]
    probs = []
    if w.dtype not in FP8:
        probs.append(f"tensor {mod}.weight: dtype {w.dtype}, expected F8_E4M3 or F8_E5M2")
    elif elem is not None and FP8[w.dtype] != elem:
        probs.append(f"tensor {mod}.weight: dtype {w.dtype} but the config says {elem}")
    if s.dtype != "U8":
        probs.append(f"tensor {mod}{suffix}: dtype {s.dtype}, expected U8 (biased E8M0)")
    if len(w.shape) != 2:
        probs.append(f"tensor {mod}.weight: shape {list(w.shape)} is not 2-D")
    elif w.shape[1] % block or tuple(s.shape) != (w.shape[0], w.shape[1] // block):
        probs.append(
            f"tensor {mod}{suffix}: shape {list(s.shape)} does not match weight {list(w.shape)} "
            f"(expected {[w.shape[0], w.shape[1] // block]})"
        )
    elif s.dtype == "U8":
        try:
            n_nan = int((read_tensor(s) == 0xFF).sum())
        except CheckpointError as e:
            return [*probs, str(e)]
        if n_nan:
            probs.append(f"tensor {mod}{suffix}: {n_nan} block(s) with NaN scale (0xFF)")
    return probs


__all__ = ["InspectReport", "inspect_checkpoint"]
