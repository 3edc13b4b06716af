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
import re
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from glob import escape as glob_escape
from pathlib import Path

import torch

import mxq
from mxq.checkpoint.config import native_config
from mxq.checkpoint.files import (
    INDEX_NAME,
    PlannedTensor,
    ShardWriter,
)
from mxq.checkpoint.validate import SCALE_DTYPES
from mxq.convert.layout import (
    ConversionLayout,
    ExpertTensor,
    check_format,
    parameter_shares,
    plan_layout,
    warn_unshardable,
)
from mxq.convert.source import ConversionError, TensorSource, open_source
from mxq.formats import quantize_mx, sqnr_db
from mxq.hf.models import ModelSource, ModelSourceError, resolve_source
from mxq.progress import progress_bar, stage
from mxq.recipe import Recipe, TensorSpec, load_recipe

FORMATS = ("mxq", "compressed-tensors")
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
)


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
    shares: dict = field(default_factory=dict)  # parameters quantized: all, routed experts (``convert_layout.parameter_shares``)
    tp_unshardable: dict = field(default_factory=dict)  # TP degree -> weights that would not shard (``mxq.runtime.tp``)

    @property
    def ratio(self) -> float:
        return self.bytes_before / max(self.bytes_after, 1)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ratio"] = self.ratio
        return d


# --- configs -------------------------------------------------------------------------------------

def compressed_tensors_config(recipe: Recipe, ignore: list[str], embeddings: bool = False) -> dict:
    """The compressed-tensors ``quantization_config`` for ``recipe`` (``mxq.checkpoint.config.ct_config``: one
    description of the layout for the writer here and the reader), as a ConversionError naming
    --format where the layout cannot hold the recipe."""
    from mxq.checkpoint.config import ct_config

    try:
        return ct_config(recipe, ignore, embeddings)
    except ValueError as e:
        raise ConversionError(f"--format compressed-tensors: {e}") from None


# --- the conversion ------------------------------------------------------------------------------

def quantize_checkpoint(
    source: str | os.PathLike | TensorSource | None,
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
    allow_nonfinite: bool = False,
) -> ConversionReport:
    """Quantize a model checkpoint to MXFP8 and write it to ``out`` (see the module docstring).
    ``source``: a directory, hub id, GGUF file, None (the embedded default), or a ``TensorSource``
    (tensors read one at a time from anywhere: a model in memory, a generator).

    ``allow_nonfinite``: a NaN or Inf in a tensor kept in high precision is copied with a warning
    naming it, instead of stopping the run (weights being quantized never may hold one).

    ``scale_dtype``: how the E8M0 scales are stored: "u8" (uint8, the default) or "e8m0"
    (float8_e8m0fnu, as transformers' own MXFP8 checkpoints); the bits are the same.

    ``plan``: a calibration plan (``mxq.calib.plan.Plan`` or the path of its JSON file). Its recipe
    is used (``recipe`` must then be None or the same name), its permutations are folded into the
    tensors as they stream, its per-layer specs replace the recipe's, and its kept layers stay bf16.
    """
    t0 = time.perf_counter()
    warn = warn or (lambda m: None)
    _check_options(fmt, scale_dtype, device)
    recipe, cplan = _recipe_and_plan(recipe, plan)
    out = _check_target(out, recipe, fmt, force)

    msrc, src = open_source(source, progress)
    _check_out(out, msrc, force)
    job = _Job(src, recipe, device, allow_nonfinite, warn, cplan, _geometry(src, cplan))
    job.plan = plan_layout(src, recipe, warn, cplan)
    check_format(fmt, recipe, job.plan)
    report = ConversionReport(msrc.display, str(out), recipe.name, fmt, device, kept=dict(sorted(job.plan.kept.items())))
    layout = _scales_stored_as(job.plan.layout, scale_dtype)

    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(out)
    tmp = out.parent / f".{out.name}.mxq-tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    writer = ShardWriter(tmp, layout, max_shard_bytes, {"mxq_version": mxq.__version__, "recipe": recipe.name})
    try:
        for name, tensor in _progress(src, progress):
            _convert_tensor(job, name, tensor, writer, report)
        writer.close()
        p = job.plan
        with stage("writing the configs and the tokenizer", enabled=progress):
            _write_configs(tmp, src, recipe, p.specs, p.kept, fmt, msrc, cplan, scale_dtype, embedding=p.embedding, experts=p.experts)
        report.shares = parameter_shares(src, p)
        report.tp_unshardable = warn_unshardable(src, layout, warn)
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


