"""PNG plots and a summary table from the benchmark JSON files (needs matplotlib: ``mxq[plot]``).

    python -m mxq.eval.plots RESULTS_DIR [--out PLOTS_DIR]

Reads whichever of these RESULTS_DIR holds (the names ``mxq bench`` writes):
``bench_gemm*.json`` (eval/bench_gemm.py; later files replace rows of earlier ones), ``bench_attention.json`` (eval/bench_attention.py),
``e2e-*.json`` (eval/bench_e2e.py), ``ppl-*.json`` (``mxq eval ppl --out``),
``convert-*.json`` (eval/bench_convert.py) and writes
``gemm.png``, ``attention.png``, ``e2e.png``, ``ppl.png`` and ``SUMMARY.md``. A missing input
skips its plot.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def _load(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def _num(v):
    return v if isinstance(v, (int, float)) and math.isfinite(v) else None


def merge_gemm(paths: list[Path]) -> dict | None:
    """One GEMM result from several bench_gemm JSON files: a later file's row replaces an
    earlier one for the same (model, layer, M) (a re-run of some shapes updates the table)."""
    if not paths:
        return None
    merged, env = {}, {}
    for p in paths:
        res = json.loads(p.read_text())
        env = res.get("env", env)
        for r in res.get("gemm", []):
            merged[(r["model"], r["layer"], r["m"])] = r
    return {"env": env, "gemm": list(merged.values())}


def gemm_rows(res: dict) -> list[dict]:
    """Per (model, layer, M): W8A8 and W8A16 speed-up over cuBLAS bf16 (baseline time / mxq time)."""
    out = []
    for r in res.get("gemm", []):
        base, w8a8, w8a16 = (
            _num(r.get(k)) for k in ("cublas_bf16_us", "mxq_w8a8_us", "mxq_w8a16_us")
        )
        ds = _num(r.get("dot_scaled_w8a8_us"))
        out.append(dict(model=r["model"], layer=r["layer"], m=r["m"], w8a8_x_cublas=base / w8a8 if base and w8a8 else None,
                        w8a16_x_cublas=base / w8a16 if base and w8a16 else None,
                        w8a8_x_dot_scaled=ds / w8a8 if ds and w8a8 else None))  # fmt: skip
    return out


def plot_gemm(res: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    rows = gemm_rows(res)
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for key in sorted({(r["model"], r["layer"]) for r in rows}):
        pts = sorted(
            (r["m"], r["w8a8_x_cublas"])
            for r in rows
            if (r["model"], r["layer"]) == key and r["w8a8_x_cublas"]
        )
        if pts:
            ax.plot(*zip(*pts), marker="o", label=f"{key[0]} {key[1]}")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(1.7, color="tab:red", ls="--", lw=0.8, label="target M≤16 (1.7x)")
    ax.axhline(0.9, color="tab:purple", ls=":", lw=0.8, label="target M≥2048 (0.9x)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("M (tokens)")
    ax.set_ylabel("speed-up over cuBLAS bf16")
    env = res.get("env", {})
    ax.set_title(
        f"MXFP8 W8A8 quantize+GEMM vs cuBLAS bf16 — {env.get('device', '')} {env.get('date', '')}"
    )
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_attention(res: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 4))
    for causal in (False, True):
        # the prefill fields are TFLOP/s: MXFP8 rate / flash rate
        pts = [
            (r["S"], r["mx_exact"] / r["flash"])
            for r in res.get("prefill", [])
            if r.get("causal") == causal and _num(r.get("mx_exact"))
        ]
        if pts:
            a1.plot(*zip(*sorted(pts)), marker="o", label="causal" if causal else "non-causal")
    a1.axhline(1.0, color="k", lw=0.8)
    a1.set_xscale("log", base=2)
    a1.set_xlabel("sequence length")
    a1.set_ylabel("MXFP8 / SDPA flash (throughput)")
    a1.set_title("prefill, B=4 H=32 D=128")
    a1.legend(fontsize=8)
    dec = [
        (r["context"], r.get("default_speedup") or r.get("speedup")) for r in res.get("decode", [])
    ]
    dec = [(c, s) for c, s in dec if _num(s)]
    if dec:
        a2.plot(*zip(*sorted(dec)), marker="o", label="MXFP8 cache (default kernel)")
    a2.axhline(1.0, color="k", lw=0.8)
    a2.axhline(1.7, color="tab:red", ls="--", lw=0.8, label="target at 16k (1.7x)")
    a2.set_xscale("log", base=2)
    a2.set_xlabel("context (tokens)")
    a2.set_ylabel("speed-up over bf16 SDPA decode")
    a2.set_title("decode, B=4 Hq=32 Hkv=8 D=128")
    a2.legend(fontsize=8)
    fig.suptitle(f"MXFP8 attention — {res.get('device', '')} {res.get('date', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_e2e(results: list[dict], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5), squeeze=False)
    for ax, res in zip(axes[0], results):
        rows = [r for r in res["summary"] if "tok/s" in r["metric"] and _num(r["ratio"])]
        labels = [
            r["metric"].replace("decode tok/s ", "decode ").replace("prefill tok/s ", "prefill ")
            for r in rows
        ]
        ax.barh(range(len(rows)), [r["ratio"] for r in rows], color="tab:blue")
        ax.set_yticks(range(len(rows)), labels, fontsize=7)
        ax.invert_yaxis()
        ax.axvline(1.0, color="k", lw=0.8)
        for i, r in enumerate(rows):
            ax.text(
                r["ratio"],
                i,
                f" {r['ratio']:.2f}x ({r['mxfp8']:.0f} vs {r['bf16']:.0f})",
                va="center",
                fontsize=7,
            )
        w = next((r for r in res["summary"] if r["metric"].startswith("weights")), None)
        extra = f", weights {w['ratio']:.2f}x" if w else ""
        ax.set_title(f"{Path(res['model']).name}, {res.get('recipe', 'mxfp8')}{extra}", fontsize=9)
        ax.set_xlabel("MXFP8 tokens/s over bf16 tokens/s")
        ax.set_xlim(0, max([r["ratio"] for r in rows] + [1.0]) * 1.45)
    fig.suptitle(
        f"End to end — {results[0]['env']['device']} {results[0]['env']['date']}", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ppl_rows(reports: dict[str, dict]) -> list[dict]:
    rows = []
    for name, rep in sorted(reports.items()):
        for r in rep.get("results", []):
            rows.append(dict(file=name, model=r["model"], role=r["role"], ppl=_num(r["ppl"]), n_windows=rep.get("n_windows"),
                             dtype=rep.get("dtype", "bfloat16"), device=r.get("device", ""), delta_pct=r.get("delta_pct_vs_baseline")))  # fmt: skip
    return rows


def plot_ppl(rows: list[dict], path: Path) -> None:
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["ppl"]]
    fig, ax = plt.subplots(figsize=(7.5, 0.45 * len(rows) + 1.2))
    labels = [
        f"{r['file']}: {Path(r['model']).name} ({r['n_windows']} win, {r['dtype']})" for r in rows
    ]
    ax.barh(range(len(rows)), [r["ppl"] for r in rows], color="tab:green")
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    for i, r in enumerate(rows):
        ax.text(r["ppl"], i, f" {r['ppl']:.4f}", va="center", fontsize=7)
    ax.set_xlim(0, max(r["ppl"] for r in rows) * 1.25)
    ax.set_xlabel("perplexity (lower is better)")
    ax.set_title("SmolLM2-135M perplexity, WikiText-2 validation", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_markdown(gemm, attn, e2e, ppl, convert=()) -> str:
    from mxq.eval.bench_e2e import table_lines

    lines = ["# mxq benchmark summary", ""]
    if convert:
        lines += ["## Converter (mxq quantize, streaming)", "", "| shape | device | run | wall s | MiB/s | peak RSS growth MiB | peak GPU MiB |",
                  "|---|---|---|---:|---:|---:|---:|"]  # fmt: skip
        for c in convert:
            for name, r in c["results"].items():
                gpu = f"{r['peak_gpu_bytes'] / 2**20:.0f}" if r.get("peak_gpu_bytes") else "-"
                lines.append(f"| {c['shape']} | {c['device']} | {name} | {r['wall_s']:.1f} | {r['mib_per_s']:.0f} | "
                             f"{r['peak_rss_growth_bytes'] / 2**20:.0f} | {gpu} |")  # fmt: skip
        lines.append("")
    if gemm:
        rows = gemm_rows(gemm)
        lines += [
            "## GEMM (W8A8 quantize+GEMM, speed-up over cuBLAS bf16)",
            "",
            "| M | min | median | max |",
            "|---:|---:|---:|---:|",
        ]
        for m in sorted({r["m"] for r in rows}):
            v = sorted(r["w8a8_x_cublas"] for r in rows if r["m"] == m and r["w8a8_x_cublas"])
            if v:
                lines.append(f"| {m} | {v[0]:.2f} | {v[len(v) // 2]:.2f} | {v[-1]:.2f} |")
        lines.append("")
    if attn:
        lines += [
            "## Attention decode (speed-up over bf16 SDPA)",
            "",
            "| context | speed-up |",
            "|---:|---:|",
        ]
        for r in attn.get("decode", []):
            lines.append(
                f"| {r['context']} | {(r.get('default_speedup') or r.get('speedup')):.2f} |"
            )
        lines.append("")
    for res in e2e:
        lines += table_lines(res) + [""]
    if ppl:
        lines += [
            "## Perplexity",
            "",
            "| file | model | windows | dtype | device | ppl | Δ% |",
            "|---|---|---:|---|---|---:|---:|",
        ]
        for r in ppl:
            d = f"{r['delta_pct']:+.2f}" if _num(r["delta_pct"]) is not None else "—"
            p = f"{r['ppl']:.4f}" if r["ppl"] else "-"
            lines.append(
                f"| {r['file']} | {r['model']} | {r['n_windows']} | {r['dtype']} | {r['device']} | {p} | {d} |"
            )
        lines.append("")
    return "\n".join(lines)


def make_all(results: Path, out: Path | None = None, plots: bool = True) -> list[Path]:
    """Write the plots (unless ``plots=False``) and SUMMARY.md for the JSON files in
    ``results``; returns the files written."""
    if plots:
        try:
            import matplotlib

            matplotlib.use("Agg")
        except ImportError:
            raise RuntimeError("plots need matplotlib: pip install 'mxq[plot]'") from None
    out = out or results
    out.mkdir(parents=True, exist_ok=True)
    gemm, attn = (
        merge_gemm(sorted(results.glob("bench_gemm*.json"))),
        _load(results / "bench_attention.json"),
    )
    e2e = [json.loads(p.read_text()) for p in sorted(results.glob("e2e-*.json"))]
    ppl = ppl_rows({p.stem: json.loads(p.read_text()) for p in sorted(results.glob("ppl-*.json"))})
    convert = [json.loads(p.read_text()) for p in sorted(results.glob("convert-*.json"))]
    written = []
    for ok, fn, arg, name in ((gemm, plot_gemm, gemm, "gemm.png"), (attn, plot_attention, attn, "attention.png"),
                              (e2e, plot_e2e, e2e, "e2e.png"), (ppl, plot_ppl, ppl, "ppl.png")):  # fmt: skip
        if ok and plots:
            tmp = out / f".{name}.tmp.png"
            fn(arg, tmp)
            tmp.replace(out / name)
            written.append(out / name)
    (out / "SUMMARY.md").write_text(summary_markdown(gemm, attn, e2e, ppl, convert))
    written.append(out / "SUMMARY.md")
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", type=Path)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    for f in make_all(a.results, a.out):
        print(f"wrote {f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
