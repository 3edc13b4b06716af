"""GPTQ rounding for MX weights, against independent references.

* a greedy least-squares sweep written from the definition (float64, explicit solves, no Cholesky,
  no lazy blocks): at each column the not-yet-rounded weights are the exact minimiser of the
  output error given the columns already rounded, and the column is rounded under its block's scale;
* brute force: for the last column of a block every fp8 code is tried, the others fixed;
* the output error ‖(W − Ŵ)Xᵀ‖ on captured layer inputs, GPTQ against round-to-nearest;
* the written checkpoint against a direct-cast one (same tensors, dtypes, shapes) and against the
  rounded in-memory model.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mxq.calib.calibrator import calibration_batches, make_plan
from mxq.calib.gptq import GPTQError, gptq_model, gptq_mx, hessian, round_plan
from mxq.calib.plan import load_plan, save_plan
from mxq.convert.converter import ConversionError, quantize_checkpoint
from mxq.formats import E4M3, E5M2, ScaleRule, fake_quantize_mx, shared_exponents
from mxq.recipe import RecipeError, TensorSpec, parse_recipe

sys.path.insert(0, str(Path(__file__).parent))
from calib_helpers import (  # noqa: E402
    TEXT,
    CharTokenizer,
    logits_of,
    tiny_llama,
    tiny_plan_inputs,
    tiny_qwen,
    token_ids,
)
from cli_helpers import run_cli  # noqa: E402


def _problem(n: int, k: int, rows: int, seed: int):
    """Weights and correlated, unevenly scaled inputs (what makes GPTQ differ from nearest)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.eye(k) + 0.4 * torch.randn(k, k, generator=g) / k**0.5
    x = (torch.randn(rows, k, generator=g) * torch.rand(k, generator=g).mul(4).add(0.1)) @ mix
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g).add(0.02)
    return w, x


def _round(v: torch.Tensor, e: torch.Tensor, elem) -> torch.Tensor:
    s = torch.pow(2.0, e.double())
    return ((v / s).clamp(-elem.max_normal, elem.max_normal).float().to(elem.torch_dtype).double() * s)


def _greedy_least_squares(w: torch.Tensor, h: torch.Tensor, spec: TensorSpec, damp: float = 0.01) -> torch.Tensor:
    """The definition: for j = 0..K-1, the free weights minimise the output error given the
    rounded columns (a linear solve on H's free block), then column j is rounded."""
    w, h = w.double(), h.double().clone()
    k = w.shape[1]
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    h += damp * torch.diagonal(h).mean() * torch.eye(k, dtype=h.dtype)
    q = torch.zeros_like(w)
    cur = w.clone()
    e = None
    for j in range(k):
        if j % 32 == 0:
            e = shared_exponents(cur[:, j : j + 32].float().unsqueeze(1), spec.elem, spec.scale_rule)[0].squeeze(1)
        q[:, j] = _round(cur[:, j], e, spec.elem)
        fixed, free = slice(0, j + 1), slice(j + 1, k)
        if j + 1 < k:
            d_fixed = w[:, fixed] - q[:, fixed]  # error of the rounded columns
            # minimise (d)H(d)ᵀ over the free part of d = W − W': d_free = −d_fixed H_SF H_FF⁻¹
            d_free = -torch.linalg.solve(h[free, free], (d_fixed @ h[fixed, free]).t()).t()
            cur[:, free] = w[:, free] - d_free
    return q


@pytest.mark.parametrize(("n", "k", "elem", "rule"), [(37, 96, E4M3, ScaleRule.RCEIL), (5, 160, E5M2, ScaleRule.RCEIL),
                                                      (23, 64, E4M3, ScaleRule.MSE)])
def test_gptq_equals_the_greedy_least_squares_definition(n, k, elem, rule):
    w, x = _problem(n, k, 4 * k, seed=n + k)
    spec = TensorSpec(elem, rule)
    h = hessian(x)
    got = gptq_mx(w, h, spec, lazy_block=64).double()
    ref = _greedy_least_squares(w, h, spec)
    same = (got == ref).float().mean().item()
    assert same >= 0.995, same  # float32 sweep vs float64 solves: a rare tie may round the other way
    err = lambda q: float(((w.double() - q) @ h.double() * (w.double() - q)).sum())  # noqa: E731
    assert err(got) == pytest.approx(err(ref), rel=2e-3)


