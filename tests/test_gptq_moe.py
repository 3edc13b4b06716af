"""GPTQ for routed experts, against independent references.

* Each expert's codes equal ``gptq_mx`` run here on that expert's weight with a Hessian built here
  from the tokens the router sends it (routing computed in the test from the router's logits; the
  ``down`` Hessian from the gated intermediate of the rounded ``gate_up``, written out per family);
  an expert with too few tokens is cast directly, bit for bit.
* ``experts_all_tokens``: every expert's Hessians from every token, while the layer's output keeps
  the router's choice (the next layer's routing is the rounded model's own).
* The plan carries the codes: ``mxq quantize --calibrate`` writes them for per-expert checkpoints
  (Qwen3-MoE, Mixtral's w1/w3/w2) and fused transposed ones with biases (gpt-oss), ``mxq.load``
  reads them back, and the config records how many experts got GPTQ.
* On held-out tokens, over several seeds, a calibrated tiny MoE is closer to the bf16 model than the
  direct cast (each experts module and the logits).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from calib_helpers import TEXT, CharTokenizer
from cli_helpers import run_cli
from moe_models import moe_model
from safetensors import safe_open

import mxq
from mxq.calib.calibrator import apply_plan, calibrate, make_plan
from mxq.calib.gptq import EXPERT_MIN_TOKENS, gptq_model, gptq_mx, hessian, round_plan
from mxq.calib.plan import PlanError, load_plan, save_plan
from mxq.checkpoint.files import checkpoint_files
from mxq.convert.converter import ConversionError, quantize_checkpoint
from mxq.formats import E4M3, ScaleRule, fake_quantize_mx
from mxq.recipe import TensorSpec, load_recipe
from mxq.runtime.experts import MXExperts, experts_layers, quantize_experts, select_model_layers

W = TensorSpec(E4M3, ScaleRule.RCEIL)
SPEC = (W, TensorSpec(E4M3, ScaleRule.RCEIL))  # mxfp8: W8A8
TRANSPOSED = ("gpt_oss", "llama4_text")  # experts stored [E, K, N]


def _batches(seed: int, n: int = 8, t: int = 64) -> list[torch.Tensor]:
    return list(torch.randint(0, 256, (n, t), generator=torch.Generator().manual_seed(seed)).split(4))


def _block(model, family: str, layer: int):
    return model.model.layers[layer].feed_forward if family == "llama4_text" else model.model.layers[layer].mlp


def _router_calls(model, family: str, batches, layer: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per batch: the router's input [T, H] (what the experts are given) and its logits [T, E]."""
    block = _block(model, family, layer)
    router = block.router if hasattr(block, "router") else block.gate
    got = []

    def hook(m, args, out):
        logits = out[1] if family == "llama4_text" else out[0]  # Llama 4: (scores, logits); the others logits first
        got.append((args[0].reshape(-1, args[0].shape[-1]), logits.float()))

    h = router.register_forward_hook(hook)
    with torch.no_grad():
        for b in batches:
            model(input_ids=b, use_cache=False)
    h.remove()
    return got


def _expert_rows(calls, family: str, e: int, k: int, all_tokens: bool = False) -> torch.Tensor:
    """Expert e's input rows: the tokens whose top-k logits include e (Llama 4: times the sigmoid
    of the logit, as its experts are fed), or every token."""
    rows = []
    for x, logits in calls:
        if family == "llama4_text":  # sigmoid over the [T, E] scores as Llama 4 computes them (bit for bit)
            top = logits.topk(k, -1) if not all_tokens else None
            s = torch.sigmoid(logits if all_tokens else torch.full_like(logits, -torch.inf).scatter(1, top.indices, top.values))
            x = x * s[:, e : e + 1].to(x.dtype)
        picked = torch.ones(x.shape[0], dtype=torch.bool) if all_tokens else (logits.topk(k, -1).indices == e).any(1)
        rows.append(x[picked])
    return torch.cat(rows)


def _gate(family: str, experts, h: torch.Tensor) -> torch.Tensor:
    if family == "gpt_oss":  # interleaved columns, clamped GLU (transformers' GptOssExperts)
        gate, up = h[..., ::2].clamp(max=experts.limit), h[..., 1::2].clamp(-experts.limit, experts.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * experts.alpha))
    gate, up = h.chunk(2, -1)
    return torch.nn.functional.silu(gate) * up


