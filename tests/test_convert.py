"""Converter, checkpoint layout, loading back, and every bad input the converter must refuse.

The reference everywhere is an independent fake-quant forward: each quantized Linear of the
original model computes ``fq(X) @ fq(W).T`` in float32, where ``fq`` rounds through the format
core (``mxq.formats.fake_quantize_mx``), never through MXLinear or the converter.
"""

from __future__ import annotations

import errno
import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import mxq
from mxq.checkpoint.files import ShardWriter, read_index
from mxq.convert.converter import ConversionError, quantize_checkpoint
from mxq.formats import E4M3, E5M2, fake_quantize_mx
from mxq.recipe import RecipeError, load_recipe
from mxq.runtime.linear import MXLinear, mx_layers

torch.manual_seed(0)


def _tiny_llama(path: Path, intermediate: int = 96, dtype=torch.bfloat16, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=320,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    m = LlamaForCausalLM(cfg).to(dtype)
    m.save_pretrained(path)
    return path


def _tiny_qwen(path: Path) -> Path:
    torch.manual_seed(1)
    cfg = Qwen2Config(
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        vocab_size=300,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    m = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():  # q/k/v carry biases in Qwen2: make them non-zero
        for layer in m.model.layers:
            for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                p.bias.normal_(0, 0.5)
    m.save_pretrained(path)
    return path


def _fake_quant_reference(
    model: torch.nn.Module, quantized: set[str], w_elem, a_elem
) -> torch.nn.Module:
    """Patch each named Linear of a plain model to compute with MX-rounded operands in float32."""
    for name in quantized:
        lin = model.get_submodule(name)
        w_q = fake_quantize_mx(lin.weight.detach().float(), -1, w_elem)

        def fwd(x, lin=lin, w_q=w_q):
            xf = x.float()
            if a_elem is not None:
                xf = fake_quantize_mx(xf, -1, a_elem)
            y = xf @ w_q.t()
            if lin.bias is not None:
                y = y + lin.bias.float()
            return y.to(x.dtype)

        lin.forward = fwd
    return model


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _ids(vocab: int, n: int = 2, s: int = 37) -> torch.Tensor:
    return torch.randint(0, vocab, (n, s))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return _tiny_llama(tmp_path_factory.mktemp("llama") / "src")


# --- tiny models: every recipe, both architectures ---------------------------------------------


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8-w8a16", "mxfp8-e5m2"])
def test_llama_roundtrip_matches_fake_quant(tmp_path, llama_dir, recipe):
    out = tmp_path / "q"
    rep = quantize_checkpoint(llama_dir, out, recipe, progress=False)
    rec = load_recipe(recipe)
    assert len(rep.quantized) == 14 and list(rep.kept) == ["lm_head"]
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    mx = set(mx_layers(model))
    assert mx == {r.name for r in rep.quantized}
    assert isinstance(model.lm_head, torch.nn.Linear) and not isinstance(model.lm_head, MXLinear)
    ref = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    a_elem = rec.activations.elem if rec.activations else None
    _fake_quant_reference(ref, mx, rec.weights.elem, a_elem)
    ids = _ids(320)
    with torch.no_grad():
        got, want = model(ids).logits, ref(ids).logits
    assert _rel(got, want) < 1e-4
    # the quantization did something: the unquantized model differs measurably
    plain = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    with torch.no_grad():
        assert _rel(plain(ids).logits, want) > 1e-4
    elem = E5M2 if recipe == "mxfp8-e5m2" else E4M3
    assert model.model.layers[0].mlp.down_proj.weight.dtype == elem.torch_dtype


def test_qwen_gqa_bias_tied_and_kept_layer(tmp_path):
    src = _tiny_qwen(tmp_path / "src")
    warnings = []
    rep = quantize_checkpoint(src, tmp_path / "q", progress=False, warn=warnings.append)
    # K = 160 of down_proj is a multiple of 32; hidden 96 too. Everything but the tied lm_head is quantized.
    assert len(rep.quantized) == 14 and "lm_head" in rep.kept
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.model.layers[1].self_attn.k_proj.bias is not None
    ref = _fake_quant_reference(
        AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32),
        {r.name for r in rep.quantized},
        E4M3,
        E4M3,
    )
    ids = _ids(300)
    with torch.no_grad():
        assert _rel(model(ids).logits, ref(ids).logits) < 1e-4


def test_k_not_multiple_of_32_stays_bf16_with_warning(tmp_path):
    src = _tiny_llama(tmp_path / "src", intermediate=80)
    warnings = []
    rep = quantize_checkpoint(src, tmp_path / "q", progress=False, warn=warnings.append)
    downs = [n for n in rep.kept if n.endswith("down_proj")]
    assert len(downs) == 2 and "80" in rep.kept[downs[0]]
    assert any("model.layers.0.mlp.down_proj" in w for w in warnings)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    assert type(model.model.layers[0].mlp.down_proj) is torch.nn.Linear
    assert "model.layers.0.mlp.up_proj" in mx_layers(model)


def test_checkpoint_layout_and_memory(tmp_path, llama_dir):
    out = tmp_path / "q"
    quantize_checkpoint(llama_dir, out, progress=False, max_shard_bytes=40_000)
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(idx["weight_map"].values()))
    assert len(shards) > 1 and all((out / s).is_file() for s in shards)
    infos = read_index(out)
    assert idx["metadata"]["total_size"] == sum(i.nbytes for i in infos.values())
    w, s = (
        infos["model.layers.1.self_attn.q_proj.weight"],
        infos["model.layers.1.self_attn.q_proj.weight_scale"],
    )
    assert (w.dtype, w.shape, s.dtype, s.shape) == ("F8_E4M3", (64, 64), "U8", (64, 2))
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert (
        qc["quant_method"] == "mxq"
        and qc["recipe"]["name"] == "mxfp8"
        and qc["ignore"] == ["lm_head"]
    )
    assert qc["layers"]["model.layers.0.mlp.up_proj"] == {
        "weights": {"elem": "e4m3", "scale_rule": "rceil"},
        "activations": {"elem": "e4m3", "scale_rule": "rceil"},
    }
    assert (out / "generation_config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(out)
    mx = list(mx_layers(model).values())
    q_bytes = sum(m.weight.numel() * m.weight.element_size() + m.weight_scale.numel() for m in mx)
    bf16_bytes = sum(m.weight.numel() * 2 for m in mx)
    assert abs(q_bytes / bf16_bytes - (1 + 1 / 32) / 2) < 1e-9  # fp8 + one scale byte per 32


def test_save_pretrained_roundtrip(tmp_path, llama_dir):
    quantize_checkpoint(llama_dir, tmp_path / "q", progress=False)
    m1 = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    m1.save_pretrained(tmp_path / "again")
    m2 = AutoModelForCausalLM.from_pretrained(tmp_path / "again")
    a = load_file(next((tmp_path / "q").glob("model-*.safetensors")))
    b = {}
    for f in (tmp_path / "again").glob("*.safetensors"):
        b.update(load_file(f))
    for k, v in a.items():
        assert torch.equal(
            v.view(torch.uint8) if v.dtype.itemsize == 1 else v,
            b[k].view(torch.uint8) if v.dtype.itemsize == 1 else b[k],
        ), k
    ids = _ids(320)
    with torch.no_grad():
        assert torch.equal(m1(ids).logits, m2(ids).logits)


def test_quantize_model_in_memory_equals_converter(tmp_path, llama_dir):
    quantize_checkpoint(llama_dir, tmp_path / "q", progress=False)
    disk = mxq.load(tmp_path / "q")
    mem = mxq.quantize_model(
        AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.bfloat16), "mxfp8"
    )
    assert mem.config.quantization_config.quant_method == "mxq"
    for (n1, p1), (n2, p2) in zip(disk.state_dict().items(), mem.state_dict().items(), strict=True):
        assert n1 == n2 and torch.equal(
            p1.view(torch.uint8) if p1.dtype.itemsize == 1 else p1,
            p2.view(torch.uint8) if p2.dtype.itemsize == 1 else p2,
        ), n1


