"""Tensor-parallel inference of mxq checkpoints on CPU: ``torchrun --nproc-per-node 2`` (gloo)
runs ``from_pretrained(out, tp_plan="auto")``; logits and greedy tokens must equal one process
(TP=1) on the same checkpoint, and each rank must hold only its shard of every MX tensor (rows of
column-parallel layers, whole 32-blocks of K with their scales for row-parallel ones)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import run_cli

HERE = Path(__file__).parent
CHILD = HERE / "tp_child.py"


def _run(ckpt: Path, out: Path, tp: int, device: str = "cpu") -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}"] if tp > 1 else [sys.executable]
    out.unlink(missing_ok=True)
    r = subprocess.run([*launch, str(CHILD), str(ckpt), str(out), device], env=env, capture_output=True, text=True, timeout=600)
    # rank 0 writes its results whole (temp file, rename) before the ranks leave; gloo on CPU has aborted
    # a rank while the process group was torn down (rarely, under load): the results then stand
    teardown = tp > 1 and out.exists() and "Signal 6 (SIGABRT)" in r.stderr
    assert r.returncode == 0 or teardown, r.stdout[-3000:] + r.stderr[-3000:]
    res = torch.load(out)
    res["log"] = r.stdout + r.stderr
    return res


def _llama(path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(hidden_size=192, intermediate_size=320, num_hidden_layers=2, num_attention_heads=6,
                      num_key_value_heads=2, head_dim=32, vocab_size=250, attention_bias=True, mlp_bias=True,
                      tie_word_embeddings=False)  # fmt: skip
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.1)  # nonzero: a row-parallel bias must be added once, after the reduction
    model.save_pretrained(path)


def _moe(family: str):
    def build(path: Path) -> None:
        from moe_models import moe_model

        moe_model(family, seed=4).save_pretrained(path)

    return build


BUILD = {"llama": _llama, "qwen3_moe": _moe("qwen3_moe"), "mixtral": _moe("mixtral"), "gpt_oss": _moe("gpt_oss")}


def _two_gpus() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.parametrize(
    "family,device",
    [("llama", "cpu"), ("qwen3_moe", "cpu"), ("qwen3_moe_fused", "cpu"), ("mixtral", "cpu"), ("gpt_oss", "cpu"),
     pytest.param("llama", "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not _two_gpus(), reason="needs 2 GPUs")]),
     *(pytest.param(f, "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not _two_gpus(), reason="needs 2 GPUs")])
       for f in ("qwen3_moe", "mixtral", "gpt_oss"))],
)  # fmt: skip
def test_tp2_equals_tp1(tmp_path, family, device):
    src, ckpt = tmp_path / "src", tmp_path / "mx"
    if family == "qwen3_moe_fused":  # experts stored fused: converted from the model in memory
        from moe_models import moe_model

        from mxq.convert.converter import TensorSource, quantize_checkpoint

        quantize_checkpoint(TensorSource.from_model(moe_model("qwen3_moe", seed=4)), ckpt, progress=False)
        assert '"layout": "fused"' in (ckpt / "config.json").read_text()
    else:
        BUILD[family](src)
        rc, out = run_cli(["quantize", str(src), str(ckpt)])
        assert rc == 0, out
    one = _run(ckpt, tmp_path / "tp1.pt", 1, device)
    two = _run(ckpt, tmp_path / "tp2.pt", 2, device)
    assert two["world"] == 2
    # the compiled step (fullgraph) runs the same operations as the eager one: the same tokens, at TP 1 and 2
    assert torch.equal(one["compiled"], one["static"]) and torch.equal(two["compiled"], two["static"])
    if family == "gpt_oss":  # no tensor-parallel plan in transformers: replicated on every rank, and said so
        assert "transformers has no tensor-parallel plan for gpt_oss's layers" in two["log"], two["log"][-2000:]
        assert two["saved"] == "written" and two["shapes"] == one["shapes"]
        assert torch.equal(two["tokens"], one["tokens"])
        return
    assert "no tensor-parallel plan" not in two["log"]
    assert one["saved"] == "written" and "loaded with tensor parallelism" in two["saved"], two["saved"]
    assert not Path(str(tmp_path / "tp2.pt") + ".saved").exists()
    # the same function: only the order of the row-parallel sums differs (float32; on a GPU each
    # shard's K may also pick another kernel tile)
    err = (two["logits"] - one["logits"]).abs().max() / one["logits"].abs().max()
    assert err < (1e-5 if device == "cpu" else 1e-4), err
    assert torch.equal(two["tokens"], one["tokens"])
    # each rank holds its shard: column-parallel rows, row-parallel K in whole blocks with the scales
    full, local = one["shapes"], two["shapes"]
    assert set(full) == set(local)
    split = {n for n in full if full[n] != local[n]}
    assert split, "no MX tensor was sharded"
    for n in split:
        whole, shard = full[n], local[n]
        rowwise = any(k in n for k in ("o_proj", "down_proj"))
        dim = len(whole) - 1 if rowwise else len(whole) - 2
        assert shard[dim] * 2 == whole[dim] and shard[:dim] + shard[dim + 1:] == whole[:dim] + whole[dim + 1:], (n, whole, shard)
    names = " ".join(sorted(split))
    for proj in ("q_proj.weight_scale", "o_proj.weight_scale", "o_proj.weight"):
        assert proj in names, (proj, names)
    if family.startswith("qwen3_moe"):
        for t in ("experts.gate_up_proj", "experts.gate_up_proj_scale", "experts.down_proj_scale"):
            assert t in names, (t, names)


def test_a_checkpoint_that_does_not_shard_is_refused_naming_the_layer(tmp_path):
    """down_proj K = 96: at TP 2 each rank would hold 48 columns, a block and a half."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=128, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, vocab_size=128, tie_word_embeddings=False)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "src")
    rc, out = run_cli(["quantize", str(tmp_path / "src"), str(tmp_path / "mx")])
    assert rc == 0, out
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(CHILD),
                        str(tmp_path / "mx"), str(tmp_path / "x.pt")], env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode != 0
    assert "tensor parallelism 2: model.layers.0.mlp.down_proj.weight: K=96 gives 48 per rank" in r.stdout + r.stderr


