"""``python -m mxq.cli``: the ``mxq`` command."""

from mxq.cli import main

main()