def test_lm_head_recipe_untied_and_tied(tmp_path, llama_dir):
    """mxfp8-lm-head quantizes an untied lm_head (converter and in memory agree, logits match
    the fake-quant reference) and keeps a tied one in bf16 with the reason."""
    rep = quantize_checkpoint(llama_dir, tmp_path / "q", recipe="mxfp8-lm-head", progress=False)
    assert "lm_head" in {r.name for r in rep.quantized}
    disk = mxq.load(tmp_path / "q")
    assert isinstance(disk.lm_head, MXLinear)
    mem = mxq.quantize_model(
        AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.bfloat16), "mxfp8-lm-head"
    )
    assert torch.equal(mem.lm_head.weight.view(torch.uint8), disk.lm_head.weight.view(torch.uint8))
    ref = _fake_quant_reference(
        AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32),
        {r.name for r in rep.quantized},
        E4M3,
        E4M3,
    )
    f32 = mxq.load(tmp_path / "q", dtype=torch.float32)
    ids = _ids(320)
    with torch.no_grad():
        assert _rel(f32(ids).logits, ref(ids).logits) < 1e-4
    tied = AutoModelForCausalLM.from_pretrained(_tiny_qwen(tmp_path / "qw"), dtype=torch.bfloat16)
    mxq.quantize_model(tied, "mxfp8-lm-head")
    assert type(tied.lm_head) is torch.nn.Linear
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    cfg = tied.config.quantization_config.to_dict()
    assert "lm_head" in cfg["ignore"] and "lm_head" not in cfg["layers"]
    from mxq.recipe import load_recipe
    from mxq.runtime.experts import select_model_layers as select_layers

    fresh = AutoModelForCausalLM.from_pretrained(tmp_path / "qw", dtype=torch.bfloat16)
    assert (
        "tied to the input embedding"
        in select_layers(fresh, load_recipe("mxfp8-lm-head"))[1]["lm_head"]
    )


