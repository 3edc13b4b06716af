"""The ``mxq`` command line: one function per command; errors are one line (``--debug`` for tracebacks)."""

from __future__ import annotations

import sys

import click
import typer
from rich.console import Console
from rich.table import Table

import mxq
from mxq import formats as F

app = typer.Typer(
    name="mxq",
    help="Quantize Hugging Face language models to MXFP8 (OCP Microscaling) and run them fast.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
_state = {"debug": False}


def _version(value: bool) -> None:
    if value:
        console.print(f"mxq {mxq.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks on errors."),
) -> None:
    _state["debug"] = debug


@app.command("formats")
def formats_cmd() -> None:
    """Print the MX element formats, the E8M0 scale and the scale rules."""
    t = Table(title="MX element formats (block of 32 elements share one E8M0 scale)")
    for col in ("format", "bits", "bias", "emax", "max normal", "min normal", "min subnormal", "Inf", "NaN byte", "torch dtype"):
        t.add_column(col)
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
        "E8M0 (scale)", "0.8.0", str(F.E8M0_BIAS), "127", "2^127", "2^-127", "-", "no",
        f"0x{F.E8M0_NAN:02X}", "uint8",
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


def _log2(v: float) -> float:
    import math

    return math.log2(v)


def main() -> None:
    debug = "--debug" in sys.argv[1:]
    try:
        app(standalone_mode=False)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        print("mxq: aborted", file=sys.stderr)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        print("mxq: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as e:  # noqa: BLE001 - the one place errors become a line
        if debug:
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"mxq: error: {msg}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
