"""On-disk cache of perplexity results, so ``mxq eval ppl`` computes a figure once.

A result is stored under a key hashed from everything that decides it:

- the model's content: the SHA-256 of its files (a GGUF file and the tokenizer files beside it; a
  model directory's every file except ``quantization_report.json``, which only people read, with
  ``quantization_config.provenance.created`` -- the time of conversion -- left out of
  ``config.json``). A hub id is not cached: its files are not on disk until it loads;
- the exact token windows (their ids, where scoring starts, sequence length and stride);
- the settings: dtype, device (CPU model and instruction sets, or GPU name and CUDA), kernels,
  batch size, torch threads, the versions of Python, torch, transformers, tokenizers, safetensors,
  gguf, triton, numpy and accelerate, the SHA-256 of mxq's own source (``mxq/``, ``kernels/``,
  ``eval/``, ``recipes/``: any code change is a miss) and every environment variable of mxq,
  Triton, oneDNN/MKL/OpenMP, torch or CUDA; on a GPU also the tuning cache's content.

Two smaller entries let a repeated run skip loading a tokenizer: the windows a model's tokenizer
makes of a text (keyed by the model's content, the text's SHA-256, seq_len, stride, max_windows, the
versions and mxq's source) and a tokenizer's vocabulary fingerprint.

Entries are JSON files in ``ppl/`` of mxq's cache folder (``mxq.settings``: ``$MXQ_CACHE``, else
``$XDG_CACHE_HOME/mxq``, else ``~/.cache/mxq``; ``MXQ_CACHE=off`` turns the cache off), written to a temporary file and
renamed into place. Each carries its key and a SHA-256 of its payload; an entry that does not parse,
whose key or checksum disagrees, or whose figures do not fit the windows is reported as corrupt,
ignored and overwritten with a fresh result.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from mxq import settings as mxq_settings

__all__ = [
    "ResultCache",
    "cache_dir",
    "code_digest",
    "file_sha256",
    "settings",
    "source_digest",
    "text_digest",
    "windows_digest",
]

FORMAT = "mxq-ppl-cache/1"
_NOT_HASHED = {"quantization_report.json"}  # written for people; nothing reads it to load a model
_TOKENIZER_SIDE_FILES = (".json", ".txt", ".model", ".jinja")  # beside a GGUF file
_VERSIONED = ("torch", "transformers", "tokenizers", "safetensors", "gguf", "triton", "numpy", "accelerate")
_ENV_PREFIXES = ("TRITON_", "ONEDNN_", "DNNL_", "MKL_", "OMP_", "KMP_", "ATEN_", "TORCH_",
                 "CUDA_", "CUBLAS", "NVIDIA_", "PYTORCH_")
_CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
              "amx_int8", "asimd", "sve", "bf16")
MAX_CACHED_WINDOW_TOKENS = 1 << 23  # windows larger than this (32 MiB of ids) are not cached


def cache_dir() -> Path | None:
    """Where entries live (``ppl/`` in mxq's cache folder, ``mxq.settings``), or None when ``MXQ_CACHE=off``."""
    return mxq_settings.cache_dir("ppl")


# --------------------------------------------------------------------------- digests


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _config_sha256(path: Path) -> str:
    """config.json without the conversion time, which differs between identical conversions."""
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
        prov = cfg["quantization_config"]["provenance"]
        if not isinstance(prov, dict) or "created" not in prov:
            raise KeyError("created")
    except (ValueError, KeyError, TypeError, OSError):
        return file_sha256(path)
    prov.pop("created")
    canon = json.dumps(cfg, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return "config:" + hashlib.sha256(canon.encode("utf-8", "surrogatepass")).hexdigest()


def _files_digest(files: Sequence[tuple[str, Path]]) -> str:
    h = hashlib.sha256()
    for rel, p in sorted(files):
        d = _config_sha256(p) if rel == "config.json" else file_sha256(p)
        h.update(f"{rel}\0{d}\n".encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def source_digest(source: str | os.PathLike | None) -> str | None:
    """The content hash of a model reference (see the module doc), or None where it cannot be
    cached (a hub id, or anything ``mxq.hf.models.resolve_source`` does not resolve)."""
    from mxq.hf.models import ModelSourceError, resolve_source

    try:
        src = resolve_source(source)
    except (ModelSourceError, OSError, ValueError):
        return None
    root = Path(src.path)
    if src.kind == "gguf":
        gguf = root / src.gguf_file
        side = [(p.name, p) for p in root.iterdir()
                if p.is_file() and p.suffix.lower() in _TOKENIZER_SIDE_FILES]  # fmt: skip
        return "gguf:" + _files_digest([(gguf.name, gguf), *side])
    if src.kind == "dir":
        files = []
        for p in root.rglob("*"):
            rel = p.relative_to(root).as_posix()
            if p.is_file() and rel not in _NOT_HASHED and "__pycache__" not in p.parts:
                files.append((rel, p))
        return "dir:" + _files_digest(files)
    return None


def text_digest(texts: Sequence[str] | str) -> str:
    h = hashlib.sha256()
    for t in [texts] if isinstance(texts, str) else texts:
        b = t.encode("utf-8", "surrogatepass")
        h.update(f"{len(b)}\0".encode())
        h.update(b)
    return h.hexdigest()


def windows_digest(windows) -> str:
    """SHA-256 of exactly what is scored: the ids of every window and where scoring starts."""
    h = hashlib.sha256()
    h.update(f"{windows.seq_len}\0{windows.stride}\0{tuple(windows.input_ids.shape)}\0".encode())
    h.update(windows.input_ids.to(torch.int64).contiguous().numpy().tobytes())
    h.update(windows.score_from.to(torch.int64).contiguous().numpy().tobytes())
    return h.hexdigest()


_code_digest: str | None = None


def code_digest() -> str:
    """SHA-256 of mxq's source files (the mxq, mxq.kernels, mxq.eval and mxq.recipes packages)."""
    global _code_digest
    if _code_digest is None:
        h = hashlib.sha256()
        for pkg in ("mxq", "mxq.kernels", "mxq.eval", "mxq.recipes"):
            spec = importlib.util.find_spec(pkg)
            for loc in (spec.submodule_search_locations or []) if spec else []:
                for p in sorted(Path(loc).glob("*")):
                    if p.is_file() and p.suffix in (".py", ".json", ".yaml"):
                        h.update(f"{pkg}/{p.name}\0".encode())
                        h.update(p.read_bytes())
        _code_digest = h.hexdigest()
    return _code_digest


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version(), "machine": platform.machine()}
    for name in _VERSIONED:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _cpu() -> dict:
    name, flags = platform.processor(), set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, val = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model", "CPU part") and name in ("", platform.processor()):
                    name = val.strip()
                elif key in ("flags", "Features"):
                    flags = set(val.split())
                    break
    except OSError:
        pass
    return {
        "name": name,
        "flags": sorted(flags & set(_CPU_FLAGS)),
        "capability": torch.backends.cpu.get_cpu_capability(),
    }


def _gpu(device: torch.device) -> dict:
    props = torch.cuda.get_device_properties(device)
    tune = {}
    try:
        from mxq.kernels.tune import cache_path  # the tuning cache chooses tiles

        p = cache_path()
        if p is not None and Path(p).is_file():
            tune = {"tune_cache": file_sha256(p)}
    except Exception:  # noqa: BLE001 - no tuning cache to read: nothing it could change
        pass
    return {"name": props.name, "capability": list(torch.cuda.get_device_capability(device)),
            "cuda": torch.version.cuda, **tune}  # fmt: skip


def settings(device: torch.device, **options) -> dict:
    """Everything besides the model and the windows that can change a figure (module doc)."""
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith(_ENV_PREFIXES)}
    env.update(mxq_settings.cache_key_environment())
    return {
        **options,
        "device": device.type,
        "hardware": _gpu(device) if device.type == "cuda" else _cpu(),
        "threads": torch.get_num_threads(),
        "versions": _versions(),
        "mxq_source": code_digest(),
        "env": env,
    }


def key_of(kind: str, inputs: dict) -> str:
    canon = json.dumps({"kind": kind, **inputs}, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canon.encode()).hexdigest()


# --------------------------------------------------------------------------- entries


class ResultCache:
    """Entries of one kind of payload under ``directory`` (``cache_dir()`` by default); a cache
    whose directory is None stores and finds nothing. ``warn`` reports a corrupt entry."""

    def __init__(self, directory: Path | None | str = "default", warn: Callable[[str], None] | None = None):
        self.directory = cache_dir() if directory == "default" else (Path(directory) if directory else None)
        self.warn = warn or (lambda msg: None)

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    def path(self, kind: str, key: str) -> Path:
        assert self.directory is not None
        return self.directory / f"{kind}-{key}.json"

    def get(self, kind: str, key: str, check: Callable[[dict], str | None] | None = None) -> dict | None:
        """The payload stored under ``key``, or None (no entry; or a corrupt one, reported).
        ``check(payload)`` returns why the payload does not fit, or None when it does."""
        if self.directory is None:
            return None
        p = self.path(kind, key)
        try:
            raw = p.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            self.warn(f"cannot read cache entry {p} ({e.strerror or e}); recomputing")
            return None
        why = None
        try:
            entry = json.loads(raw)
            if not isinstance(entry, dict) or entry.get("format") != FORMAT:
                why = "not an entry of this format"
            elif entry.get("kind") != kind or entry.get("key") != key:
                why = "its key does not match its name"
            elif not isinstance(entry.get("payload"), dict) or entry.get("payload_sha256") != payload_sha256(entry["payload"]):
                why = "its checksum does not match"
            elif check is not None:
                why = check(entry["payload"])
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            why = f"unreadable: {type(e).__name__}"
        if why is not None:
            self.warn(f"ignoring a corrupt cache entry {p} ({why}); recomputing")
            return None
        return {**entry["payload"], "_cache": {"entry": str(p), "written_at": entry.get("written_at", "")}}

    def put(self, kind: str, key: str, payload: dict, inputs: dict | None = None) -> Path | None:
        """Store ``payload`` (JSON-serializable) under ``key``: a temporary file renamed into place.
        A cache that cannot be written is reported and skipped; the run goes on."""
        if self.directory is None:
            return None
        p = self.path(kind, key)
        entry = {
            "format": FORMAT,
            "kind": kind,
            "key": key,
            "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "inputs": inputs or {},
            "payload": payload,
            "payload_sha256": payload_sha256(payload),
        }
        tmp = None
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(entry, f, default=str)
            os.replace(tmp, p)
            tmp = None
        except OSError as e:
            self.warn(f"cannot write cache entry {p} ({e.strerror or e}); not cached")
            return None
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
        return p


def payload_sha256(payload: dict) -> str:
    """The checksum an entry stores of its payload (canonical JSON, SHA-256), checked on every read."""
    canon = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canon.encode("utf-8", "surrogatepass")).hexdigest()