def check_source(
    source: str | os.PathLike | None, out: str | os.PathLike, recipe: Recipe | str | None = None, *,
    fmt: str = "mxq", device: str = "cpu", force: bool = False, scale_dtype: str = "u8",
) -> None:  # fmt: skip
    """What ``quantize_checkpoint`` refuses before it converts a tensor, checked without a
    calibration plan and without writing anything: the options, OUT, the source's config and
    checkpoint headers, the plan of every output tensor and what the format cannot hold.
    ``mxq quantize --calibrate`` runs it before calibrating, so that a conversion bound to fail
    fails before minutes of calibration. A GGUF source is only resolved here (its reader
    dequantizes the whole file; the calibration loads it next and the conversion plans it)."""
    _check_options(fmt, scale_dtype, device)
    recipe = recipe if isinstance(recipe, Recipe) else load_recipe(recipe)
    out = _check_target(out, recipe, fmt, force)
    try:
        msrc = resolve_source(source)
    except ModelSourceError as e:
        raise ConversionError(str(e)) from None
    if msrc.kind != "gguf":
        msrc, src = open_source(source)
        plan = plan_layout(src, recipe, lambda m: None)  # its warnings come with the conversion
        check_format(fmt, recipe, plan)
    _check_out(out, msrc, force)


def _check_target(out: str | os.PathLike, recipe: Recipe, fmt: str, force: bool) -> Path:
    """OUT as an absolute path, refused if it exists (without ``force``); a recipe the format
    cannot hold is refused here too, before any work."""
    out = Path(out).expanduser().absolute()
    if out.exists() and not force:
        raise ConversionError(f"{out}: already exists (pass --force to replace it)")
    if fmt == "compressed-tensors":
        compressed_tensors_config(recipe, [])
    return out


@dataclass
class _Job:
    """One conversion's settings and its plan, as every tensor sees them."""

    src: TensorSource
    recipe: Recipe
    device: str
    allow_nonfinite: bool
    warn: Callable[[str], None]
    cplan: object = None  # the calibration plan (mxq.calib.plan.Plan), or None
    geometry: object = None  # mxq.calib.reorder.Geometry of the source, with a calibration plan
    plan: ConversionLayout | None = None


def _check_options(fmt: str, scale_dtype: str, device: str) -> None:
    if fmt not in FORMATS:
        raise ConversionError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    if scale_dtype not in SCALE_DTYPES:
        raise ConversionError(f"--scale-dtype {scale_dtype!r}: expected one of {', '.join(SCALE_DTYPES)}")
    if scale_dtype != "u8" and fmt == "compressed-tensors":
        raise ConversionError(f"--scale-dtype {scale_dtype}: the compressed-tensors layout stores uint8 scales; use --format mxq")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConversionError(f"--device {device}: CUDA is not available on this machine")


def _recipe_and_plan(recipe: Recipe | str | None, plan) -> tuple[Recipe, object]:
    """The recipe to apply and the calibration plan (loaded from its file if a path): a plan brings
    its own recipe; a GPTQ recipe needs a plan with rounded codes."""
    from mxq.calib.plan import Plan, PlanError, load_plan

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
    if recipe.rounding != "nearest" and (plan is None or (plan.rounded is None and plan.rounded_file is None)):
        raise ConversionError(
            f"recipe {recipe.name!r}: weights.rounding {recipe.rounding} needs calibration text: "
            f"pass --calibrate --dataset D (or --plan with a plan made by `mxq calibrate --rounding {recipe.rounding}`)"
        )
    return recipe, plan


def _geometry(src: TensorSource, cplan):
    """The source's geometry, checked against the plan's (its permutations fold into these shapes)."""
    if cplan is None:
        return None
    from mxq.calib.reorder import Geometry

    geom = Geometry.from_config(src.config)
    if geom != cplan.geometry:
        raise ConversionError(f"plan: model: made for {cplan.geometry.to_dict()}, the source is {geom.to_dict()}")
    return geom


