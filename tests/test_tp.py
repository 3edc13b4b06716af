"""The tensor-parallel shard rule for MX weights (``mxq.runtime.tp``), against a brute-force split, and as
`mxq quantize` warns and `mxq inspect --tp` reports it on a checkpoint built to fail it."""

from __future__ import annotations

import json

import pytest
import torch
from cli_helpers import run_cli

from mxq.runtime.tp import check_shard, split_style


def _brute(shape, style, tp) -> bool:
    """Split the weight as a rank would and check each slice: whole rows, or whole 32-blocks of K."""
    n, k = shape[-2], shape[-1]
    if style == "replicated":
        return True
    if style in ("colwise", "packed_colwise"):
        halves = [n // 2, n // 2] if style == "packed_colwise" and n % 2 == 0 else ([n] if style == "colwise" else None)
        if halves is None:
            return False
        return all(h * r % tp == 0 for h in halves for r in range(tp + 1))
    bounds = [r * k / tp for r in range(tp + 1)]
    return all(b == int(b) and int(b) % 32 == 0 for b in bounds)


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 8])
def test_rule_matches_a_brute_force_split(tp):
    g = torch.Generator().manual_seed(tp)
    for _ in range(300):
        n = int(torch.randint(1, 40, (), generator=g)) * 8
        k = int(torch.randint(1, 40, (), generator=g)) * 32
        for style in ("colwise", "packed_colwise", "rowwise", "replicated"):
            got = check_shard("w", (n, k), style, tp)
            assert got.ok == _brute((n, k), style, tp), (n, k, style, tp, got)
            assert got.ok or got.why


def test_split_style_from_the_plan_and_names():
    plan = {"layers.*.self_attn.o_proj": "rowwise", "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
            "layers.*.mlp.experts.down_proj": "rowwise", "layers.*.mlp.gate_proj": "colwise"}  # fmt: skip
    assert split_style("model.layers.3.self_attn.o_proj.weight", plan) == "rowwise"
    assert split_style("model.layers.0.mlp.experts.gate_up_proj", plan) == "packed_colwise"
    assert split_style("model.layers.0.mlp.gate_proj.weight", plan) == "colwise"
    assert split_style("model.layers.0.block_sparse_moe.experts.3.w2.weight", None) == "rowwise"
    assert split_style("model.layers.0.mlp.experts.3.up_proj.weight", None) == "colwise"
    assert split_style("model.embed_tokens.weight", plan) == "replicated"


def test_quantize_warns_and_inspect_reports(tmp_path):
    """A Llama whose MLP width (96) and hidden size (64) break the 32-block rule at TP 2, 4 and 8."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from mxq.checkpoint.describe import inspect_checkpoint
    from mxq.convert.converter import quantize_checkpoint

    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=128, tie_word_embeddings=False)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "src")
    out, said = tmp_path / "out", []
    quantize_checkpoint(tmp_path / "src", out, progress=False, warn=said.append)
    report = json.loads((out / "quantization_report.json").read_text())["tp_unshardable"]
    down, o = "model.layers.0.mlp.down_proj.weight", "model.layers.0.self_attn.o_proj.weight"
    assert report["2"] == [down] and sorted(report["4"]) == sorted(report["8"]) == sorted([down, o])
    for tp in (2, 4, 8):
        assert any(f"tensor parallelism {tp} would not shard" in m and down in m for m in said), said
    rc, err = run_cli(["inspect", str(out), "--tp", "8"])
    assert rc == 0, err
    rep = inspect_checkpoint(out, tp=8)
    shapes = {s.name: s.shape for s in rep.shards}
    assert {s.name for s in rep.shards if not s.ok} == {
        n for n, sh in shapes.items() if not _brute(sh, split_style(n, cfg.base_model_tp_plan), 8)
    } == {down, o}