# --------------------------------------------------------------------------- windows as JSON


def windows_payload(windows) -> dict | None:
    """A Windows as JSON (ids as base64 int32), or None when too large to be worth caching."""
    ids = windows.input_ids
    if ids.numel() > MAX_CACHED_WINDOW_TOKENS or (ids.numel() and int(ids.max()) >= 2**31):
        return None
    return {
        "shape": list(ids.shape),
        "ids_int32_b64": base64.b64encode(ids.to(torch.int32).contiguous().numpy().tobytes()).decode("ascii"),
        "score_from": [int(s) for s in windows.score_from],
        "seq_len": windows.seq_len,
        "stride": windows.stride,
        "n_text_tokens": windows.n_text_tokens,
        "n_windows_total": windows.n_windows_total,
        "tokenizer_id": windows.tokenizer_id,
        "digest": windows_digest(windows),
    }


def windows_from_payload(d: dict):
    """The Windows a payload holds; ValueError when it is inconsistent (a corrupt entry)."""
    import numpy as np

    from mxq.eval.perplexity import Windows

    n, s = (int(x) for x in d["shape"])
    buf = base64.b64decode(d["ids_int32_b64"], validate=True)
    if len(buf) != 4 * n * s or len(d["score_from"]) != n or s != int(d["seq_len"]):
        raise ValueError("windows of the wrong size")
    ids = torch.from_numpy(np.frombuffer(buf, dtype="<i4").astype(np.int64).reshape(n, s))
    w = Windows(
        input_ids=ids,
        score_from=torch.tensor(d["score_from"], dtype=torch.long),
        seq_len=s,
        stride=None if d["stride"] is None else int(d["stride"]),
        n_text_tokens=int(d["n_text_tokens"]),
        n_windows_total=int(d["n_windows_total"]),
        tokenizer_id=str(d["tokenizer_id"]),
    )
    if windows_digest(w) != d["digest"]:
        raise ValueError("windows do not match their digest")
    return w


