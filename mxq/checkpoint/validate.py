"""One validator for MXFP8 checkpoints: ``mxq.load``, ``from_pretrained`` (mxq's quantizer) and ``mxq inspect``.

What a checkpoint must be before anything uses it (every problem is one line naming the file and
the key or tensor):

- every shard header passes ``mxq.checkpoint.files.read_header``; an index names only tensors its
  shards hold;
- the ``quantization_config`` (native, or the native one ``mxq.checkpoint.config.foreign_to_native`` made):
  ``format_version``, ``block_size``, each layer's ``weights`` / ``activations`` spec,
  ``scale_dtype`` and ``attention`` are values this mxq reads;
- every listed layer has a 2-D fp8 ``weight`` [N, K] in the element format the config names and
  a ``weight_scale`` (or ``weight_scale_inv``) [N, K/32] stored as U8 or F8_E8M0 (both are the
  bits of a biased E8M0), as the config's ``scale_dtype`` records; no fp8 tensor or scale belongs
  to a layer the config does not list (it would load as plain numbers, without its scales);
- the data holds no fp8 NaN code (E4M3 ``S.1111.111``; E5M2 exponent ``11111``: NaN and ±Inf)
  and no NaN scale (0xFF), scanned in bounded chunks.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mxq.checkpoint.files import (
    INDEX_NAME,
    CheckpointError,
    TensorInfo,
    checkpoint_files,
    read_header,
)
from mxq.formats import E8M0_NAN, ElemFormat, as_elem_format, as_scale_rule

FP8_DTYPES = {"F8_E4M3": "e4m3", "F8_E5M2": "e5m2"}
# quantization_config scale_dtype -> the safetensors dtype of the scales
SCALE_DTYPES = {"u8": "U8", "e8m0": "F8_E8M0"}
SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv")
# bytes b with (b & mask) == mask are not finite numbers
_NONFINITE_MASK = {"F8_E4M3": 0x7F, "F8_E5M2": 0x7C}
SCAN_CHUNK = 1 << 24  # bytes the NaN-code scan reads from a file at a time


@dataclass
class Validation:
    """What the validator found: the checkpoint's format, tensors, quantized layers and problems."""

    format: str
    config: dict
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    layers: dict[str, ElemFormat | None] = field(default_factory=dict)  # None: any fp8 format
    problems: list[str] = field(default_factory=list)
    fused: dict[str, tuple[ElemFormat, int]] = field(default_factory=dict)  # fused experts tensor -> (format, experts)


def validate_checkpoint(
    path: str | os.PathLike, config: dict | None = None, files: list | None = None, scan: bool = True,
    share: tuple[int, int] | None = None,
) -> Validation:
    """``check_checkpoint``, raising ``CheckpointError`` with the first problem."""
    v = check_checkpoint(path, config, files, scan, share=share)
    if v.problems:
        raise CheckpointError(v.problems[0])
    return v


