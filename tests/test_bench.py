"""``mxq bench`` and the plots/summary built from benchmark JSON."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from mxq.cli import app
from mxq.cli_bench import part_commands
from mxq.eval import plots

RESULTS = Path(__file__).resolve().parents[1] / "eval" / "results" / "2026-11-21-h200"
HAS_MPL = importlib.util.find_spec("matplotlib") is not None


def test_summary_from_recorded_results(tmp_path):
    written = plots.make_all(RESULTS, tmp_path, plots=HAS_MPL)
    md = (tmp_path / "SUMMARY.md").read_text()
    rows = {}
    for f in sorted(RESULTS.glob("bench_gemm*.json")):  # later files update rows of earlier ones
        rows.update(
            {(r["model"], r["layer"], r["m"]): r for r in json.loads(f.read_text())["gemm"]}
        )
    gemm = list(rows.values())
    # the M=2048 median speed-up, recomputed from the raw times
    v = sorted(r["cublas_bf16_us"] / r["mxq_w8a8_us"] for r in gemm if r["m"] == 2048)
    assert f"| 2048 | {v[0]:.2f} | {v[len(v) // 2]:.2f} | {v[-1]:.2f} |" in md
    ppl = json.loads((RESULTS / "ppl-mxfp8.json").read_text())
    assert f"{ppl['results'][1]['ppl']:.4f}" in md
    if HAS_MPL:
        for name in ("gemm.png", "ppl.png"):
            assert (tmp_path / name) in written
            assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob(".*.tmp.png"))


def test_part_commands():
    cmds = dict(part_commands(Path("o"), ["gemm", "e2e"], quick=True, model="default"))
    assert cmds["gemm"][2:] == [
        "mxq.eval.bench_gemm",
        "--out",
        "o/bench_gemm.json",
        "--models",
        "8b",
        "--ms",
        "1,16,2048",
        "--no-quantize",
    ]
    assert "--shape" in cmds["e2e"] and "tiny" in cmds["e2e"]
    assert cmds["e2e-model"][cmds["e2e-model"].index("--model") + 1] == "default"
    full = dict(part_commands(Path("o"), ["e2e"], quick=False, model=None))
    assert "--compile" in full["e2e"] and "llama3-8b" in full["e2e"]


def test_cli_bench_convert_quick(tmp_path):
    """The one part that runs without a GPU, end to end through the CLI."""
    out = tmp_path / "b"
    res = CliRunner().invoke(
        app, ["bench", "--parts", "convert", "--quick", "--out", str(out), "--no-plots"]
    )
    assert res.exit_code == 0, res.output
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rep = json.loads((out / f"convert-{dev}-tiny.json").read_text())
    r = rep["results"]["mxq_quantize"]
    assert r["output_bytes"] < rep["results"]["io_floor"]["output_bytes"]
    assert "## Converter" in (out / "SUMMARY.md").read_text()
    assert not (out / "convert-work" / "src-tiny").exists()  # the generated checkpoint is removed


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error")
def test_cli_bench_gpu_parts_need_cuda(tmp_path):
    res = CliRunner().invoke(app, ["bench", "--parts", "gemm,convert", "--out", str(tmp_path)])
    assert res.exit_code != 0 and "need a CUDA device" in res.output
    res = CliRunner().invoke(app, ["bench", "--parts", "nope", "--out", str(tmp_path)])
    assert res.exit_code != 0 and "unknown part(s) nope" in res.output


def test_bench_e2e_tensor_parallel_on_cpu(tmp_path):
    """``bench_e2e --tp 2``: checkpoints written once, each role under torchrun (gloo), rank 0 reports;
    the MXFP8 rank holds less than the bf16 one."""
    import json
    import subprocess
    import sys

    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "mxq.eval.bench_e2e", "--shape", "tiny", "--device", "cpu", "--tp", "2",
           "--checkpoint-dir", str(tmp_path / "ck"), "--batch", "1", "--new-tokens", "3", "--reps", "1", "--seq-len", "32",
           "--prompt-len", "8", "--generate-tokens", "2", "--out", str(out)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["tp"] == 2 and "x 2 (tensor parallel)" in r.stdout
    assert (tmp_path / "ck" / "bf16" / "config.json").exists() and (tmp_path / "ck" / "mxfp8" / "config.json").exists()
    rows = {row["metric"]: row for row in res["summary"]}
    assert 0 < rows["weights (GiB)"]["ratio"] < 1
    assert all(d.get("tokens_per_s", 0) > 0 for d in res["mxfp8"]["decode"]), res["mxfp8"]["decode"]


def test_bench_e2e_merge_adds_pairs(tmp_path):
    """``--merge`` of complete runs: their pairs form one median with min-max (a long run split over
    several calls); recomputed here from the raw tokens/s of the parts."""
    import copy

    from mxq.eval import bench_e2e

    base = json.loads((RESULTS.parent / "2026-11-25-tp" / "e2e-70b16l-tp2.json").read_text())
    parts, scale = [], [1.0, 2.0, 0.5]
    for i, k in enumerate(scale):
        part = copy.deepcopy(base)
        for d in part["mxfp8"]["decode"]:
            d["tokens_per_s"] = d["tokens_per_s"] * k if d.get("tokens_per_s") else d.get("tokens_per_s")
        path = tmp_path / f"p{i}.json"
        path.write_text(json.dumps(part))
        parts.append(path)
    out = tmp_path / "m.json"
    assert bench_e2e.main(["--merge", *map(str, parts), "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert len(res["runs"]["bf16"]) == len(res["runs"]["mxfp8"]) == 3
    d0b, d0q = base["bf16"]["decode"][0], base["mxfp8"]["decode"][0]
    row = next(r for r in res["summary"] if r["metric"] == f"decode tok/s B={d0b['batch']} {d0b['mode']}")
    r = d0q["tokens_per_s"] / d0b["tokens_per_s"]
    assert row["pairs"] == 3
    assert row["ratio"] == pytest.approx(r) and row["ratio_min"] == pytest.approx(r * 0.5)
    assert row["ratio_max"] == pytest.approx(r * 2)
    one = tmp_path / "one.json"
    assert bench_e2e.main(["--merge", str(parts[0]), "--out", str(one)]) == 0
    assert "runs" not in json.loads(one.read_text())
    # a run that measured fewer modes: each metric counts the pairs that have it, by name
    fewer = copy.deepcopy(base)
    for role in ("bf16", "mxfp8"):
        fewer[role]["decode"] = fewer[role]["decode"][1:]
    (tmp_path / "fewer.json").write_text(json.dumps(fewer))
    assert bench_e2e.main(["--merge", str(parts[0]), str(parts[1]), str(tmp_path / "fewer.json"), "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    row = next(r for r in res["summary"] if r["metric"] == f"decode tok/s B={d0b['batch']} {d0b['mode']}")
    assert row["pairs"] == 2 and row["ratio_min"] == pytest.approx(r) and row["ratio_max"] == pytest.approx(r * 2)
    d1b = base["bf16"]["decode"][1]
    row = next(r for r in res["summary"] if r["metric"] == f"decode tok/s B={d1b['batch']} {d1b['mode']}")
    assert row["pairs"] == 3 and row["bf16"] == pytest.approx(d1b["tokens_per_s"])