# --- other MXFP8 layouts -----------------------------------------------------------------------


def test_compressed_tensors_layout(tmp_path, llama_dir):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationConfig

    out = tmp_path / "ct"
    quantize_checkpoint(llama_dir, out, "mxfp8", fmt="compressed-tensors", progress=False)
    qc_dict = json.loads((out / "config.json").read_text())["quantization_config"]
    qc = QuantizationConfig.model_validate(qc_dict)
    assert qc.format == "mxfp8-quantized" and qc.quant_method == "compressed-tensors"
    group = qc.config_groups["group_0"]
    assert (
        group.weights.num_bits == 8
        and group.weights.group_size == 32
        and group.weights.scale_dtype == torch.uint8
    )
    assert group.input_activations.dynamic is True and "lm_head" in qc.ignore
    # the package's own compressor accepts the scheme
    from compressed_tensors.compressors.mxfp8.base import MXFP8QuantizationCompressor

    assert MXFP8QuantizationCompressor.can_compress(torch.nn.Linear, group)
    infos = read_index(out)
    for name, info in infos.items():
        if name.endswith(".weight_scale"):
            w = infos[name[: -len("_scale")]]
            assert (
                w.dtype == "F8_E4M3"
                and info.dtype == "U8"
                and info.shape == (w.shape[0], w.shape[1] // 32)
            )
    # mxq reads it back, equal to the native checkpoint
    quantize_checkpoint(llama_dir, tmp_path / "native", progress=False)
    ids = _ids(320)
    with torch.no_grad():
        assert torch.equal(mxq.load(out)(ids).logits, mxq.load(tmp_path / "native")(ids).logits)


def test_compressed_tensors_refuses_e5m2(tmp_path, llama_dir):
    with pytest.raises(ConversionError, match="E4M3 only"):
        quantize_checkpoint(
            llama_dir, tmp_path / "x", "mxfp8-e5m2", fmt="compressed-tensors", progress=False
        )
    assert not (tmp_path / "x").exists()


def _as_transformers_checkpoint(native, other, qc: dict, scale_dtype=None):
    """mxq's checkpoint with transformers' names (``weight_scale_inv``, the scale bytes viewed as
    ``scale_dtype`` if given) and the quantization_config ``qc``."""
    other.mkdir()
    tensors = {}
    for f in native.glob("model-*.safetensors"):
        for k, v in load_file(f).items():
            if k.endswith(".weight_scale") and scale_dtype is not None:
                v = v.view(scale_dtype)
            tensors[k.replace(".weight_scale", ".weight_scale_inv")] = v
    save_file(tensors, other / "model.safetensors")
    cfg = json.loads((native / "config.json").read_text())
    cfg["quantization_config"] = qc
    (other / "config.json").write_text(json.dumps(cfg))
    return other


def test_transformers_mxfp8_checkpoint_loads(tmp_path, llama_dir):
    native = tmp_path / "native"
    quantize_checkpoint(llama_dir, native, progress=False)
    qc = {"quant_method": "mxfp8", "activation_scheme": "dynamic", "weight_block_size": [1, 32], "scale_fmt": "ue8m0",
          "modules_to_not_convert": ["lm_head"]}  # fmt: skip
    other = _as_transformers_checkpoint(native, tmp_path / "hf-mxfp8", qc)
    ids = _ids(320)
    with torch.no_grad():
        got = mxq.load(other)
        assert "model.layers.0.mlp.gate_proj" in mx_layers(got)
        assert torch.equal(got(ids).logits, mxq.load(native)(ids).logits)


# --- safety: temp dir + rename, --force, and bad inputs ------------------------------------------


def _leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".mxq-" in p.name]


