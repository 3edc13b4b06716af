"""``mxq eval``: perplexity beside a baseline, and per-layer error. Mounted by ``mxq.cli``.

Errors are raised as exceptions with one-line messages; ``mxq.cli.main`` prints them as one
line (tracebacks behind ``--debug``).
"""

from __future__ import annotations

import gc
from pathlib import Path

import typer
from rich.console import Console


# ``mxq.hf.models`` (torch, transformers) loads when a command runs, not for ``--help``
def load_model(*args, **kwargs):
    from mxq.hf.models import load_model as load

    return load(*args, **kwargs)


def resolve_device(*args, **kwargs):
    from mxq.hf.models import resolve_device as resolve

    return resolve(*args, **kwargs)


def resolve_source(*args, **kwargs):
    from mxq.hf.models import resolve_source as resolve

    return resolve(*args, **kwargs)


eval_app = typer.Typer(
    help="Evaluate models: perplexity, chat answers, per-layer SQNR.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True)

MODEL_HELP = "an mxq checkpoint dir, a Hugging Face model dir, a .gguf file, or 'default' (the embedded SmolLM2-135M)"
DATASET_HELP = (
    "wikitext2 (wikitext-2-raw-v1 test, needs the hub or a cached copy), pydoc (offline, ships with "
    "Python), or a local .txt / .jsonl / .parquet file (jsonl/parquet: a 'text' column)"
)


def _label(source: str) -> str:
    return resolve_source(source).display


DTYPES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "float32": "float32",
    "fp32": "float32",
}


def _dtype(name: str, option: str = "--dtype"):
    import torch

    if name.lower() not in DTYPES:
        raise typer.BadParameter(f"{option} must be one of bfloat16, float16, float32, got {name!r}")
    return getattr(torch, DTYPES[name.lower()])


def compute_dtype(name: str, device) -> tuple[str, str | None]:
    """``--dtype`` as given, or for "auto" bfloat16, except float32 on a CPU that lacks bf16 matrix
    instructions (``mxq.kernels.cpu.native_bf16_matmul``); with the reason where auto chose float32."""
    if name.lower() != "auto":
        return name, None
    from mxq.kernels.cpu import native_bf16_matmul

    if device.type == "cpu" and not native_bf16_matmul():
        return "float32", "--dtype auto: this CPU has no bf16 matrix instructions; --dtype bfloat16 computes in bf16"
    return "bfloat16", None


KERNELS_HELP = (
    "Kernels that may run the MX layers: auto, reference (the torch reference, for A/B checks) or "
    "comma-separated path names (`mxq kernels` lists them)."
)


def _kernels(spec: str) -> str:
    from mxq.kernels import check_kernels

    try:
        return check_kernels(spec, source="--kernels")
    except ValueError as e:
        raise typer.BadParameter(str(e).removeprefix("--kernels=")) from None


def _load(source: str, device, dtype=None, kernels: str | None = None, fuse: bool = True, tokenizer: bool = True):
    from mxq.hf.models import runtime
    from mxq.progress import stage

    with stage(f"loading {_label(source)}"):
        kw = {"dtype": dtype} if dtype is not None else {}
        if not tokenizer:
            kw["tokenizer"] = False
        got = load_model(source, device=device, kernels=kernels, fuse=fuse, **kw)
    err.print(f"{_label(source)} runs on {runtime(got[0])}", highlight=False)
    return got


def _tokenizer(source: str):
    from mxq.hf.models import load_tokenizer
    from mxq.progress import stage

    with stage(f"loading the tokenizer of {_label(source)}"):
        return load_tokenizer(source)


