"""A model that loads is a model that is right: every parameter written from the checkpoint.

Experts stored one by one under the names other tools write (``foreign_layouts``) load to the
logits of the family's transformers model holding the exactly decoded weights; a checkpoint that
leaves any parameter unwritten is refused naming it, by ``mxq.load``, by ``from_pretrained`` after
``import mxq`` and by ``mxq inspect`` alike, with no NaN model handed out.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from cli_helpers import run_cli
from moe_models import moe_model
from safetensors import safe_open
from safetensors.torch import save_file

import mxq
from mxq.checkpoint.files import CheckpointError, checkpoint_files
from mxq.runtime.experts import MXExperts

pytest.importorskip("compressed_tensors")
from foreign_layouts import per_expert_checkpoint  # noqa: E402  (needs compressed_tensors)

LAYOUTS = [
    ("mixtral", "gate_up_down", "mlp"),  # llm-compressor oneshot on a transformers 5 Mixtral
    ("mixtral", "w1_w3_w2", "block_sparse_moe"),  # Mixtral's original names
    ("mixtral", "w1_w3_w2", "mlp"),
    ("qwen3_moe", "w1_w3_w2", "mlp"),
    ("qwen3_moe", "gate_up_down", "mlp"),
    ("gpt_oss", "gate_up_down", "mlp"),  # llm-compressor's linearized gpt-oss experts, with biases
]


def _ids(seed=3):
    return torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(seed))


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    """Same function, float32 accumulation order apart (measured differences ~1e-6 on logits of
    magnitude ~1; the bound is 100x that)."""
    assert not a.isnan().any()
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), (a - b).abs().max()


@pytest.mark.parametrize("family,naming,container", LAYOUTS)
def test_per_expert_namings_load_to_the_decoded_reference(tmp_path, family, naming, container):
    ref = per_expert_checkpoint(tmp_path / "ct", family, naming, container)
    model = mxq.load(tmp_path / "ct", dtype=torch.float32)
    assert sum(isinstance(m, MXExperts) for m in model.modules()) == 2
    with torch.no_grad():
        _close(model(_ids()).logits, ref(_ids()).logits)
    rc, err = run_cli(["inspect", str(tmp_path / "ct")])
    assert rc == 0, err


def _native(tmp_path, family="qwen3_moe"):
    src = tmp_path / "src"
    moe_model(family).save_pretrained(src)
    out = tmp_path / "mx"
    assert run_cli(["quantize", str(src), str(out)])[0] == 0
    f = checkpoint_files(out)[0]
    with safe_open(f, "pt") as h:
        return out, f, {n: h.get_tensor(n) for n in h.keys()}


def _rewrite(out, f, tensors, config_edit=None):
    save_file(tensors, f, metadata={"format": "pt"})
    idx = out / "model.safetensors.index.json"
    if idx.exists():
        idx.unlink()
        f.rename(out / "model.safetensors")
    if config_edit is not None:
        cfg = json.loads((out / "config.json").read_text())
        config_edit(cfg)
        (out / "config.json").write_text(json.dumps(cfg))


def _rename_experts(out, f, tensors, names: dict) -> None:
    """Rewrite a native checkpoint with its per-expert projections renamed (``names``: old -> new),
    in the tensors and in the quantization_config's ``stored`` names alike."""

    def rename(k: str) -> str:
        for a, b in names.items():
            k = k.replace(f".{a}", f".{b}")
        return k

    def edit(cfg):
        for d in cfg["quantization_config"]["experts"].values():
            d["stored"] = [rename(s) for s in d["stored"]]

    _rewrite(out, f, {rename(k) if ".experts." in k else k: v for k, v in tensors.items()}, edit)


