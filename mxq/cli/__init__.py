"""The ``mxq`` command line: one function per command; errors are one line (``--debug`` for tracebacks)."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

import mxq  # cheap: torch and transformers load with the first command that needs them
from mxq.progress import stage

if TYPE_CHECKING:
    from mxq.calib.calibrator import CalibrationOptions
    from mxq.calib.plan import Plan
    from mxq.recipe import Recipe

app = typer.Typer(
    name="mxq",
    help="Quantize Hugging Face language models to MXFP8 (OCP Microscaling) and run them fast.",
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help: wraps at word boundaries in 80 columns (details: README)
)
console = Console()

from mxq.cli.eval import eval_app  # noqa: E402

app.add_typer(eval_app, name="eval")

from mxq.cli.bench import bench_cmd  # noqa: E402

app.command("bench", short_help="Run the benchmarks on a GPU: JSON, plots, SUMMARY.md.")(bench_cmd)

from mxq.cli.tune import tune_cmd  # noqa: E402

app.command("tune", short_help="Tune the decode GEMM's tiles for a model's shapes (GPU).")(tune_cmd)

from mxq.cli.inspect_cmd import fmt_bytes, inspect_cmd  # noqa: E402

app.command("inspect", short_help="Describe and validate a checkpoint.")(inspect_cmd)

# Options that `mxq calibrate` and `mxq quantize --calibrate` share: one definition each.
ModelArg = Annotated[str, typer.Argument(
    help="HF model directory, hub id, .gguf file, or default (the embedded SmolLM2-135M-Instruct).", show_default=False)]
RecipeOpt = Annotated[str, typer.Option(
    "--recipe", "-r", help="mxfp8, mxfp8-w8a16, mxfp8-e5m2, mxfp8-attn, mxfp8-lm-head, mxfp8-all, or a YAML file.")]
Samples = Annotated[int, typer.Option("--samples", help="Calibration windows.")]
SeqLen = Annotated[int, typer.Option("--seq-len", help="Tokens per calibration window.")]
KeepBf16 = Annotated[int, typer.Option("--keep-bf16", help="Keep the N most sensitive layers in bf16.")]
KEEP_BYTES_DEFAULT = 3.5  # percent: the best measured on SmolLM2 with GPTQ (eval/CALIBRATION_RESULTS.md)
KeepBytes = Annotated[float | None, typer.Option(
    "--keep-bytes", show_default=False,
    help=f"Keep the most sensitive layers in bf16 within PCT % more bytes (default {KEEP_BYTES_DEFAULT}).")]
MaxDppl = Annotated[float | None, typer.Option(
    "--max-dppl", show_default=False,
    help="Keep the fewest layers in bf16 that hold the perplexity rise to X %.")]
Reorder = Annotated[bool, typer.Option("--reorder/--no-reorder", help="Fold channel permutations that raise SQNR.")]
ScaleSearch = Annotated[bool, typer.Option(
    "--scale-search/--no-scale-search", help="Per layer, the better of the recipe's scale rule and MSE.")]
SensSamples = Annotated[int, typer.Option("--sensitivity-samples", help="Windows for the per-layer KL.")]
SensSeqLen = Annotated[int, typer.Option("--sensitivity-seq-len", help="Tokens per KL window.")]
DATASET_HELP = "Calibration text: wikitext2, pydoc, or a .txt/.jsonl/.parquet file."
Rounding = Annotated[str, typer.Option("--rounding", help="Weight codes: gptq, signround (each layer's codes tuned against its output), signround-scales (its block scales tuned too) or nearest (direct cast).")]
Iters = Annotated[int | None, typer.Option(
    "--iters", show_default=False, help="signround: signed steps per layer (default 50; more: closer, slower).")]
ExpertsAllTokens = Annotated[bool, typer.Option(
    "--experts-all-tokens", help="GPTQ: every routed expert learns from every token.")]


def _version(value: bool) -> None:
    if value:
        console.print(f"mxq {mxq.__version__}")
        raise typer.Exit()


@app.callback(invoke_without_command=True)
def _root(
    ctx: typer.Context,
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks on errors."),
    verbose: bool = typer.Option(False, "--verbose", help="Show the libraries' own progress bars and warnings."),
) -> None:
    del debug  # declared here for --help; main() looks for it in argv before typer runs
    if ctx.invoked_subcommand is None:  # bare `mxq`: the help, and success
        typer.echo(ctx.get_help())
        raise typer.Exit(0)
    if not verbose:
        ctx.call_on_close(quiet_libraries())


def quiet_libraries():
    """What transformers, torch and the GGUF reader print on their own and that tells an `mxq` user
    nothing (a progress bar for every GGUF load, tokenizer notes, deprecation warnings): off, until
    the returned function puts the settings back (the command line calls it when the command ends,
    which matters only to callers that run commands inside their own process). mxq's own progress
    and warnings stay; `mxq --verbose` keeps the libraries' too. `import mxq` changes nothing."""
    import functools
    import importlib
    import warnings

    from huggingface_hub import utils as hub
    from transformers.utils import logging as hf_logging

    kept_warnings = warnings.catch_warnings()  # its exit puts the filters back
    kept_warnings.__enter__()
    verbosity, bars, hub_bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled(), not hub.are_progress_bars_disabled()
    warnings.filterwarnings("ignore")
    warnings.filterwarnings("default", module=r"mxq(\.|$)")
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # "Loading weights"; it turns the hub's download bars off too:
    if hub_bars:
        hub.enable_progress_bars()  # a download of minutes keeps its bar
    try:  # the GGUF reader's bar is a plain tqdm that transformers' switch does not reach
        gguf = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    except ImportError:
        gguf = None
    tqdm = getattr(gguf, "tqdm", None)
    if tqdm is not None:
        gguf.tqdm = functools.partial(tqdm, disable=True)

    def restore() -> None:
        kept_warnings.__exit__(None, None, None)
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
        (hub.enable_progress_bars if hub_bars else hub.disable_progress_bars)()
        if tqdm is not None:
            gguf.tqdm = tqdm

    return restore


