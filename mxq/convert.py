"""The converter: a Hugging Face model in, an MXFP8 safetensors checkpoint out, one tensor at a time.

Data path: resolve the source (local directory, hub id, GGUF file, embedded default) ->
build the model skeleton on the meta device to learn which tensors are Linear weights ->
plan every output tensor (with a calibration plan: its per-layer specs and kept layers) (quantized Linear weights become ``weight`` fp8 [N, K] plus
``weight_scale`` uint8 [N, K/32]; everything else passes through) -> stream: read a
tensor, fold the plan's channel permutations into it, quantize it, write it -> config, tokenizer and report -> rename into place.

All output goes to a temporary directory beside OUT that is renamed at the end; a failure or
an interrupt removes it, so OUT is either complete or absent.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from glob import escape as glob_escape
from pathlib import Path

import torch

import mxq
from mxq.checkpoint import (
    DTYPE_NAMES,
    INDEX_NAME,
    PlannedTensor,
    ShardWriter,
    TensorInfo,
    read_index,
    read_tensor,
)
from mxq.config import LayerSelectionError, LinearLayer, native_config, read_config, select_layers
from mxq.formats import quantize_mx, sqnr_db
from mxq.models import ModelSource, ModelSourceError, resolve_source
from mxq.progress import progress_bar
from mxq.recipe import Recipe, TensorSpec, load_recipe
from mxq.validate import SCALE_DTYPES

FORMATS = ("mxq", "compressed-tensors")
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
)


class ConversionError(RuntimeError):
    """A conversion that cannot proceed; the message names the file, tensor or option."""


@dataclass
class LayerResult:
    name: str
    shape: tuple[int, int]
    sqnr_db: float
    bytes_before: int
    bytes_after: int


@dataclass
class ConversionReport:
    source: str
    out: str
    recipe: str
    format: str
    device: str
    quantized: list[LayerResult] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)
    bytes_before: int = 0
    bytes_after: int = 0
    seconds: float = 0.0
    n_tensors: int = 0

    @property
    def ratio(self) -> float:
        return self.bytes_before / max(self.bytes_after, 1)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ratio"] = self.ratio
        return d


# --- sources -------------------------------------------------------------------------------------

@dataclass
class _Source:
    """Tensors of a model, listed up front and read one at a time."""

    config: object  # transformers PretrainedConfig
    raw_config: dict
    tensors: list[tuple[str, str, tuple[int, ...]]]  # name, safetensors dtype, shape
    read: Callable[[str], torch.Tensor]
    files_dir: Path | None  # where generation config and tokenizer files live (HF directory)
    gguf: ModelSource | None = None
    generation_config: object = None


def _open_dir(path: Path) -> _Source:
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
    return _Source(
        config, raw, [(i.name, i.dtype, i.shape) for i in infos.values()], lambda n: read_tensor(infos[n]), path
    )


def _open_gguf(src: ModelSource) -> _Source:
    from transformers import AutoModelForCausalLM

    # GGUF weights are block-quantized in their own formats: transformers dequantizes the
    # whole file, so this source holds the model in memory (small models only).
    model = AutoModelForCausalLM.from_pretrained(src.path, gguf_file=src.gguf_file, dtype=torch.bfloat16,
                                                 trust_remote_code=False)
    sd = model.state_dict()
    if getattr(model.config.get_text_config(), "tie_word_embeddings", False):
        sd.pop("lm_head.weight", None)  # tied to the embedding: the loader re-ties it
    tensors = [(k, DTYPE_NAMES[v.dtype], tuple(v.shape)) for k, v in sd.items()]
    return _Source(model.config, model.config.to_dict(), tensors, sd.__getitem__, None, src, model.generation_config)


def _open_source(source: str | os.PathLike | None) -> tuple[ModelSource, _Source]:
    try:
        src = resolve_source(source)
    except ModelSourceError as e:
        raise ConversionError(str(e)) from None
    if src.kind == "gguf":
        return src, _open_gguf(src)
    if src.kind == "hub":
        try:
            from huggingface_hub import snapshot_download

            local = snapshot_download(
                src.path, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
            )
        except Exception as e:  # noqa: BLE001 - network/auth errors of many kinds
            raise ConversionError(f"{src.path}: cannot fetch from the Hugging Face hub ({_line(e)}); pass a local directory") from None
        return src, _open_dir(Path(local))
    return src, _open_dir(Path(src.path))


# --- planning ------------------------------------------------------------------------------------

def _skeleton_linears(config):
    """The model's Linear layers (built on the meta device), the name of its output head, and its
    input embedding (``mxq.embedding.EmbeddingLayer`` with the tied head, or None)."""
    from transformers import AutoModelForCausalLM

    from mxq.embedding import embedding_layer

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as e:  # noqa: BLE001 - a config.json the architecture cannot be built from fails in many ways
        raise ConversionError(f"architecture {getattr(config, 'model_type', '?')!r} is not a causal LM transformers can build ({_line(e)})") from None
    head = model.get_output_embeddings()
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    return linears, [n for n, m in linears.items() if m is head], embedding_layer(model)


def _plan(src: _Source, recipe: Recipe, warn: Callable[[str], None], cplan=None):
    linears, heads, emb = _skeleton_linears(src.config)
    if not set(linears) - set(heads):
        raise ConversionError(
            f"architecture {getattr(src.config, 'model_type', '?')!r} has no torch.nn.Linear layers "
            "besides its output head: nothing to quantize"
        )
    weights = {name: (dtype, shape) for name, dtype, shape in src.tensors}
    layers = []
    for mod in linears:
        if mod + ".weight" in weights:
            dtype, shape = weights[mod + ".weight"]
            layers.append(LinearLayer(mod, tuple(shape), dtype))
        else:
            layers.append(LinearLayer(mod, tied="tied to another tensor (not in the checkpoint)"))
    try:
        selected, kept = select_layers(layers, recipe, warn)
    except LayerSelectionError as e:
        raise ConversionError(str(e)) from None
    chosen = set(selected)
    if not chosen:
        raise ConversionError("no Linear layer is selected for quantization (check the recipe's include/exclude)")
    specs = {m: (recipe.weights, recipe.activations) for m in chosen}
    if cplan is not None:
        for m in sorted(chosen):
            lp = cplan.layers.get(m)
            if lp is None:
                raise ConversionError(f"plan: layers: no entry for {m!r}, which the recipe quantizes (a plan for another model?)")
            if lp.keep_bf16:
                chosen.discard(m)
                kept[m] = f"kept in bf16 by the calibration plan: {lp.reason}"
            else:
                specs[m] = (lp.weights, lp.activations)
        for m in cplan.layers:
            if m not in linears:
                raise ConversionError(f"plan: layers[{m!r}]: the model has no Linear layer of this name")
    emb_choice = _plan_embedding(src, emb, recipe, warn, weights, chosen, kept, specs)
    layout: list[PlannedTensor] = []
    for name, dtype, shape in src.tensors:
        mod = name[: -len(".weight")] if name.endswith(".weight") else None
        if mod in chosen:
            n, k = shape
            layout.append(PlannedTensor(name, DTYPE_NAMES[specs[mod][0].elem.torch_dtype], (n, k)))
            layout.append(PlannedTensor(mod + ".weight_scale", "U8", (n, k // recipe.block_size)))
        else:
            layout.append(PlannedTensor(name, dtype, tuple(shape)))
    return chosen, kept, layout, {m: specs[m] for m in chosen}, emb_choice


def _plan_embedding(src: _Source, emb, recipe: Recipe, warn, weights: dict, chosen: set, kept: dict, specs: dict):
    """The input embedding's part of the plan (``mxq.embedding.select_embedding``, returned; None
    without one): when quantized it joins ``chosen`` and ``specs`` (no activations) and a tied head
    leaves ``kept`` (it shares the embedding's tensors); a stored copy of the tied head's weight is dropped."""
    from mxq.embedding import EmbeddingLayer, select_embedding

    if emb is None or emb.name + ".weight" not in weights:
        return None
    dtype, shape = weights[emb.name + ".weight"]
    try:
        choice = select_embedding(EmbeddingLayer(emb.name, tuple(shape), dtype, emb.head), recipe, warn)
    except LayerSelectionError as e:
        raise ConversionError(str(e)) from None
    if choice.kept:
        kept[emb.name] = choice.kept
    chosen.update(choice.layers())
    specs.update(choice.layers())
    for head in choice.tied():
        kept.pop(head, None)
        src.tensors = [t for t in src.tensors if t[0] != head + ".weight"]  # one copy: the embedding's
    return choice


# --- configs -------------------------------------------------------------------------------------

def compressed_tensors_config(recipe: Recipe, ignore: list[str], embeddings: bool = False) -> dict:
    """The compressed-tensors ``mxfp8-quantized`` layout that vLLM serves (``embeddings``: the
    input embedding is quantized too, targeted by its class name "Embedding")."""
    if recipe.weights.elem.name != "e4m3" or (recipe.activations and recipe.activations.elem.name != "e4m3"):
        raise ConversionError(f"--format compressed-tensors: recipe {recipe.name!r} uses E5M2; the mxfp8-quantized format is E4M3 only")
    if recipe.attention:
        raise ConversionError(f"--format compressed-tensors: recipe {recipe.name!r} uses attention {recipe.attention!r}, a runtime-only mxq feature")

    def args(dynamic: bool) -> dict:
        return {
            "num_bits": 8, "type": "float", "symmetric": True, "group_size": 32, "strategy": "group",
            "dynamic": dynamic, "scale_dtype": "torch.uint8",
        }

    return {
        "quant_method": "compressed-tensors",
        "format": "mxfp8-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear", "Embedding"] if embeddings else ["Linear"],
                "weights": args(False),
                "input_activations": args(True) if recipe.activations else None,
                "output_activations": None,
                "format": "mxfp8-quantized",
            }
        },
        "ignore": sorted(ignore),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }


# --- the conversion ------------------------------------------------------------------------------

def quantize_checkpoint(
    source: str | os.PathLike | None,
    out: str | os.PathLike,
    recipe: Recipe | str | None = None,
    *,
    fmt: str = "mxq",
    device: str = "cpu",
    force: bool = False,
    max_shard_bytes: int = 2 * 1024**3,
    progress: bool = True,
    warn: Callable[[str], None] | None = None,
    plan=None,
    scale_dtype: str = "u8",
) -> ConversionReport:
    """Quantize a model checkpoint to MXFP8 and write it to ``out`` (see the module docstring).

    ``scale_dtype``: how the E8M0 scales are stored: "u8" (uint8, the default) or "e8m0"
    (float8_e8m0fnu, as transformers' own MXFP8 checkpoints); the bits are the same.

    ``plan``: a calibration plan (``mxq.calibrate.Plan`` or the path of its JSON file). Its recipe
    is used (``recipe`` must then be None or the same name), its permutations are folded into the
    tensors as they stream, its per-layer specs replace the recipe's, and its kept layers stay bf16.
    """
    from mxq.calibrate import Plan, PlanError, load_plan
    from mxq.reorder import Geometry, ReorderError, permute_tensor

    t0 = time.perf_counter()
    warn = warn or (lambda m: None)
    if fmt not in FORMATS:
        raise ConversionError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    if scale_dtype not in SCALE_DTYPES:
        raise ConversionError(f"--scale-dtype {scale_dtype!r}: expected one of {', '.join(SCALE_DTYPES)}")
    if scale_dtype != "u8" and fmt == "compressed-tensors":
        raise ConversionError(f"--scale-dtype {scale_dtype}: the compressed-tensors layout stores uint8 scales; use --format mxq")
    if plan is not None and not isinstance(plan, Plan):
        try:
            plan = load_plan(plan)
        except PlanError as e:
            raise ConversionError(str(e)) from None
    if plan is not None:
        name = recipe.name if isinstance(recipe, Recipe) else recipe
        if name is not None and name != plan.recipe.name:
            raise ConversionError(f"--recipe {name!r}: the plan was made for recipe {plan.recipe.name!r}; pass one or the other")
        recipe = plan.recipe
    recipe = recipe if isinstance(recipe, Recipe) else load_recipe(recipe)
    if recipe.rounding == "gptq" and (plan is None or (plan.rounded is None and plan.rounded_file is None)):
        raise ConversionError(
            f"recipe {recipe.name!r}: weights.rounding gptq needs calibration text: "
            "pass --calibrate --dataset D (or --plan with a plan made by `mxq calibrate --rounding gptq`)"
        )
    out = Path(out).expanduser().absolute()
    if out.exists() and not force:
        raise ConversionError(f"{out}: already exists (pass --force to replace it)")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConversionError(f"--device {device}: CUDA is not available on this machine")
    if fmt == "compressed-tensors":
        compressed_tensors_config(recipe, [])  # reject what the format cannot hold before any work

    msrc, src = _open_source(source)
    _check_out(out, msrc, force)
    cplan = plan
    geom = None
    if cplan is not None:
        geom = Geometry.from_config(src.config)
        if geom != cplan.geometry:
            raise ConversionError(f"plan: model: made for {cplan.geometry.to_dict()}, the source is {geom.to_dict()}")
    chosen, kept, layout, specs, emb_choice = _plan(src, recipe, warn, cplan)
    if scale_dtype != "u8":  # the writer stores the uint8 scale bytes as this dtype
        layout = [
            PlannedTensor(t.name, SCALE_DTYPES[scale_dtype], t.shape) if t.name.endswith(".weight_scale") and t.dtype == "U8" else t
            for t in layout
        ]
    report = ConversionReport(msrc.display, str(out), recipe.name, fmt, device, kept=dict(sorted(kept.items())))

    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(out)
    tmp = out.parent / f".{out.name}.mxq-tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    writer = ShardWriter(tmp, layout, max_shard_bytes, {"mxq_version": mxq.__version__, "recipe": recipe.name})
    try:
        for name, tensor in _progress(src, progress):
            mod = name[: -len(".weight")] if name.endswith(".weight") else None
            report.bytes_before += tensor.numel() * tensor.element_size()
            if cplan is not None:
                try:
                    tensor = permute_tensor(name, tensor, cplan.permutations, geom)
                except ReorderError as e:
                    raise ConversionError(f"plan: permutations: {e}") from None
            rounded = cplan.rounded_weight(mod) if cplan is not None and mod in chosen else None
            if rounded is not None:
                data, scales, sqnr = _rounded_weight(name, tensor, rounded, specs[mod][0], recipe.block_size)
            elif mod in chosen:
                data, scales, sqnr = _quantize_weight(name, tensor, specs[mod][0], recipe.block_size, device)
            if mod in chosen:
                writer.write(name, data)
                writer.write(mod + ".weight_scale", scales)
                after = data.numel() + scales.numel()
                report.quantized.append(LayerResult(mod, tuple(tensor.shape), sqnr, tensor.numel() * tensor.element_size(), after))
                report.bytes_after += after
            else:
                writer.write(name, tensor)
                report.bytes_after += tensor.numel() * tensor.element_size()
            report.n_tensors += 1
        writer.close()
        _write_configs(tmp, src, recipe, specs, kept, fmt, msrc, cplan, scale_dtype, embedding=emb_choice)
        report.seconds = time.perf_counter() - t0
        (tmp / "quantization_report.json").write_text(json.dumps(report.to_dict(), indent=1) + "\n")
        _replace(tmp, out, force)
    except OSError as e:
        writer.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        if e.errno == errno.ENOSPC:
            raise ConversionError(f"{out}: no space left on device while writing; nothing was written") from None
        raise ConversionError(f"{out}: {e.strerror or e}; nothing was written") from None
    except BaseException:
        writer.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return report


def _progress(src: _Source, enabled: bool) -> Iterator[tuple[str, torch.Tensor]]:
    from mxq.checkpoint import _itemsize

    total = sum(torch.Size(s).numel() * _itemsize(d) for _, d, s in src.tensors)
    label = "quantize {task.fields[n]}/{task.fields[of]} tensors"
    with progress_bar(label, enabled=enabled, transfer=True) as bar:
        task = bar.add_task("quantize", total=total, n=0, of=len(src.tensors))
        for i, (name, _dtype, _shape) in enumerate(src.tensors):
            t = src.read(name)
            yield name, t
            bar.update(task, advance=t.numel() * t.element_size(), n=i + 1)


def _quantize_weight(name: str, w: torch.Tensor, spec: TensorSpec, block_size: int, device: str):
    w = w.to(device)
    bad = ~torch.isfinite(w)
    if bad.any():
        r, c = (int(i) for i in bad.nonzero()[0])
        val = w[r, c].item()
        b = c // block_size
        raise ConversionError(
            f"tensor {name}: non-finite value {val} at row {r}, block {b} "
            f"(columns {b * block_size}-{(b + 1) * block_size - 1})"
        )
    q = quantize_mx(w, -1, spec.elem, block_size, spec.scale_rule)
    sqnr = sqnr_db(w.float(), q.dequantize())
    return q.data.cpu(), q.scales.cpu(), sqnr


def _rounded_weight(name: str, w: torch.Tensor, rounded, spec: TensorSpec, block_size: int):
    """The plan's GPTQ codes for ``name`` (checked against the source tensor's shape and the spec)."""
    from mxq.formats import MXTensor

    data, scales = rounded
    n, k = w.shape
    if data.dtype != spec.elem.torch_dtype or tuple(data.shape) != (n, k) or scales.dtype != torch.uint8 \
            or tuple(scales.shape) != (n, k // block_size):
        raise ConversionError(
            f"plan: GPTQ codes of {name}: {data.dtype}{list(data.shape)} / {scales.dtype}{list(scales.shape)} "
            f"do not fit the source tensor {list(w.shape)} ({spec.elem.name}); a plan for another model?"
        )
    deq = MXTensor(data, scales, data.shape, 1, block_size, spec.elem).dequantize()
    return data, scales, sqnr_db(w.float(), deq)


def _write_configs(
    tmp: Path, src: _Source, recipe: Recipe, specs: dict, kept: dict, fmt: str, msrc: ModelSource, cplan=None,
    scale_dtype: str = "u8", embedding=None,
) -> None:
    tied = embedding.tied() if embedding is not None else {}
    if src.gguf is not None:
        src.config.save_pretrained(tmp)
        cfg = json.loads((tmp / "config.json").read_text())
        if src.generation_config is not None:
            src.generation_config.save_pretrained(tmp)
        from mxq.models import load_tokenizer

        load_tokenizer(src.gguf).save_pretrained(tmp)
    else:
        cfg = dict(src.raw_config)
        for f in ("generation_config.json", *TOKENIZER_FILES):
            if (src.files_dir / f).is_file():
                shutil.copy2(src.files_dir / f, tmp / f)
    if fmt == "compressed-tensors":
        embs = set(embedding.layers()) if embedding is not None else set()
        if any(w.elem != recipe.weights.elem or (a != recipe.activations and m not in embs) for m, (w, a) in specs.items()):
            raise ConversionError("--format compressed-tensors: the plan sets per-layer formats, which that layout cannot record; use --format mxq")
        # a tied head computing with bf16 activations is "ignored": its weight is the embedding's anyway
        ignore = list(kept) + [h for h, (_, a) in tied.items() if a is None]
        cfg["quantization_config"] = compressed_tensors_config(recipe, ignore, embeddings=bool(embs))
    else:
        layers = dict(specs)
        prov = {
            "mxq_version": mxq.__version__,
            "source": msrc.display,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "torch_version": torch.__version__,
        }
        calib = cplan.config_section() if cplan is not None else None
        cfg["quantization_config"] = native_config(recipe, layers, sorted(kept), prov, calibration=calib, scale_dtype=scale_dtype, tied=tied)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _replace(tmp: Path, out: Path, force: bool) -> None:
    """Move the finished directory into place. Without --force, an OUT that appeared while this
    run worked (another mxq run, say) stays; with it, only a previous mxq output is replaced,
    and only after the new one is complete."""
    if out.exists() or out.is_symlink():
        if not force:
            raise ConversionError(f"{out}: appeared while converting (another run?); it was left as it is")
        _check_replaceable(out)
        old = out.parent / f".{out.name}.mxq-old-{os.getpid()}"
        out.rename(old)
        tmp.rename(out)
        if old.is_symlink() or not old.is_dir():
            old.unlink(missing_ok=True)
        else:
            shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)  # onto a directory made in the last instant this fails unless it is empty


# what an mxq output holds; --force replaces a directory only if it holds nothing else
_OUTPUT_FILES = {"config.json", "generation_config.json", "quantization_report.json", INDEX_NAME, *TOKENIZER_FILES}


def _check_out(out: Path, msrc: ModelSource, force: bool) -> None:
    """OUT is never the source, a directory that contains it, or (with --force) anything but a
    previous mxq output."""
    if msrc.kind in ("dir", "gguf"):
        src = Path(msrc.path).resolve()
        if msrc.kind == "gguf":
            src = src / str(msrc.gguf_file)
        real = out.resolve()
        if real == src or src.is_relative_to(real):
            raise ConversionError(f"{out}: is the source model or contains it ({src}); choose another OUT")
    if force and (out.exists() or out.is_symlink()):
        _check_replaceable(out)


def _check_replaceable(out: Path) -> None:
    target = out.resolve()
    if not target.is_dir():
        raise ConversionError(f"{out}: exists and is not a directory written by mxq; --force replaces only mxq output")
    foreign = sorted(p.name for p in target.iterdir() if p.name not in _OUTPUT_FILES and p.suffix != ".safetensors")
    if foreign or not (target / "quantization_report.json").is_file():
        why = f"holds {foreign[0]!r}" if foreign else "has no quantization_report.json"
        raise ConversionError(f"{out}: not a directory written by mxq ({why}); --force replaces only mxq output")


def _remove_stale(out: Path) -> None:
    """Temporary directories beside OUT left by runs that were killed (their process is gone)."""
    for p in out.parent.glob(f".{glob_escape(out.name)}.mxq-*-*"):
        kind, _, pid = p.name[len(out.name) + 1 :].rpartition("-")
        if kind not in (".mxq-tmp", ".mxq-old") or not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # that run is still going
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError):
            continue
        if p.is_symlink() or not p.is_dir():
            p.unlink(missing_ok=True)
        else:
            shutil.rmtree(p, ignore_errors=True)


def _line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__
