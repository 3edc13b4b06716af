"""``mxq.compat``: every probe of a release-specific behaviour, checked against its table for the
releases installed here (CI runs this file in both environments: the pinned and the latest). A
release that changes one of them fails here by name; ``mxq.compat``'s table is then updated."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from mxq import compat

ROOT = Path(__file__).resolve().parent.parent


def test_release_parses_what_packages_publish():
    assert [compat.release(v) for v in ("3.6.0", "3.6.1+git7f3a", "5.24.0.dev0", "3", "", None, "x.y")] == [
        (3, 6), (3, 6), (5, 24), None, None, None, None]  # fmt: skip


def test_direct_launches_only_with_the_launcher_they_were_written_for():
    """The direct launch hands arguments to the C launcher in the list of the release it knows:
    Triton 3.5-3.6's (1) and 3.9's (2, another order, the arguments as one tuple); on any other
    release every launch goes through the JIT."""
    assert [compat.direct_launch_abi(v) for v in ("3.5.1", "3.6.0", "3.6.1+git7f3a", "3.7.0", "3.9.0", "4.0.0", "3")] == [
        1, 1, 1, 0, 2, 0, 0]  # fmt: skip
    triton = pytest.importorskip("triton")
    from mxq.kernels import launch
    from mxq.kernels.toolchain import INTERPRET

    assert launch.ABI == compat.direct_launch_abi(triton.__version__)
    assert launch.FAST == (not INTERPRET and launch.ABI > 0)


def test_installed_releases_are_the_checked_ones():
    """No environment runs a release older than the oldest ``CHECKED`` one. A newer release than the
    newest checked is allowed: the probes of this file are what decide whether it still behaves as
    the table says."""
    for package, (oldest, _newest) in compat.CHECKED.items():
        r = compat.release(compat.installed(package))
        if r is None:
            continue
        assert oldest <= r, f"{package} {compat.installed(package)} is older than mxq supports"
    assert compat.versions().keys() == {"torch", "triton", "transformers"}


def test_transformers_marks_every_loaded_tensor(tmp_path):
    """The load check's premise: after ``from_pretrained`` every tensor read from the checkpoint
    carries ``LOADED_MARK``, and a tensor the checkpoint lacked does not."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    model = LlamaForCausalLM.from_pretrained(tmp_path)
    entries = model.state_dict(keep_vars=True)
    assert all(compat.was_loaded(t) for t in entries.values()), [n for n, t in entries.items() if not compat.was_loaded(t)]
    shard = tmp_path / "model.safetensors"
    tensors = load_file(shard)
    missing = "model.layers.0.mlp.down_proj.weight"
    del tensors[missing]
    save_file(tensors, shard, metadata={"format": "pt"})
    model = LlamaForCausalLM.from_pretrained(tmp_path)
    unmarked = [n for n, t in model.state_dict(keep_vars=True).items() if not compat.was_loaded(t)]
    assert unmarked == [missing]


def test_transformers_experts_gates():
    """The gate ``MXExperts`` borrows: transformers' default SiLU·up for Qwen3-MoE and Mixtral,
    gpt-oss's own clamped GLU (the names ``mxq.runtime.experts`` matches to pick the fused gate)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    names = [compat.experts_gate(c).__qualname__ for c in (Qwen3MoeExperts, MixtralExperts, GptOssExperts)]
    assert names == ["_default_apply_gate", "_default_apply_gate", "GptOssExperts._apply_gate"]
    assert compat.experts_gate(torch.nn.Linear) is None


def test_transformers_mask_table_overrides():
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    local = compat.mask_overrides(ALL_MASK_ATTENTION_FUNCTIONS)
    assert isinstance(local, dict)
    assert compat.mask_overrides(object()) is None


def test_transformers_conversion_hook_signature():
    """5.17 passes the conversions only; 5.23 and later the model too (the quantizer passes on
    whatever arrives, so both work)."""
    r = compat.release(compat.installed("transformers"))
    assert compat.conversion_hook_takes_model() == (r >= (5, 23))


def test_no_release_check_outside_compat():
    """Nothing in mxq/ or kernels/ reads transformers' or Triton's version but ``mxq.compat``."""
    pattern = re.compile(r"\b(?:triton|transformers)\.__version__|version\([\"'](?:triton|transformers)[\"']\)")
    found = [f"{p.relative_to(ROOT)}:{i}" for folder in ("mxq", "kernels") for p in sorted((ROOT / folder).rglob("*.py"))
             if p.name != "compat.py" for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]  # fmt: skip
    assert not found, found