def check_checkpoint(
    path: str | os.PathLike, config: dict | None = None, files: list | None = None, scan: bool = True,
    scan_float: bool = False, share: tuple[int, int] | None = None,
) -> Validation:
    """Every problem of the checkpoint at ``path`` (see the module doc).

    ``config``: its config.json as a dict (read from ``path`` when None); a foreign MXFP8
    checkpoint's ``quantization_config`` may already be the native one ``foreign_to_native`` made.
    ``files``: the shards to check (default: ``checkpoint_files(path)``). ``scan``: read the data
    for NaN codes, not only the headers. ``scan_float``: also read every high-precision
    (F32/F16/BF16) tensor for NaN/Inf (``mxq inspect``; loading does not pay for it).
    ``share``: (rank, world) of processes that check one checkpoint together (tensor-parallel loading):
    this one reads the data of the layers whose name hashes to ``rank``, the headers of all.
    """
    from mxq.checkpoint.config import checkpoint_format, read_config

    path = Path(path)
    cfg_file = path / "config.json"
    config = read_config(path) if config is None else config
    try:
        fmt = checkpoint_format(config)
    except (ValueError, AttributeError) as e:
        raise CheckpointError(f"{cfg_file}: {_line(e)}") from None
    v = Validation(fmt, config)
    shards = [Path(f) for f in files] if files is not None else checkpoint_files(path)
    for f in shards:
        try:
            infos, _ = read_header(f)
        except CheckpointError as e:
            v.problems.append(str(e))
            continue
        for name, info in infos.items():
            if name in v.tensors:
                v.problems.append(f"{f}: tensor {name} also appears in {v.tensors[name].file}")
            v.tensors.setdefault(name, info)
    v.problems.extend(_index_problems(path, v.tensors))

    qc = config.get("quantization_config")
    scale_dtypes = tuple(SCALE_DTYPES.values())
    if fmt == "mxq":
        try:
            v.layers, scale_dtype = _config_layers(qc)
            scale_dtypes = (SCALE_DTYPES[scale_dtype],)
            per_expert, v.fused = _config_experts(qc, v.tensors)
        except ValueError as e:
            v.problems.insert(0, f"{cfg_file}: {e}")
            return v
        v.layers.update(per_expert)
    elif fmt != "none":  # foreign: the layers are the ones with scales
        suffix = ".weight_scale_inv" if fmt == "mxfp8" else ".weight_scale"
        v.layers = {n[: -len(suffix)]: None for n in v.tensors if n.endswith(suffix)}
    mine = (lambda n: True) if share is None else (lambda n: zlib.crc32(n.encode()) % share[1] == share[0])
    for mod, elem in sorted(v.layers.items()):
        v.problems.extend(_layer_problems(path, mod, elem, scale_dtypes, v.tensors, scan and mine(mod)))
    if fmt == "mxq":
        v.problems.extend(_expert_shape_problems(per_expert, v.tensors))
    for name, (elem, e) in sorted(v.fused.items()):
        v.problems.extend(_fused_problems(path, name, elem, e, scale_dtypes, v.tensors, scan and mine(name)))
    v.problems.extend(_unlisted(v.layers, v.tensors, v.fused))
    if scan_float:
        v.problems.extend(nonfinite_problems(v.tensors))
    return v


# --- the config ----------------------------------------------------------------------------------

def _config_layers(qc: object) -> tuple[dict[str, ElemFormat], str]:
    """The layers a native quantization_config lists (name -> weight format) and its scale_dtype;
    ValueError naming the key for anything this mxq does not read."""
    from mxq.checkpoint.config import NativeConfig

    if not isinstance(qc, dict):
        raise ValueError("quantization_config: expected a JSON object")
    try:
        NativeConfig(**qc)
    except TypeError as e:
        raise ValueError(f"quantization_config: {_line(e)}") from None
    layers = qc.get("layers")
    if not isinstance(layers, dict):  # empty is valid: a plan may keep every layer in bf16
        raise ValueError("quantization_config layers: expected a mapping of layer names to specs")
    out = {}
    for name, d in layers.items():
        where = f"quantization_config layers[{name!r}]"
        if not isinstance(d, dict) or not isinstance(d.get("weights"), dict):
            raise ValueError(f"{where}: expected {{'weights': {{elem, scale_rule}}, 'activations': ...}}")
        out[name] = _spec(d["weights"], f"{where}.weights")
        act = d.get("activations")
        if act is not None:
            if not isinstance(act, dict):
                raise ValueError(f"{where}.activations: expected {{elem, scale_rule}} or null")
            _spec(act, f"{where}.activations")
    scale_dtype = qc.get("scale_dtype", "u8")
    if not isinstance(scale_dtype, str) or scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"quantization_config scale_dtype: expected one of {sorted(SCALE_DTYPES)}, got {scale_dtype!r}"[:300])
    if qc.get("attention") not in (None, "bf16", "mxfp8"):
        raise ValueError(f"quantization_config attention: expected null, 'bf16' or 'mxfp8', got {qc.get('attention')!r}"[:300])
    return out, scale_dtype


