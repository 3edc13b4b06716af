"""``mxq inspect``: describe and validate a checkpoint (``mxq.checkpoint.describe``), optionally against a tensor
parallelism degree; ``fmt_bytes`` is the byte count every command prints."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from mxq.progress import stage

console = Console()


def fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


def inspect_cmd(
    path: Path = typer.Argument(..., help="An mxq (or other MXFP8) checkpoint directory."),
    tensors: bool = typer.Option(False, "--tensors", help="List every tensor."),
    tp: int = typer.Option(None, "--tp", min=1, help="Judge every quantized weight against tensor parallelism of this degree (whole 32-element blocks per rank).", show_default=False),
) -> None:
    """Describe and validate a checkpoint: format, recipe, tensors, dtypes, bytes."""
    from mxq.checkpoint.describe import inspect_checkpoint

    with stage(f"checking {path}", after=5.0):  # seconds for a large checkpoint, none for a small one
        rep = inspect_checkpoint(path, tp=tp)
    t = Table(title=f"mxq inspect: {path}")
    t.add_column("")
    t.add_column("value")
    t.add_row("format", rep.format)
    t.add_row("recipe", rep.recipe or "-")
    t.add_row("architecture", rep.architecture)
    t.add_row("tensors", str(len(rep.tensors)))
    t.add_row("quantized layers", str(rep.n_quantized))
    t.add_row("parameters in MX", f"{rep.mx_share:.1%}")
    t.add_row(
        "bytes by dtype",
        ", ".join(f"{k} {fmt_bytes(v)}" for k, v in sorted(rep.bytes_by_dtype.items())),
    )
    t.add_row("total", fmt_bytes(sum(rep.bytes_by_dtype.values())))
    console.print(t)
    if tensors:
        tt = Table()
        for c in ("tensor", "dtype", "shape", "bytes"):
            tt.add_column(c)
        for i in rep.tensors:
            tt.add_row(i.name, i.dtype, str(list(i.shape)), str(i.nbytes))
        console.print(tt)
    if tp is not None:
        _print_shards(rep.shards, tp)
    if rep.problems:
        for p in rep.problems:
            console.print(f"[red]problem:[/] {p}")
        raise ValueError(f"{path}: {len(rep.problems)} problem(s) found; first: {rep.problems[0]}")
    console.print("[green]ok[/]: headers, shapes, dtypes and the quantization config agree")


def _print_shards(shards, tp: int) -> None:
    """``inspect --tp``: every quantized weight that breaks the shard rule, and the count that keeps it."""
    bad = [s for s in shards if not s.ok]
    if not bad:
        console.print(f"[green]tp {tp}[/]: all {len(shards)} quantized weights shard (whole 32-element blocks per rank)")
        return
    t = Table(title=f"tensor parallelism {tp}: {len(bad)} of {len(shards)} quantized weights do not shard")
    for c in ("weight", "split", "shape", "why"):
        t.add_column(c)
    for s in bad:
        t.add_row(s.name, s.style, str(list(s.shape)), s.why)
    console.print(t)