def _scales_stored_as(layout: list[PlannedTensor], scale_dtype: str) -> list[PlannedTensor]:
    """The writer stores the uint8 scale bytes as ``scale_dtype`` (the same bits)."""
    if scale_dtype == "u8":
        return layout
    return [
        PlannedTensor(t.name, SCALE_DTYPES[scale_dtype], t.shape) if t.name.endswith("_scale") and t.dtype == "U8" else t
        for t in layout
    ]


def _convert_tensor(job: _Job, name: str, tensor: torch.Tensor, writer: ShardWriter, report: ConversionReport) -> None:
    """One source tensor to its output: permuted by the plan, then quantized (a selected Linear
    weight or an expert tensor, with its scales) or copied (checked finite)."""
    p, bs = job.plan, job.recipe.block_size
    mod = name[: -len(".weight")] if name.endswith(".weight") else None
    nbytes = tensor.numel() * tensor.element_size()
    report.bytes_before += nbytes
    report.n_tensors += 1
    if job.cplan is not None:
        from mxq.calib.reorder import ReorderError, permute_tensor

        try:
            tensor = permute_tensor(name, tensor, job.cplan.permutations, job.geometry)
        except ReorderError as e:
            raise ConversionError(f"plan: permutations: {e}") from None
    et = p.expert_tensors.get(name)
    if et is not None:
        from mxq.runtime.experts import canonical

        w = canonical(tensor, et.transposed) if tensor.dim() == 3 else tensor
        got = _rounded_expert_weight(name, w, et, job.cplan, bs) if job.cplan is not None else None
        data, scales, sqnr = got if got is not None else _quantize_weight(name, w, et.spec, bs, job.device)
        layer, scale_name = name, et.scale_name
    elif mod in p.chosen:
        rounded = job.cplan.rounded_weight(mod) if job.cplan is not None else None
        spec = p.specs[mod][0]
        if rounded is not None:
            data, scales, sqnr = _rounded_weight(name, tensor, rounded, spec, bs)
        else:
            data, scales, sqnr = _quantize_weight(name, tensor, spec, bs, job.device)
        layer, scale_name = mod, mod + ".weight_scale"
    else:
        _check_finite(name, tensor, job.allow_nonfinite, job.warn)
        writer.write(name, tensor)
        report.bytes_after += nbytes
        return
    writer.write(name, data)
    writer.write(scale_name, scales)
    after = data.numel() + scales.numel()
    report.quantized.append(LayerResult(layer, tuple(data.shape), sqnr, nbytes, after))
    report.bytes_after += after


def _progress(src: TensorSource, enabled: bool) -> Iterator[tuple[str, torch.Tensor]]:
    from mxq.checkpoint.files import itemsize

    total = sum(torch.Size(s).numel() * itemsize(d) for _, d, s in src.tensors)
    label = "converting {task.fields[n]}/{task.fields[of]} tensors"
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
        idx = [int(i) for i in bad.nonzero()[0]]
        val = w[tuple(idx)].item()
        *lead, r, c = idx
        b = c // block_size
        where = f"expert {lead[0]}, " if lead else ""
        raise ConversionError(
            f"tensor {name}: non-finite value {val} at {where}row {r}, block {b} "
            f"(columns {b * block_size}-{(b + 1) * block_size - 1})"
        )
    q = quantize_mx(w, -1, spec.elem, block_size, spec.scale_rule)
    sqnr = sqnr_db(w.float(), q.dequantize())
    return q.data.cpu(), q.scales.cpu(), sqnr


def _check_finite(name: str, t: torch.Tensor, allow: bool, warn) -> None:
    """A tensor copied as it is must hold no NaN/Inf: it would reach every output unnoticed."""
    if not t.is_floating_point() or t.dtype.itemsize < 2:
        return
    bad = ~torch.isfinite(t)
    if not bad.any():
        return
    idx = [int(i) for i in bad.nonzero()[0]]
    msg = f"tensor {name}: {int(bad.sum())} NaN/Inf value(s), the first {t[tuple(idx)].item()} at index {idx}"
    if not allow:
        raise ConversionError(f"{msg}; nothing was written (--allow-nonfinite copies it with a warning)")
    warn(f"{msg}: copied as it is (--allow-nonfinite)")


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


