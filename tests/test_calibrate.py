"""Calibrator: folded permutations leave the model's function unchanged, statistics, reordering,
sensitivity against a brute-force loop, kept layers, plan files.

References are independent: logits of the unpermuted fp32 model, statistics computed on the
concatenated captured activations, KL computed by quantizing one layer with ``quantize_model``
and running the whole model.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from calib_helpers import (
    logits_of,
    tiny_llama,
    tiny_plan_inputs,
    tiny_qwen,
    token_ids,
)
from transformers import (
    AutoModelForCausalLM,
)

import mxq
from mxq.calib.calibrator import (
    LinearStats,
    block_spread,
    channel_orders,
    collect_statistics,
    layer_sensitivity,
    make_plan,
    output_sqnr,
)
from mxq.calib.plan import LayerPlan, Plan, PlanError, load_plan, save_plan
from mxq.calib.reorder import Geometry, Permutations, permute_model
from mxq.convert.converter import quantize_checkpoint
from mxq.formats import E4M3, E5M2, ScaleRule
from mxq.recipe import TensorSpec, load_recipe, parse_recipe
from mxq.runtime.linear import linear_layers

MODELS = {"llama": tiny_llama, "qwen2": tiny_qwen}


def _random_perms(model, which: str, seed: int = 0) -> Permutations:
    g = torch.Generator().manual_seed(seed)
    geom = Geometry.from_config(model.config)
    p = Permutations()
    if which in ("mlp", "all"):
        p.mlp = {i: torch.randperm(geom.intermediate_size, generator=g).tolist() for i in range(geom.num_hidden_layers)}
    if which in ("v", "all"):
        p.v = {i: [torch.randperm(geom.head_dim, generator=g).tolist() for _ in range(geom.num_key_value_heads)]
               for i in range(geom.num_hidden_layers)}
    if which in ("residual", "all"):
        p.residual = torch.randperm(geom.hidden_size, generator=g).tolist()
    return p


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


# --- permutations leave the function unchanged --------------------------------------------------

@pytest.mark.parametrize("arch", list(MODELS))
@pytest.mark.parametrize("which", ["mlp", "v", "residual", "all"])
def test_folded_permutations_in_memory(arch, which):
    model = MODELS[arch]()
    ids = token_ids(model.config.vocab_size)
    ref = logits_of(model, ids)
    perms = _random_perms(model, which)
    permuted = permute_model(copy.deepcopy(model), perms)
    if which in ("mlp", "all"):  # the permutation really moved weights
        assert not torch.equal(permuted.model.layers[0].mlp.down_proj.weight, model.model.layers[0].mlp.down_proj.weight)
    if arch == "qwen2" and which in ("residual", "all"):
        assert permuted.lm_head.weight is permuted.model.embed_tokens.weight  # still tied
    assert _rel(logits_of(permuted, ids), ref) <= 1e-5


def _all_kept_plan(model, perms: Permutations, recipe="mxfp8") -> Plan:
    rec = load_recipe(recipe)
    layers = {n: LayerPlan(rec.weights, rec.activations, keep_bf16=True, reason="test")
              for n in linear_layers(model) if n != "lm_head"}
    return Plan(rec, Geometry.from_config(model.config), layers, perms)


@pytest.mark.parametrize("arch", list(MODELS))
def test_folded_permutations_through_converter(tmp_path, arch):
    """Convert with a plan that keeps every layer (so nothing is rounded) and load it back."""
    model = MODELS[arch]()
    model.save_pretrained(tmp_path / "src")
    ids = token_ids(model.config.vocab_size)
    ref = logits_of(model, ids)
    for which in ("mlp", "v", "residual", "all"):
        plan = _all_kept_plan(model, _random_perms(model, which, seed=3))
        out = tmp_path / f"out-{which}"
        quantize_checkpoint(tmp_path / "src", out, plan=plan, progress=False)
        qc = json.loads((out / "config.json").read_text())["quantization_config"]
        assert qc["layers"] == {} and qc["calibration"]["permutations_folded"]["residual"] == (which in ("residual", "all"))
        loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        assert _rel(logits_of(loaded, ids), ref) <= 1e-5, which


def test_converter_plan_equals_in_memory_apply(tmp_path):
    """Quantized with permutations and per-layer rules: the converter and apply_plan agree exactly."""
    from mxq.calib.calibrator import apply_plan

    model = tiny_llama()
    model.save_pretrained(tmp_path / "src")
    rec = load_recipe("mxfp8")
    layers = {}
    for i, n in enumerate(n for n in linear_layers(model) if n != "lm_head"):
        rule = ScaleRule.MSE if i % 2 else ScaleRule.RCEIL
        layers[n] = LayerPlan(TensorSpec(E4M3, rule), rec.activations, keep_bf16=(i == 3), reason="test" if i == 3 else "")
    layers["lm_head"] = LayerPlan(rec.weights, rec.activations, True, "excluded by recipe")
    plan = Plan(rec, Geometry.from_config(model.config), layers, _random_perms(model, "all"))
    save_plan(plan, tmp_path / "plan.json")
    rep = quantize_checkpoint(tmp_path / "src", tmp_path / "out", plan=tmp_path / "plan.json", progress=False)
    kept = [n for n, lp in layers.items() if lp.keep_bf16]
    assert sorted(rep.kept) == sorted(kept)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    mem = apply_plan(copy.deepcopy(model), load_plan(tmp_path / "plan.json"))
    ids = token_ids(320)
    assert torch.equal(logits_of(loaded, ids), logits_of(mem, ids))
    qc = loaded.config.quantization_config
    assert qc.layers["model.layers.0.self_attn.k_proj"]["weights"]["scale_rule"] == "mse"
    assert qc.layers["model.layers.0.self_attn.q_proj"]["weights"]["scale_rule"] == "rceil"
    assert set(kept) <= set(qc.ignore)


# --- statistics ------------------------------------------------------------------------------------

def test_statistics_equal_direct_computation():
    model = tiny_llama()
    batches = [token_ids(320, 2, 40), token_ids(320, 3, 40) + 1]
    caught = []
    h = model.model.layers[1].mlp.down_proj.register_forward_pre_hook(lambda m, a: caught.append(a[0].reshape(-1, 96)))
    stats = collect_statistics(model, batches, sample_rows=7, progress=False)
    h.remove()
    x = torch.cat(caught).double()
    st = stats["model.layers.1.mlp.down_proj"]
    assert st.rows == 200
    torch.testing.assert_close(st.absmax.double(), x.abs().amax(0))
    torch.testing.assert_close(st.mean_abs, x.abs().mean(0))
    torch.testing.assert_close(st.second_moment, (x**2).mean(0))
    # histogram of floor(log2 amax) over 1x32 blocks, computed independently in float64
    amax = x.abs().reshape(200, 3, 32).amax(-1).flatten()
    e = torch.floor(torch.log2(amax)).long()
    expect = torch.bincount((e + 40 + 2).clamp(1, 81), minlength=82)
    assert torch.equal(st.block_hist, expect)
    assert st.samples.shape == (7, 96)
    assert all((x.float() == r).all(-1).any() for r in st.samples)  # sampled rows are real rows
    assert stats["model.layers.0.self_attn.q_proj"].k == 64 and "lm_head" in stats


# --- reordering groups magnitudes --------------------------------------------------------------

def _outlier_layer(k=512, n=256, rows=256, seed=0):
    """Activations with a few huge channels scattered over K, whose weight columns are small
    (as in LLMs with massive activations): per-channel magnitudes span ~2^20."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.ones(k)
    out_ch = torch.randperm(k, generator=g)[:12]
    scale[out_ch] = 2.0**16
    x = torch.randn(rows, k, generator=g) * scale
    lin = torch.nn.Linear(k, n, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * 0.05)
        lin.weight[:, out_ch] *= 2.0**-14
    st = LinearStats(k, sample_rows=rows)
    st.update(x, rows)
    return lin, x, st