def _weights(experts, family: str, proj: str) -> torch.Tensor:
    w = getattr(experts, proj).detach().float()
    return w.transpose(1, 2) if family in TRANSPOSED else w


def _expected(family: str, experts, xs: list[torch.Tensor], min_tokens: float) -> dict[str, torch.Tensor]:
    """Both projections of every expert rounded from the definition: GPTQ on the expert's own rows
    (the down input: its rounded gate_up on the MX-rounded rows, the gate), or direct cast."""
    out = {}
    for proj in ("gate_up_proj", "down_proj"):
        w = _weights(experts, family, proj)
        q = torch.empty_like(w)
        for e, x in enumerate(xs):
            if x.shape[0] < min_tokens * w.shape[-1]:
                q[e] = fake_quantize_mx(w[e], -1, E4M3, 32, ScaleRule.RCEIL)
                continue
            if proj == "down_proj":
                h = fake_quantize_mx(x, -1, E4M3, 32, ScaleRule.RCEIL) @ out["gate_up_proj"][e].t()
                if getattr(experts, "gate_up_proj_bias", None) is not None:
                    h = h + experts.gate_up_proj_bias[e].float()
                x = _gate(family, experts, h)
            q[e] = gptq_mx(w[e], hessian(x), W)
        out[proj] = q
    return out


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "llama4_text"])
def test_expert_codes_are_gptq_on_the_tokens_routed_to_them(family):
    model = moe_model(family)
    batches = _batches(0)
    calls = _router_calls(model, family, batches)
    k = model.config.num_experts_per_tok
    xs = [_expert_rows(calls, family, e, k) for e in range(4)]
    counts = sorted(x.shape[0] for x in xs)
    assert counts[0] < counts[1] and counts[0] > 0, counts
    # the least routed expert falls below the threshold, the others not
    min_tokens = (counts[0] + 1) / 64
    name0, name1 = sorted(experts_layers(model))
    rounded = copy.deepcopy(model)
    res = gptq_model(rounded, batches, {name0: SPEC, name1: SPEC}, progress=False, expert_min_tokens=min_tokens)

    want = _expected(family, model.get_submodule(name0), xs, min_tokens)
    got = rounded.get_submodule(name0)
    for proj in ("gate_up_proj", "down_proj"):
        assert torch.equal(_weights(got, family, proj), want[proj]), proj
    starved = min(range(4), key=lambda e: xs[e].shape[0])
    st = res.experts[name0]
    assert st["tokens"] == [x.shape[0] for x in xs]
    for proj in ("gate_up_proj", "down_proj"):
        assert st["projections"][proj]["rounding"] == ["nearest" if e == starved else "gptq" for e in range(4)]
    # the starved expert is the direct cast of its weights
    for proj in ("gate_up_proj", "down_proj"):
        w = _weights(model.get_submodule(name0), family, proj)[starved]
        assert torch.equal(_weights(got, family, proj)[starved], fake_quantize_mx(w, -1, E4M3, 32, ScaleRule.RCEIL))