@eval_app.command("ppl")
def ppl_cmd(
    model: str = typer.Argument(..., help=f"Model to evaluate: {MODEL_HELP}."),
    baseline: str | None = typer.Option(
        None, "--baseline", help=f"Reference model, evaluated on the same windows: {MODEL_HELP}."
    ),
    dataset: str = typer.Option("wikitext2", "--dataset", help=DATASET_HELP + "."),
    seq_len: int = typer.Option(2048, "--seq-len", help="Tokens per window."),
    stride: int | None = typer.Option(
        None,
        "--stride",
        help="Sliding windows every STRIDE tokens, scoring only the new tokens "
        "(default: non-overlapping windows, GPTQ style).",
    ),
    max_windows: int | None = typer.Option(
        None, "--max-windows", help="Score only the first N windows (stated in the output)."
    ),
    batch_size: int = typer.Option(1, "--batch-size", help="Windows per forward pass."),
    device: str = typer.Option("auto", "--device", help="auto (cuda if available), cpu or cuda."),
    dtype: str = typer.Option(
        "auto",
        "--dtype",
        help="Activation/compute dtype of the non-quantized parts: bfloat16, float16, float32, or auto "
        "(bfloat16; float32 on a CPU without bf16 matrix instructions, where bf16 matmuls are slower).",
    ),
    kernels: str = typer.Option("auto", "--kernels", help=KERNELS_HELP),
    out: Path | None = typer.Option(None, "--out", help="Write the report as JSON here."),
    plot: Path | None = typer.Option(
        None,
        "--plot",
        help="Write a PNG of the per-window NLL difference here (needs --baseline and matplotlib).",
    ),
    no_cache: bool = typer.Option(
        False,
        "--no-cache",
        help="Compute every perplexity anew, neither reading nor writing the results cache "
        "(ppl/ in $MXQ_CACHE, else $XDG_CACHE_HOME/mxq or ~/.cache/mxq).",
    ),
) -> None:
    """Perplexity of MODEL (and of --baseline on the same windows), as a markdown table.

    A result computed before for the same model bytes, token windows and settings comes from the
    cache, and the output says so (``--no-cache`` recomputes)."""
    from mxq.eval.data import chars_for_tokens, load_texts
    from mxq.eval.perplexity import make_windows
    from mxq.eval.report import require_matplotlib

    # Everything that can fail fast does, before minutes of model loading and evaluation.
    if plot is not None:
        if baseline is None:
            raise typer.BadParameter(
                "--plot shows the difference to --baseline; pass --baseline too"
            )
        require_matplotlib()
    dev = resolve_device(device)
    dtype, dtype_note = compute_dtype(dtype, dev)
    torch_dtype = _dtype(dtype)
    kernels = _kernels(kernels)
    _check_windows(seq_len, stride, max_windows, batch_size)
    labels = {"model": _label(model)}
    if baseline is not None:
        labels["baseline"] = _label(baseline)
    # a text file: with --max-windows only the text those windows need, else all of it (streamed)
    need = None if max_windows is None else seq_len + (max_windows - 1) * (stride or seq_len)
    texts = load_texts(dataset, max_chars=None if need is None else chars_for_tokens(need))

    sources = {"baseline": baseline, "model": model} if baseline is not None else {"model": model}
    cache = None if no_cache else _cache(texts, seq_len, stride, max_windows, dev, DTYPES[dtype.lower()], kernels, batch_size)
    results = _perplexities(
        sources,
        lambda source, **kw: _load(source, dev, torch_dtype, kernels, **kw),
        lambda tok: make_windows(tok, texts, seq_len, stride, max_windows),
        batch_size,
        dev,
        cache,
    )
    _report_perplexities(results, labels, dataset, DTYPES[dtype.lower()], out, plot, dtype_note)


def _check_windows(seq_len: int, stride: int | None, max_windows: int | None, batch_size: int) -> None:
    if seq_len < 2:
        raise typer.BadParameter(f"--seq-len must be at least 2, got {seq_len}")
    if stride is not None and not 1 <= stride <= seq_len:
        raise typer.BadParameter(
            f"--stride must be between 1 and --seq-len ({seq_len}), got {stride}"
        )
    if max_windows is not None and max_windows < 1:
        raise typer.BadParameter(f"--max-windows must be at least 1, got {max_windows}")
    if batch_size < 1:
        raise typer.BadParameter(f"--batch-size must be at least 1, got {batch_size}")


def _cache(texts, seq_len, stride, max_windows, dev, dtype: str, kernels: str, batch_size: int):
    """The results cache of this run (None when ``MXQ_CACHE=off``)."""
    from mxq.eval.cache import PerplexityCache, ResultCache, settings

    store = ResultCache(warn=lambda msg: err.print(f"warning: {msg}"))
    if not store.enabled:
        return None
    opts = settings(dev, dtype=dtype, kernels=kernels, batch_size=batch_size, fuse=True)
    return PerplexityCache(texts, seq_len, stride, max_windows, opts, store)