def test_existing_out_needs_force(tmp_path, llama_dir):
    out = tmp_path / "q"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ConversionError, match="already exists.*--force"):
        quantize_checkpoint(llama_dir, out, progress=False)
    assert (out / "keep.txt").read_text() == "mine"
    # --force replaces only a previous mxq output, never a directory holding files mxq did not write
    with pytest.raises(ConversionError, match="not a directory written by mxq.*keep.txt"):
        quantize_checkpoint(llama_dir, out, progress=False, force=True)
    assert (out / "keep.txt").read_text() == "mine"
    mine = tmp_path / "q2"
    quantize_checkpoint(llama_dir, mine, progress=False)
    (mine / "config.json").write_text("{}")  # stale content of an earlier mxq run
    quantize_checkpoint(llama_dir, mine, progress=False, force=True)
    assert json.loads((mine / "config.json").read_text())["quantization_config"]["quant_method"] == "mxq"
    assert _leftovers(tmp_path) == []


def _corrupt(src: Path, how: str) -> None:
    f = next(src.glob("*.safetensors"))
    raw = f.read_bytes()
    if how == "truncate":
        f.write_bytes(raw[: len(raw) - 100])
    elif how == "header":
        f.write_bytes(raw[:8] + b"{not json" + raw[17:])
    elif how == "length":
        f.write_bytes((10**9).to_bytes(8, "little") + raw[8:])


@pytest.mark.parametrize(
    "case, message",
    [
        ("truncate", r"model.safetensors: tensor .*truncated file"),
        ("header", r"model.safetensors: corrupt header \(not valid JSON\)"),
        ("length", r"model.safetensors: corrupt header \(claims"),
        ("no-config", r"missing config.json"),
        (
            "nan",
            r"tensor model.layers.1.mlp.up_proj.weight: non-finite value nan at row 5, block 1 \(columns 32-63\)",
        ),
        (
            "inf",
            r"tensor model.layers.0.self_attn.o_proj.weight: non-finite value -inf at row 0, block 0",
        ),
        ("int-weight", r"tensor model.layers.0.self_attn.q_proj.weight: unsupported dtype I32"),
        ("no-linear", r"has no torch.nn.Linear layers"),
        ("already", r"already quantized"),
        ("bin", r"PyTorch .bin checkpoints are not supported"),
    ],
)
def test_bad_input_is_one_clear_error_and_nothing_written(tmp_path, case, message):
    src = _tiny_llama(tmp_path / "src", dtype=torch.float32)
    f = src / "model.safetensors"
    if case in ("truncate", "header", "length"):
        _corrupt(src, case)
    elif case == "no-config":
        (src / "config.json").unlink()
    elif case in ("nan", "inf", "int-weight"):
        t = load_file(f)
        if case == "nan":
            t["model.layers.1.mlp.up_proj.weight"][5, 40] = float("nan")
        elif case == "inf":
            t["model.layers.0.self_attn.o_proj.weight"][0, 3] = float("-inf")
        else:
            t["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(64, 64, dtype=torch.int32)
        save_file(t, f)
    elif case == "no-linear":
        from transformers import GPT2Config, GPT2LMHeadModel

        for p in src.iterdir():
            p.unlink()
        # GPT-2 computes its projections with Conv1D, not torch.nn.Linear
        GPT2LMHeadModel(
            GPT2Config(
                n_embd=32,
                n_layer=1,
                n_head=2,
                vocab_size=64,
                n_positions=32,
                tie_word_embeddings=True,
            )
        ).save_pretrained(src)
    elif case == "already":
        quantize_checkpoint(_tiny_llama(tmp_path / "other"), tmp_path / "prev", progress=False)
        src = tmp_path / "prev"
    elif case == "bin":
        f.unlink()
        (src / "pytorch_model.bin").write_bytes(b"x")
    out = tmp_path / "out"
    with pytest.raises((ConversionError, ValueError)) as ei:
        quantize_checkpoint(src, out, progress=False)
    msg = str(ei.value)
    assert "\n" not in msg
    import re

    assert re.search(message, msg), msg
    assert not out.exists() and _leftovers(tmp_path) == []


def test_unknown_recipe_key_names_file_and_key(tmp_path, llama_dir):
    bad = tmp_path / "r.yaml"
    bad.write_text("name: x\nweights: {elem: e4m3, scale_rule: rceil}\nactivatons: null\n")
    with pytest.raises(RecipeError, match=r"r.yaml: unknown key 'activatons'"):
        quantize_checkpoint(llama_dir, tmp_path / "o", bad, progress=False)
    bad.write_text("name: x\nweights: {elem: e3m4, scale_rule: rceil}\n")
    with pytest.raises(RecipeError, match=r"r.yaml: weights: unknown element format 'e3m4'"):
        load_recipe(bad)
    with pytest.raises(RecipeError, match="unknown recipe 'nope'"):
        load_recipe("nope")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "text,match",
    [
        ("name: [1, 2]\nweights: {elem: e4m3}\n", r"name: expected a non-empty string"),
        ("name: ''\nweights: {elem: e4m3}\n", r"name: expected a non-empty string"),
        ("name: x\ndescription: [a]\nweights: {elem: e4m3}\n", r"description: expected a string"),
        ("name: x\nblock_size: '32'\nweights: {elem: e4m3}\n", r"block_size: MX blocks are 32 elements, got '32'"),
        ("name: x\nblock_size: 16\nweights: {elem: e4m3}\n", r"block_size: MX blocks are 32 elements, got 16"),
        ("name: x\nblock_size: true\nweights: {elem: e4m3}\n", r"block_size: MX blocks are 32 elements, got True"),
        ("name: x\nblock_size: " + "9" * 5000 + "\nweights: {elem: e4m3}\n", r"r.yaml: unreadable value"),
        (b"\x00\xff\xfe binary", r"r.yaml: not a text file"),
    ],
)
def test_bad_recipe_values_are_one_line_errors(tmp_path, text, match):
    """Values of the wrong type or out of range (and files that are not YAML text) are refused with
    a RecipeError naming the file and the key, never a raw Python error or a silently kept value."""
    bad = tmp_path / "r.yaml"
    bad.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(RecipeError, match=match) as e:
        load_recipe(bad)
    assert "\n" not in str(e.value) and len(str(e.value)) < 400