@pytest.mark.parametrize("family", ["gpt_oss", "llama4_text"])
def test_all_tokens_give_every_expert_a_hessian_and_routing_stays(family):
    model = moe_model(family)
    if family == "gpt_oss":
        with torch.no_grad():  # the router never picks expert 3
            for layer in model.model.layers:
                layer.mlp.router.bias[3] = -1e4
    batches = _batches(1)
    names = sorted(experts_layers(model))
    specs = {n: SPEC for n in names}
    routed = gptq_model(copy.deepcopy(model), batches, specs, progress=False)
    if family == "gpt_oss":
        assert routed.experts[names[0]]["tokens"][3] == 0
        assert routed.experts[names[0]]["projections"]["gate_up_proj"]["rounding"][3] == "nearest"

    rounded = copy.deepcopy(model)
    res = gptq_model(rounded, batches, specs, progress=False, experts_all_tokens=True)
    tokens = sum(b.numel() for b in batches)
    for n in names:
        assert res.experts[n]["hessian_tokens"] == [tokens] * 4
        assert all(r == ["gptq"] * 4 for r in (d["rounding"] for d in res.experts[n]["projections"].values()))
    # layer 0 against the definition, every token to every expert
    calls = _router_calls(model, family, batches)
    xs = [_expert_rows(calls, family, e, model.config.num_experts_per_tok, all_tokens=True) for e in range(4)]
    want = _expected(family, model.get_submodule(names[0]), xs, EXPERT_MIN_TOKENS)
    for proj in ("gate_up_proj", "down_proj"):
        assert torch.equal(_weights(rounded.get_submodule(names[0]), family, proj), want[proj]), proj
    # routing is the router's own: tokens counted in layer 1 are what the rounded W8A8 model routes there
    assert res.experts[names[0]]["tokens"] == routed.experts[names[0]]["tokens"]
    mx = copy.deepcopy(rounded)
    quantize_experts(mx, names[:1], *SPEC)
    k = model.config.num_experts_per_tok
    calls1 = _router_calls(mx, family, batches, layer=1)
    assert res.experts[names[1]]["tokens"] == [int(sum((lg.topk(k, -1).indices == e).any(1).sum() for _, lg in calls1))
                                              for e in range(4)]  # fmt: skip


# --- the plan and the converter ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A word-level tokenizer of fewer than 256 tokens and a calibration text file."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    d = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([TEXT], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    assert len(fast) <= 256
    fast.save_pretrained(d / "tok")
    (d / "text.txt").write_text((TEXT + "\n") * 8)
    return d


def _source(tmp_path, family, tokenizer_dir):
    from transformers import AutoTokenizer

    src = tmp_path / family
    moe_model(family).save_pretrained(src)
    AutoTokenizer.from_pretrained(tokenizer_dir / "tok").save_pretrained(src)
    return src


CAL = ["--samples", "8", "--seq-len", "64", "--sensitivity-seq-len", "16"]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_quantize_calibrate_writes_the_plans_expert_codes(tmp_path, family, tokenizer_dir):
    src = _source(tmp_path, family, tokenizer_dir)
    out, plan_json = tmp_path / "mx", tmp_path / "plan.json"
    all_tokens = ["--experts-all-tokens"] if family == "gpt_oss" else []
    rc, err = run_cli(["quantize", str(src), str(out), "--calibrate", "--dataset", str(tokenizer_dir / "text.txt"), *CAL,
                       "--rounding", "gptq", "--plan-out", str(plan_json), *all_tokens])  # fmt: skip
    assert rc == 0, err
    plan = load_plan(plan_json)
    assert sorted(plan.experts) == sorted(experts_layers(moe_model(family)))
    model = mxq.load(out, dtype=torch.float32)
    for name in plan.experts:
        m = model.get_submodule(name)
        assert isinstance(m, MXExperts)
        for proj in m.projections:
            codes, scales = plan.rounded_expert_weight(name, proj)
            assert torch.equal(getattr(m, proj).view(torch.uint8), codes.view(torch.uint8)), (name, proj)
            assert torch.equal(getattr(m, proj + "_scale"), scales), (name, proj)
    with safe_open(checkpoint_files(out)[0], "pt") as f:  # the bytes on disk, in the source's layout
        keys = set(f.keys())
        if family == "mixtral":  # per expert: w1 = gate rows, w3 = up rows of gate_up, w2 = down
            name = "model.layers.1.mlp.experts"
            gu, down = plan.rounded_expert_weight(name, "gate_up_proj")[0], plan.rounded_expert_weight(name, "down_proj")[0]
            for e in range(4):
                disk = f"model.layers.1.block_sparse_moe.experts.{e}"
                assert torch.equal(f.get_tensor(f"{disk}.w1.weight").view(torch.uint8), gu[e, :64].view(torch.uint8))
                assert torch.equal(f.get_tensor(f"{disk}.w3.weight").view(torch.uint8), gu[e, 64:].view(torch.uint8))
                assert torch.equal(f.get_tensor(f"{disk}.w2.weight").view(torch.uint8), down[e].view(torch.uint8))
        elif family == "gpt_oss":  # fused, written [E, N, K]; biases as they were
            assert "model.layers.0.mlp.experts.gate_up_proj_bias" in keys
            assert f.get_slice("model.layers.0.mlp.experts.gate_up_proj").get_shape() == [4, 128, 64]
        else:
            assert "model.layers.0.mlp.experts.3.gate_proj.weight_scale" in keys
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    rounding = qc["calibration"]["experts_rounding"]
    n_experts = 4 * len(plan.experts)
    assert rounding["experts"] == n_experts
    for proj in ("gate_up_proj", "down_proj"):
        assert rounding["gptq"][proj] + rounding["nearest"][proj] == n_experts
    assert rounding["gptq"]["gate_up_proj"] > 0
    summary = qc["calibration"]["choices"]["gptq"]["experts"]
    assert summary["all_tokens"] == bool(all_tokens) and summary["gptq"] == rounding["gptq"]
    if all_tokens:
        assert rounding["nearest"] == {"gate_up_proj": 0, "down_proj": 0}
    # and the loaded model computes: the rounded experts are not the direct cast
    direct = mxq.quantize_model(moe_model(family), "mxfp8")
    name = sorted(plan.experts)[0]
    assert not torch.equal(direct.get_submodule(name).gate_up_proj.view(torch.uint8),
                           model.get_submodule(name).gate_up_proj.view(torch.uint8))  # fmt: skip
    ids = torch.randint(0, 256, (1, 9))
    assert torch.isfinite(model(ids).logits).all()


