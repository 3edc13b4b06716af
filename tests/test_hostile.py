"""Hostile and broken inputs: each refused in one line naming the file, tensor or option, with no
traceback and nothing left beside OUT (or, where an option allows it, a warning naming it)."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from cli_helpers import run_cli
from safetensors import safe_open
from safetensors.torch import save_file


@pytest.fixture()
def tiny(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=128, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path / "src"
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def _leftovers(parent):
    return [p.name for p in parent.iterdir() if ".mxq-" in p.name]


def _one_line(rc, err, *named):
    """Failed, with one error line (after any progress output) naming each of ``named``."""
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("mxq: ")]
    assert rc != 0 and len(lines) == 1 and lines[0].startswith("mxq: error: ") and "Traceback" not in err, err[-800:]
    for n in named:
        assert str(n) in lines[0], (n, lines[0])


def _header_file(path, header: bytes):
    f = path / "model.safetensors"
    f.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 64)
    return f


@pytest.mark.parametrize("case", ["nested", "dtype_list", "shape_str", "extra_key"])
def test_malformed_headers_name_file_and_tensor(tiny, tmp_path, case):
    header = {
        "nested": b"[" * 50000 + b"]" * 50000,
        "dtype_list": json.dumps({"a.weight": {"dtype": ["F32"], "shape": [4, 4], "data_offsets": [0, 64]}}).encode(),
        "shape_str": json.dumps({"a.weight": {"dtype": "F32", "shape": "4x4", "data_offsets": [0, 64]}}).encode(),
        "extra_key": json.dumps({"a.weight": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64], "x": 1}}).encode(),
    }[case]
    f = _header_file(tiny, header)
    out = tmp_path / "out"
    for cmd in (["quantize", str(tiny), str(out)], ["inspect", str(tiny)]):
        rc, err = run_cli(cmd)
        _one_line(rc, err, f)
        if case != "nested":
            assert "a.weight" in err
    assert not out.exists() and not _leftovers(tmp_path)


def test_max_shard_size_inf_is_named(tiny, tmp_path):
    rc, err = run_cli(["quantize", str(tiny), str(tmp_path / "out"), "--max-shard-size", "inf"])
    assert rc != 0 and "--max-shard-size" in err and "Traceback" not in err


@pytest.mark.parametrize("where", ["model.norm.weight", "model.embed_tokens.weight"])
def test_nonfinite_high_precision_tensor_stops_the_run(tiny, tmp_path, where):
    f = tiny / "model.safetensors"
    with safe_open(f, "pt") as h:
        t = {n: h.get_tensor(n) for n in h.keys()}
    t[where] = t[where].clone()
    t[where].view(-1)[3] = float("nan")
    save_file(t, f, metadata={"format": "pt"})
    out = tmp_path / "out"
    rc, err = run_cli(["quantize", str(tiny), str(out)])
    _one_line(rc, err, where)
    assert not out.exists() and not _leftovers(tmp_path)
    rc, err = run_cli(["inspect", str(tiny)])
    assert rc != 0 and where in err and "NaN/Inf" in err
    rc, err = run_cli(["quantize", str(tiny), str(out), "--allow-nonfinite"])
    assert rc == 0 and out.exists()
    rc, err = run_cli(["inspect", str(out)])
    assert rc != 0 and where in err


def test_a_binary_plan_is_named(tiny, tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_bytes(b"\x80\x04\x95" + bytes(range(256)))  # a pickle's opening bytes
    out = tmp_path / "out"
    rc, err = run_cli(["quantize", str(tiny), str(out), "--plan", str(plan)])
    _one_line(rc, err, plan)
    assert "binary" in err and not out.exists()


# --- mixtures of experts ----------------------------------------------------------------------------

def _moe_source(tmp_path, family, edit=None):
    """A tiny ``family`` checkpoint (tests/moe_models.py), its tensors changed by ``edit``."""
    from moe_models import moe_model

    src = tmp_path / family
    moe_model(family).save_pretrained(src)
    if edit is not None:
        f = src / "model.safetensors"
        with safe_open(f, "pt") as h:
            t = {n: h.get_tensor(n) for n in h.keys()}
        edit(t)
        save_file(t, f, metadata={"format": "pt"})
    return src


@pytest.mark.parametrize("case", ["both_fused", "one_fused"])
def test_two_layouts_of_the_same_experts_are_refused(tmp_path, case):
    """Fused 3-D experts beside the per-expert 2-D tensors of the same layer: transformers fails
    to load such a source, or drops one layout without a word (the reference, below); mxq quantize
    used to write it with exit 0 (the output then failed at load). Now it names a tensor of each
    layout and writes nothing."""
    from transformers import AutoModelForCausalLM

    fused = "model.layers.0.mlp.experts.gate_up_proj"
    gate_up = torch.randn(4, 128, 64)  # [E, 2I, H]

    def edit(t):
        t[fused] = gate_up
        if case == "both_fused":
            t["model.layers.0.mlp.experts.down_proj"] = torch.randn(4, 64, 64)

    src = _moe_source(tmp_path, "qwen3_moe", edit)
    if case == "both_fused":
        with pytest.raises(AttributeError):
            AutoModelForCausalLM.from_pretrained(src)
    else:  # it loads the per-expert tensors and ignores the fused one
        model = AutoModelForCausalLM.from_pretrained(src)
        assert not torch.equal(model.model.layers[0].mlp.experts.gate_up_proj.detach(), gate_up)
    out = tmp_path / "out"
    rc, err = run_cli(["quantize", str(src), str(out)])
    _one_line(rc, err, "two layouts", fused, "model.layers.0.mlp.experts.0.down_proj.weight")
    assert not out.exists() and not _leftovers(tmp_path)


def test_incomplete_fused_experts_are_named(tmp_path):
    """gpt-oss stores its experts fused; one projection missing is named, not kept silently."""
    gone = "model.layers.1.mlp.experts.down_proj"
    src = _moe_source(tmp_path, "gpt_oss", lambda t: t.pop(gone))
    out = tmp_path / "out"
    rc, err = run_cli(["quantize", str(src), str(out)])
    _one_line(rc, err, "model.layers.1.mlp.experts.gate_up_proj without " + gone)
    assert not out.exists() and not _leftovers(tmp_path)


@pytest.mark.parametrize("calibrate", [False, True])
def test_compressed_tensors_refuses_fused_experts_at_planning(tmp_path, monkeypatch, calibrate):
    """compressed-tensors stores one Linear per expert, so fused 3-D experts (gpt-oss) are refused
    while planning: no tensor is read, no shard opened, no calibration run."""
    import mxq.cli
    import mxq.convert.converter
    import mxq.convert.source

    src = _moe_source(tmp_path, "gpt_oss")
    (tmp_path / "text.txt").write_text("calibration text\n")

    def fail(*a, **k):
        # pytest.fail raises no Exception: the command line's one-line handler does not catch it
        pytest.fail("work started before the format was checked")

    monkeypatch.setattr(mxq.convert.source, "read_tensor", fail)
    monkeypatch.setattr(mxq.convert.converter, "ShardWriter", fail)
    monkeypatch.setattr(mxq.cli, "run_calibration", fail)
    out = tmp_path / "out"
    cal = ["--calibrate", "--dataset", str(tmp_path / "text.txt")] if calibrate else []
    rc, err = run_cli(["quantize", str(src), str(out), "--format", "compressed-tensors", *cal])
    fused = "model.layers.0.mlp.experts holds its experts as fused 3-D tensors"
    _one_line(rc, err, f"--format compressed-tensors: {fused}")
    assert not out.exists() and not _leftovers(tmp_path)