@pytest.mark.parametrize("bad", [{"block_size": 0}, {"block_size": -32}, {"block_size": "32"}, {"block_size": 16},
                                 {"format_version": "1"}, {"format_version": 99}])  # fmt: skip
def test_bad_quantization_config_values_are_refused(tmp_path, llama_dir, bad):
    """A checkpoint whose quantization_config has a wrong block_size or format_version loads with
    a one-line error naming the key, not a traceback or a silently wrong model."""
    out = tmp_path / "q"
    quantize_checkpoint(llama_dir, out, "mxfp8", progress=False)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"].update(bad)
    (out / "config.json").write_text(json.dumps(cfg))
    key = next(iter(bad))
    with pytest.raises(ValueError, match=rf"quantization_config {key}") as e:
        mxq.load(out)
    assert "\n" not in str(e.value)


def test_disk_full_leaves_nothing(tmp_path, llama_dir, monkeypatch):
    calls = {"n": 0}
    real = ShardWriter.write

    def failing(self, name, tensor):
        calls["n"] += 1
        if calls["n"] == 7:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, name, tensor)

    monkeypatch.setattr(ShardWriter, "write", failing)
    with pytest.raises(
        ConversionError, match="no space left on device while writing; nothing was written"
    ):
        quantize_checkpoint(llama_dir, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []


def test_interrupt_leaves_nothing(tmp_path, llama_dir, monkeypatch):
    import mxq.convert.converter as conv

    real = conv._quantize_weight
    calls = {"n": 0}

    def interrupted(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(conv, "_quantize_weight", interrupted)
    with pytest.raises(KeyboardInterrupt):
        quantize_checkpoint(llama_dir, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []


# --- CLI -----------------------------------------------------------------------------------------


def _mxq(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "mxq.cli", *args], capture_output=True, text=True, cwd=cwd
    )


def test_cli_quantize_inspect_and_errors(tmp_path, llama_dir):
    r = _mxq("quantize", str(llama_dir), str(tmp_path / "q"), "--recipe", "mxfp8-w8a16")
    assert r.returncode == 0, r.stderr
    assert "layers quantized" in r.stdout and "compression" in r.stdout and "SQNR" in r.stdout
    r = _mxq("inspect", str(tmp_path / "q"))
    assert r.returncode == 0 and "mxfp8-w8a16" in r.stdout and "ok" in r.stdout, r.stdout + r.stderr
    r = _mxq("quantize", str(llama_dir), str(tmp_path / "q"))
    assert r.returncode == 1 and r.stderr.strip().count("\n") == 0 and "--force" in r.stderr
    r = _mxq("quantize", str(tmp_path / "nope"), str(tmp_path / "z"))
    assert r.returncode == 1 and "nope" in r.stderr and "Traceback" not in r.stderr
    r = _mxq("--debug", "quantize", str(tmp_path / "nope"), str(tmp_path / "z"))
    assert r.returncode == 1 and "Traceback" in r.stderr


def test_inspect_reports_bad_scale_shape_by_name(tmp_path, llama_dir):
    from mxq.checkpoint.describe import inspect_checkpoint

    out = tmp_path / "q"
    quantize_checkpoint(llama_dir, out, progress=False)
    assert inspect_checkpoint(out).problems == []
    f = next(out.glob("model-*.safetensors"))
    t = load_file(f)
    t["model.layers.0.mlp.gate_proj.weight_scale"] = t["model.layers.0.mlp.gate_proj.weight_scale"][
        :, :1
    ].contiguous()
    t["model.layers.1.mlp.up_proj.weight_scale"][0, 0] = 0xFF
    save_file(t, f)
    probs = inspect_checkpoint(out).problems
    assert any(
        "model.layers.0.mlp.gate_proj.weight_scale: shape [96, 1] does not match weight [96, 64]"
        in p
        for p in probs
    )
    assert any(
        "model.layers.1.mlp.up_proj.weight_scale: 1 block(s) with NaN scale" in p for p in probs
    )


def _rewrite_header(f, edit) -> None:
    """Rewrite the JSON header of safetensors file ``f`` with ``edit(header, data) -> (header, data)``."""
    import struct

    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8 : 8 + n]), raw[8 + n :]
    header, data = edit(header, data)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    f.write_bytes(struct.pack("<Q", len(h)) + h + data)