def test_round_plan_then_converter_and_apply_plan_agree(tmp_path):
    """The Python API: ``round_plan`` on a Mixtral (experts stored per expert on disk), the plan saved
    and loaded, the converter's checkpoint and ``apply_plan`` on the rounded model hold the same
    expert codes and compute the same logits."""
    model = moe_model("mixtral")
    model.save_pretrained(tmp_path / "src")
    cal = calibrate(model, CharTokenizer(256), TEXT, load_recipe("mxfp8"), samples=8, seq_len=64, sample_rows=64,
                    sensitivity_samples=1, sensitivity_seq_len=16, progress=False)  # fmt: skip
    plan = make_plan(model, cal, keep_bytes=0, progress=False)
    rounded = copy.deepcopy(model)
    round_plan(rounded, plan, _batches(2, 16), progress=False)
    save_plan(plan, tmp_path / "plan.json")
    quantize_checkpoint(tmp_path / "src", tmp_path / "mx", plan=tmp_path / "plan.json", progress=False)
    loaded = mxq.load(tmp_path / "mx", dtype=torch.float32)
    mem = apply_plan(rounded, load_plan(tmp_path / "plan.json"))
    for name in plan.experts:
        for proj in ("gate_up_proj", "down_proj"):
            codes = plan.rounded_expert_weight(name, proj)[0].view(torch.uint8)
            assert torch.equal(getattr(loaded.get_submodule(name), proj).view(torch.uint8), codes)
            assert torch.equal(getattr(mem.get_submodule(name), proj).view(torch.uint8), codes)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, mem(ids).logits, rtol=1e-5, atol=1e-5)