def test_reordering_groups_magnitudes_on_outlier_inputs():
    lin, x, st = _outlier_layer()
    cands = channel_orders(st, lin.weight)
    before = block_spread(st.absmax)
    for p in cands.values():
        assert sorted(p.tolist()) == list(range(512))
        assert block_spread(st.absmax, p) < before / 4
    a = TensorSpec(E4M3, ScaleRule.RCEIL)
    direct = output_sqnr(lin, x, a, a)
    sorted_ = output_sqnr(lin, x, a, a, cands["absmax"])
    assert sorted_ > direct + 3.0  # the small channels no longer sit in the outliers' blocks


def test_make_plan_chooses_reordering_for_outlier_channels():
    model = tiny_llama()
    with torch.no_grad():  # make four gate/up rows huge: outlier channels at the down_proj input
        for layer in model.model.layers:
            layer.mlp.up_proj.weight[[5, 40, 61, 90]] *= 2.0**16
            layer.mlp.down_proj.weight[:, [5, 40, 61, 90]] *= 2.0**-16
    rec, cal = tiny_plan_inputs(model)
    plan = make_plan(model, cal, residual=False, scale_search=False, progress=False)
    assert plan.permutations.mlp, plan.choices
    for i in plan.permutations.mlp:
        lp = plan.layers[f"model.layers.{i}.mlp.down_proj"]
        assert lp.reorder.startswith("mlp:") and lp.sqnr_db["reorder"] > lp.sqnr_db["direct"]
        st = plan.statistics[f"model.layers.{i}.mlp.down_proj"]["block_spread_log2"]
        assert st["after"] < st["before"]
    # the folded plan computes what the per-layer choice measured: function unchanged before rounding
    ids = token_ids(320)
    ref = logits_of(model, ids)
    assert _rel(logits_of(permute_model(copy.deepcopy(model), plan.permutations), ids), ref) <= 1e-5