def _first(header):
    return next(k for k in header if k != "__metadata__")


@pytest.mark.parametrize(
    "edit,match",
    [
        # a 64-byte hole: the first tensor's data moved back, its old bytes belong to nothing
        (lambda h, d: ({k: (dict(v, data_offsets=[v["data_offsets"][0] + 64, v["data_offsets"][1] + 64]) if k != "__metadata__" else v)
                        for k, v in h.items()}, b"\0" * 64 + d), r"64 bytes of no tensor before"),
        (lambda h, d: (h, d + b"\0" * 16), r"16 bytes after the last tensor belong to no tensor"),
        (lambda h, d: (dict(h, __metadata__={"format": 1}), d), r"__metadata__ must map strings to strings"),
        (lambda h, d: (dict(h, __metadata__=["pt"]), d), r"__metadata__ must map strings to strings"),
        (lambda h, d: ({**h, _first(h): dict(h[_first(h)], shape=[2**64, 0])}, d), r"bad shape"),
        (lambda h, d: ({**h, _first(h): dict(h[_first(h)], shape=[True, 1])}, d), r"shape must be a list of integers"),
    ],
)
def test_malformed_headers_refused_alike_by_inspect_and_loader(tmp_path, llama_dir, edit, match):
    """The safetensors rules (offsets contiguous from 0 and covering the data exactly, string
    metadata, sane shapes): `mxq inspect` and `mxq.load` refuse the same file with the same
    one-line message naming it."""
    from mxq.checkpoint.describe import inspect_checkpoint
    from mxq.checkpoint.files import CheckpointError, read_header

    out = tmp_path / "q"
    quantize_checkpoint(llama_dir, out, progress=False)
    f = next(out.glob("model-*.safetensors"))
    _rewrite_header(f, edit)
    with pytest.raises(CheckpointError, match=match) as e:
        read_header(f)
    assert f.name in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(CheckpointError, match=match):
        mxq.load(out)
    try:
        probs = inspect_checkpoint(out).problems
    except CheckpointError as e2:
        probs = [str(e2)]
    assert any(re.search(match, p) for p in probs), probs


# --- streaming: peak memory stays near the largest tensor ---------------------------------------

