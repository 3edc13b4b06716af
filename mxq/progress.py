"""Progress for long work (converter, calibrator, perplexity, the command line's stages), on stderr.

In a terminal: rich bars (``progress_bar``) and spinners (``stage``). Anywhere else (a log file, a
pipe, CI): plain lines instead, one when the work starts and then one at least every
``LOG_INTERVAL_S`` seconds while it runs, each naming the command, the stage, n/N and the time
spent, e.g. ``mxq quantize: converting 120/272 tensors, 120.3/269.0 MB, 14 s``.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.text import Text

LOG_INTERVAL_S = 5.0  # without a terminal: the longest wait between two progress lines

_lock = threading.Lock()
_active: list[_Reporter] = []  # the running bars and stages, innermost last; only that one reports


def _stderr_is_live() -> bool:
    """Whether stderr shows rich's live displays (a terminal, or a notebook's output area)."""
    c = Console(stderr=True)
    return (c.is_terminal and not c.is_dumb_terminal) or c.is_jupyter


def _command() -> str:
    """The running command's name for log lines (``mxq quantize``), or ``mxq`` outside the CLI."""
    import importlib

    # typer >= 0.29 carries its own click (its context is there); older ones use click itself
    for where in ("typer._click.globals", "click.globals"):
        try:
            ctx = importlib.import_module(where).get_current_context(silent=True)
        except (ImportError, AttributeError):
            continue
        path = getattr(ctx, "command_path", "") or ""
        if path.startswith("mxq"):
            return path
    return "mxq"


def log_line(text: str) -> None:
    """One plain progress line on stderr, prefixed with the command (``mxq quantize: ...``)."""
    _write(f"{_command()}: {text}")


def _write(line: str) -> None:
    # a timeout, not a plain `with`: a Ctrl-C landing between acquire and release must not leave
    # every later line (and the heartbeat thread) waiting forever
    got = _lock.acquire(timeout=2.0)
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr closed or gone: progress is not worth failing for
        pass
    finally:
        if got:
            _lock.release()


def _secs(s: float | None) -> str:
    s = max(0.0, s or 0.0)
    if s < 60:
        return f"{s:.0f} s"
    m, s = divmod(int(s), 60)
    return f"{m} min {s:02d} s" if m < 60 else f"{m // 60} h {m % 60:02d} min"


class _Reporter:
    """Log mode's shared part: a thread that writes the current line every ``LOG_INTERVAL_S``
    while this reporter is the innermost one running."""

    _first_after: float | None = None  # the first heartbeat's wait, where not LOG_INTERVAL_S

    def _start_reporting(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="mxq-progress", daemon=True)
        _active.append(self)  # list operations are atomic: no lock a Ctrl-C could leave held
        self._thread.start()

    def _stop_reporting(self) -> None:
        self._stop.set()
        if self in _active:
            _active.remove(self)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)

    def _beat(self) -> None:
        wait = self._first_after if self._first_after is not None else LOG_INTERVAL_S
        while not self._stop.wait(wait):
            wait = LOG_INTERVAL_S
            try:
                innermost = _active[-1] is self
            except IndexError:
                innermost = False
            if innermost:
                line = self._line()
                if line:
                    _write(line)

    def _line(self) -> str | None:
        raise NotImplementedError