@app.command("formats", short_help="Print the MX element formats and the scale rules.")
def formats_cmd() -> None:
    """Print the MX element formats, the E8M0 scale and the scale rules."""
    t = Table(title="MX element formats (block of 32 elements share one E8M0 scale)")
    for col in (
        "format",
        "bits",
        "bias",
        "emax",
        "max normal",
        "min normal",
        "min subnormal",
        "Inf",
        "NaN byte",
        "torch dtype",
    ):
        t.add_column(col)
    from mxq import formats as F

    for f in F.ELEM_FORMATS.values():
        t.add_row(
            f.name.upper(),
            f"1.{f.ebits}.{f.mbits}",
            str(f.bias),
            str(f.emax),
            f"±{f.max_normal:g}",
            f"2^{int(_log2(f.min_normal))}",
            f"2^{int(_log2(f.min_subnormal))}",
            "yes" if f.has_inf else "no",
            f"0x{f.nan_byte:02X}",
            str(f.torch_dtype).replace("torch.", ""),
        )
    t.add_row(
        "E8M0 (scale)",
        "0.8.0",
        str(F.E8M0_BIAS),
        "127",
        "2^127",
        "2^-127",
        "-",
        "no",
        f"0x{F.E8M0_NAN:02X}",
        "uint8",
    )
    console.print(t)
    r = Table(title="Scale rules (shared exponent e of a block with absolute max amax)")
    r.add_column("rule")
    r.add_column("exponent")
    r.add_row("floor", "floor(log2 amax) - emax  (OCP v1.0; may clip the block max)")
    r.add_row("rceil", "ceil(log2(amax / max normal))  (never clips; the default)")
    r.add_row("even", "floor(log2(amax rounded to the element's mantissa width)) - emax")
    r.add_row("mse", "least squared error among rceil, rceil-1, rceil-2  (for weights)")
    console.print(r)
    console.print(
        f"Finite blocks get e clamped to [{F.E8M0_MIN_EXP}, {F.E8M0_MAX_EXP}] (never byte 0: Triton <= 3.8 "
        "decodes it as zero); blocks holding NaN or Inf get scale 0xFF."
    )