def _config_experts(qc: dict, tensors: dict) -> tuple[dict[str, ElemFormat], dict[str, tuple[ElemFormat, int]]]:
    """The experts section's tensors: per-expert ones as layers (name -> format, one per expert and
    projection) and fused ones (name -> (format, experts)); ValueError naming the key.

    Where the entry's ``stored`` tensors are absent but the other layout is complete on disk, that
    one is taken: ``save_pretrained`` writes experts in the model family's own checkpoint layout
    (transformers splits a fused [E, N, K] tensor back into per-expert ones, scales included), which
    need not be the layout the config was written for."""
    per_expert, fused = {}, {}
    for name, d in (qc.get("experts") or {}).items():  # NativeConfig checked the section's shape
        where = f"quantization_config experts[{name!r}]"[:200]
        elem = _spec(d["weights"], f"{where}.weights")
        layout, stored = _experts_on_disk(name, d, tensors)
        for t in stored:
            if layout == "fused":
                fused[t] = (elem, d["num_experts"])
            elif t.count("{e}") != 1 or "{" in t.replace("{e}", "") or "}" in t.replace("{e}", ""):
                raise ValueError(f"{where}.stored: {t!r} must hold {{e}} once (the expert index)"[:300])
            else:
                per_expert.update({t.replace("{e}", str(i)): elem for i in range(d["num_experts"])})
    return per_expert, fused


def _expert_shape_problems(per_expert: dict, tensors: dict) -> list[str]:
    """Per-expert weights of one projection must share a shape (loading stacks them into [E, N, K])."""
    import re

    first: dict[str, TensorInfo] = {}
    probs = []
    for base in sorted(per_expert):
        w = tensors.get(base + ".weight")
        if w is None:
            continue
        key = re.sub(r"\.\d+\.([^.]+)$", r".{e}.\1", base)
        ref = first.setdefault(key, w)
        if tuple(w.shape) != tuple(ref.shape):
            probs.append(f"{w.file}: tensor {w.name}: shape {list(w.shape)}, but {ref.name} has {list(ref.shape)} (experts of one projection share a shape)")
    return probs


def _experts_on_disk(name: str, d: dict, tensors: dict) -> tuple[str, list[str]]:
    """(layout, stored names) of one experts entry: as the config says, or the other layout where
    only that one is on disk (numbered per-expert tensors under the module's decoder layer)."""
    import re

    if not tensors or all((t if d["layout"] == "fused" else t.replace("{e}", "0") + ".weight") in tensors for t in d["stored"]):
        return d["layout"], d["stored"]
    fused = [f"{name}.{p}" for p in d["projections"]]
    if all(t in tensors for t in fused):
        return "fused", fused
    layer, _, leaf = name.rpartition(".")
    pat = re.compile(rf"^{re.escape(layer.rpartition('.')[0])}\.[^.]+\.{re.escape(leaf)}\.(\d+)\.([^.]+)\.weight$")
    found = sorted({re.sub(r"\.(\d+)\.([^.]+)\.weight$", r".{e}.\2", t) for t in tensors if pat.match(t)})
    return ("per_expert", found) if found else (d["layout"], d["stored"])


def _spec(d: dict, where: str) -> ElemFormat:
    for key in ("elem", "scale_rule"):
        if not isinstance(d.get(key), str):
            raise ValueError(f"{where}.{key}: expected a string, got {d.get(key)!r}"[:300])
    try:
        as_scale_rule(d["scale_rule"])
        return as_elem_format(d["elem"])
    except ValueError as e:
        raise ValueError(f"{where}: {e}"[:300]) from None


# --- the tensors ---------------------------------------------------------------------------------