def test_act_order_is_the_definition_in_hessian_order():
    """With act_order the blocks are visited by decreasing Hessian diagonal and each block's columns
    likewise: the same least-squares definition run on W and H permuted that way, then un-permuted.
    Blocks stay whole, so direct cast still reproduces the values."""
    w, x = _problem(19, 128, 512, seed=11)
    spec = TensorSpec(E4M3, ScaleRule.RCEIL)
    h = hessian(x)
    d = torch.diagonal(h).reshape(-1, 32)
    order = [int(b) * 32 + int(c) for b in torch.argsort(d.sum(1), descending=True, stable=True)
             for c in torch.argsort(d[b], descending=True, stable=True)]
    assert order != list(range(128))  # the test problem really reorders
    perm = torch.tensor(order)
    ref = torch.empty(19, 128, dtype=torch.float64)
    ref[:, perm] = _greedy_least_squares(w[:, perm], h[perm][:, perm], spec)
    got = gptq_mx(w, h, spec, act_order=True).double()
    assert (got == ref).float().mean().item() >= 0.995
    assert torch.equal(fake_quantize_mx(got.float(), -1, E4M3, 32, ScaleRule.RCEIL), got.float())
    assert not torch.equal(got, gptq_mx(w, h, spec).double())


def test_last_column_is_the_best_code_by_brute_force():
    """With every other column fixed at GPTQ's choice, no fp8 code of the block's last column (under
    its scale) gives a smaller output error than the one GPTQ picked."""
    w, x = _problem(6, 64, 256, seed=3)
    spec = TensorSpec(E4M3, ScaleRule.RCEIL)
    h = hessian(x).double()
    hd = h + 0.01 * torch.diagonal(h).mean() * torch.eye(64, dtype=h.dtype)
    q = gptq_mx(w, hessian(x), spec).double()
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    codes = codes[torch.isfinite(codes)]
    qq = fake_quantize_mx(q.float(), -1, E4M3, 32, ScaleRule.RCEIL).double()
    assert torch.equal(qq, q)
    for r in range(6):
        e = shared_exponents(q[r, 32:].float().view(1, 32), E4M3, ScaleRule.RCEIL)[0]
        cands = codes * 2.0 ** float(e)
        best = None
        for c in cands:
            t = q[r].clone()
            t[63] = c
            d = w[r].double() - t
            v = float(d @ hd @ d)
            best = v if best is None or v < best else best
        d = w[r].double() - q[r]
        assert float(d @ hd @ d) <= best * (1 + 1e-9), r


@pytest.mark.parametrize("elem", [E4M3, E5M2])
@pytest.mark.parametrize("rule", [ScaleRule.RCEIL, ScaleRule.MSE])
def test_direct_cast_reproduces_gptq_values(elem, rule):
    w, x = _problem(29, 128, 300, seed=7)
    w[3, :32] *= 1e-30  # a block deep in the small range
    w[4, 32:64] = 0.0
    spec = TensorSpec(elem, rule)
    q = gptq_mx(w, hessian(x), spec)
    assert torch.equal(fake_quantize_mx(q, -1, elem, 32, rule), q)
    assert torch.equal(q.bfloat16().float(), q)  # the rounded model holds them exactly in bf16


def test_refuses_rules_that_clip_and_bad_shapes():
    w, x = _problem(4, 64, 100, seed=1)
    for rule in (ScaleRule.FLOOR, ScaleRule.EVEN):
        with pytest.raises(GPTQError, match="rceil or mse"):
            gptq_mx(w, hessian(x), TensorSpec(E4M3, rule))
    with pytest.raises(GPTQError, match="divisible by 32"):
        gptq_mx(w[:, :48], hessian(x[:, :48]), TensorSpec(E4M3, ScaleRule.RCEIL))
    with pytest.raises(RecipeError, match="weights.rounding"):
        parse_recipe({"name": "x", "weights": {"elem": "e4m3", "scale_rule": "floor", "rounding": "gptq"}})
    with pytest.raises(RecipeError, match="weights.rounding"):
        parse_recipe({"name": "x", "weights": {"elem": "e4m3", "rounding": "stochastic"}})


