"""Running the ``mxq`` command line inside the test process, as the console script does."""

from __future__ import annotations

import contextlib
import io
import sys


def run_cli(args: list[str]) -> tuple[int, str]:
    """``mxq ARGS``: its exit status and what it wrote to stderr (stdout is discarded). Captures by
    itself, so hypothesis tests (no function-scoped fixtures) can use it too."""
    rc, _, err = run_cli_out(args)
    return rc, err


def run_cli_out(args: list[str]) -> tuple[int, str, str]:
    """``mxq ARGS`` inside the test process: its exit status, stdout and stderr."""
    from mxq.cli import main

    argv, out, err = sys.argv, io.StringIO(), io.StringIO()
    sys.argv = ["mxq", *args]
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            main()
        rc = 0
    except SystemExit as e:
        rc = e.code or 0
    finally:
        sys.argv = argv
    return rc, out.getvalue(), err.getvalue()