def _layer_problems(
    path: Path, mod: str, elem: ElemFormat | None, scale_dtypes: tuple[str, ...],
    infos: dict[str, TensorInfo], scan: bool,
) -> list[str]:  # fmt: skip
    w = infos.get(mod + ".weight")
    if w is None:
        return [f"{path}: tensor {mod}.weight: missing (the quantization_config lists layer {mod})"]
    scales = [infos[mod + s] for s in SCALE_SUFFIXES if mod + s in infos]
    if not scales:
        return [f"{w.file}: tensor {mod}.weight_scale: missing (the quantization_config lists layer {mod})"]
    if len(scales) > 1:
        return [f"{scales[1].file}: tensor {scales[1].name}: a second scale for {mod} (beside {scales[0].name})"]
    s = scales[0]
    probs = []
    if w.dtype not in FP8_DTYPES:
        probs.append(f"{w.file}: tensor {w.name}: dtype {w.dtype}, expected F8_E4M3 or F8_E5M2")
    elif elem is not None and FP8_DTYPES[w.dtype] != elem.name:
        probs.append(f"{w.file}: tensor {w.name}: dtype {w.dtype} but the quantization_config says {elem.name}")
    if s.dtype not in scale_dtypes:
        want = " or ".join(scale_dtypes)
        probs.append(f"{s.file}: tensor {s.name}: dtype {s.dtype}, expected {want} (biased E8M0 scales)")
    if len(w.shape) != 2:
        probs.append(f"{w.file}: tensor {w.name}: shape {list(w.shape)} is not 2-D")
    elif w.shape[1] % 32 or tuple(s.shape) != (w.shape[0], w.shape[1] // 32):
        probs.append(
            f"{s.file}: tensor {s.name}: shape {list(s.shape)} does not match weight {list(w.shape)} "
            f"(expected {[w.shape[0], w.shape[1] // 32]})"
        )
    if probs or not scan:
        return probs
    nan = "NaN" if w.dtype == "F8_E4M3" else "NaN/Inf"
    checks = ((w, _NONFINITE_MASK[w.dtype], f"{nan} code(s) in the fp8 data", "column"), (s, E8M0_NAN, "block(s) with NaN scale (0xFF)", "block"))
    for info, mask, what, col in checks:
        try:
            n, first = count_codes(info, mask)
        except CheckpointError as e:
            return [str(e)]
        if n:
            r, c = divmod(first, info.shape[1]) if info.shape[1] else (0, 0)
            probs.append(f"{info.file}: tensor {info.name}: {n} {what}, the first at row {r}, {col} {c}")
    return probs


def _fused_problems(path: Path, name: str, elem: ElemFormat, experts: int, scale_dtypes: tuple[str, ...],
                    infos: dict[str, TensorInfo], scan: bool) -> list[str]:  # fmt: skip
    """A fused experts tensor: fp8 [E, N, K] in the config's format with ``<name>_scale`` [E, N, K/32]."""
    w, s = infos.get(name), infos.get(name + "_scale")
    if w is None or s is None:
        miss = name if w is None else name + "_scale"
        return [f"{path}: tensor {miss}: missing (the quantization_config's experts store it)"]
    if w.dtype not in FP8_DTYPES or FP8_DTYPES[w.dtype] != elem.name:
        return [f"{w.file}: tensor {name}: dtype {w.dtype} but the quantization_config says {elem.name}"]
    if s.dtype not in scale_dtypes:
        return [f"{s.file}: tensor {s.name}: dtype {s.dtype}, expected {' or '.join(scale_dtypes)} (biased E8M0 scales)"]
    if len(w.shape) != 3 or w.shape[0] != experts or w.shape[2] % 32 or tuple(s.shape) != (*w.shape[:2], w.shape[2] // 32):
        return [f"{s.file}: tensor {s.name}: shape {list(s.shape)} does not match {name} {list(w.shape)} of {experts} experts"]
    if not scan:
        return []
    probs = []
    for info, mask, what in ((w, _NONFINITE_MASK[w.dtype], "non-finite fp8 code(s)"), (s, E8M0_NAN, "NaN scale(s) (0xFF)")):
        try:
            n, first = count_codes(info, mask)
        except CheckpointError as e:
            return [str(e)]
        if n:
            rows = info.shape[1] * info.shape[2]
            probs.append(f"{info.file}: tensor {info.name}: {n} {what}, the first in expert {first // rows}")
    return probs


def _unlisted(layers: dict, infos: dict[str, TensorInfo], fused: dict | None = None) -> list[str]:
    """fp8 weights and scales of layers the config does not list: they would load without scales."""
    probs = []
    fused = fused or {}
    for name, i in sorted(infos.items()):
        if name in fused or (name.endswith("_scale") and name[: -len("_scale")] in fused):
            continue
        for suffix in SCALE_SUFFIXES:
            if name.endswith(suffix) and name[: -len(suffix)] not in layers:
                probs.append(f"{i.file}: tensor {name}: a scale for a layer the quantization_config does not list")
        if i.dtype in FP8_DTYPES and not (name.endswith(".weight") and name[: -len(".weight")] in layers):
            if len(i.shape) == 3 and ".experts." in name + ".":
                # a fused 3-D experts tensor outside mxq's own format: which axis its blocks run along
                # (gpt-oss stores [E, K, N]) is not recorded, so it cannot be read safely
                probs.append(f"{i.file}: tensor {name}: fused {i.dtype} experts {list(i.shape)} in a checkpoint whose quantization_config "
                             "does not describe them; mxq reads other tools' experts stored one by one (experts.N.<proj>.weight + weight_scale)")
            else:
                probs.append(f"{i.file}: tensor {name}: {i.dtype} data of a layer the quantization_config does not list")
    return probs


def _index_problems(path: Path, infos: dict[str, TensorInfo]) -> list[str]:
    """An index that names a tensor its shard does not hold."""
    import json

    idx = path / INDEX_NAME
    if not idx.is_file():
        return []
    try:
        wm = json.loads(idx.read_text())["weight_map"]
        wm = dict(wm)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return []  # checkpoint_files reports a malformed index
    for name, shard in sorted(wm.items()):
        i = infos.get(name)
        if i is None or Path(i.file).name != shard:
            where = f"is in {Path(i.file).name}" if i is not None else "is in no shard"
            return [f"{idx}: weight_map puts tensor {name} in {shard}, but it {where}"[:400]]
    return []


# floating-point words whose exponent bits are all ones are NaN or +-Inf
_FLOAT_EXP = {"BF16": (torch.int16, 0x7F80), "F16": (torch.int16, 0x7C00), "F32": (torch.int32, 0x7F800000)}


def nonfinite_problems(infos: dict[str, TensorInfo]) -> list[str]:
    """Every high-precision tensor holding NaN or Inf, with the count and the first element."""
    probs = []
    for name, info in sorted(infos.items()):
        if info.dtype not in _FLOAT_EXP or not info.nbytes:
            continue
        n, first = count_nonfinite(info)
        if n:
            probs.append(f"{info.file}: tensor {name}: {n} NaN/Inf value(s), the first at element {first}")
    return probs


def count_nonfinite(info: TensorInfo) -> tuple[int, int]:
    """NaN/Inf values of a F32/F16/BF16 tensor and the flat index of the first (-1 if none), read
    in chunks of 16 MiB from the file."""
    dtype, mask = _FLOAT_EXP[info.dtype]
    size = torch.empty((), dtype=dtype).element_size()
    n, first, done = 0, -1, 0
    with open(info.file, "rb") as f:
        f.seek(info.begin)
        while done < info.nbytes:
            want = min(SCAN_CHUNK, info.nbytes - done)
            buf = f.read(want)
            if len(buf) != want:
                raise CheckpointError(f"{info.file}: tensor {info.name}: truncated ({done + len(buf)} of {info.nbytes} bytes)")
            words = torch.frombuffer(bytearray(buf), dtype=dtype)
            hit = (words & mask) == mask
            k = int(hit.sum())
            if k:
                first = first if first >= 0 else done // size + int(hit.nonzero()[0])
                n += k
            done += want
    return n, first


def _word(byte: int) -> int:
    """``byte`` repeated in the 8 bytes of a signed 64-bit word."""
    w = int.from_bytes(bytes([byte]) * 8, "little")
    return w - (1 << 64) if w >= 1 << 63 else w


_ONES, _HIGH = _word(0x01), _word(0x80)


def _none_match(words: torch.Tensor, mask: int, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether no byte ``x`` of ``words`` has ``x & mask == mask``, eight bytes a word: ``y = x | ~mask``
    is 0xFF exactly in the bytes that match, so ``v = ~y`` is zero there, and a word holds a zero byte
    iff ``(v - 0x01..01) & ~v & 0x80..80`` is nonzero (exact for whether one exists; which byte is left
    to the byte-wise count). ``v - 0x01..01`` is ``-y - 1 - 0x01..01`` (two's complement).
    ``a``, ``b``: scratch of the same shape."""
    torch.bitwise_or(words, _word(~mask & 0xFF), out=a)
    torch.neg(a, out=b)
    b.sub_(_ONES + 1)
    torch.bitwise_and(b, a, out=b)
    torch.bitwise_and(b, _HIGH, out=b)
    return not bool(b.any())


def count_codes(info: TensorInfo, mask: int, wordwise: bool = True) -> tuple[int, int]:
    """How many bytes ``b`` of a tensor's data have ``b & mask == mask``, and the index of the first
    (-1 if none). Reads the file in chunks of 16 MiB (bounded memory); a chunk is first tested eight
    bytes a word (``_none_match``: the usual answer, none, about 2x faster) and counted byte by byte
    only where that finds a match. ``wordwise=False``: byte by byte throughout (the reference the
    tests and ``bench_scan`` hold the word-wise test against)."""
    n, first = 0, -1
    buf = bytearray(min(SCAN_CHUNK, info.nbytes))
    if not buf:
        return 0, -1
    t = torch.frombuffer(buf, dtype=torch.uint8)
    words = torch.frombuffer(buf, dtype=torch.int64, count=len(buf) // 8) if len(buf) >= 8 else None
    scratch = [torch.empty(words.shape, dtype=torch.int64, device="cpu") for _ in range(2)] if words is not None else []
    tmp = torch.empty(t.shape, dtype=torch.uint8, device="cpu")  # also under transformers' meta-device context
    hit = torch.empty(t.shape, dtype=torch.bool, device="cpu")
    with open(info.file, "rb") as f:
        f.seek(info.begin)
        done = 0
        while done < info.nbytes:
            want = min(len(buf), info.nbytes - done)
            got = f.readinto(memoryview(buf)[:want])
            if got != want:
                raise CheckpointError(f"{info.file}: tensor {info.name}: truncated ({done + got} of {info.nbytes} bytes)")
            w = got // 8
            if wordwise and w and _none_match(words[:w], mask, scratch[0][:w], scratch[1][:w]):
                rest = slice(8 * w, got)  # the last few bytes of the tensor, when its size is not a multiple of 8
            else:
                rest = slice(0, got)
            if rest.stop > rest.start:
                torch.bitwise_and(t[rest], mask, out=tmp[rest])
                torch.eq(tmp[rest], mask, out=hit[rest])
                if hit[rest].any():
                    k = int(hit[rest].sum())
                    if first < 0:
                        first = done + rest.start + int(hit[rest].nonzero()[0])
                    n += k
            done += got
    return n, first


def _line(e: BaseException) -> str:
    s = str(e).strip()
    return (s.splitlines()[0] if s else type(e).__name__)[:300]


__all__ = ["Validation", "check_checkpoint", "validate_checkpoint", "count_codes", "SCALE_DTYPES"]
