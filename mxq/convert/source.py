"""Where the converter's tensors come from: ``TensorSource`` (a model's tensors, listed up front and
read one at a time) and ``open_source`` (a local directory, a hub id, a GGUF file or the embedded
default, resolved by ``mxq.hf.models``). ``ConversionError`` is the converter's one error: a conversion
that cannot proceed, named by file, tensor or option."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from mxq.checkpoint.config import read_config
from mxq.checkpoint.files import DTYPE_NAMES, TensorInfo, read_index, read_tensor
from mxq.hf.models import (
    ModelSource,
    ModelSourceError,
    check_config,
    load_gguf_model,
    resolve_source,
)
from mxq.progress import stage

__all__ = ["ConversionError", "TensorSource", "open_source", "error_line"]


class ConversionError(RuntimeError):
    """A conversion that cannot proceed; the message names the file, tensor or option."""


def error_line(e: BaseException) -> str:
    """An exception's first line (its type's name where it says nothing), for one-line errors."""
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__

@dataclass
class TensorSource:
    """Tensors of a model, listed up front and read one at a time: what the converter streams.
    ``quantize_checkpoint`` opens one from a directory, a hub id or a GGUF file; a caller may pass
    its own, e.g. ``TensorSource.from_model(model)`` for a model in memory, or a reader that makes
    each tensor when it is asked for (a checkpoint larger than memory never exists whole)."""

    config: object  # transformers PretrainedConfig
    raw_config: dict
    tensors: list[tuple[str, str, tuple[int, ...]]]  # name, safetensors dtype, shape
    read: Callable[[str], torch.Tensor]
    files_dir: Path | None = None  # where generation config and tokenizer files live (HF directory)
    gguf: ModelSource | None = None
    generation_config: object = None
    label: str = "tensors in memory"

    @classmethod
    def from_model(cls, model, label: str = "") -> TensorSource:
        """The tensors of an in-memory transformers model (its ``state_dict``; a tied head is left
        to the loader, which re-ties it)."""
        sd = model.state_dict()
        if getattr(model.config.get_text_config(), "tie_word_embeddings", False):
            sd.pop("lm_head.weight", None)
        tensors = [(k, DTYPE_NAMES[v.dtype], tuple(v.shape)) for k, v in sd.items()]
        return cls(model.config, model.config.to_dict(), tensors, sd.__getitem__,
                   generation_config=getattr(model, "generation_config", None),
                   label=label or f"{type(model).__name__} in memory")  # fmt: skip


def _open_dir(path: Path) -> TensorSource:
    from transformers import AutoConfig

    raw = read_config(path)
    if raw.get("quantization_config"):
        qm = raw["quantization_config"].get("quant_method") if isinstance(raw["quantization_config"], dict) else None
        raise ConversionError(f"{path}: already quantized (quant_method {qm!r}); mxq quantize needs a bf16/fp16/fp32 model")
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - transformers' and huggingface_hub's many kinds: all a bad config.json
        raise ConversionError(f"{path}/config.json: {' '.join(str(e).split())[:300] or type(e).__name__}") from None
    infos: dict[str, TensorInfo] = read_index(path)
    return TensorSource(
        config, raw, [(i.name, i.dtype, i.shape) for i in infos.values()], lambda n: read_tensor(infos[n]), path
    )


def _open_gguf(src: ModelSource) -> TensorSource:
    # GGUF weights are block-quantized in their own formats: transformers dequantizes the
    # whole file, so this source holds the model in memory (small models only).
    try:
        model = load_gguf_model(src, torch.bfloat16)
    except ModelSourceError as e:
        raise ConversionError(str(e)) from None
    out = TensorSource.from_model(model)
    out.gguf, out.label = src, src.display
    return out


def open_source(source: str | os.PathLike | TensorSource | None, progress: bool = False) -> tuple[ModelSource, TensorSource]:
    """The source's description and its tensors; a ``TensorSource`` is taken as it is."""
    if isinstance(source, TensorSource):
        return ModelSource("memory", "", label=source.label), source
    try:
        src = resolve_source(source)
    except ModelSourceError as e:
        raise ConversionError(str(e)) from None
    if src.kind == "gguf":
        with stage(f"reading {src.display}", enabled=progress):  # transformers dequantizes it whole
            return src, _open_gguf(src)
    if src.kind == "hub":
        try:
            from huggingface_hub import snapshot_download

            local = snapshot_download(
                src.path, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
            )
        except Exception as e:  # noqa: BLE001 - network/auth errors of many kinds
            raise ConversionError(f"{src.path}: cannot fetch from the Hugging Face hub ({error_line(e)}); pass a local directory") from None
        try:
            check_config(local)  # a local directory had it from resolve_source
        except ModelSourceError as e:
            raise ConversionError(str(e)) from None
        return src, _open_dir(Path(local))
    return src, _open_dir(Path(src.path))