# --- sensitivity and kept layers ------------------------------------------------------------------

def _brute_force_kl(model, name, ids):
    ref = torch.log_softmax(logits_of(model, ids).float(), -1)
    rec = parse_recipe({"name": "one", "weights": {"elem": "e4m3", "scale_rule": "rceil"},
                        "activations": {"elem": "e4m3", "scale_rule": "rceil"}, "include": [name], "exclude": []})
    q = mxq.quantize_model(copy.deepcopy(model), rec)
    logq = torch.log_softmax(logits_of(q, ids).float(), -1)
    return float((ref.exp() * (ref - logq)).sum(-1).double().mean())


def test_sensitivity_equals_brute_force_loop():
    model = tiny_llama()
    rec = load_recipe("mxfp8")
    names = [n for n in linear_layers(model) if n != "lm_head"]
    batches = [token_ids(320, 1, 40), token_ids(320, 1, 40) + 3]
    sens = layer_sensitivity(model, {n: (rec.weights, rec.activations) for n in names}, batches, progress=False)
    brute = {n: sum(_brute_force_kl(model, n, b) for b in batches) / 2 for n in names}
    for n in names:
        assert sens[n] == pytest.approx(brute[n], rel=1e-4, abs=1e-9), n
    assert sorted(names, key=sens.get) == sorted(names, key=brute.get)


@pytest.fixture(scope="module")
def qwen_cal():
    model = tiny_qwen()
    return model, tiny_plan_inputs(model)


@pytest.mark.parametrize("n", [0, 1, 3])
def test_keep_bf16_keeps_the_n_most_sensitive(qwen_cal, n):
    model, (rec, cal) = qwen_cal
    plan = make_plan(model, cal, keep_bf16=n, progress=False)
    ranking = sorted(cal.selected, key=lambda x: -cal.sensitivity[x])
    kept = {k for k, lp in plan.layers.items() if lp.keep_bf16 and k in cal.selected}
    assert kept == set(ranking[:n])
    assert plan.layers["lm_head"].keep_bf16 and plan.layers["lm_head"].reason == "excluded by recipe"


def test_max_dppl_budget(qwen_cal):
    model, (rec, cal) = qwen_cal
    loose = make_plan(model, cal, max_dppl=1e6, progress=False)
    assert loose.choices["kept_by_sensitivity"] == 0
    tight = make_plan(model, cal, max_dppl=0.0, progress=False)
    curve = tight.choices["max_dppl_search"]
    k = tight.choices["kept_by_sensitivity"]
    base = curve["bf16_ppl"]
    assert curve["ppl_by_kept"][str(k)] <= base * (1 + 1e-12) or k == len(cal.selected)
    if str(k - 1) in curve["ppl_by_kept"]:
        assert curve["ppl_by_kept"][str(k - 1)] > base


# --- plan files ----------------------------------------------------------------------------------

def test_plan_round_trip(tmp_path, qwen_cal):
    model, (rec, cal) = qwen_cal
    plan = make_plan(model, cal, keep_bf16=1, progress=False)
    save_plan(plan, tmp_path / "plan.json")
    back = load_plan(tmp_path / "plan.json")
    assert back.to_dict() == json.loads((tmp_path / "plan.json").read_text())
    assert back.calibration["samples"] == 4 and back.calibration["seq_len"] == 48
    assert back.kept == plan.kept and back.permutations.to_dict() == plan.permutations.to_dict()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.pop("layers"), "missing key 'layers'"),
        (lambda d: d.update(format="other"), "format: expected 'mxq-plan'"),
        (lambda d: d["layers"]["model.layers.0.mlp.up_proj"]["weights"].update(scale_rule="best"), "layers['model.layers.0.mlp.up_proj'].weights/activations: unknown scale rule"),
        (lambda d: d["layers"]["model.layers.0.mlp.up_proj"].update(keep_bf16="yes"), "layers['model.layers.0.mlp.up_proj'].keep_bf16: expected bool"),
        (lambda d: d["permutations"].update(residual=[0, 0] + list(range(2, 96))), "permutations.residual: not a permutation of 0..95"),
        (lambda d: d["permutations"]["mlp"].update({"7": list(range(160))}), "permutations.mlp.7: layer index out of range"),
        (lambda d: d["model"].pop("head_dim"), "missing key model.'head_dim'"),
        (lambda d: d["recipe"].update(block_size=16), "recipe: block_size"),
    ],
)
def test_bad_plan_files_name_the_key(tmp_path, qwen_cal, edit, message):
    model, (rec, cal) = qwen_cal
    d = make_plan(model, cal, progress=False).to_dict()
    edit(d)
    (tmp_path / "bad.json").write_text(json.dumps(d))
    with pytest.raises(PlanError) as e:
        load_plan(tmp_path / "bad.json")
    assert message in str(e.value) and str(tmp_path / "bad.json") in str(e.value)
    assert "\n" not in str(e.value)