def test_dead_inputs_and_low_rank_hessians():
    """Inputs that are always zero (zero rows/columns of H) and fewer samples than K still round."""
    w, x = _problem(8, 96, 40, seed=2)
    x[:, 10:20] = 0
    q = gptq_mx(w, hessian(x), TensorSpec(E4M3, ScaleRule.RCEIL))
    assert torch.isfinite(q).all()
    assert torch.equal(fake_quantize_mx(q, -1, E4M3, 32, ScaleRule.RCEIL), q)


# --- the model ---------------------------------------------------------------------------------

def _capture_inputs(model, ids, names):
    got = {}
    mods = dict(model.named_modules())
    hooks = [mods[n].register_forward_pre_hook(lambda m, a, n=n: got.setdefault(n, []).append(a[0].detach().float()))
             for n in names]
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    for h in hooks:
        h.remove()
    return {n: torch.cat([t.reshape(-1, t.shape[-1]) for t in v]) for n, v in got.items()}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gptq_model_lowers_every_layer_output_error(arch):
    """On a tiny model and a fixed calibration set, each rounded layer's output error on its
    inputs (captured from the rounded model) is below round-to-nearest's."""
    model = tiny_llama() if arch == "llama" else tiny_qwen()
    tok = CharTokenizer(model.config.vocab_size)
    batches = calibration_batches(tok, TEXT, 8, 64)
    rec = parse_recipe({"name": "w", "weights": {"elem": "e4m3"}, "activations": None})
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    specs = {n: (rec.weights, None) for n in names}
    orig = {n: m.weight.detach().clone() for n, m in model.named_modules() if n in specs}
    rounded = copy.deepcopy(model)
    res = gptq_model(rounded, batches, specs, progress=False)
    assert set(res.layers) == set(names)
    mods = dict(rounded.named_modules())
    xs = _capture_inputs(rounded, torch.cat(batches), names)
    for n in names:
        x, w, wq = xs[n], orig[n].float(), mods[n].weight.detach().float()
        rtn = fake_quantize_mx(w, -1, E4M3, 32, ScaleRule.RCEIL)
        e_g = ((x @ (w - wq).t()).norm() / (x @ w.t()).norm()).item()
        e_r = ((x @ (w - rtn).t()).norm() / (x @ w.t()).norm()).item()
        assert e_g < e_r, (n, e_g, e_r)
        assert torch.equal(fake_quantize_mx(wq, -1, E4M3, 32, ScaleRule.RCEIL), wq), n


def test_checkpoint_has_the_direct_cast_format_and_loads_the_rounded_model(tmp_path):
    from transformers import AutoModelForCausalLM

    import mxq

    model = tiny_qwen()
    model.save_pretrained(tmp_path / "src")
    rec, cal = tiny_plan_inputs(model)
    plan = make_plan(model, cal, keep_bf16=1, progress=False)
    rounded = copy.deepcopy(model)
    round_plan(rounded, plan, calibration_batches(CharTokenizer(model.config.vocab_size), TEXT, 4, 48), progress=False)
    save_plan(plan, tmp_path / "plan.json")
    assert (tmp_path / "plan.safetensors").is_file()
    quantize_checkpoint(tmp_path / "src", tmp_path / "gptq", plan=tmp_path / "plan.json", progress=False)
    direct = make_plan(model, cal, keep_bf16=1, progress=False)
    quantize_checkpoint(tmp_path / "src", tmp_path / "direct", plan=direct, progress=False)

    def layout(d):
        with safe_open(str(next(d.glob("*.safetensors"))), "pt") as f:
            return {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}

    assert layout(tmp_path / "gptq") == layout(tmp_path / "direct")
    qc = json.loads((tmp_path / "gptq" / "config.json").read_text())["quantization_config"]
    assert qc["calibration"]["choices"]["rounding"] == "gptq"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "gptq", dtype=torch.float32).eval()
    kept = set(plan.kept)
    for n, m in loaded.named_modules():
        if isinstance(m, mxq.MXLinear) and hasattr(m, "dequantized_weight") and n in plan.layers:
            want = dict(rounded.named_modules())[n].weight.detach().float()
            assert torch.equal(m.dequantized_weight(), want), n
            assert n not in kept
    # and the same model through apply_plan (direct cast of the rounded bf16 values)
    mem = mxq.calib.calibrator.apply_plan(copy.deepcopy(rounded), load_plan(tmp_path / "plan.json"))
    ids = token_ids(model.config.vocab_size)
    assert torch.equal(logits_of(loaded, ids), logits_of(mem, ids))