class _LogProgress(_Reporter, Progress):
    """A ``Progress`` that keeps rich's task bookkeeping (add_task, update, advance, fields) but
    draws nothing; it writes plain lines instead: at each task's start, every ``LOG_INTERVAL_S``,
    and a last one when the work ends without an error."""

    def __init__(self, label: str, unit: str, transfer: bool):
        super().__init__(TextColumn(label), console=Console(stderr=True), disable=True)
        self._label, self._unit, self._transfer = label, unit, transfer
        self._prefix = _command()

    def start(self) -> None:
        super().start()
        self._start_reporting()

    def stop(self) -> None:
        self._stop_reporting()
        super().stop()

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:
        self.stop()
        if exc_type is None:
            for line in self._lines(done=True):
                _write(line)

    def add_task(self, description: str, start: bool = True, total: float | None = 100.0, completed: int = 0,
                 visible: bool = True, **fields) -> int:  # fmt: skip
        task = super().add_task(description, start=start, total=total, completed=completed, visible=visible, **fields)
        for line in self._lines(only=task):
            _write(line)
        return task

    def _line(self) -> str | None:
        lines = self._lines()
        return "\n".join(lines) if lines else None

    def _lines(self, done: bool = False, only=None) -> list[str]:
        with self._lock:
            tasks = [t for t in self._tasks.values() if t.visible and (only is None or t.id == only)]
        return [self._text(t, done) for t in tasks]

    def _text(self, task, done: bool) -> str:
        try:
            what = Text.from_markup(self._label.format(task=task)).plain.strip()
        except (KeyError, AttributeError, IndexError, ValueError):
            what = task.description
        n, total = task.completed, task.total
        if self._transfer:
            mb = f"{n / 1e6:.1f}/{total / 1e6:.1f} MB" if total is not None else f"{n / 1e6:.1f} MB"
            counts = f"{what}, {mb}"
        else:
            counts = f"{what} {n:.0f}/{total:.0f}" if total is not None else f"{what} {n:.0f}"
            counts += f" {self._unit}" if self._unit else ""
        if done:
            return f"{self._prefix}: {counts}, done in {_secs(task.elapsed)}"
        left = task.time_remaining if task.completed else None
        return f"{self._prefix}: {counts}, {_secs(task.elapsed)}" + (f", about {_secs(left)} left" if left else "")


class _LiveProgress(Progress):
    """rich's ``Progress``, registered while it runs so that a stage spinner around it steps aside."""

    def start(self) -> None:
        if not self.disable:
            _pause_live_stages()
        super().start()


def progress_bar(label: str, *, enabled: bool = True, transfer: bool = False, transient: bool = False,
                 unit: str = "") -> Progress:  # fmt: skip
    """A bar titled ``label``: counts (n/total ``unit``) by default, bytes and throughput with
    ``transfer``. Without a terminal on stderr it draws nothing and writes plain progress lines
    instead (see the module doc).

    ``label`` may use the task's fields, e.g. "converting {task.fields[n]}/{task.fields[of]} tensors".
    """
    if enabled and not _stderr_is_live():
        return _LogProgress(label, unit, transfer)
    counts = (DownloadColumn(), TransferSpeedColumn()) if transfer else (MofNCompleteColumn(),)
    if unit:
        counts += (TextColumn(unit),)
    return _LiveProgress(
        TextColumn(f"[bold]{label}[/]"), BarColumn(), *counts, TimeElapsedColumn(), TimeRemainingColumn(),
        console=Console(stderr=True), disable=not enabled, transient=transient,
    )


class _LogStage(_Reporter):
    def __init__(self, what: str):
        self._what, self._prefix, self._t0 = what, _command(), time.monotonic()

    def _line(self) -> str:
        return f"{self._prefix}: {self._what}, {_secs(time.monotonic() - self._t0)}"


_live_stages: list[Progress] = []


def _pause_live_stages() -> None:
    while _live_stages:
        _live_stages.pop().stop()


@contextlib.contextmanager
def stage(what: str, *, enabled: bool = True, after: float = 0.0) -> Iterator[None]:
    """A step of unknown length (``what``: "reading the model"): a spinner with the time spent in
    a terminal, or a plain line at its start and then every ``LOG_INTERVAL_S`` without one. A bar
    started inside it takes its place. ``after``: without a terminal, the first line only once
    the step has taken that long (a step that is usually quick stays silent)."""
    if not enabled:
        yield
        return
    if _stderr_is_live():
        spinner = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                           console=Console(stderr=True), transient=True)  # fmt: skip
        _pause_live_stages()
        spinner.add_task(what, total=None)
        spinner.start()
        _live_stages.append(spinner)
        try:
            yield
        finally:
            if spinner in _live_stages:
                _live_stages.remove(spinner)
            spinner.stop()
        return
    s = _LogStage(what)
    if after > 0:
        s._first_after = after
    else:
        _write(f"{s._prefix}: {what}")
    s._start_reporting()
    try:
        yield
    finally:
        s._stop_reporting()