def _perplexities(sources: dict[str, str], load, windows_of, batch_size: int, dev, cache=None) -> dict:
    """Per role, the perplexity of its model (``load(source)`` -> (model, tokenizer);
    ``load(source, tokenizer=False)`` -> (model, None)), one model in memory at a time, all on the
    windows the first tokenizer makes of the text (``windows_of``); the other tokenizers must agree
    with it. With a ``cache`` (``mxq.eval.cache.PerplexityCache``), a model whose bytes hash
    (``identity``) takes its windows, tokenizer fingerprint and result from it where present, and
    loads only what is missing."""
    from mxq.eval.perplexity import check_same_tokenizer, perplexity, tokenizer_fingerprint

    results = {}
    windows = first_source = first_tok = None
    for role, source in sources.items():
        ident = cache.identity(source) if cache is not None else None
        m = tok = None
        if ident is None:
            m, tok = load(source)
        if windows is None:
            windows = cache.windows(ident) if ident else None
            if windows is None:
                from mxq.progress import stage

                tok = tok or _tokenizer(source)
                with stage("tokenizing the text"):
                    windows = windows_of(tok)
                if ident:
                    cache.put_windows(ident, windows)
            first_source, first_tok = source, tok
            err.print(f"{windows.n_text_tokens} tokens; {windows.protocol}")
        else:
            fp = cache.fingerprint(ident) if ident else None
            if fp is None:
                tok = tok or _tokenizer(source)
                fp = tokenizer_fingerprint(tok)
                if ident:
                    cache.put_fingerprint(ident, fp)
            if fp != windows.tokenizer_id:
                check_same_tokenizer(first_tok or _tokenizer(first_source), tok or _tokenizer(source), "baseline", "model")
                raise ValueError("baseline and model use different tokenizers: perplexities are only comparable on the same token stream")
        result = cache.result(ident, windows) if ident else None
        if result is not None:
            err.print(f"{role}: perplexity from the cache ({result.extra['cache']['entry']}; computed "
                      f"{result.extra['cache']['written_at']})")  # fmt: skip
        else:
            if m is None:
                m, _ = load(source, tokenizer=False)
            result = perplexity(m, windows=windows, batch_size=batch_size, desc=role)
            if ident:
                cache.put_result(ident, windows, result)
        results[role] = result
        del m
        gc.collect()
        if dev.type == "cuda":
            import torch

            torch.cuda.empty_cache()
    return results


def _report_perplexities(results: dict, labels: dict[str, str], dataset: str, dtype: str, out: Path | None,
                         plot: Path | None, dtype_note: str | None = None) -> None:  # fmt: skip
    """The markdown table on stdout; the JSON report and the NLL-difference plot where asked."""
    from mxq.eval.report import plot_nll_diff, ppl_markdown, ppl_report, write_json

    report = ppl_report(
        (labels["model"], results["model"]),
        (labels["baseline"], results["baseline"]) if "baseline" in results else None,
        dataset=dataset,
    )
    report["dtype"] = dtype
    if dtype_note:
        report["dtype_note"] = dtype_note
    typer.echo(ppl_markdown(report))
    cached = [role for role, r in results.items() if r.extra.get("cache", {}).get("hit")]
    if cached:
        when = "; ".join(f"{role} computed {results[role].extra['cache']['written_at']}" for role in cached)
        typer.echo(
            f"From the cache: {' and '.join(cached)} ({when}; same model bytes, windows and settings; "
            "tokens/s and peak memory are from that run). --no-cache recomputes."
        )
    if out is not None:
        write_json(out, report)
        err.print(f"wrote {out}")
    if plot is not None:
        plot_nll_diff(
            plot, (labels["model"], results["model"]), (labels["baseline"], results["baseline"])
        )
        err.print(f"wrote {plot}")