def test_plan_expert_codes_are_validated(tmp_path, tokenizer_dir):
    from safetensors.torch import load_file, save_file

    src = _source(tmp_path, "qwen3_moe", tokenizer_dir)
    rc, err = run_cli(["calibrate", str(src), "--dataset", str(tokenizer_dir / "text.txt"), *CAL, "--out", str(tmp_path / "plan.json")])
    assert rc == 0, err
    plan = load_plan(tmp_path / "plan.json")
    name = "model.layers.0.mlp.experts.down_proj"
    assert plan.rounded_expert_weight("model.layers.0.mlp.experts", "down_proj")[0].shape == (4, 64, 64)
    tensors = load_file(tmp_path / "plan.safetensors")
    bad = dict(tensors)
    bad[name + "_scale"] = bad[name + "_scale"][:, :, :1].contiguous()
    save_file(bad, tmp_path / "plan.safetensors")
    with pytest.raises(PlanError, match=name):
        load_plan(tmp_path / "plan.json").rounded_expert_weight("model.layers.0.mlp.experts", "down_proj")
    # codes of another model's width: the converter names the tensor and writes nothing
    plan = load_plan(tmp_path / "plan.json")
    plan.rounded, plan.rounded_experts = {}, {"model.layers.0.mlp.experts": {"down_proj": (tensors[name][:, :32], tensors[name + "_scale"][:, :32])}}
    plan.rounded_file = None
    with pytest.raises(ConversionError, match=r"experts\.0\.down_proj"):
        quantize_checkpoint(src, tmp_path / "out", plan=plan, progress=False)
    assert not (tmp_path / "out").exists()
    # a plan without expert codes (made before experts had GPTQ): the experts are cast directly
    plan.rounded_experts = {}
    save_plan(plan, tmp_path / "dense.json")
    quantize_checkpoint(src, tmp_path / "out", plan=tmp_path / "dense.json", progress=False)
    loaded = mxq.load(tmp_path / "out", dtype=torch.float32).get_submodule("model.layers.0.mlp.experts")
    direct = mxq.quantize_model(moe_model("qwen3_moe"), "mxfp8").get_submodule("model.layers.0.mlp.experts")
    assert torch.equal(loaded.down_proj.view(torch.uint8), direct.down_proj.view(torch.uint8))
    rc, err = run_cli(["quantize", str(src), str(tmp_path / "x"), "--experts-all-tokens"])
    assert rc != 0 and "--calibrate" in err


# --- held-out tokens ------------------------------------------------------------------------------------

def _correlated(family: str, seed: int = 0):
    """A tiny MoE in bf16 whose activations are correlated as a trained LM's are: token embeddings
    with a decaying spectrum (σᵢ ∝ 1/i). Random weights alone give isotropic activations, where
    no rounding can use correlations between input channels."""
    model = moe_model(family, seed=seed)
    g = torch.Generator().manual_seed(42 + seed)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        h = emb.shape[1]
        q, _ = torch.linalg.qr(torch.randn(h, h, generator=g))
        emb.copy_(torch.randn(emb.shape, generator=g) / torch.arange(1, h + 1).float() @ q.t())
    return model.to(torch.bfloat16)


def logits_of(model, batches) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(input_ids=b, use_cache=False).logits.float() for b in batches])


def _held_out_errors(family: str, seed: int) -> tuple[dict, dict]:
    """GPTQ on 16 calibration sequences, errors on 16 others, for the model of ``seed``: the logits'
    relative error to the bf16 model after the direct cast ("direct"), dense-only GPTQ with the
    experts cast directly ("gptq_dense") and GPTQ everywhere ("gptq"); and each experts module's
    relative output error on the bf16 model's own held-out inputs, cast directly or GPTQ-rounded."""
    rec = load_recipe("mxfp8")
    base = _correlated(family, seed)
    cal, held = _batches(2 * seed, 16), _batches(2 * seed + 1, 16)
    ref = logits_of(base, held)
    chosen, _ = select_model_layers(base, rec)
    moe = experts_layers(base)
    every = {n: (rec.weights, rec.activations) for n in chosen}
    err, rounded = {}, {}
    for key, specs in (("direct", {}), ("gptq_dense", {n: s for n, s in every.items() if n not in moe}), ("gptq", every)):
        m = copy.deepcopy(base)
        if specs:
            res = gptq_model(m, cal, specs, progress=False)
        rounded[key] = m
        err[key] = float((logits_of(mxq.quantize_model(copy.deepcopy(m), rec), held) - ref).norm() / ref.norm())
    # every expert saw enough calibration tokens for GPTQ
    assert res.experts_summary()["nearest"] == {"gate_up_proj": 0, "down_proj": 0}
    calls = {n: [] for n in moe}  # each experts module on the bf16 model's held-out inputs
    hooks = [base.get_submodule(n).register_forward_pre_hook(lambda m, a, n=n: calls[n].append(a)) for n in moe]
    logits_of(base, held)
    for h in hooks:
        h.remove()
    modules = {}
    for n in moe:
        with torch.no_grad():
            want = torch.cat([base.get_submodule(n)(*a).float() for a in calls[n]])
            modules[n] = {k: float((torch.cat([MXExperts.from_experts(rounded[k].get_submodule(n), *every[n])(*a).float() for a in calls[n]])
                                    - want).norm() / want.norm()) for k in ("direct", "gptq")}  # fmt: skip
    return err, modules


