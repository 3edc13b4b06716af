"""``mxq bench``: every benchmark in one command, then plots and a summary table.

Each part runs in its own Python process (one model or shape set per process, so GPU memory
and compiled-kernel caches do not leak between parts), writes its JSON into OUT, and a failed
part is reported without stopping the others. GEMM, attention and end-to-end parts need a CUDA
device; the converter part runs anywhere.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import typer

PARTS = ("gemm", "attention", "e2e", "convert")


def part_commands(
    out: Path, parts: list[str], quick: bool, model: str | None
) -> list[tuple[str, list[str]]]:
    """(name, argv) for each part: the exact commands, also printed so any part can be rerun."""
    py = [sys.executable, "-m"]
    cmds = []
    for p in parts:
        if p == "gemm":
            extra = ["--models", "8b", "--ms", "1,16,2048", "--no-quantize"] if quick else []
            cmds.append(
                (p, py + ["mxq.eval.bench_gemm", "--out", str(out / "bench_gemm.json"), *extra])
            )
        elif p == "attention":
            extra = ["--quick"] if quick else []
            cmds.append(
                (
                    p,
                    py
                    + [
                        "mxq.eval.bench_attention",
                        "--no-sweep",
                        "--out",
                        str(out / "bench_attention.json"),
                        *extra,
                    ],
                )
            )
        elif p == "e2e":
            shape = ["--shape", "tiny" if quick else "llama3-8b"]
            extra = ["--batch", "1", "--new-tokens", "32"] if quick else ["--compile"]
            cmds.append(
                (
                    p,
                    py
                    + [
                        "mxq.eval.bench_e2e",
                        *shape,
                        *extra,
                        "--out",
                        str(out / f"e2e-{shape[1]}.json"),
                    ],
                )
            )
            if model:
                cmds.append(
                    (
                        f"{p}-model",
                        py
                        + [
                            "mxq.eval.bench_e2e",
                            "--model",
                            model,
                            *extra,
                            "--out",
                            str(out / "e2e-model.json"),
                        ],
                    )
                )
        elif p == "convert":
            shape = "tiny" if quick else "llama3-8b"
            dev = "cuda" if _cuda() else "cpu"
            cmds.append((p, py + ["mxq.eval.bench_convert", "--shape", shape, "--device", dev, "--work", str(out / "convert-work"),
                                  "--out", str(out / f"convert-{dev}-{shape}.json")]))  # fmt: skip
    return cmds


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def bench_cmd(
    out: Path = typer.Option(
        Path("bench-results"), "--out", help="Directory for the JSON results, plots and SUMMARY.md."
    ),
    parts: str = typer.Option(
        ",".join(PARTS), "--parts", help=f"Comma-separated subset of: {', '.join(PARTS)}."
    ),
    quick: bool = typer.Option(
        False, "--quick", help="Fewer shapes and tokens (minutes instead of ~20)."
    ),
    model: str | None = typer.Option(
        None, "--model", help="Also run the end-to-end part on this model (e.g. 'default')."
    ),
    plots: bool = typer.Option(
        True, "--plots/--no-plots", help="Write PNG plots (needs matplotlib, the plot extra)."
    ),
) -> None:
    """Run the GEMM, attention, end-to-end and converter benchmarks; write JSON, plots, SUMMARY.md."""
    chosen = [p.strip() for p in parts.split(",") if p.strip()]
    bad = [p for p in chosen if p not in PARTS]
    if bad or not chosen:
        raise typer.BadParameter(
            f"--parts: unknown part(s) {', '.join(bad) or '(none given)'}; choose from {', '.join(PARTS)}"
        )
    gpu_parts = [p for p in chosen if p != "convert"]
    if gpu_parts and not _cuda():
        raise typer.BadParameter(
            f"--parts {','.join(gpu_parts)} need a CUDA device and none is available; run --parts convert here"
        )
    if plots:
        from mxq.eval.report import require_matplotlib

        require_matplotlib()
    out.mkdir(parents=True, exist_ok=True)
    failed = []
    for name, argv in part_commands(out, chosen, quick, model):
        typer.echo(f"\n=== {name}: {' '.join(argv)}", err=True)
        t0 = time.perf_counter()
        rc = subprocess.call(argv)
        typer.echo(f"=== {name}: exit {rc} after {time.perf_counter() - t0:.0f} s", err=True)
        if rc != 0:
            failed.append(name)
    from mxq.eval.plots import make_all

    for f in make_all(out, plots=plots):
        typer.echo(f"wrote {f}", err=True)
    summary = out / "SUMMARY.md"
    if summary.is_file():
        typer.echo(summary.read_text())
    if failed:
        raise RuntimeError(
            f"benchmark part(s) failed: {', '.join(failed)} (their output is above; the others are in {out})"
        )
