"""Progress bars for long work (converter, calibrator, perplexity): rich, on stderr, one look."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)


def progress_bar(label: str, *, enabled: bool = True, transfer: bool = False, transient: bool = False) -> Progress:
    """A bar titled ``label``: counts (n/total) by default, bytes and throughput with ``transfer``.

    ``label`` may use the task's fields, e.g. "quantize {task.fields[n]}/{task.fields[of]} tensors".
    """
    counts = (DownloadColumn(), TransferSpeedColumn()) if transfer else (MofNCompleteColumn(),)
    return Progress(
        TextColumn(f"[bold]{label}[/]"), BarColumn(), *counts, TimeElapsedColumn(), TimeRemainingColumn(),
        console=Console(stderr=True), disable=not enabled, transient=transient,
    )