@app.command("kernels", short_help="List the kernel paths, in dispatch order.")
def kernels_cmd() -> None:
    """List the kernel paths, in the order each function's dispatch tries them (``--kernels`` names)."""
    from mxq.kernels import registry

    registry.load_paths()  # every registry registers on import
    for reg in registry.REGISTRIES.values():
        t = Table(title=f"{reg.what}: the first path that takes a call runs it")
        t.add_column("path")
        t.add_column("what it is")
        for path in reg:
            t.add_row(path.name, path.summary)
        console.print(t)
    console.print(
        "--kernels / MXQ_KERNELS / mxq.set_kernels(model, ...): auto (all, in this order), reference, "
        "or comma-separated names (only those; the reference stays the last resort)."
    )


@app.command("quantize")
def quantize_cmd(
    model: ModelArg = None,
    out: Path = typer.Argument(None, help="Output directory. Default: out/MODEL-RECIPE.", show_default=False),
    recipe: RecipeOpt = "mxfp8",
    fmt: str = typer.Option("mxq", "--format", help="mxq or compressed-tensors (vLLM)."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    force: bool = typer.Option(False, "--force", help="Replace OUT if it exists."),
    max_shard_size: float = typer.Option(2.0, "--max-shard-size", help="Largest shard, in GiB."),
    scale_dtype: str = typer.Option("u8", "--scale-dtype", help="Scales stored as u8 or e8m0 (bits alike)."),
    allow_nonfinite: bool = typer.Option(
        False, "--allow-nonfinite", help="Copy a NaN/Inf of a kept tensor, with a warning."
    ),
    calibrate: bool = typer.Option(False, "--calibrate", help="Calibrate on --dataset first (options below)."),
    plan: Path = typer.Option(None, "--plan", help="Apply a plan from `mxq calibrate`.", show_default=False),
    dataset: str = typer.Option(None, "--dataset", help=DATASET_HELP, show_default=False),
    samples: Samples = 64,
    seq_len: SeqLen = 512,
    keep_bf16: KeepBf16 = 0,
    max_dppl: MaxDppl = None,
    keep_bytes: KeepBytes = None,
    reorder: Reorder = True,
    scale_search: ScaleSearch = True,
    plan_out: Path = typer.Option(None, "--plan-out", help="Also save the plan here.", show_default=False),
    sensitivity_samples: SensSamples = 2,
    sensitivity_seq_len: SensSeqLen = 256,
    rounding: Rounding = "gptq",
    iters: Iters = None,
    experts_all_tokens: ExpertsAllTokens = False,
) -> None:
    """Quantize a model to MXFP8 and write a safetensors checkpoint."""
    from mxq.convert.converter import quantize_checkpoint

    opts = _calibration_options(locals())
    if not (math.isfinite(max_shard_size) and max_shard_size > 0 and max_shard_size * 1024**3 >= 1):
        raise typer.BadParameter(f"--max-shard-size must be a finite positive size in GiB, got {max_shard_size}")
    if scale_dtype not in ("u8", "e8m0"):
        raise typer.BadParameter(f"--scale-dtype must be u8 or e8m0, got {scale_dtype!r}")
    _check_plan_source(calibrate, plan, plan_out, opts)

    def started(rec: Recipe) -> None:  # the recipe is known: name the work before any long stretch
        nonlocal out
        if out is None:
            stem = Path(model).stem if model else "smollm2-135m-instruct"
            out = Path("out") / f"{stem}-{rec.name}"
        _print_header(model, out)
        if calibrate:  # what the conversion would refuse, before the calibration's minutes
            from mxq.convert.converter import check_source

            check_source(model, out, rec, fmt=fmt, device=device, force=force, scale_dtype=scale_dtype)

    rec, cplan = _quantize_plan(model, recipe, plan, opts if calibrate else None, plan_out, started)
    warn = lambda m: console.print(f"[yellow]warning:[/] {m}")
    report = quantize_checkpoint(
        model,
        out,
        None if cplan is not None else rec,
        fmt=fmt,
        device=device,
        force=force,
        max_shard_bytes=int(max_shard_size * 1024**3),
        warn=warn,
        plan=cplan,
        scale_dtype=scale_dtype,
        allow_nonfinite=allow_nonfinite,
    )
    _print_report(report)


def _print_header(model: str | None, out: Path) -> None:
    """``mxq quantize: SOURCE -> OUT``, first on stdout (the report's opening line), so that a
    log shows what runs before minutes of work. A source that does not resolve is named as given:
    the conversion reports that error in its own words."""
    from mxq.hf.models import resolve_source

    try:
        src = resolve_source(model).display
    except Exception:  # noqa: BLE001 - reported by the conversion
        src = str(model)
    print(f"mxq quantize: {src} -> {out}", flush=True)


def _calibration_options(params: dict) -> CalibrationOptions:
    """The calibration options of a command (``locals()`` at its start): its parameters of the
    same names as ``CalibrationOptions``' fields, so that both commands build them one way."""
    import dataclasses

    from mxq.calib.calibrator import CalibrationOptions

    return CalibrationOptions(**{f.name: params[f.name] for f in dataclasses.fields(CalibrationOptions)})


def _check_plan_source(calibrate: bool, plan: Path | None, plan_out: Path | None, opts: CalibrationOptions) -> None:
    """`mxq quantize` takes --calibrate or --plan, and the calibration options only with --calibrate."""
    if calibrate and plan is not None:
        raise typer.BadParameter("pass --calibrate or --plan, not both")
    if not calibrate and (opts.dataset or opts.keep_bf16 or opts.max_dppl is not None or opts.keep_bytes is not None or plan_out
                          or opts.experts_all_tokens or opts.iters is not None):  # fmt: skip
        raise typer.BadParameter(
            "--dataset, --keep-bf16, --max-dppl, --keep-bytes, --plan-out, --iters and --experts-all-tokens go with --calibrate"
        )


def _quantize_plan(model: str | None, recipe: str, plan: Path | None, opts: CalibrationOptions | None,
                   plan_out: Path | None, started=lambda rec: None) -> tuple[Recipe, Plan | None]:  # fmt: skip
    """The recipe and calibration plan `mxq quantize` converts with: the --plan file's, or --recipe
    with a plan calibrated here (``opts``: --calibrate, the plan also saved to ``plan_out``), or
    --recipe alone. ``started(recipe)`` runs once the recipe is known, before any calibration."""
    from mxq.recipe import load_recipe

    if plan is not None:
        from mxq.calib.plan import load_plan

        cplan = load_plan(plan)
        if recipe not in ("mxfp8", cplan.recipe.name):
            raise typer.BadParameter(f"--recipe {recipe!r}: the plan was made for recipe {cplan.recipe.name!r}")
        started(cplan.recipe)
        return cplan.recipe, cplan
    rec = load_recipe(recipe)
    started(rec)
    if opts is None:
        return rec, None
    if not opts.dataset:
        raise typer.BadParameter("--calibrate needs --dataset")
    cplan = run_calibration(model, rec, opts)
    if plan_out:
        from mxq.calib.plan import save_plan

        save_plan(cplan, plan_out)
        console.print(f"plan written to {plan_out}")
    return rec, cplan


def run_calibration(model: str | None, rec: Recipe, opts: CalibrationOptions) -> Plan:
    """Calibrate ``model`` on ``opts.dataset``, make the plan and round its weights as
    ``opts.rounding`` says; the plan is printed and returned."""
    import torch

    from mxq.calib.calibrator import calibrate, make_plan
    from mxq.eval.data import chars_for_tokens, load_texts
    from mxq.hf.models import load_model, resolve_device

    opts = _checked_calibration(opts, rec)
    with stage(f"reading the calibration text ({opts.dataset})"):
        texts = load_texts(opts.dataset, max_chars=chars_for_tokens(opts.samples * opts.seq_len))  # a text file: only what the windows need
    with stage("loading the model"):
        m, tok = load_model(model, device=resolve_device(opts.device), dtype=torch.bfloat16)
    cal = calibrate(
        m,
        tok,
        texts,
        rec,
        samples=opts.samples,
        seq_len=opts.seq_len,
        dataset=str(opts.dataset),
        sensitivity_samples=opts.sensitivity_samples,
        sensitivity_seq_len=opts.sensitivity_seq_len,
    )
    with stage("choosing permutations, scale rules and the layers kept in bf16"):
        p = make_plan(
            m, cal, reorder=opts.reorder, scale_search=opts.scale_search, keep_bf16=opts.keep_bf16, max_dppl=opts.max_dppl,
            keep_bytes=opts.keep_bytes or None,
        )
    if opts.rounding == "gptq":
        from mxq.calib.gptq import round_plan

        round_plan(m, p, cal.batches, experts_all_tokens=opts.experts_all_tokens)
    elif opts.rounding in ("signround", "signround-scales"):
        from mxq.calib.signround import SIGNROUND_ITERS, signround_plan

        signround_plan(m, p, cal.batches, iters=opts.iters or SIGNROUND_ITERS, scales=opts.rounding == "signround-scales")
    else:
        p.choices["rounding"] = "nearest"
    _print_plan(p)
    return p


def _checked_calibration(opts: CalibrationOptions, rec: Recipe) -> CalibrationOptions:
    """``opts`` with the --keep-bytes default where no other budget is given; bad combinations are
    refused before the model loads."""
    import dataclasses

    from mxq.recipe import ROUNDINGS

    if opts.keep_bf16 < 0 or (opts.max_dppl is not None and opts.max_dppl < 0) or (opts.keep_bytes is not None and not opts.keep_bytes >= 0):
        raise typer.BadParameter("--keep-bf16, --max-dppl and --keep-bytes must not be negative")
    if opts.rounding not in ROUNDINGS:
        raise typer.BadParameter(f"--rounding {opts.rounding!r}: expected one of {', '.join(ROUNDINGS)}")
    if opts.rounding != "nearest" and rec.weights.scale_rule.value not in ("rceil", "mse"):
        raise typer.BadParameter(f"--rounding {opts.rounding}: recipe {rec.name!r} uses scale_rule {rec.weights.scale_rule.value!r}; {opts.rounding} takes rceil or mse (or pass --rounding nearest)")
    if opts.experts_all_tokens and opts.rounding != "gptq":
        raise typer.BadParameter("--experts-all-tokens goes with --rounding gptq")
    if opts.iters is not None and (not opts.rounding.startswith("signround") or opts.iters < 1):
        raise typer.BadParameter(f"--iters {opts.iters}: a number of steps >= 1, with --rounding signround or signround-scales")
    if opts.keep_bytes is None and not opts.keep_bf16 and opts.max_dppl is None:
        return dataclasses.replace(opts, keep_bytes=KEEP_BYTES_DEFAULT)
    return opts


def _print_plan(p) -> None:
    q = [lp for lp in p.layers.values() if lp.sqnr_db and not lp.keep_bf16]
    t = Table(title="mxq calibrate: plan")
    t.add_column("")
    t.add_column("value", justify="right")
    t.add_row("recipe", p.recipe.name)
    t.add_row(
        "calibration",
        f"{p.calibration.get('samples')} x {p.calibration.get('seq_len')} tokens of {p.calibration.get('dataset')}",
    )
    t.add_row("layers quantized / kept", f"{len(p.quantized)} / {len(p.kept)}")
    t.add_row(
        "permutations folded",
        f"mlp {len(p.permutations.mlp)}, v/o {len(p.permutations.v)}, residual {'yes' if p.permutations.residual else 'no'}",
    )
    t.add_row(
        "MSE weight scales",
        str(
            sum(
                lp.weights.scale_rule.value == "mse" for lp in p.layers.values() if not lp.keep_bf16
            )
        ),
    )
    if q:
        for key in ("direct", "reorder", "chosen", "weights_nearest", "weights_gptq"):
            v = [lp.sqnr_db[key] for lp in q if key in lp.sqnr_db]
            if v:  # weights_* only after GPTQ
                t.add_row(f"mean output SQNR dB, {key}", f"{sum(v) / len(v):.3f}")
    ex = p.experts_summary()
    if ex and ex["gptq"]:
        for proj in ex["gptq"]:
            t.add_row(f"experts {proj}: GPTQ / direct cast (too few tokens)", f"{ex['gptq'][proj]} / {ex['nearest'][proj]}")
    console.print(t)
    kept = sorted(
        ((n, lp) for n, lp in p.layers.items() if lp.keep_bf16 and lp.sensitivity_kl is not None),
        key=lambda x: -x[1].sensitivity_kl,
    )
    if kept:
        k = Table(title="kept in bf16 (most sensitive)")
        k.add_column("layer")
        k.add_column("KL", justify="right")
        for n, lp in kept:
            k.add_row(n, f"{lp.sensitivity_kl:.3g}")
        console.print(k)


@app.command("calibrate", short_help="Calibrate on text; write a plan for `mxq quantize --plan`.")
def calibrate_cmd(
    model: ModelArg = None,
    dataset: str = typer.Option(..., "--dataset", help=DATASET_HELP),
    samples: Samples = 64,
    seq_len: SeqLen = 512,
    out: Path = typer.Option(
        Path("plan.json"), "--out", "-o", help="Where to write the plan (JSON)."
    ),
    recipe: RecipeOpt = "mxfp8",
    keep_bf16: KeepBf16 = 0,
    max_dppl: MaxDppl = None,
    keep_bytes: KeepBytes = None,
    reorder: Reorder = True,
    scale_search: ScaleSearch = True,
    sensitivity_samples: SensSamples = 2,
    sensitivity_seq_len: SensSeqLen = 256,
    device: str = typer.Option(
        "cpu", "--device", help="Where to run the model: cpu, cuda or auto."
    ),
    rounding: Rounding = "gptq",
    iters: Iters = None,
    experts_all_tokens: ExpertsAllTokens = False,
) -> None:
    """Run calibration text through the bf16 model and write a plan for `mxq quantize --plan`."""
    from mxq.calib.plan import save_plan
    from mxq.hf.models import resolve_source
    from mxq.recipe import load_recipe

    opts = _calibration_options(locals())
    resolve_source(model)  # a model reference or config.json that cannot work, before the text is read
    p = run_calibration(model, load_recipe(recipe), opts)
    save_plan(p, out)
    console.print(f"plan written to {out}")


def _print_kept(kept: dict[str, str]) -> None:
    """Every matrix left in high precision, grouped by reason (all names in quantization_report.json)."""
    by_reason: dict[str, list[str]] = {}
    for name, why in kept.items():
        by_reason.setdefault(why, []).append(name)
    if not by_reason:
        return
    k = Table(title="left in high precision")
    k.add_column("reason")
    k.add_column("layers")
    for why, names in sorted(by_reason.items()):
        shown = ", ".join(names[:4]) + (f", ... ({len(names)} in all)" if len(names) > 4 else "")
        k.add_row(why, shown)
    console.print(k)


def _print_report(r) -> None:
    t = Table(title=f"mxq quantize: {r.source} -> {r.out}")
    t.add_column("")
    t.add_column("value", justify="right")
    t.add_row("recipe / format", f"{r.recipe} / {r.format}")
    t.add_row("layers quantized", str(len(r.quantized)))
    t.add_row(
        "layers kept",
        str(len(r.kept))
        + (f" ({', '.join(list(r.kept)[:3])}{'...' if len(r.kept) > 3 else ''})" if r.kept else ""),
    )
    if r.shares:
        t.add_row("parameters in MX", f"{r.shares['quantized_share']:.1%}")
        if r.shares.get("experts_quantized_share") is not None:
            t.add_row("routed-expert parameters in MX", f"{r.shares['experts_quantized_share']:.1%}")
    t.add_row("bytes before", fmt_bytes(r.bytes_before))
    t.add_row("bytes after", fmt_bytes(r.bytes_after))
    t.add_row("compression", f"{r.ratio:.2f}x")
    if r.quantized:
        s = sorted(x.sqnr_db for x in r.quantized)
        t.add_row(
            "weight SQNR dB (min / median / max)",
            f"{s[0]:.2f} / {s[len(s) // 2]:.2f} / {s[-1]:.2f}",
        )
    t.add_row("time", f"{r.seconds:.1f} s")
    console.print(t)
    _print_kept(r.kept)
    if r.quantized:
        w = Table(title="per-layer weight SQNR (worst 10; all layers in quantization_report.json)")
        for c in ("layer", "shape", "SQNR dB"):
            w.add_column(c, justify="right" if c != "layer" else "left")
        for x in sorted(r.quantized, key=lambda x: x.sqnr_db)[:10]:
            w.add_row(x.name, "x".join(map(str, x.shape)), f"{x.sqnr_db:.2f}")
        console.print(w)


def _log2(v: float) -> float:
    return math.log2(v)


_TERMINATED = []  # SIGTERM seen: the interrupt it raised ends as "terminated", status 143


def _on_sigterm(signum, frame) -> None:
    """SIGTERM as Ctrl-C: the work in flight unwinds through its cleanup (the converter removes its
    temporary directory) instead of the process dying where it stands."""
    _TERMINATED.append(signum)
    raise KeyboardInterrupt


def main() -> None:
    """The ``mxq`` command: errors are one line (status 1; a usage error: status 2), Ctrl-C is one
    line and status 130 (SIGTERM: 143), ``--debug`` shows tracebacks."""
    import signal

    debug = "--debug" in sys.argv[1:]
    # from here on Ctrl-C unwinds the work in flight through its cleanup (the launcher, mxq_launch,
    # ended the process at once while the imports ran); a signal the parent ignores stays ignored
    for sig, handler in ((signal.SIGINT, signal.default_int_handler), (getattr(signal, "SIGTERM", None), _on_sigterm)):
        try:
            if sig is not None and signal.getsignal(sig) is not signal.SIG_IGN:
                signal.signal(sig, handler)
        except ValueError:  # not the main thread (an embedding program): leave its handling alone
            pass
    try:
        # standalone_mode=False: typer turns Ctrl-C into a returned exit code (130), not an exception
        rc = app(prog_name="mxq", standalone_mode=False)
        if rc == 130:
            _interrupted()
        if isinstance(rc, int) and rc:
            sys.exit(rc)
    except KeyboardInterrupt:
        _interrupted()
    except Exception as e:  # noqa: BLE001 - the one place errors become a line
        code = _usage_exit(e)
        if code is not None:
            sys.exit(code)
        if debug:
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"mxq: error: {msg}", file=sys.stderr)
        sys.exit(1)