_PER_EXPERT = re.compile(r"\.(\d+)\.([^.]+)\.weight$")
# a per-expert tensor's rows in its module's codes: gate_up rows [:I] are gate_proj/w1, [I:] up_proj/w3
_PER_EXPERT_ROWS = {"gate_proj": ("gate_up_proj", 0), "w1": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
                    "w3": ("gate_up_proj", 1), "down_proj": ("down_proj", None), "w2": ("down_proj", None)}  # fmt: skip


def _rounded_expert_weight(name: str, w: torch.Tensor, et: ExpertTensor, cplan, block_size: int):
    """The plan's GPTQ codes for the expert tensor ``name`` (``w``: its source values, [E, N, K] for
    a fused tensor, [N, K] for one expert's), or None where the plan has none (direct cast): a
    fused tensor takes its projection's codes whole, a per-expert one the rows of its expert."""
    from mxq.formats import MXTensor

    m = _PER_EXPERT.search(name)
    if w.dim() == 3:
        proj, e, half = name.rpartition(".")[2], None, None
    elif m is not None and m.group(2) in _PER_EXPERT_ROWS:
        (proj, half), e = _PER_EXPERT_ROWS[m.group(2)], int(m.group(1))
    elif any(cplan.rounded_expert_weight(et.module, p) is not None for p in ("gate_up_proj", "up_proj", "down_proj")):
        raise ConversionError(f"plan: GPTQ codes of {et.module}: no rule maps the expert tensor {name} to them")
    else:
        return None
    rounded = cplan.rounded_expert_weight(et.module, proj)
    if rounded is None and proj == "gate_up_proj":  # experts without a gate: up_proj is the whole first projection
        rounded, half = cplan.rounded_expert_weight(et.module, "up_proj"), None
    if rounded is None:
        return None
    data, scales = rounded
    if e is not None:
        if e >= data.shape[0]:
            raise ConversionError(f"plan: GPTQ codes of {et.module}.{proj} hold {data.shape[0]} experts; {name} is expert {e}")
        data, scales = data[e], scales[e]
        if half is not None:
            rows = data.shape[0] // 2
            data, scales = data[half * rows : (half + 1) * rows], scales[half * rows : (half + 1) * rows]
    if data.dtype != et.spec.elem.torch_dtype or data.shape != w.shape or scales.dtype != torch.uint8 \
            or tuple(scales.shape) != (*w.shape[:-1], w.shape[-1] // block_size):
        raise ConversionError(
            f"plan: GPTQ codes of {name}: {data.dtype}{list(data.shape)} / {scales.dtype}{list(scales.shape)} "
            f"do not fit the source tensor {list(w.shape)} ({et.spec.elem.name}); a plan for another model?"
        )
    data, scales = data.contiguous(), scales.contiguous()
    deq = MXTensor(data, scales, data.shape, data.dim() - 1, block_size, et.spec.elem).dequantize()
    return data, scales, sqnr_db(w.float(), deq)


def _write_configs(
    tmp: Path, src: TensorSource, recipe: Recipe, specs: dict, kept: dict, fmt: str, msrc: ModelSource, cplan=None,
    scale_dtype: str = "u8", embedding=None, experts: dict | None = None,
) -> None:
    tied = embedding.tied() if embedding is not None else {}
    if src.gguf is not None:
        src.config.save_pretrained(tmp)
        cfg = json.loads((tmp / "config.json").read_text())
        if src.generation_config is not None:
            src.generation_config.save_pretrained(tmp)
        from mxq.hf.models import load_tokenizer

        load_tokenizer(src.gguf).save_pretrained(tmp)
    else:
        cfg = dict(src.raw_config)
        if src.generation_config is not None and src.files_dir is None:
            src.generation_config.save_pretrained(tmp)
        for f in ("generation_config.json", *TOKENIZER_FILES) if src.files_dir is not None else ():
            if (src.files_dir / f).is_file():
                shutil.copy2(src.files_dir / f, tmp / f)
    if fmt == "compressed-tensors":
        embs = set(embedding.layers()) if embedding is not None else set()
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
        cfg["quantization_config"] = native_config(recipe, layers, sorted(kept), prov, calibration=calib, scale_dtype=scale_dtype,
                                                   tied=tied, experts=experts)  # fmt: skip
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