STREAM_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from mxq.convert.converter import quantize_checkpoint

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    src, small, out = map(Path, sys.argv[1:4])
    quantize_checkpoint(small, out / "warm", progress=False)  # imports and allocator warm-up
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
    base = status("VmRSS")
    quantize_checkpoint(src, out / "big", progress=False)
    print(json.dumps({"base": base, "peak": status("VmHWM")}))
    """
)


@pytest.mark.slow
def test_streaming_peak_memory(tmp_path):
    cfg = LlamaConfig(
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=24,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=256,
        tie_word_embeddings=True,
    )
    src = tmp_path / "big"
    src.mkdir()
    cfg.save_pretrained(src)
    with torch.device("meta"):
        skel = LlamaForCausalLM(cfg)
    shapes = {k: tuple(v.shape) for k, v in skel.state_dict().items() if k != "lm_head.weight"}
    largest = max(torch.Size(s).numel() * 4 for s in shapes.values())
    # Four fp32 shards written one at a time, so the test itself never holds the model either.
    names = sorted(shapes)
    total = 0
    for i in range(4):
        part = {k: torch.randn(shapes[k]) for k in names[i::4]}
        total += sum(v.numel() * 4 for v in part.values())
        save_file(part, src / f"model-{i + 1:05d}-of-00004.safetensors")
    (src / "model.safetensors.index.json").write_text(
        json.dumps(
            {
                "metadata": {"total_size": total},
                "weight_map": {
                    k: f"model-{i % 4 + 1:05d}-of-00004.safetensors" for i, k in enumerate(names)
                },
            }
        )
    )
    small = _tiny_llama(tmp_path / "small", dtype=torch.float32)
    r = subprocess.run(
        [sys.executable, "-c", STREAM_SCRIPT, str(src), str(small), str(tmp_path / "outs")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout.strip().splitlines()[-1])
    growth = m["peak"] - m["base"]
    bound = 12 * largest + 24 * 2**20  # a small factor of the largest tensor, plus fixed slack
    assert total > 3 * bound, "the checkpoint must be several times larger than the bound"
    assert growth < bound, (
        f"peak RSS grew {growth / 2**20:.1f} MiB converting {total / 2**20:.0f} MiB (bound {bound / 2**20:.1f} MiB)"
    )
    assert (
        json.loads((tmp_path / "outs" / "big" / "config.json").read_text())["quantization_config"][
            "quant_method"
        ]
        == "mxq"
    )


def test_checkout_root_on_sys_path_does_not_shadow_hf_kernels():
    """From the repo root `kernels/` is importable as a top-level `kernels`, the name transformers
    probes for the Hugging Face kernels package; that must not break `import transformers`."""
    root = Path(__file__).resolve().parents[1]
    code = "from transformers import LlamaForCausalLM; import mxq, mxq.kernels; print(mxq.kernels.mx_linear.__name__)"
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "mx_linear", r.stderr[-1500:]


def test_hub_id_goes_through_snapshot_download(tmp_path, llama_dir, monkeypatch):
    """No hub here: a stand-in snapshot_download returns a local copy; offline is one clear line."""
    import huggingface_hub

    calls = []

    def fake_snapshot(repo_id, allow_patterns=None, **kw):
        calls.append((repo_id, allow_patterns))
        return str(llama_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    rep = quantize_checkpoint("someorg/tiny-llama", tmp_path / "q", progress=False)
    assert calls and calls[0][0] == "someorg/tiny-llama" and "*.safetensors" in calls[0][1]
    assert len(rep.quantized) == 14 and (tmp_path / "q" / "config.json").is_file()

    def offline(repo_id, **kw):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(
        ConversionError,
        match=r"someorg/tiny-llama: cannot fetch from the Hugging Face hub .*pass a local directory",
    ):
        quantize_checkpoint("someorg/tiny-llama", tmp_path / "q2", progress=False)
    assert not (tmp_path / "q2").exists()


NO_TRITON = textwrap.dedent(
    """
    import importlib.abc, sys

    class NoTriton(importlib.abc.MetaPathFinder):  # as on a machine without the triton wheel
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ImportError("No module named 'triton'")

    sys.meta_path.insert(0, NoTriton())
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    import mxq
    from mxq.kernels import dispatch

    assert not dispatch.HAS_TRITON and "triton" not in sys.modules
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="mxfp8")
    mxq.quantize_model(model, "mxfp8")
    out = model(torch.randint(0, 64, (1, 9))).logits
    assert torch.isfinite(out).all()
    print("ok")
    """
)


def test_import_and_cpu_path_without_triton():
    r = subprocess.run([sys.executable, "-c", NO_TRITON], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


def test_transformers_fp8_1x32_ue8m0_checkpoint_loads(tmp_path, llama_dir):
    """transformers' FineGrainedFP8Config(weight_block_size=(1, 32), scale_fmt="ue8m0") writes MXFP8
    under quant_method "fp8" (E8M0 weight_scale_inv, 1x32 blocks, RCEIL scales): mxq reads it; any
    other fp8 layout is refused in one line naming config.json."""
    from mxq.checkpoint.files import CheckpointError

    native = tmp_path / "native"
    quantize_checkpoint(llama_dir, native, progress=False)
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [1, 32], "scale_fmt": "ue8m0",
          "modules_to_not_convert": ["lm_head"]}  # fmt: skip
    other = _as_transformers_checkpoint(native, tmp_path / "hf-fp8", qc, torch.float8_e8m0fnu)
    ids = _ids(320)
    with torch.no_grad():
        assert torch.equal(mxq.load(other)(ids).logits, mxq.load(native)(ids).logits)
    cfg = json.loads((other / "config.json").read_text())
    cfg["quantization_config"] = {**qc, "weight_block_size": [128, 128], "scale_fmt": "float"}
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json.*'fp8'.*not MXFP8"):
        mxq.load(other)


def test_every_unquantized_matrix_is_named(tmp_path, llama_dir):
    """A matrix no rule covers is listed as kept with its reason (and, if it looks like a
    projection, warned about): no weight is left in high precision without a word."""
    src = tmp_path / "src"
    shutil.copytree(llama_dir, src)
    f = next(src.glob("*.safetensors"))
    t = load_file(f)
    t["model.extra_table"] = torch.randn(8, 64)
    t["model.layers.0.mlp.extra_proj.weight"] = torch.randn(64, 64)
    save_file(t, f, metadata={"format": "pt"})
    idx = src / "model.safetensors.index.json"
    if idx.exists():
        data = json.loads(idx.read_text())
        data["weight_map"].update({k: f.name for k in ("model.extra_table", "model.layers.0.mlp.extra_proj.weight")})
        idx.write_text(json.dumps(data))
    said = []
    report = quantize_checkpoint(src, tmp_path / "out", progress=False, warn=said.append)
    assert "no rule covers" in report.kept["model.layers.0.mlp.extra_proj.weight"]
    assert "kept as it is" in report.kept["model.extra_table"]
    assert any("extra_proj" in m for m in said) and not any("extra_table" in m for m in said)


def _tensors(directory: Path) -> dict:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update({k: v.view(torch.uint8) if v.dtype.itemsize == 1 else v for k, v in load_file(f).items()})
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "gpt_oss"])
def test_tensor_source_from_memory_equals_the_directory(tmp_path, llama_dir, family):
    """A model in memory (``TensorSource.from_model``) converts to the same bytes and the same
    quantization config as its saved directory; a reader that makes each tensor on request is read
    once per tensor, in the listed order."""
    from moe_models import moe_model

    from mxq.convert.converter import TensorSource

    if family == "llama":
        model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.bfloat16)
    else:
        model = moe_model(family, seed=11, dtype=torch.bfloat16)
        model.save_pretrained(tmp_path / "src")
    src = llama_dir if family == "llama" else tmp_path / "src"
    quantize_checkpoint(src, tmp_path / "disk", progress=False)
    source = TensorSource.from_model(model)
    reads = []
    read = source.read
    source.read = lambda n: reads.append(n) or read(n)
    quantize_checkpoint(source, tmp_path / "mem", progress=False)
    assert reads == [n for n, _, _ in source.tensors] and len(set(reads)) == len(reads)
    if family == "llama":  # the same layout on disk: the same bytes
        disk, mem = _tensors(tmp_path / "disk"), _tensors(tmp_path / "mem")
        assert set(disk) == set(mem)
        for k in disk:
            assert torch.equal(disk[k], mem[k]), k
    # transformers saves experts one by one, the model in memory holds them fused: the loaded models agree
    a, b = mxq.load(tmp_path / "disk"), mxq.load(tmp_path / "mem")
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb)
    for k in sa:
        assert torch.equal(sa[k].view(torch.uint8) if sa[k].dtype.itemsize == 1 else sa[k],
                           sb[k].view(torch.uint8) if sb[k].dtype.itemsize == 1 else sb[k]), k
    qd, qm = (json.loads((tmp_path / d / "config.json").read_text())["quantization_config"] for d in ("disk", "mem"))
    assert qm.pop("provenance")["source"] == f"{type(model).__name__} in memory"
    qd.pop("provenance")
    for e in qm.get("experts", {}).values():  # the one difference: how the experts lie on disk
        assert e.pop("layout") == "fused" and all(n.endswith(("gate_up_proj", "down_proj")) for n in e.pop("stored"))
    for e in qd.get("experts", {}).values():
        e.pop("layout"), e.pop("stored")
    assert qd == qm
    ids = _ids(model.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)
