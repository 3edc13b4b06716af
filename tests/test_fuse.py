"""Sibling projections as one MX GEMM (mxq.runtime.linear.fuse_projections), on tiny models of each family built from configs.

The fused model must compute the unfused model's logits exactly (stacking along N keeps every
row's codes and scales), keep the per-projection checkpoint layout in ``state_dict`` and
``load_state_dict``, run one ``mxq::mx_linear`` per group under ``torch.compile``, and undo.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import mxq
from mxq.runtime.linear import (
    FusedMXLinear,
    MXLinear,
    ProjectionSlice,
    fuse_projections,
    unfuse_projections,
)

SMALL = dict(vocab_size=97, hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=3,
             num_key_value_heads=1, head_dim=32, max_position_embeddings=64)  # fmt: skip
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),  # q/k/v with bias
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),  # q/k norms after the projections
}


def _model(family: str, recipe: str = "mxfp8"):
    torch.manual_seed(sum(map(ord, family)))
    cfg_cls, model_cls = FAMILIES[family]
    m = model_cls(cfg_cls(**SMALL)).eval()
    return mxq.quantize_model(m, recipe, fuse=False)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8-w8a16"])
def test_fused_model_equals_unfused_and_keeps_the_checkpoint_layout(family, recipe):
    m = _model(family, recipe)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 13))
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with torch.no_grad():
        y0 = m(ids).logits
    groups = fuse_projections(m)
    assert len(groups) == 2 * SMALL["num_hidden_layers"]
    attn = m.model.layers[0].self_attn
    assert isinstance(attn.q_proj, ProjectionSlice) and isinstance(attn.mxq_fused_q_proj_k_proj_v_proj, FusedMXLinear)
    with torch.no_grad():
        y1 = m(ids).logits
    assert torch.equal(y0, y1)
    after = m.state_dict()
    assert sorted(after) == sorted(before)
    for k, v in before.items():
        assert after[k].dtype == v.dtype and torch.equal(_bytes(after[k]), _bytes(v)), k
        assert after[k].untyped_storage().data_ptr() != m.model.layers[0].self_attn.mxq_fused_q_proj_k_proj_v_proj.weight.untyped_storage().data_ptr()
    # the standard layout loads back into the fused model (new values land in the fused weights)
    fresh = _model(family, recipe)
    fuse_projections(fresh)
    fresh.load_state_dict(before)
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, y0)
    unfuse_projections(m)
    assert type(m.model.layers[1].mlp.up_proj) is MXLinear and not hasattr(m.model.layers[1].mlp, "mxq_fused_gate_proj_up_proj")
    with torch.no_grad():
        assert torch.equal(m(ids).logits, y0)


def test_no_fusion_across_different_formats():
    m = _model("llama")
    mlp = m.model.layers[0].mlp
    mlp.up_proj.act = None  # weight-only up_proj beside a W8A8 gate_proj: not one GEMM
    groups = fuse_projections(m)
    assert "model.layers.0.mlp.gate_proj+up_proj" not in groups and "model.layers.1.mlp.gate_proj+up_proj" in groups
    assert type(mlp.gate_proj) is MXLinear


def compiled_linear_calls(m, ids, monkeypatch):
    """(logits of m compiled by dynamo with fullgraph=True, the second call's ``mx_linear`` calls as
    (output width, whether the producer gave X's codes))."""
    import mxq.kernels

    calls, orig = [], mxq.kernels.mx_linear

    def counting(*a, **k):
        calls.append((a[1].shape[0], k.get("x_mx") is not None))
        return orig(*a, **k)

    monkeypatch.setattr(mxq.kernels, "mx_linear", counting)
    torch._dynamo.reset()
    g = torch.compile(m, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        g(ids)
        calls.clear()
        got = g(ids).logits
    torch._dynamo.reset()
    return got, calls


def test_compiled_fused_model_runs_one_gemm_per_group(monkeypatch):
    """Traced by dynamo, the three q/k/v calls on one input become one mxq::mx_linear call."""
    m = _model("qwen3")
    ids = torch.randint(0, SMALL["vocab_size"], (1, 9))
    with torch.no_grad():
        want = m(ids).logits
    fuse_projections(m)
    got, calls = compiled_linear_calls(m, ids, monkeypatch)
    calls = [n for n, _ in calls]
    assert torch.equal(got, want)
    layers = SMALL["num_hidden_layers"]
    # per layer: fused qkv, o_proj, fused gate_up, down_proj
    assert len(calls) == 4 * layers, calls
    qkv = SMALL["head_dim"] * (SMALL["num_attention_heads"] + 2 * SMALL["num_key_value_heads"])
    assert calls.count(qkv) == layers and calls.count(2 * SMALL["intermediate_size"]) == layers


def test_quantize_model_and_from_pretrained_fuse_by_default(tmp_path):
    """What users get: ``quantize_model`` fuses; a checkpoint written by the converter loads fused
    through ``from_pretrained`` and ``mxq.load``, and ``mxq.load(fuse=False)`` keeps the layers;
    all three give the unfused model's logits."""
    from transformers import AutoModelForCausalLM

    from mxq.convert.converter import quantize_checkpoint

    torch.manual_seed(7)
    src = tmp_path / "bf16"
    LlamaForCausalLM(LlamaConfig(**SMALL)).save_pretrained(src)
    ids = torch.randint(0, SMALL["vocab_size"], (1, 10))
    ref = mxq.quantize_model(AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval(), "mxfp8", fuse=False)
    fused = mxq.quantize_model(AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval(), "mxfp8")
    assert isinstance(fused.model.layers[0].mlp.up_proj, ProjectionSlice)
    quantize_checkpoint(str(src), tmp_path / "q", "mxfp8", progress=False, warn=lambda m: None)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.float32).eval()
    assert isinstance(loaded.model.layers[1].self_attn.v_proj, ProjectionSlice)
    kept = mxq.load(tmp_path / "q", dtype=torch.float32, fuse=False)
    assert type(kept.model.layers[1].self_attn.v_proj) is MXLinear
    with torch.no_grad():
        want = ref(ids).logits
        for m in (fused, loaded, kept):
            assert torch.equal(m(ids).logits, want)


def test_siblings_with_and_without_bias_fuse_exactly():
    """Only k_proj has a bias: the fused bias carries zeros for q and v, and the state_dict keeps
    exactly the biases the layers had."""
    m = _model("llama")
    attn = m.model.layers[0].self_attn
    torch.manual_seed(3)
    k = attn.k_proj
    k.bias = torch.nn.Parameter(torch.randn(k.out_features))
    ids = torch.randint(0, SMALL["vocab_size"], (1, 7))
    with torch.no_grad():
        want = m(ids).logits
    keys = sorted(m.state_dict())
    fuse_projections(m)
    with torch.no_grad():
        assert torch.equal(m(ids).logits, want)
    assert sorted(m.state_dict()) == keys and "model.layers.0.self_attn.q_proj.bias" not in keys
