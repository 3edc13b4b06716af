"""The ``mxq`` console command's first instructions, before torch and transformers load.

Importing ``mxq.cli`` is quick (torch and transformers load inside the commands that need them), but
on a loaded machine it can still take a while. Ctrl-C (or SIGTERM) in that time ends
the process here with the same one line and status as later on (``mxq: interrupted``, 130;
``mxq: terminated``, 143), never a traceback from the middle of an import: nothing has been
written yet, so there is nothing to clean up. ``mxq.cli.main`` then hands Ctrl-C back to Python,
which lets the work in flight unwind through its cleanup.
"""

import os
import signal
import sys


def _while_importing(signum, frame) -> None:
    os.write(2, b"\r\033[K" if _STARTING else b"")
    os.write(2, b"mxq: interrupted\n" if signum == signal.SIGINT else b"mxq: terminated\n")
    os._exit(130 if signum == signal.SIGINT else 143)


_STARTING = False  # a "starting" note is on the terminal's last line


def main() -> None:
    global _STARTING
    for name in ("SIGINT", "SIGTERM"):
        sig = getattr(signal, name, None)
        if sig is not None and signal.getsignal(sig) is not signal.SIG_IGN:  # ignored (nohup, `&`): stays so
            signal.signal(sig, _while_importing)
    try:
        tty = sys.stderr.isatty()
    except (AttributeError, ValueError):
        tty = False
    if tty:  # imports: say so on a terminal, and wipe the note once they are done
        sys.stderr.write("mxq: starting ...")
        sys.stderr.flush()
        _STARTING = True
    else:  # a log: a line only where the imports are slow (a loaded machine), so that it never waits long
        import threading

        imported = threading.Event()
        threading.Thread(target=_slow_start_lines, args=(imported,), daemon=True).start()
    try:
        from mxq.cli import main as cli_main
    finally:
        if _STARTING:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
            _STARTING = False
        if not tty:
            imported.set()
    cli_main()


SLOW_START_S = 8.0  # without a terminal: the first note on slow imports, then one as often


def _slow_start_lines(imported) -> None:
    import time

    t0 = time.monotonic()
    while not imported.wait(SLOW_START_S):
        try:
            os.write(2, f"mxq: starting, {time.monotonic() - t0:.0f} s\n".encode())
        except OSError:
            return


if __name__ == "__main__":
    main()