# Twelve seeds (model, embeddings, calibration and held-out tokens), measured on one x86 machine
# (AMX, AVX-512) with 1 and 2 threads and with oneDNN and ATen limited to AVX2 (ONEDNN_MAX_CPU_ISA,
# ATEN_CPU_CAPABILITY: the paths of CPUs without them). These settings move one seed's logits
# error by up to 2 % (bf16 sums in another order, a token routed elsewhere), the means over the
# seeds by at most 0.0045 (logits) and 0.0004 (experts modules); the bounds below keep margins of
# 6 to 17 times that on the logits, over 50 times on the modules:
#   experts module output, GPTQ / direct cast: every module 0.75-0.87, mean 0.80-0.83;
#   logits, GPTQ / direct cast, mean: qwen3_moe 0.77, mixtral 0.84, gpt_oss 0.882-0.885;
#   logits, GPTQ / dense-only GPTQ, mean: qwen3_moe 0.987-0.988 (12 of 12 seeds below 1), gpt_oss
#   0.936-0.941 (10 of 12), mixtral 0.990-0.993 with single seeds from 0.91 to 1.04 (7 of 12):
#   for Mixtral the gain over dense-only GPTQ is not shown, one seed is a coin toss (0.03486 vs
#   0.03468 on another machine was seed 0).
HELD_OUT_SEEDS = range(12)
VS_DENSE = {"qwen3_moe": (0.997, 10), "gpt_oss": (0.975, 8)}  # mean ratio below, seeds won at least


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_calibrated_moe_is_closer_to_bf16_on_held_out_tokens(family):
    """GPTQ per expert is closer to bf16 than the direct cast on held-out tokens, over twelve models:
    each experts module's output, and the logits; the logits also beat dense-only GPTQ (experts cast
    directly) where that is robust. One seed decided by half a percent is not a result on tiny
    random models (bf16 sums differ between CPUs), so every bound has a margin many times the
    spread measured above."""
    runs = [_held_out_errors(family, seed) for seed in HELD_OUT_SEEDS]
    for seed, (err, modules) in zip(HELD_OUT_SEEDS, runs, strict=True):
        print(family, seed, "held-out relative logits error", err, "experts modules", modules)
    module = [m["gptq"] / m["direct"] for _, modules in runs for m in modules.values()]
    assert max(module) < 0.9 and sum(module) / len(module) < 0.87, module
    vs_direct = [err["gptq"] / err["direct"] for err, _ in runs]
    assert sum(vs_direct) / len(vs_direct) < 0.93, vs_direct
    vs_dense = [err["gptq"] / err["gptq_dense"] for err, _ in runs]
    if family in VS_DENSE:
        bound, wins = VS_DENSE[family]
        assert sum(vs_dense) / len(vs_dense) < bound, vs_dense
        assert sum(r < 1 for r in vs_dense) >= wins, vs_dense
    else:
        # Mixtral: not shown. The experts modules' own gain holds (above), but in the logits it is
        # within what rounding the dense layers and routing flips move them by; what is robust is
        # that GPTQ on the experts makes them no worse than dense-only GPTQ, on average.
        assert sum(vs_dense) / len(vs_dense) < 1.02, vs_dense


def test_one_expert_hessian_at_a_time(monkeypatch):
    """Per-expert Hessians are built and consumed one at a time: when one is built, none other is alive."""
    import weakref

    import mxq.calib.gptq_experts as gptq_experts

    alive, most = [], [0]
    make = gptq_experts.hessian

    def tracked(x):
        most[0] = max(most[0], sum(r() is not None for r in alive))
        h = make(x)
        alive.append(weakref.ref(h))
        return h

    monkeypatch.setattr(gptq_experts, "hessian", tracked)
    model = moe_model("qwen3_moe")
    res = gptq_model(model, _batches(0), {n: SPEC for n in experts_layers(model)}, progress=False)
    assert len(alive) == 2 * 2 * 4 - sum(v for v in res.experts_summary()["nearest"].values())
    assert most[0] == 0