@eval_app.command("chat")
def chat_cmd(
    model: str = typer.Argument(..., help=f"Model to check: {MODEL_HELP}."),
    baseline: str = typer.Option(..., "--baseline", help=f"Reference model that answers the same prompts: {MODEL_HELP}."),
    prompts: Path | None = typer.Option(
        None, "--prompts", help="A JSON file of prompts ({\"prompts\": [{id, prompt, expect?}]}); default: mxq's own set."
    ),
    limit: int | None = typer.Option(None, "--limit", help="Only the first N prompts."),
    max_new_tokens: int = typer.Option(24, "--max-new-tokens", help="Longest answer, in tokens."),
    first: int = typer.Option(8, "--first", help="Tokens compared at the start of each answer."),
    device: str = typer.Option("auto", "--device", help="auto (cuda if available), cpu or cuda."),
    kernels: str = typer.Option("auto", "--kernels", help=KERNELS_HELP),
    dtype: str | None = typer.Option(
        None, "--dtype", help="Compute dtype of MODEL's non-quantized parts: bfloat16, float16, float32 (default: the loader's)."
    ),
    baseline_dtype: str | None = typer.Option(
        None, "--baseline-dtype",
        help="The same for --baseline (default: --dtype). The same model at another dtype measures the check's own floor.",
    ),
    out: Path | None = typer.Option(None, "--out", help="Write the report as JSON here."),
) -> None:
    """Greedy chat answers of MODEL beside --baseline's: agreement on the first tokens and on the
    whole answer, which answers contain what the prompt expects, and every prompt where they differ."""
    from mxq.eval.chat import answer, compare, load_prompts
    from mxq.eval.report import write_json

    for opt, v in (("--limit", limit), ("--max-new-tokens", max_new_tokens), ("--first", first)):
        if v is not None and v < 1:
            raise typer.BadParameter(f"{opt} must be at least 1, got {v}")
    items = load_prompts(prompts)[:limit]
    dev, kernels = resolve_device(device), _kernels(kernels)
    dtypes = {"model": dtype and _dtype(dtype)}
    dtypes["baseline"] = _dtype(baseline_dtype, "--baseline-dtype") if baseline_dtype else dtypes["model"]
    answers, ran = {}, {}
    for role, source in (("baseline", baseline), ("model", model)):
        m, tok = _load(source, dev, dtypes[role], kernels=kernels)
        answers[role] = answer(m, tok, items, max_new_tokens, label=f"{role} answering")
        ran[role] = str(m.dtype).removeprefix("torch.")
        del m
        gc.collect()
    rep = compare(items, answers["baseline"], answers["model"], first)
    n = len(rep.rows)
    typer.echo(f"| prompt | first {first} tokens | baseline | model |\n|---|---|---|---|")
    for r in rep.rows:
        cells = [r["id"], "same" if r["agree_first"] else "**differ**", _cell(r["baseline"]), _cell(r["model"])]
        typer.echo("| " + " | ".join(cells) + " |")
    typer.echo(
        f"\n{_label(model)} against {_label(baseline)}, {n} prompts, greedy, up to {max_new_tokens} tokens: "
        f"first {first} tokens agree on {round(rep.agree_first * n)}/{n} ({rep.agree_first:.0%}), whole answers on "
        f"{round(rep.agree_all * n)}/{n}; answers with what the prompt expects: baseline {rep.right['baseline']}, "
        f"model {rep.right['model']}"
    )
    differ = rep.differing()
    if differ:
        typer.echo(f"Differ within the first {first} tokens: " + ", ".join(r["id"] for r in differ))
    if out is not None:
        write_json(out, {"model": _label(model), "baseline": _label(baseline), "dtype": ran["model"],
                         "baseline_dtype": ran["baseline"], "max_new_tokens": max_new_tokens, **rep.to_json()})  # fmt: skip
        err.print(f"wrote {out}")


def _cell(text: str, width: int = 80) -> str:
    """An answer as one markdown table cell."""
    t = " ".join(text.split()).replace("|", "\\|")
    return t if len(t) <= width else t[: width - 3] + "..."


@eval_app.command("layers")
def layers_cmd(
    quant: str = typer.Argument(..., help="The quantized model (an mxq checkpoint dir)."),
    baseline: str = typer.Option(..., "--baseline", help=f"The original model: {MODEL_HELP}."),
    dataset: str = typer.Option("wikitext2", "--dataset", help=DATASET_HELP + "."),
    seq_len: int = typer.Option(512, "--seq-len", help="Tokens per batch."),
    batches: int = typer.Option(4, "--batches", help="Batches of real text to run."),
    device: str = typer.Option("auto", "--device", help="auto (cuda if available), cpu or cuda."),
    kernels: str = typer.Option("auto", "--kernels", help=KERNELS_HELP),
    out: Path | None = typer.Option(None, "--out", help="Write the report as JSON here."),
) -> None:
    """Per-Linear weight SQNR and output SQNR of QUANT against --baseline, worst first."""
    from mxq.eval.data import chars_for_tokens, load_texts
    from mxq.eval.layers import layer_sqnr, layers_report
    from mxq.eval.perplexity import check_same_tokenizer, make_windows
    from mxq.eval.report import layers_markdown, write_json

    dev = resolve_device(device)
    kernels = _kernels(kernels)
    if seq_len < 2 or batches < 1:
        raise typer.BadParameter("--seq-len must be at least 2 and --batches at least 1")
    q_label, b_label = _label(quant), _label(baseline)
    texts = load_texts(dataset, max_chars=chars_for_tokens(batches * seq_len))
    base_model, base_tok = _load(baseline, dev)
    quant_model, quant_tok = _load(quant, dev, kernels=kernels)
    check_same_tokenizer(base_tok, quant_tok, "baseline", "model")
    windows = make_windows(base_tok, texts, seq_len, None, batches)
    from mxq.progress import stage

    with stage(f"running {windows.n_windows} batches of {seq_len} tokens through both models"):
        rows = layer_sqnr(quant_model, base_model, windows.input_ids)
    report = layers_report(
        rows,
        model=q_label,
        baseline=b_label,
        dataset=dataset,
        seq_len=seq_len,
        n_batches=windows.n_windows,
    )
    typer.echo(layers_markdown(report))
    if out is not None:
        write_json(out, report)
        err.print(f"wrote {out}")