def test_gptq_recipe_without_calibration_is_one_line(tmp_path):
    model = tiny_llama()
    model.save_pretrained(tmp_path / "src")
    (tmp_path / "r.yaml").write_text("name: g\nweights: {elem: e4m3, scale_rule: rceil, rounding: gptq}\n")
    with pytest.raises(ConversionError, match="needs calibration text"):
        quantize_checkpoint(tmp_path / "src", tmp_path / "out", recipe=str(tmp_path / "r.yaml"), progress=False)
    assert not (tmp_path / "out").exists()


def test_plan_codes_file_must_sit_beside_the_plan(tmp_path):
    from mxq.calib.plan import PlanError

    model = tiny_llama()
    rec, cal = tiny_plan_inputs(model)
    plan = make_plan(model, cal, progress=False)
    round_plan(copy.deepcopy(model), plan, calibration_batches(CharTokenizer(320), TEXT, 2, 48), progress=False)
    save_plan(plan, tmp_path / "plan.json")
    d = json.loads((tmp_path / "plan.json").read_text())
    for bad in ("../plan.safetensors", "/etc/passwd", "missing.safetensors"):
        d["rounded_weights"]["file"] = bad
        (tmp_path / "bad.json").write_text(json.dumps(d))
        with pytest.raises(PlanError, match="rounded_weights.file"):
            load_plan(tmp_path / "bad.json")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
