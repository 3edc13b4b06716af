"""Safetensors files read and written one tensor at a time, with strict validation.

mxq reads tensors with plain file reads (no mmap) so that memory holds only the tensor in
hand, and writes shards whose layout is planned up front (every output shape is known before
any data is converted), so tensors stream straight to disk. Every problem is reported with
the file and the tensor name.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,  # MX scales as transformers writes them: the bits of a biased E8M0
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 * 1024 * 1024
INDEX_NAME = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint file that is malformed; the message names the file and the tensor."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str  # path of the shard holding it
    begin: int  # byte offset of the data, from the start of the file
    nbytes: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def itemsize(dtype: str) -> int:
    return torch.empty((), dtype=DTYPES[dtype]).element_size()


def read_header(path: str | os.PathLike) -> tuple[dict[str, TensorInfo], dict]:
    """Parse and validate a safetensors header: bounds, dtypes, sizes, overlaps."""
    path = str(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated (file of {size} bytes has no safetensors header)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise CheckpointError(f"{path}: corrupt header (claims {n} bytes, file has {size})")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"{path}: corrupt header (not valid JSON)") from None
    except RecursionError:
        raise CheckpointError(f"{path}: corrupt header (JSON nested too deeply)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt header (not a JSON object)")
    meta = header.pop("__metadata__", None)
    if meta is None:
        meta = {}
    elif not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise CheckpointError(f"{path}: corrupt header (__metadata__ must map strings to strings)")
    data_start, data_len = 8 + n, size - 8 - n
    infos: dict[str, TensorInfo] = {}
    spans = []
    for name, e in header.items():
        dtype, shape, (b, end) = _entry(path, name, e)
        if dtype not in DTYPES:
            raise CheckpointError(f"{path}: tensor {name}: unsupported dtype {dtype}")
        if not all(type(d) is int and 0 <= d < 2**63 for d in shape):
            raise CheckpointError(f"{path}: tensor {name}: bad shape {list(shape)[:8]}"[:300])
        want = math.prod(shape) * itemsize(dtype)
        if not (type(b) is int and type(end) is int and 0 <= b <= end) or end - b != want:
            raise CheckpointError(f"{path}: tensor {name}: data offsets {[b, end]} do not fit {dtype}{list(shape)}")
        if end > data_len:
            raise CheckpointError(
                f"{path}: tensor {name}: data ends at byte {end} but the file holds {data_len} (truncated file?)"
            )
        spans.append((b, end, name))
        infos[name] = TensorInfo(name, dtype, shape, path, data_start + b, want)
    # the safetensors rule: data offsets contiguous from 0, covering the data buffer exactly
    spans.sort()
    pos, prev = 0, None
    for b, end, name in spans:
        if b < pos:
            raise CheckpointError(f"{path}: tensors {prev} and {name} overlap")
        if b > pos:
            raise CheckpointError(f"{path}: {b - pos} bytes of no tensor before {name} (offsets must be contiguous)")
        pos, prev = end, name
    if pos != data_len:
        raise CheckpointError(f"{path}: {data_len - pos} bytes after the last tensor belong to no tensor")
    return infos, meta


def _entry(path: str, name: str, e: object) -> tuple[str, tuple, tuple]:
    """One header entry checked against the safetensors schema: {"dtype": str, "shape": [int, ...],
    "data_offsets": [int, int]} and nothing else; a one-line error naming the tensor and the key."""
    where = f"{path}: tensor {name[:200]}"
    if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
        got = sorted(map(str, e))[:5] if isinstance(e, dict) else type(e).__name__
        raise CheckpointError(f"{where}: malformed header entry (expected dtype, shape, data_offsets; got {got})"[:400])
    dtype, shape, offsets = e["dtype"], e["shape"], e["data_offsets"]
    if not isinstance(dtype, str):
        raise CheckpointError(f"{where}: dtype must be a string, got {type(dtype).__name__}")
    if not isinstance(shape, list) or not all(type(d) is int for d in shape):
        raise CheckpointError(f"{where}: shape must be a list of integers, got {str(shape)[:60]}"[:400])
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(type(d) is int for d in offsets):
        raise CheckpointError(f"{where}: data_offsets must be two integers, got {str(offsets)[:60]}"[:400])
    return dtype, tuple(shape), tuple(offsets)


def read_tensor(info: TensorInfo) -> torch.Tensor:
    """Read one tensor into its own memory (no mmap: memory holds only this tensor)."""
    with open(info.file, "rb") as f:
        f.seek(info.begin)
        buf = bytearray(info.nbytes)
        got = f.readinto(buf)
    if got != info.nbytes:
        raise CheckpointError(f"{info.file}: tensor {info.name}: truncated ({got} of {info.nbytes} bytes)")
    if info.nbytes == 0:
        return torch.empty(info.shape, dtype=info.torch_dtype)
    return torch.frombuffer(buf, dtype=torch.uint8).view(info.torch_dtype).reshape(info.shape)


def checkpoint_files(path: str | os.PathLike) -> list[Path]:
    p = Path(path)
    idx = p / INDEX_NAME
    if idx.is_file():
        try:
            wm = json.loads(idx.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
            raise CheckpointError(f"{idx}: corrupt index (no weight_map)") from None
        if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
            raise CheckpointError(f"{idx}: weight_map must map tensor names to shard file names (strings)")
        for name in sorted(set(wm.values())):
            # a shard is a file beside the index: never a path that leads out of the model directory
            if Path(name).name != name or name in (".", ".."):
                raise CheckpointError(f"{idx}: shard {name!r} is not a file name in {p}")
        files = sorted({p / f for f in wm.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{idx}: lists shard {missing[0]}, which is missing")
        return _inside(p, files)
    files = sorted(p.glob("*.safetensors"))
    if not files:
        bins = sorted(p.glob("*.bin"))
        hint = " (PyTorch .bin checkpoints are not supported: re-save with safe_serialization)" if bins else ""
        raise CheckpointError(f"{p}: no .safetensors files{hint}")
    return _inside(p, files)


def _inside(directory: Path, files: list[Path]) -> list[Path]:
    """The files, each checked to resolve inside ``directory`` (a symlinked shard may not lead out)."""
    root = directory.resolve()
    for f in files:
        if not f.resolve().is_relative_to(root):
            raise CheckpointError(f"{f}: resolves to {f.resolve()}, outside the model directory {root}")
    return files


def read_index(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """Every tensor of a (possibly sharded) safetensors checkpoint directory, in file order."""
    out: dict[str, TensorInfo] = {}
    for f in checkpoint_files(path):
        infos, _ = read_header(f)
        for name, info in sorted(infos.items(), key=lambda kv: kv[1].begin):
            if name in out:
                raise CheckpointError(f"{f}: tensor {name} also appears in {out[name].file}")
            out[name] = info
    return out


# --- writing -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


class ShardWriter:
    """Writes a set of planned tensors into safetensors shards, one tensor at a time.

    Tensors must arrive in plan order; the headers are written before any data.
    """

    def __init__(self, directory: str | os.PathLike, plan: list[PlannedTensor], max_shard_bytes: int, metadata: dict | None = None):
        self.dir = Path(directory)
        self.metadata = {"format": "pt", **(metadata or {})}
        shards: list[list[PlannedTensor]] = [[]]
        size = 0
        for t in plan:
            if shards[-1] and size + t.nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(t)
            size += t.nbytes
        n = len(shards)
        self.shards = [(f"model-{i + 1:05d}-of-{n:05d}.safetensors", s) for i, s in enumerate(shards)]
        self.order = [(fname, t) for fname, s in self.shards for t in s]
        self._pos = 0
        self._fh = None
        self._fname = None
        self.total_size = sum(t.nbytes for t in plan)

    def _open(self, fname: str, tensors: list[PlannedTensor]) -> None:
        header, off = {}, 0
        for t in tensors:
            header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [off, off + t.nbytes]}
            off += t.nbytes
        header["__metadata__"] = self.metadata
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * ((-len(raw)) % 8)  # data starts 8-byte aligned
        self._fh = open(self.dir / fname, "wb")
        self._fh.write(struct.pack("<Q", len(raw)))
        self._fh.write(raw)
        self._fname = fname

    def write(self, name: str, tensor: torch.Tensor) -> None:
        fname, t = self.order[self._pos]
        if t.dtype == "F8_E8M0" and tensor.dtype == torch.uint8:  # biased E8M0 bytes: the same bits
            tensor = tensor.view(torch.float8_e8m0fnu)
        if name != t.name or DTYPE_NAMES.get(tensor.dtype) != t.dtype or tuple(tensor.shape) != t.shape:
            raise AssertionError(f"writer expected {t.name} {t.dtype}{list(t.shape)}, got {name} {tensor.dtype}{list(tensor.shape)}")
        if fname != self._fname:
            self._close_file()
            self._open(fname, next(s for f, s in self.shards if f == fname))
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        if data.numel():
            self._fh.write(memoryview(data.numpy()))
        self._pos += 1

    def _close_file(self) -> None:
        if self._fh is not None:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()
            self._fh = None

    def close(self) -> None:
        if self._pos != len(self.order):
            raise AssertionError(f"writer closed after {self._pos} of {len(self.order)} tensors")
        if not self.order:  # nothing planned: still write one (empty) shard
            self._open(self.shards[0][0], [])
        self._close_file()
        index = {
            "metadata": {"total_size": self.total_size},
            "weight_map": {t.name: fname for fname, t in self.order},
        }
        (self.dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")

    def abort(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
