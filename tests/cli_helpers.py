"""Running the ``mxq`` command line inside the test process, as the console script does."""

from __future__ import annotations

import sys


def run_cli(args: list[str], capsys) -> tuple[int, str]:
    """``mxq ARGS``: its exit status and what it wrote to stderr."""
    from mxq.cli import main

    argv = sys.argv
    sys.argv = ["mxq", *args]
    try:
        main()
        rc = 0
    except SystemExit as e:
        rc = e.code or 0
    finally:
        sys.argv = argv
    return rc, capsys.readouterr().err