# --------------------------------------------------------------------------- one `mxq eval ppl` run

_RESULT_FIELDS = ("ppl", "nll_sum", "n_tokens", "n_windows", "per_window_nll", "tokens_per_s", "peak_mem_bytes",
                  "peak_mem_kind", "seq_len", "stride", "elapsed_s", "device")  # fmt: skip


class PerplexityCache:
    """The cache as one perplexity run uses it: windows, tokenizer fingerprints and results of the
    models it names, for one text, window geometry and set of settings (``settings()``)."""

    def __init__(self, texts: Sequence[str] | str, seq_len: int, stride: int | None, max_windows: int | None,
                 settings: dict, store: ResultCache | None = None):  # fmt: skip
        self.store = store or ResultCache()
        self.settings = settings
        code = {"versions": settings["versions"], "mxq_source": settings["mxq_source"]}
        self._windows_inputs = {"text": text_digest(texts), "seq_len": seq_len, "stride": stride,
                                "max_windows": max_windows, **code}  # fmt: skip
        self._tokenizer_inputs = code
        self._idents: dict[str, str | None] = {}

    @property
    def enabled(self) -> bool:
        return self.store.enabled

    def identity(self, source) -> str | None:
        """The content hash of a model reference (None: not cacheable, or the cache is off)."""
        if not self.enabled:
            return None
        k = str(source)
        if k not in self._idents:
            self._idents[k] = source_digest(source)
        return self._idents[k]

    # windows
    def windows(self, ident: str):
        inputs = {"model": ident, **self._windows_inputs}
        got = self.store.get("windows", key_of("windows", inputs), check=self._windows_check)
        return None if got is None else windows_from_payload(got)

    def _windows_check(self, d: dict) -> str | None:
        try:
            w = windows_from_payload(d)
        except (KeyError, TypeError, ValueError) as e:
            return f"windows: {e}"
        want = self._windows_inputs
        if w.seq_len != want["seq_len"] or w.stride != want["stride"]:
            return "windows of another geometry"
        return None

    def put_windows(self, ident: str, windows) -> None:
        payload = windows_payload(windows)
        if payload is not None:
            inputs = {"model": ident, **self._windows_inputs}
            self.store.put("windows", key_of("windows", inputs), payload, inputs)

    # tokenizer fingerprints
    def fingerprint(self, ident: str) -> str | None:
        inputs = {"model": ident, **self._tokenizer_inputs}
        got = self.store.get("tokenizer", key_of("tokenizer", inputs),
                             check=lambda d: None if isinstance(d.get("tokenizer_id"), str) else "no tokenizer_id")  # fmt: skip
        return None if got is None else got["tokenizer_id"]

    def put_fingerprint(self, ident: str, tokenizer_id: str) -> None:
        inputs = {"model": ident, **self._tokenizer_inputs}
        self.store.put("tokenizer", key_of("tokenizer", inputs), {"tokenizer_id": tokenizer_id}, inputs)

    # results
    def _result_inputs(self, ident: str, windows) -> dict:
        return {"model": ident, "windows": windows_digest(windows), **self.settings}

    def result(self, ident: str, windows):
        """The cached PerplexityResult of this model on these windows, or None. Its ``extra["cache"]``
        says where it came from and when it was computed."""
        from mxq.eval.perplexity import PerplexityResult

        key = key_of("result", self._result_inputs(ident, windows))
        got = self.store.get("result", key, check=lambda d: _result_check(d, windows))
        if got is None:
            return None
        fields = {k: got[k] for k in _RESULT_FIELDS}
        return PerplexityResult(
            **fields,
            protocol=windows.protocol,
            n_windows_total=windows.n_windows_total,
            extra={"cache": {"hit": True, **got["_cache"]}},
        )

    def put_result(self, ident: str, windows, result) -> None:
        inputs = self._result_inputs(ident, windows)
        payload = {k: getattr(result, k) for k in _RESULT_FIELDS}
        if _result_check(payload, windows) is not None:
            return  # nothing to reuse (e.g. a perplexity of inf)
        p = self.store.put("result", key_of("result", inputs), payload, inputs)
        if p is not None:
            result.extra["cache"] = {"hit": False, "entry": str(p)}


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _result_check(d: dict, windows) -> str | None:
    """Why a stored result does not fit these windows (None: it does)."""
    import math

    missing = [k for k in _RESULT_FIELDS if k not in d]
    if missing:
        return f"missing {', '.join(missing)}"
    if not all(_is_num(d[k]) for k in ("ppl", "nll_sum", "n_tokens", "n_windows", "tokens_per_s", "elapsed_s")):
        return "a figure that is not a number"
    if d["n_windows"] != windows.n_windows or d["n_tokens"] != windows.n_scored:
        return "figures for other windows"
    if d["seq_len"] != windows.seq_len or d["stride"] != windows.stride:
        return "figures for another geometry"
    per = d["per_window_nll"]
    if not isinstance(per, list) or len(per) != windows.n_windows or not all(_is_num(x) for x in per):
        return "per-window figures for other windows"
    if not (math.isfinite(d["ppl"]) and d["ppl"] > 0 and math.isfinite(d["nll_sum"])):
        return "a perplexity that is not finite"
    mean = d["nll_sum"] / d["n_tokens"]
    if not math.isclose(math.log(d["ppl"]), mean, rel_tol=1e-9, abs_tol=1e-12):
        return "a perplexity that disagrees with its NLL"
    scored = (windows.seq_len - windows.score_from).tolist()
    total = sum(x * n for x, n in zip(per, scored))
    if not math.isclose(total, d["nll_sum"], rel_tol=1e-9, abs_tol=1e-9):
        return "per-window figures that disagree with the total"
    return None