def test_gpu_gptq_equals_cpu_and_offload_bounds_device_memory():
    """On the GPU, GPTQ picks the CPU's codes (float32 sums in another order may flip a rare tie);
    with ``offload`` the device holds one decoder layer at a time, not the model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = tiny_llama()
    batches = calibration_batches(CharTokenizer(320), TEXT, 8, 64)
    specs = {n: (parse_recipe({"name": "w", "weights": {}}).weights, None)
             for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    on = {}
    for dev in ("cpu", "cuda"):
        m = copy.deepcopy(model).to(dev)
        gptq_model(m, batches, specs, progress=False)
        on[dev] = {n: mod.weight.detach().cpu() for n, mod in m.named_modules() if n in specs}
    same = sum(int((on["cpu"][n] == on["cuda"][n]).sum()) for n in specs) / sum(v.numel() for v in on["cpu"].values())
    assert same >= 0.995, same

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24, num_attention_heads=8,
                      num_key_value_heads=8, vocab_size=512, max_position_embeddings=512)
    big = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    layer_bytes = sum(p.numel() * p.element_size() for p in big.model.layers[0].parameters())
    model_bytes = sum(p.numel() * p.element_size() for p in big.parameters())
    specs = {n: (parse_recipe({"name": "w", "weights": {}}).weights, None)
             for n, m in big.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    ids = torch.randint(0, 512, (8, 256))
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    gptq_model(big, list(ids.split(4)), specs, device="cuda", offload=True, progress=False)
    peak = torch.cuda.max_memory_allocated() - base
    # What one layer's rounding holds at once: the layer, the largest sibling group as float32
    # (input, working copy, result, nearest-rounded reference and a temporary), the largest
    # Hessian and its factors, the calibration activations in and out, embedding and head.
    group = 2 * cfg.intermediate_size * cfg.hidden_size * 4
    hess = cfg.intermediate_size**2 * 4
    acts = 8 * 256 * cfg.hidden_size * 2
    rest = 2 * cfg.vocab_size * cfg.hidden_size * 2
    bound = 2 * layer_bytes + 6 * group + 5 * hess + 4 * acts + rest
    assert peak < bound, (peak, bound)
    assert peak < model_bytes / 2, (peak, model_bytes)
    assert next(big.model.layers.parameters()).device.type == "cpu"


# --- the command line ------------------------------------------------------------------------------



@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama with a word-level tokenizer of its own, and a calibration text file."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    d = tmp_path_factory.mktemp("cli")
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([TEXT], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    model = tiny_llama()
    assert len(fast) <= model.config.vocab_size
    model.save_pretrained(d / "src")
    fast.save_pretrained(d / "src")
    (d / "text.txt").write_text((TEXT + "\n") * 8)
    return d


def test_cli_calibrate_then_quantize_with_gptq(model_dir, tmp_path):
    src, text = str(model_dir / "src"), str(model_dir / "text.txt")
    cal = ["--dataset", text, "--samples", "4", "--seq-len", "32", "--sensitivity-seq-len", "16"]
    rc, err = run_cli(["calibrate", src, *cal, "--out", str(tmp_path / "plan.json")])
    assert rc == 0, err
    assert (tmp_path / "plan.safetensors").is_file()
    rc, err = run_cli(["quantize", src, str(tmp_path / "g"), "--plan", str(tmp_path / "plan.json")])
    assert rc == 0, err
    rc, err = run_cli(["quantize", src, str(tmp_path / "n"), "--calibrate", *cal, "--rounding", "nearest"])
    assert rc == 0, err
    choices = {k: json.loads((tmp_path / k / "config.json").read_text())["quantization_config"]["calibration"]["choices"]
               for k in ("g", "n")}
    assert choices["g"]["rounding"] == "gptq" and choices["n"]["rounding"] == "nearest"
    assert choices["g"]["gptq"]["layers"] + choices["g"]["kept_by_sensitivity"] == 14  # the default byte budget keeps some
    assert choices["g"]["keep_bytes_percent"] == 3.5 and choices["n"]["keep_bytes_percent"] == 3.5
    rc, err = run_cli(["quantize", src, str(tmp_path / "x"), "--calibrate", *cal, "--rounding", "stochastic"])
    assert rc != 0 and "--rounding" in err and not (tmp_path / "x").exists()


@pytest.mark.parametrize("percent", [0.0, 3.5, 12.0])
def test_keep_bytes_budget_against_written_checkpoints(tmp_path, percent):
    """``keep_bytes``: the kept layers are the most sensitive in rank order, and the written
    checkpoint is at most PCT percent larger than the direct-cast one (one more would pass it)."""
    model = tiny_qwen()
    model.save_pretrained(tmp_path / "src")
    rec, cal = tiny_plan_inputs(model)
    plan = make_plan(model, cal, keep_bytes=percent, progress=False)
    direct = quantize_checkpoint(tmp_path / "src", tmp_path / "d", recipe="mxfp8", progress=False)
    kept = quantize_checkpoint(tmp_path / "src", tmp_path / "k", plan=plan, progress=False)
    ranking = sorted(cal.selected, key=lambda n: -cal.sensitivity[n])
    n = plan.choices["kept_by_sensitivity"]
    assert {k for k, lp in plan.layers.items() if lp.keep_bf16 and k in cal.selected} == set(ranking[:n])
    extra = kept.bytes_after - direct.bytes_after
    assert extra <= percent / 100 * direct.bytes_after
    if n < len(ranking):
        w = dict(model.named_modules())[ranking[n]].weight
        assert extra + w.numel() * w.element_size() - w.numel() * 33 // 32 > percent / 100 * direct.bytes_after
    assert (n == 0) if percent == 0 else (n > 0 or percent < 10)