EXPERT_PARALLEL = """
import sys
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig
import mxq  # noqa: F401
AutoModelForCausalLM.from_pretrained(sys.argv[1], distributed_config=DistributedConfig(enable_expert_parallel=True, tp_plan="auto"))
print("loaded")
"""


def test_expert_parallelism_is_refused_saying_what_works(tmp_path):
    """transformers' expert parallelism would hand the experts remapped choices mxq's block never
    sees (and left the scales unsharded): refused before loading, pointing at tp_plan."""
    _moe("qwen3_moe")(tmp_path / "src")
    rc, out = run_cli(["quantize", str(tmp_path / "src"), str(tmp_path / "mx")])
    assert rc == 0, out
    (tmp_path / "ep.py").write_text(EXPERT_PARALLEL)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        str(tmp_path / "ep.py"), str(tmp_path / "mx")], env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode != 0 and "loaded" not in r.stdout
    assert "mxq: expert parallelism (DistributedConfig(enable_expert_parallel=True)) does not run mxq checkpoints; " \
           "load with tensor parallelism (tp_plan=\"auto\")" in r.stdout + r.stderr, r.stderr[-2000:]


def test_a_nan_code_is_refused_when_the_ranks_share_the_scan(tmp_path):
    """Tensor-parallel loading: the ranks split the NaN-code scan; whichever reads the bad layer
    refuses it naming the tensor, and the run fails."""
    from safetensors.torch import load_file, save_file

    _moe("qwen3_moe")(tmp_path / "src")
    rc, out = run_cli(["quantize", str(tmp_path / "src"), str(tmp_path / "mx")])
    assert rc == 0, out
    name = "model.layers.1.self_attn.o_proj.weight"
    for f in (tmp_path / "mx").glob("*.safetensors"):
        t = load_file(f)
        if name in t:
            w = t[name].view(torch.uint8).clone()
            w[2, 5] = 0xFF
            t[name] = w.view(torch.float8_e4m3fn)
            save_file(t, f, metadata={"format": "pt"})
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(CHILD),
                        str(tmp_path / "mx"), str(tmp_path / "x.pt")], env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode != 0 and not (tmp_path / "x.pt").exists()
    assert f"tensor {name}: 1 NaN code(s) in the fp8 data, the first at row 2, column 5" in r.stdout + r.stderr, r.stderr[-3000:]