def test_cli_bad_plan_is_one_line(tmp_path):
    (tmp_path / "p.json").write_text("{\"format\": \"mxq-plan\", \"version\": 1}")
    r = subprocess.run([sys.executable, "-m", "mxq.cli", "quantize", "default", str(tmp_path / "o"), "--plan", str(tmp_path / "p.json")],
                       capture_output=True, text=True)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [f"mxq: error: {tmp_path / 'p.json'}: missing key 'recipe'"]


def test_plan_for_another_model_is_refused(tmp_path):
    a, b = tiny_llama(), tiny_qwen()
    b.save_pretrained(tmp_path / "src")
    with pytest.raises(Exception, match="plan: model: made for"):
        quantize_checkpoint(tmp_path / "src", tmp_path / "out", plan=_all_kept_plan(a, Permutations()), progress=False)
    assert not (tmp_path / "out").exists()


def test_e5m2_geometry_and_layer_specs_survive(tmp_path):
    """A plan made with the E5M2 recipe writes E5M2 weights with its per-layer rules."""
    model = tiny_llama()
    model.save_pretrained(tmp_path / "src")
    rec = load_recipe("mxfp8-e5m2")
    layers = {n: LayerPlan(TensorSpec(E5M2, ScaleRule.MSE), rec.activations) for n in linear_layers(model) if n != "lm_head"}
    plan = Plan(rec, Geometry.from_config(model.config), layers, _random_perms(model, "v"))
    quantize_checkpoint(tmp_path / "src", tmp_path / "out", plan=plan, progress=False)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert loaded.model.layers[1].self_attn.o_proj.weight.dtype == torch.float8_e5m2
    assert Path(tmp_path / "out" / "quantization_report.json").is_file()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
def test_gpu_calibration_on_cuda_equals_cpu(tmp_path):
    """Calibrating the model on the GPU makes the plan it makes on the CPU (statistics are kept on
    the host, the model's weights on the device): the same permutations, scale rules and kept
    layers, SQNRs within 0.05 dB (what ``mxq calibrate`` / ``mxq quantize --calibrate`` run with
    ``--device cuda``); the converter on the GPU with that plan writes what ``apply_plan`` makes."""
    model = tiny_llama()
    with torch.no_grad():  # outlier channels at the down_proj inputs, so reordering is chosen
        for layer in model.model.layers:
            layer.mlp.up_proj.weight[[5, 40, 61, 90]] *= 2.0**16
            layer.mlp.down_proj.weight[:, [5, 40, 61, 90]] *= 2.0**-16
    plans = {}
    for dev in ("cpu", "cuda"):
        m = copy.deepcopy(model).to(dev)
        rec, cal = tiny_plan_inputs(m)
        plans[dev] = make_plan(m, cal, keep_bf16=1, max_dppl=50.0, progress=False)
    cpu, gpu = plans["cpu"], plans["cuda"]
    assert cpu.permutations == gpu.permutations and cpu.permutations.mlp
    for n, lp in cpu.layers.items():
        g = gpu.layers[n]
        assert (lp.weights, lp.keep_bf16, lp.reorder) == (g.weights, g.keep_bf16, g.reorder), n
        for k, v in lp.sqnr_db.items():
            assert abs(v - g.sqnr_db[k]) <= 0.05, (n, k, v, g.sqnr_db[k])
    src = tmp_path / "src"
    model.save_pretrained(src)
    quantize_checkpoint(src, tmp_path / "out", plan=gpu, device="cuda", progress=False)
    q = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    mem = mxq.calib.calibrator.apply_plan(copy.deepcopy(model), gpu)
    ids = token_ids(320)
    assert torch.equal(logits_of(q, ids), logits_of(mem, ids))