def _usage_exit(e: Exception) -> int | None:
    """The exit status for click's (or typer's own copy of click's) exceptions, after their one
    line: a help request is the help and 0, a usage error one line and 2, ``Exit`` its code, an
    aborted prompt 130. None for any other exception. (Typer 0.29 carries its own click, whose
    exceptions are not ``click``'s: they are told apart by name.)"""
    names = {c.__name__ for c in type(e).__mro__}
    if "NoArgsIsHelpError" in names:  # `mxq eval` alone: its help
        ctx = getattr(e, "ctx", None)
        typer.echo(ctx.get_help() if ctx is not None else e.format_message())
        return 0
    if "Exit" in names and hasattr(e, "exit_code"):
        return e.exit_code
    if "Abort" in names:
        print("mxq: aborted", file=sys.stderr)
        return 130
    if "UsageError" in names:
        ctx = getattr(e, "ctx", None)
        path = getattr(ctx, "command_path", "") if ctx is not None else ""
        if "BadParameter" in names and getattr(e, "param", None) is None and not getattr(e, "param_hint", None):
            msg, path = str(e.message), ""  # a check of mxq's own: its message names the option
        else:
            msg = e.format_message()
        msg = " ".join(msg.split())
        print(f"mxq: error: {msg}" + (f" (see {path} --help)" if path else ""), file=sys.stderr)
        return 2
    if "ClickException" in names:
        print(f"mxq: error: {' '.join(e.format_message().split())}", file=sys.stderr)
        return getattr(e, "exit_code", 1)
    return None


def _interrupted() -> None:
    """Ctrl-C: one line and status 130. The work in flight has already cleaned up after itself
    (the converter removes its temporary directory); the process ends here without interpreter
    finalization, where a late KeyboardInterrupt in a library's exit hook was seen to turn the
    status into death by SIGINT."""
    print("mxq: terminated" if _TERMINATED else "mxq: interrupted", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(143 if _TERMINATED else 130)
