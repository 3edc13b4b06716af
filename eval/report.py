"""Reports of the eval harness: a markdown table for people, JSON for machines, a PNG for eyes.

The report is a plain dict (what ``--out`` writes); the markdown is rendered from that dict, so
the two always agree.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from pathlib import Path

from mxq.eval.perplexity import PerplexityResult

__all__ = [
    "ppl_report",
    "ppl_markdown",
    "layers_markdown",
    "write_json",
    "plot_nll_diff",
    "require_matplotlib",
    "format_bytes",
]


def ppl_report(
    model: tuple[str, PerplexityResult],
    baseline: tuple[str, PerplexityResult] | None = None,
    *,
    dataset: str = "",
) -> dict:
    """The perplexity report: baseline first (when given), then the model, with Δ% vs baseline."""
    entries = [("model", model)] if baseline is None else [("baseline", baseline), ("model", model)]
    rows = []
    for role, (label, r) in entries:
        row = {"role": role, "model": label, **r.to_dict()}
        if baseline is not None:
            row["delta_pct_vs_baseline"] = _pct(r.ppl, baseline[1].ppl)
        rows.append(row)
    r = model[1]
    return {
        "dataset": dataset,
        "protocol": r.protocol,
        "seq_len": r.seq_len,
        "stride": r.stride,
        "n_windows": r.n_windows,
        "n_windows_total": r.n_windows_total,
        "n_tokens": r.n_tokens,
        "results": rows,
    }


def _pct(x: float, ref: float) -> float | None:
    if not (math.isfinite(x) and math.isfinite(ref)) or ref == 0:
        return None
    return 100.0 * (x - ref) / ref


def format_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _fmt_ppl(x) -> str:
    return f"{x:.4f}" if isinstance(x, (int, float)) else str(x)


def ppl_markdown(report: dict) -> str:
    """The side-by-side table and the protocol line."""
    lines = [
        "| model | ppl | Δ% vs baseline | tokens/s | peak memory | device |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for row in report["results"]:
        if row["role"] == "baseline":
            delta = "(baseline)"
        elif row.get("delta_pct_vs_baseline") is not None:
            delta = f"{row['delta_pct_vs_baseline']:+.2f} %"
        else:
            delta = "—"
        lines.append(
            f"| {row['model']} | {_fmt_ppl(row['ppl'])} | {delta} | {row['tokens_per_s']:.1f} | "
            f"{format_bytes(row['peak_mem_bytes'])} | {row['device']} |"
        )
    kinds = sorted({row["peak_mem_kind"] for row in report["results"]})
    lines += [
        "",
        f"Dataset: {report['dataset']} ({report['n_tokens']} scored tokens in {report['n_windows']} windows).",
        f"Protocol: {report['protocol']}.",
        f"Peak memory: {', '.join(kinds)}"
        + (" (whole process, never decreases: models evaluated later include earlier ones)" if "process peak RSS" in kinds else "")
        + "; tokens/s counts every window token through the forward pass.",
    ]
    if "dtype" in report:
        note = report.get("dtype_note")
        lines.append(f"Computed in {report['dtype']}" + (f" ({note})." if note else "."))
    return "\n".join(lines)


def layers_markdown(report: dict) -> str:
    """Per-Linear SQNR table, worst output SQNR first."""
    lines = [
        "| layer | shape [N,K] | weight SQNR (dB) | output SQNR (dB) | end-to-end SQNR (dB) |",
        "|---|---|---:|---:|---:|",
    ]
    for row in report["layers"]:
        lines.append(
            f"| {row['name']} | {row['shape'][0]}x{row['shape'][1]} | {_db(row['weight_sqnr_db'])} | "
            f"{_db(row['output_sqnr_db'])} | {_db(row.get('end_to_end_sqnr_db'))} |"
        )
    lines += ["", report.get("method", "")]
    return "\n".join(lines).rstrip()


def _db(x) -> str:
    if x is None:
        return "—"
    if isinstance(x, str):
        return x
    return f"{x:.2f}" if math.isfinite(x) else ("inf" if x > 0 else "-inf")


def _jsonable(o):
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)  # "inf", "-inf", "nan": JSON has no such numbers
    if isinstance(o, dict):
        return {k: _jsonable(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_jsonable(v) for v in o]
    return o


def write_json(path: str | os.PathLike, obj: dict) -> Path:
    """Write ``obj`` as JSON to a temporary file beside ``path``, then rename: never half-written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(_jsonable(obj), f, indent=2, ensure_ascii=False)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def require_matplotlib():
    """matplotlib.pyplot, or one line saying how to install it (it is the ``plot`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError(
            "--plot needs matplotlib, which is not installed: pip install 'mxq[plot]'"
        ) from e
    return plt


def plot_nll_diff(
    path: str | os.PathLike,
    model: tuple[str, PerplexityResult],
    baseline: tuple[str, PerplexityResult],
) -> Path:
    """PNG of the per-window mean NLL difference (model - baseline), in nats per token."""
    plt = require_matplotlib()
    (m_label, m), (b_label, b) = model, baseline
    if len(m.per_window_nll) != len(b.per_window_nll):
        raise ValueError("model and baseline were scored on different windows")
    diff = [x - y for x, y in zip(m.per_window_nll, b.per_window_nll, strict=True)]
    mean = (m.nll_sum - b.nll_sum) / m.n_tokens
    fig, ax = plt.subplots(figsize=(8, 3.5), dpi=120)
    ax.bar(range(len(diff)), diff, width=1.0, color="tab:blue")
    ax.axhline(mean, color="tab:red", lw=1, label=f"mean {mean:+.4f}")
    ax.axhline(0, color="black", lw=0.5)
    ax.set_xlabel("window")
    ax.set_ylabel("Δ NLL (nats/token)")
    ax.set_title(f"{m_label} − {b_label}", fontsize=9)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