def test_native_w1_w3_w2_loads_like_gate_up_down(tmp_path):
    """A native checkpoint whose experts carry Mixtral's w1/w3/w2 names: the same bytes as the
    gate/up/down one, the same logits, through mxq.load and from_pretrained."""
    from transformers import AutoModelForCausalLM

    out, f, t = _native(tmp_path)
    want = mxq.load(out, dtype=torch.float32)
    _rename_experts(out, f, t, {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"})
    got = mxq.load(out, dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        w = want(_ids()).logits
        assert torch.equal(got(_ids()).logits, w)
        assert torch.equal(hf(_ids()).logits, w)


def _refused(out, match):
    """mxq.load, from_pretrained and mxq inspect all refuse ``out`` naming ``match``."""
    from transformers import AutoModelForCausalLM

    with pytest.raises(CheckpointError, match=match):
        mxq.load(out)
    with pytest.raises(CheckpointError, match=match):
        AutoModelForCausalLM.from_pretrained(out)
    rc, err = run_cli(["inspect", str(out)])
    assert rc != 0 and "Traceback" not in err, err
    assert any(match.replace("\\", "") in line for line in err.splitlines()), err


def test_a_missing_dense_tensor_is_refused(tmp_path):
    out, f, t = _native(tmp_path)
    name = "model.layers.1.post_attention_layernorm.weight"
    del t[name]
    _rewrite(out, f, t)
    _refused(out, name.replace(".", r"\."))


def test_experts_under_an_unknown_naming_are_refused(tmp_path):
    """Per-expert tensors under names no family uses: the experts module is refused by name, not
    left on uninitialized memory."""
    out, f, t = _native(tmp_path)
    _rename_experts(out, f, t, {"gate_proj": "fc1", "up_proj": "fc3", "down_proj": "fc2"})
    _refused(out, r"model\.layers\.0\.mlp\.experts")


def test_a_missing_expert_bias_is_refused(tmp_path):
    ct = tmp_path / "ct"
    per_expert_checkpoint(ct, "gpt_oss")
    f = ct / "model.safetensors"
    with safe_open(f, "pt") as h:
        t = {n: h.get_tensor(n) for n in h.keys()}
    del t["model.layers.1.mlp.experts.2.up_proj.bias"]
    save_file(t, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"experts\.2\.up_proj\.bias"):
        mxq.load(ct)
    rc, err = run_cli(["inspect", str(ct)])
    assert rc != 0 and "experts.2.up_proj.bias" in err, err


def test_scales_blocked_along_the_wrong_axis_are_refused(tmp_path):
    """Per-expert scales blocked along N (a transposed [K, N] matrix quantized along its last axis)
    are refused naming the tensor, not broadcast into the experts."""
    ct = tmp_path / "ct"
    per_expert_checkpoint(ct, "gpt_oss", intermediate_size=96)  # [N, K] and [K, N] tell apart
    f = ct / "model.safetensors"
    with safe_open(f, "pt") as h:
        t = {n: h.get_tensor(n) for n in h.keys()}
    for e in range(4):
        base = f"model.layers.0.mlp.experts.{e}.down_proj"
        w = t[base + ".weight"]  # [H, I]: stored as [I, H] with scales along H
        t[base + ".weight"] = w.view(torch.uint8).t().contiguous().view(w.dtype)
        t[base + ".weight_scale"] = torch.ones(w.shape[1], w.shape[0] // 32, dtype=torch.uint8) * 127
    save_file(t, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"experts\.0\.down_proj"):
        mxq.load(ct)


def test_an_expert_beyond_the_config_is_refused(tmp_path):
    """fp8 data for an expert index the config does not have looks like weights of a quantized
    layer: an error naming it, never silently dropped."""
    out, f, t = _native(tmp_path)
    base = "model.layers.0.mlp.experts.3.gate_proj"
    t["model.layers.0.mlp.experts.7.gate_proj.weight"] = t[base + ".weight"].clone()
    t["model.layers.0.mlp.experts.7.gate_proj.weight_scale"] = t[base + ".weight_scale"].clone()
    _rewrite(out, f, t)
    _refused(out, r"experts\.7\.gate_proj")


@pytest.mark.parametrize("count", [8, -4, 10**9])
@pytest.mark.parametrize("layout", ["native", "compressed-tensors"])
def test_config_and_tensors_that_disagree_are_refused(tmp_path, count, layout):
    """config.json giving another expert count than the tensors hold (more, a negative count that
    makes transformers build dense MLPs, a billion): refused by load and inspect alike, in bounded
    memory (nothing is built per expected expert)."""
    import resource

    if layout == "native":
        out, f, t = _native(tmp_path, "mixtral")
    else:
        out = tmp_path / "ct"
        per_expert_checkpoint(out, "mixtral")
        f, t = _ct_tensors(out)
    _rewrite(out, f, t, lambda cfg: cfg.__setitem__("num_local_experts", count))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises((CheckpointError, ValueError), match=r"experts|mlp"):
        mxq.load(out)
    rc, err = run_cli(["inspect", str(out)])
    assert rc != 0 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 1 << 20  # KiB: under 1 GiB more


def _ct_tensors(ct):
    f = ct / "model.safetensors"
    with safe_open(f, "pt") as h:
        return f, {n: h.get_tensor(n) for n in h.keys()}


def test_fused_foreign_experts_are_refused_by_name(tmp_path):
    """gpt-oss's fused experts quantized as stored ([E, K, N], blocks along the last axis, as a
    tool quantizing each tensor as it finds it would): refused naming the tensor, never read with
    blocks along the wrong axis."""
    from foreign_layouts import quantize_exact

    ct = tmp_path / "ct"
    per_expert_checkpoint(ct, "gpt_oss", intermediate_size=96)
    f, t = _ct_tensors(ct)
    t = {k: v for k, v in t.items() if ".experts." not in k}
    sd = moe_model("gpt_oss", intermediate_size=96).state_dict()
    for layer in range(2):
        for p in ("gate_up_proj", "down_proj"):
            w = sd[f"model.layers.{layer}.mlp.experts.{p}"]
            parts = [quantize_exact(w[e]) for e in range(w.shape[0])]
            t[f"model.layers.{layer}.mlp.experts.{p}"] = torch.stack([c for c, _, _ in parts])
            t[f"model.layers.{layer}.mlp.experts.{p}_scale"] = torch.stack([s for _, s, _ in parts])
            t[f"model.layers.{layer}.mlp.experts.{p}_bias"] = sd[f"model.layers.{layer}.mlp.experts.{p}_bias"]
    save_file(t, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"mlp\.experts\.(gate_up|down)_proj: fused"):
        mxq.load(ct)
    rc, err = run_cli(["inspect", str(ct)])
    assert rc != 0 and "fused" in err, err


# each edit breaks one tensor and returns a pattern of the name a refusal gives it (the disk name,
# or the model's where transformers renamed it: Mixtral's block_sparse_moe.gate is mlp.gate)
def _edit_router_fp8(tensors):
    r = next(k for k in sorted(tensors) if k.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")))
    tensors[r] = tensors[r].to(torch.float8_e4m3fn)
    return re.escape(r)


def _edit_router_shape(tensors):
    r = next(k for k in sorted(tensors) if k.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")))
    tensors[r] = tensors[r][:, :32].contiguous()
    return r.split(".")[2].join([r"layers\.", r"\.[a-z_]+\.gate\.weight"])


def _edit_drop_expert(tensors):
    name = next(k for k in sorted(tensors) if ".experts.3." in k and k.endswith(".weight"))
    del tensors[name]
    return re.escape(name.rsplit(".", 1)[0])


@pytest.mark.parametrize("edit", [_edit_router_fp8, _edit_router_shape, _edit_drop_expert])
@pytest.mark.parametrize("layout", ["native", "compressed-tensors"])
def test_inspect_refuses_what_load_refuses(tmp_path, edit, layout):
    """One validator: for each broken checkpoint, mxq inspect and mxq.load both refuse, naming the
    same tensor."""
    if layout == "native":
        out, f, t = _native(tmp_path, "mixtral")
    else:
        out = tmp_path / "ct"
        per_expert_checkpoint(out, "mixtral", "w1_w3_w2", "block_sparse_moe")
        f, t = _ct_tensors(out)
    pattern = edit(t)
    _rewrite(out, f, t)
    with pytest.raises((CheckpointError, ValueError), match=pattern):
        mxq.load(out)
    rc, err = run_cli(["inspect", str(out)])
    assert rc != 0 and re.search(pattern, err), err


def test_a_quantized_router_is_refused_saying_what_it_is(tmp_path):
    """A compressed-tensors checkpoint whose router carries fp8 codes and a scale: the router is
    not a Linear (transformers 5 routers are their own modules), and the refusal says so."""
    ct = tmp_path / "ct"
    per_expert_checkpoint(ct, "qwen3_moe")
    f, t = _ct_tensors(ct)
    r = "model.layers.0.mlp.gate"
    codes, scales, _ = __import__("foreign_layouts").quantize_exact(t[r + ".weight"])
    t[r + ".weight"], t[r + ".weight_scale"] = codes, scales
    save_file(t, f, metadata={"format": "pt"})
    kind = type(moe_model("qwen3_moe").model.layers[0].mlp.gate).__name__
    with pytest.raises(ValueError, match=rf"{re.escape(r)} is a {kind}, not a Linear"):
        mxq.load(ct)
    rc, err = run_cli(["inspect", str(ct)])
    assert rc != 0 and f"is a {kind}, not a Linear" in err, err
