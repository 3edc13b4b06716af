"""``mxq bench`` and the plots/summary built from benchmark JSON."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from mxq.cli import app
from mxq.cli.bench import part_commands
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


# --- the MoE benchmarks' new modes, on a CPU at tiny widths --------------------------------------

LAYER_TINY = ["--experts", "8", "--top-k", "2", "--hidden", "96", "--width", "64", "--device", "cpu"]


@pytest.mark.parametrize("family", ["qwen3", "gpt-oss"])
def test_bench_moe_layer_on_cpu(tmp_path, family):
    """``bench_moe --layer``: transformers' experts module and its MXExperts (W8A16, W8A8) run on the
    same routing at every token count, each checked against the fp32 reference of its dequantized
    weights, and every figure the table prints is in the JSON (times: the CPU's wall time)."""
    from mxq.eval import bench_moe

    out = tmp_path / "layer.json"
    assert bench_moe.main(["--layer", "--family", family, *LAYER_TINY, "--layer-tokens", "1,5,40", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["layer"] == dict(experts=8, top_k=2, hidden=96, width=64, bias=family == "gpt-oss")
    assert [r["tokens"] for r in res["layer_rows"]] == [1, 5, 40] and not res["failed"]
    for r in res["layer_rows"]:
        for role in ("w8a16", "w8a8"):
            assert r[f"{role}_relerr"] < 1e-2, r  # bf16 output rounding: ~2e-3
            assert 0 < r[f"{role}_vs_bf16"] < 0.2, r  # the quantization moves the output, a little
        for role in ("bf16", "w8a16", "w8a8"):
            assert r[f"{role}_us"] > 0 and r[f"{role}_host_us"] > 0
        # bytes at decode sizes: the active experts' codes + scales (+ biases), X and Y
        per_expert = 3 * 64 * 96 * (1 + 1 / 32) + (2 * (2 * 64 + 96) if family == "gpt-oss" else 0)
        assert r["mxq_bytes"] == pytest.approx(r["active_experts"] * per_expert + 4 * r["tokens"] * 96)
        assert 1 <= r["active_experts"] <= min(8, 2 * r["tokens"])


@pytest.mark.parametrize("family", ["qwen3", "gpt-oss"])
def test_bench_moe_layer_reference_is_the_family_layer(family):
    """The reference that judges mxq, fed the bf16 module's own weights, gives transformers' own
    output for the layer (its gate and layout, gpt-oss's interleaved columns and biases included)."""
    from mxq.eval import bench_moe

    dev = torch.device("cpu")
    m = bench_moe.build_experts_layer(family, 8, 2, 96, 64, dev, seed=1)
    x, idx, w = bench_moe.layer_inputs(12, 8, 2, 96, torch.Generator().manual_seed(2), dev)
    t = family == "gpt-oss"  # gpt-oss stores [E, K, N]
    canon = lambda p: (p.transpose(1, 2) if t else p).float()
    bias = lambda n: m._parameters[n].float() if n in m._parameters else None
    weights = (canon(m.gate_up_proj), bias("gate_up_proj_bias"), canon(m.down_proj), bias("down_proj_bias"))
    with torch.inference_mode():
        ref = bench_moe.layer_reference(weights, family, x, idx, w, 1.702, 7.0, None)
        got = m(x, idx, w).float()
    assert m.config._experts_implementation == "grouped_mm"
    assert ((got - ref).norm() / ref.norm()).item() < 1e-2
    if t:  # the biases count: without them the layer is another
        assert m.gate_up_proj_bias.abs().max() > 0 and m.down_proj_bias.abs().max() > 0


def test_bench_moe_layer_fails_loudly(tmp_path, monkeypatch, capsys):
    """A layer that disagrees with the reference (here: the reference's gate changed) is a FAIL, exit 1,
    and nothing is timed."""
    from mxq.eval import bench_moe

    gate = bench_moe.family_gate
    monkeypatch.setattr(bench_moe, "family_gate", lambda *a: gate(*a) * 1.1)
    out = tmp_path / "layer.json"
    assert bench_moe.main(["--layer", "--family", "qwen3", *LAYER_TINY, "--layer-tokens", "3", "--out", str(out)]) == 1
    assert "FAIL qwen3 T=3 w8a16" in capsys.readouterr().out
    res = json.loads(out.read_text())
    assert res["failed"] and "bf16_us" not in res["layer_rows"][0]


def test_bench_e2e_gpt_oss_shapes(tmp_path):
    """``--shape tiny-gpt-oss`` through the whole bench path on a CPU (build, the recipe's quantization,
    the logits check, prefill with host/device time per forward and per MoE layer, decode), and the
    ``gpt-oss-20b`` shape is gpt-oss-20b (its parameter count, attention pattern and rope)."""
    import subprocess
    import sys

    from transformers import AutoConfig, AutoModelForCausalLM

    from mxq.eval import bench_e2e

    kw = dict(bench_e2e.SHAPES["gpt-oss-20b"])
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    with torch.device("meta"):
        big = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    assert 20.8e9 < sum(p.numel() for p in big.parameters()) < 21.0e9  # openai/gpt-oss-20b: 20.9 B
    assert cfg.layer_types == ["sliding_attention", "full_attention"] * 12 and cfg.sliding_window == 128
    assert cfg.rope_parameters["rope_type"] == "yarn" and cfg.rope_parameters["rope_theta"] == 150000.0
    assert (cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size, cfg.head_dim) == (32, 4, 2880, 64)

    tiny = bench_e2e.build_random("tiny-gpt-oss", torch.device("cpu"))
    assert tiny.config._experts_implementation == "grouped_mm" and bench_e2e.moe_layers(tiny) == 2
    biases = [p for n, p in tiny.named_parameters() if n.endswith("bias")]
    assert biases and all(p.abs().max() > 0 for p in biases)  # drawn, not transformers' zeros
    out = tmp_path / "e2e.json"
    cmd = [sys.executable, "-m", "mxq.eval.bench_e2e", "--shape", "tiny-gpt-oss", "--device", "cpu", "--seq-len", "16",
           "--batch", "1", "--new-tokens", "4", "--prompt-len", "8", "--reps", "2", "--no-graph", "--no-generate",
           "--out", str(out)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**__import__("os").environ, "OMP_NUM_THREADS": "2"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["config"]["num_experts"] == 4 and res["check"]["logits_finite"] and res["check"]["logits_rel_err_vs_bf16"] < 0.2
    for role in ("bf16", "mxfp8"):
        pf = res[role]["prefill"]
        assert pf["moe_layers"] == 2 and pf["host_s"] > 0 and pf["device_s"] == pf["median_s"] > 0
        assert pf["host_s_per_moe_layer"] == pytest.approx(pf["host_s"] / 2)
        assert pf["launches"] is None  # counted on CUDA only
        assert all(d.get("tokens_per_s", 0) > 0 for d in res[role]["decode"]), res[role]["decode"]
    rows = {row["metric"]: row for row in res["summary"]}
    assert 0 < rows["weights (GiB)"]["ratio"] < 1
    for metric in ("prefill host ms / forward", "prefill device ms / forward", "prefill host ms / MoE layer"):
        assert rows[metric]["bf16"] > 0 and rows[metric]["mxfp8"] > 0 and f"| {metric} |" in r.stdout
    assert "prefill kernel launches / forward" not in rows


def test_bench_e2e_prefill_rows():
    """The prefill's host/device time per forward, host time per MoE layer and launch count are table
    rows (ratios as MXFP8's fraction of bf16); a dense model has no per-MoE-layer row, and a run
    recorded before these figures existed has none of them."""
    from mxq.eval import bench_e2e

    def role(host, dev, moe, kernels):
        return dict(weight_bytes=2**30, decode=[], prefill=dict(
            batch=1, seq_len=2048, tokens_per_s=2048 / dev, peak_bytes=None, host_s=host, device_s=dev, moe_layers=moe,
            host_s_per_moe_layer=host / moe if moe else None, launches=dict(kernels=kernels, copies=3)))  # fmt: skip

    rows = {r["metric"]: r for r in bench_e2e.summary_rows(dict(bf16=role(0.02, 0.04, 16, 400), mxfp8=role(0.03, 0.03, 16, 300)))}
    host = rows["prefill host ms / forward"]
    assert host["bf16"] == pytest.approx(20) and host["ratio"] == pytest.approx(1.5)
    assert rows["prefill device ms / forward"]["mxfp8"] == pytest.approx(30)
    assert rows["prefill host ms / MoE layer"]["mxfp8"] == pytest.approx(30 / 16)
    assert rows["prefill kernel launches / forward"]["ratio"] == pytest.approx(0.75)
    dense = {r["metric"] for r in bench_e2e.summary_rows(dict(bf16=role(0.02, 0.04, 0, 1), mxfp8=role(0.03, 0.03, 0, 1)))}
    assert "prefill host ms / forward" in dense and "prefill host ms / MoE layer" not in dense
    old = dict(bf16=role(0.02, 0.04, 1, 1), mxfp8=role(0.03, 0.03, 1, 1))
    for r in old.values():
        for k in ("host_s", "device_s", "moe_layers", "host_s_per_moe_layer", "launches"):
            del r["prefill"][k]
    assert not [r for r in bench_e2e.summary_rows(old) if "/ forward" in r["metric"] or "MoE layer" in r["metric"]]


def test_mx_only_checkpoint_is_made_without_bf16(tmp_path):
    """``--mx-only``: the MXFP8 checkpoint comes from tensors made one at a time (no bf16 copy), at
    ``--layers``; what it holds decodes to those tensors, and the run reports the bf16 bytes it avoided."""
    import subprocess
    import sys

    import mxq
    from mxq.eval import bench_e2e

    ck, out = tmp_path / "ck", tmp_path / "r.json"
    cmd = [sys.executable, "-m", "mxq.eval.bench_e2e", "--shape", "tiny-moe", "--layers", "3", "--device", "cpu",
           "--checkpoint-dir", str(ck), "--roles", "mxfp8", "--mx-only", "--seq-len", "16", "--batch", "1",
           "--new-tokens", "2", "--prompt-len", "4", "--reps", "1", "--no-generate", "--no-static-generate",
           "--no-launch-count", "--out", str(out)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**__import__("os").environ, "OMP_NUM_THREADS": "2"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert sorted(p.name for p in ck.iterdir()) == ["mxfp8"]
    res = json.loads(out.read_text())
    ref = bench_e2e.build_random("tiny-moe", torch.device("cpu"), layers=3)
    assert res["config"]["num_hidden_layers"] == 3 and ref.config.num_hidden_layers == 3
    assert res["bf16_bytes"] == sum(t.numel() * 2 for t in ref.state_dict().values())
    assert "bf16 would hold" in r.stdout and "| decode tok/s B=1 static eager |" in r.stdout
    src = bench_e2e.random_source("tiny-moe", torch.device("cpu"), layers=3)
    assert torch.equal(src.read("model.layers.2.self_attn.q_proj.weight"), src.read("model.layers.2.self_attn.q_proj.weight"))
    assert not torch.equal(src.read("model.layers.1.self_attn.q_proj.weight"), src.read("model.layers.2.self_attn.q_proj.weight"))
    model = mxq.load(ck / "mxfp8")
    sd = model.state_dict()
    assert torch.equal(sd["model.embed_tokens.weight"], src.read("model.embed_tokens.weight"))
    assert torch.equal(sd["model.layers.0.input_layernorm.weight"], torch.ones(128, dtype=torch.bfloat16))
    q = model.get_submodule("model.layers.2.self_attn.q_proj")  # a slice of the fused q/k/v GEMM
    w = src.read("model.layers.2.self_attn.q_proj.weight").float()
    blockmax = w.abs().reshape(w.shape[0], -1, 32).amax(-1, keepdim=True)
    err = (q.dequantized_weight().float() - w).abs().reshape(w.shape[0], -1, 32)
    assert (err <= blockmax * 2**-4 + 1e-12).all()  # E4M3: within half a step of the block's largest binade


def test_bench_scan_times_both_paths_and_writes_json(tmp_path):
    """``bench_scan``: the word-wise and byte-wise scans of one tensor, a row per thread count."""
    from mxq.eval import bench_scan

    out = tmp_path / "scan.json"
    assert bench_scan.main(["--mib", "3", "--threads", "1,2", "--reps", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["threads"] for r in res["rows"]] == [1, 2] and res["mib"] == 3
    assert all(r["wordwise_gb_s"] > 0 and r["bytewise_gb_s"] > 0 for r in res["rows"])


def test_bench_gemm_tp2_shapes_are_one_ranks_shards():
    """bench_gemm's 70b-tp2 rows are what one rank of two holds under mxq.runtime.tp's split of Llama's
    projections (column-parallel q/k/v and gate/up by N, row-parallel o and down by K)."""
    from mxq.eval.bench_gemm import LLAMA_SHAPES
    from mxq.runtime import tp

    modules = {"qkv": ["q_proj", "k_proj", "v_proj"], "o": ["o_proj"], "gate_up": ["gate_proj", "up_proj"],
               "down": ["down_proj"]}  # fmt: skip
    for layer, (n, k) in LLAMA_SHAPES["70b"].items():
        styles = {tp.split_style(f"model.layers.0.x.{m}.weight", None) for m in modules[layer]}
        assert len(styles) == 1
        style = styles.pop()
        assert style in ("colwise", "rowwise") and tp.check_shard(layer, (n, k), style, 2).ok
        assert LLAMA_SHAPES["70b-tp2"][layer] == ((n // 2, k) if style == "colwise" else (n, k // 2))
    # `mxq tune --shapes llama3-70b-tp2` tunes the same shapes
    from mxq.cli.tune import PRESETS

    assert PRESETS["llama3-70b-tp2"] == list(LLAMA_SHAPES["70b-tp2"].values())
    assert PRESETS["llama3-70b"] == list(LLAMA_SHAPES["70b"].values())


@pytest.mark.parametrize("m,layer", [(1, "qkv"), (8, "qkv"), (1, "down"), (16, "o"), (1, "gate_up")])
def test_bench_gemm_same_bytes_copy_size(m, layer):
    """The decode table's yardstick copies half the GEMM's bytes rounded up to a multiple of 64 KiB
    (torch's byte copy ran a third slower at sizes of 2048 mod 4096 on an H200): never fewer bytes than
    the GEMM moves, less than 64 KiB more."""
    from mxq.eval.bench_gemm import COPY_ROUND, LLAMA_SHAPES, copy_half_bytes, read_bytes

    n, k = LLAMA_SHAPES["8b"][layer]
    nbytes = read_bytes(m, n, k, 1 + 1 / 32)
    half = copy_half_bytes(nbytes)
    assert half % 4096 == 0 and half % COPY_ROUND == 0 and COPY_ROUND == 1 << 16
    assert nbytes / 2 - 1 <= half < nbytes / 2 + COPY_ROUND
