"""Corrupt and foreign checkpoints and datasets: what the loaders, `mxq inspect` and the data
readers refuse (one line naming the file and the tensor or key) and what they read correctly
(E8M0 scales stored as float8_e8m0fnu)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from cli_helpers import run_cli
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import mxq
from mxq.checkpoint.describe import inspect_checkpoint
from mxq.checkpoint.files import CheckpointError, read_header
from mxq.convert.converter import quantize_checkpoint
from mxq.runtime.linear import mx_layers

LAYER = "model.layers.0.mlp.gate_proj"  # [96, 64]: scales [96, 2]


def _tiny_llama(path: Path) -> Path:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, tie_word_embeddings=False)  # fmt: skip
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return _tiny_llama(tmp_path_factory.mktemp("trust") / "src")


@pytest.fixture(scope="module")
def quantized(src, tmp_path_factory):
    """The tiny model quantized: "u8" (E4M3, uint8 scales), "e5m2"; "e8m0" (as u8, float8_e8m0fnu
    scales) where a test asks for it (``e8m0`` fixture)."""
    root = tmp_path_factory.mktemp("q")
    quantize_checkpoint(src, root / "u8", progress=False)
    quantize_checkpoint(src, root / "e5m2", "mxfp8-e5m2", progress=False)
    return root


@pytest.fixture(scope="module")
def e8m0(src, quantized):
    quantize_checkpoint(src, quantized / "e8m0", progress=False, scale_dtype="e8m0")
    return quantized / "e8m0"


def _copy(d: Path, to: Path) -> Path:
    import shutil

    shutil.copytree(d, to)
    return to


def _shard(d: Path) -> Path:
    return next(d.glob("model-*.safetensors"))


def _edit_tensors(d: Path, edit) -> Path:
    f = _shard(d)
    t = load_file(f)
    edit(t)
    save_file(t, f, metadata={"format": "pt"})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {k: f.name for k in t}}))
    return f


def _edit_config(d: Path, edit) -> None:
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg["quantization_config"])
    (d / "config.json").write_text(json.dumps(cfg))


def _set_bytes(f: Path, name: str, index: int, value: int) -> None:
    """Overwrite one byte of tensor ``name``'s data in place (the header stays as it is)."""
    info = read_header(f)[0][name]
    with open(f, "r+b") as fh:
        fh.seek(info.begin + index)
        fh.write(bytes([value]))


def _refused_by_both(d: Path, *needles: str) -> None:
    """mxq.load and a plain transformers from_pretrained (through mxq's quantizer) both refuse,
    with one line naming every needle (the file, the tensor)."""
    for load in (lambda: mxq.load(d), lambda: AutoModelForCausalLM.from_pretrained(d)):
        with pytest.raises(CheckpointError) as e:
            load()
        msg = str(e.value)
        assert "\n" not in msg and all(n in msg for n in needles), msg


# --- the loader refuses --------------------------------------------------------------------------


def test_missing_weight_scale_is_refused(quantized, tmp_path):
    d = _copy(quantized / "u8", tmp_path / "q")
    f = _edit_tensors(d, lambda t: t.pop(f"{LAYER}.weight_scale"))
    _refused_by_both(d, f.name, f"{LAYER}.weight_scale: missing")


@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16])
def test_scales_of_a_wrong_dtype_are_refused(quantized, tmp_path, dtype):
    d = _copy(quantized / "u8", tmp_path / "q")

    def edit(t):
        s = t[f"{LAYER}.weight_scale"]
        t[f"{LAYER}.weight_scale"] = s.view(torch.int8).clone() if dtype == torch.int8 else s.to(dtype)

    f = _edit_tensors(d, edit)
    want = "I8" if dtype == torch.int8 else "BF16"
    _refused_by_both(d, f.name, f"{LAYER}.weight_scale: dtype {want}, expected U8")


@pytest.mark.parametrize("say,have", [("e5m2", "u8"), ("e4m3", "e5m2")])
def test_config_element_format_must_match_the_weights(quantized, tmp_path, say, have):
    """A config that says e5m2 over F8_E4M3 data (or the reverse) is refused, not cast by value."""
    d = _copy(quantized / have, tmp_path / "q")
    _edit_config(d, lambda qc: qc["layers"][LAYER]["weights"].update(elem=say))
    _refused_by_both(d, _shard(d).name, f"{LAYER}.weight: dtype F8_E", f"the quantization_config says {say}")


@pytest.mark.parametrize(
    "which,byte",
    [("u8", 0x7F), ("u8", 0xFF), ("e5m2", 0x7C), ("e5m2", 0xFC), ("e5m2", 0x7E), ("e5m2", 0xFD)],
)
def test_fp8_nan_and_inf_codes_are_refused(quantized, tmp_path, which, byte):
    """E4M3 NaN (S.1111.111) and E5M2 Inf/NaN (exponent 11111) in the weight data: refused by both
    loaders and reported by `mxq inspect`, naming the file, the tensor and where."""
    d = _copy(quantized / which, tmp_path / "q")
    f = _shard(d)
    _set_bytes(f, f"{LAYER}.weight", 64 * 5 + 7, byte)
    _refused_by_both(d, f.name, f"{LAYER}.weight: 1 ", "row 5, column 7")
    probs = inspect_checkpoint(d).problems
    assert len(probs) == 1 and f"{LAYER}.weight: 1 " in probs[0] and f.name in probs[0]


def test_nan_scale_is_refused(quantized, tmp_path):
    d = _copy(quantized / "u8", tmp_path / "q")
    _set_bytes(_shard(d), f"{LAYER}.weight_scale", 3, 0xFF)
    _refused_by_both(d, f"{LAYER}.weight_scale: 1 block(s) with NaN scale (0xFF), the first at row 1, block 1")


def test_scale_shape_and_model_shape_are_checked(quantized, tmp_path):
    d = _copy(quantized / "u8", tmp_path / "q")
    _edit_tensors(d, lambda t: t.update({f"{LAYER}.weight_scale": t[f"{LAYER}.weight_scale"][:, :1].contiguous()}))
    _refused_by_both(d, f"{LAYER}.weight_scale: shape [96, 1] does not match weight [96, 64]")
    # a model the config describes with other shapes than the tensors have: transformers would
    # set the checkpoint's tensors without a word under a quantizer
    d2 = _copy(quantized / "u8", tmp_path / "q2")
    cfg = json.loads((d2 / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (d2 / "config.json").write_text(json.dumps(cfg))
    _refused_by_both(d2, _shard(d2).name, "mlp.down_proj.weight: shape [64, 96]", "describes it has [64, 128]")


def test_fp8_data_of_an_unlisted_layer_is_refused(quantized, tmp_path):
    """A layer dropped from the quantization_config would load its fp8 bytes as plain numbers."""
    d = _copy(quantized / "u8", tmp_path / "q")
    _edit_config(d, lambda qc: qc["layers"].pop(LAYER))
    _refused_by_both(d, f"{LAYER}.weight", "does not list")


def test_index_naming_a_tensor_its_shard_lacks_is_refused(quantized, tmp_path):
    d = _copy(quantized / "u8", tmp_path / "q")
    idx = d / "model.safetensors.index.json"
    data = json.loads(idx.read_text())
    data["weight_map"]["model.layers.0.extra.weight"] = _shard(d).name
    idx.write_text(json.dumps(data))
    _refused_by_both(d, idx.name, "model.layers.0.extra.weight")


def test_the_scan_reads_only_what_it_needs_in_bounded_chunks(tmp_path):
    """count_codes on a 64 MiB tensor: chunks, right count and first position."""
    from mxq.checkpoint.validate import SCAN_CHUNK, count_codes

    w = torch.zeros(4096, 16384, dtype=torch.uint8)
    w[3000, 5] = w[4000, 9] = 0xFF
    save_file({"w": w.view(torch.float8_e4m3fn)}, tmp_path / "x.safetensors")
    info = read_header(tmp_path / "x.safetensors")[0]["w"]
    assert info.nbytes > 2 * SCAN_CHUNK
    assert count_codes(info, 0x7F) == (2, 3000 * 16384 + 5)


@pytest.mark.parametrize("mask", [0x7F, 0x7C, 0xFF])  # E4M3 NaN, E5M2 Inf/NaN, E8M0 NaN
@pytest.mark.parametrize("size", [1, 7, 8, 8 * 1021 + 5, (1 << 24) + 13])
def test_the_word_wise_scan_counts_what_a_byte_wise_one_counts(tmp_path, mask, size):
    """count_codes tests eight bytes a word before it counts byte by byte: against numpy on random
    bytes with matches planted near chunk and word edges (and none), sizes not a multiple of 8."""
    import numpy as np

    from mxq.checkpoint.validate import SCAN_CHUNK, count_codes

    rng = np.random.default_rng(size * 7 + mask)
    for planted in ([], [size - 1], [0, size // 2], [min(SCAN_CHUNK, size - 1), min(SCAN_CHUNK + 7, size - 1)]):
        data = rng.integers(0, 256, size, dtype=np.uint8)
        data[(data & mask) == mask] &= ~np.uint8(1 << 2)  # clear every accidental match (bit 2 is in each mask)
        for i in planted:
            data[i] |= mask
        save_file({"w": torch.from_numpy(data.copy())}, tmp_path / "x.safetensors")
        info = read_header(tmp_path / "x.safetensors")[0]["w"]
        hits = np.flatnonzero((data & mask) == mask)
        want = (len(hits), int(hits[0]) if len(hits) else -1)
        assert count_codes(info, mask) == want == count_codes(info, mask, wordwise=False), (planted, mask, size)


def test_ranks_share_the_scan_and_together_read_every_layer(quantized, tmp_path):
    """Tensor-parallel loading: each of N processes reads the data of its share of the layers (the
    headers of all); a NaN code in any layer is found by exactly one of them."""
    from mxq.checkpoint.files import read_index
    from mxq.checkpoint.validate import check_checkpoint

    d = _copy(quantized / "u8", tmp_path / "q")
    layers = sorted(n[: -len(".weight_scale")] for n in read_index(d) if n.endswith(".weight_scale"))
    for world in (2, 3):
        for layer in (layers[0], layers[-1], LAYER):
            e = _copy(d, tmp_path / f"w{world}-{layer}")

            def plant(t, layer=layer):
                w = t[f"{layer}.weight"].view(torch.uint8).clone()
                w[1, 3] = 0x7F
                t[f"{layer}.weight"] = w.view(torch.float8_e4m3fn)

            _edit_tensors(e, plant)
            found = [p for r in range(world) for p in check_checkpoint(e, share=(r, world)).problems]
            assert len(found) == 1 and f"{layer}.weight: 1 NaN code(s)" in found[0], found
            assert check_checkpoint(e).problems == found


# --- mxq inspect: the same validator -------------------------------------------------------------




@pytest.mark.parametrize(
    "key,value,match",
    [
        ("block_size", "32", "quantization_config block_size"),
        ("format_version", 99, "quantization_config format_version 99"),
        ("scale_dtype", "i8", "quantization_config scale_dtype"),
        ("layers", "LAYER_RULE", "unknown scale rule 'nearest'"),
    ],
)
def test_inspect_refuses_what_the_loader_refuses(quantized, tmp_path, key, value, match):
    d = _copy(quantized / "u8", tmp_path / "q")
    if value == "LAYER_RULE":
        _edit_config(d, lambda qc: qc["layers"][LAYER]["weights"].update(scale_rule="nearest"))
    else:
        _edit_config(d, lambda qc: qc.update({key: value}))
    rc, err = run_cli(["inspect", str(d)])
    lines = err.strip().splitlines()
    assert rc == 1 and len(lines) == 1 and match in lines[0] and str(d / "config.json") in lines[0], err
    with pytest.raises(ValueError, match=match.replace("(", r"\(")):
        mxq.load(d)


def test_inspect_reports_nan_codes_in_one_line(quantized, tmp_path):
    d = _copy(quantized / "u8", tmp_path / "q")
    _set_bytes(_shard(d), f"{LAYER}.weight", 0, 0x7F)
    rc, err = run_cli(["inspect", str(d)])
    lines = err.strip().splitlines()
    assert rc == 1 and len(lines) == 1 and f"{LAYER}.weight: 1 NaN code(s)" in lines[0] and _shard(d).name in lines[0]


# --- E8M0 scales stored as float8_e8m0fnu --------------------------------------------------------


def test_e8m0_scales_load_bit_for_bit(quantized, e8m0):
    """`--scale-dtype e8m0` writes F8_E8M0 scales and records it; both loaders read the bits (not
    the values) back: the same scales, dequantized weights and logits as the uint8 checkpoint."""
    e8 = e8m0
    assert read_header(_shard(e8))[0][f"{LAYER}.weight_scale"].dtype == "F8_E8M0"
    assert json.loads((e8 / "config.json").read_text())["quantization_config"]["scale_dtype"] == "e8m0"
    assert inspect_checkpoint(e8).problems == []
    ids = torch.randint(0, 128, (2, 11))
    ref = mxq.load(quantized / "u8")
    with torch.no_grad():
        want = ref(ids).logits
        for model in (mxq.load(e8), AutoModelForCausalLM.from_pretrained(e8, dtype=torch.bfloat16)):
            a, b = mx_layers(model), mx_layers(ref)
            assert set(a) == set(b)
            for n in a:
                assert a[n].weight_scale.dtype == torch.uint8
                assert torch.equal(a[n].dequantized_weight(), b[n].dequantized_weight()), n
            assert torch.equal(model(ids).logits, want)


def test_transformers_mxfp8_with_e8m0_scales(quantized, e8m0, tmp_path):
    """transformers' own mxfp8 layout: weight_scale_inv tensors in float8_e8m0fnu."""
    other = tmp_path / "hf-mxfp8"
    other.mkdir()
    t = load_file(_shard(e8m0))
    save_file({k.replace(".weight_scale", ".weight_scale_inv"): v for k, v in t.items()}, other / "model.safetensors")
    cfg = json.loads((e8m0 / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp8", "activation_scheme": "dynamic", "weight_block_size": [1, 32],
                                  "scale_fmt": "ue8m0", "modules_to_not_convert": ["lm_head"]}  # fmt: skip
    (other / "config.json").write_text(json.dumps(cfg))
    assert inspect_checkpoint(other).problems == []
    ids = torch.randint(0, 128, (1, 9))
    with torch.no_grad():
        assert torch.equal(mxq.load(other)(ids).logits, mxq.load(quantized / "u8")(ids).logits)


def test_recorded_scale_dtype_must_match_the_tensors(quantized, tmp_path):
    d = _copy(quantized / "u8", tmp_path / "q")
    _edit_config(d, lambda qc: qc.update(scale_dtype="e8m0"))
    _refused_by_both(d, "weight_scale: dtype U8, expected F8_E8M0")


def test_cli_scale_dtype(src, tmp_path):
    out = tmp_path / "q"
    rc, err = run_cli(["quantize", str(src), str(out), "--scale-dtype", "e8m0"])
    assert rc == 0, err
    assert read_header(_shard(out))[0][f"{LAYER}.weight_scale"].dtype == "F8_E8M0"
    rc, err = run_cli(["inspect", str(out)])
    assert rc == 0, err
    rc, err = run_cli(["quantize", str(src), str(tmp_path / "x"), "--scale-dtype", "e8m0", "--format", "compressed-tensors"])
    assert rc == 1 and "compressed-tensors" in err and not (tmp_path / "x").exists()


# --- text files as datasets ----------------------------------------------------------------------


def _no_datasets(monkeypatch):
    import datasets

    def refuse(*a, **k):
        raise AssertionError("a .txt file went through datasets")

    monkeypatch.setattr(datasets, "load_dataset", refuse)


@pytest.mark.parametrize(
    "content,match",
    [
        (b"\x1f\x8b\x08\x00" + bytes(range(256)) * 4, r"not UTF-8 text \(undecodable byte at offset 1\)"),  # gzip
        (b"PK\x03\x04" + b"\x00" * 64, r"binary data"),  # zip
        (b"caf\xc3\xa9 ok\n" * 100 + b"\xff", r"undecodable byte at offset 900"),
        (b"", r"empty file"),
        (b" \n\n\t", r"empty \(no text\)"),
    ],
)
def test_text_file_errors_are_one_line(tmp_path, monkeypatch, content, match):
    from mxq.eval.data import DatasetError, load_texts

    _no_datasets(monkeypatch)
    p = tmp_path / "corpus.txt"
    p.write_bytes(content)
    with pytest.raises(DatasetError, match=match) as e:
        load_texts(p)
    assert str(e.value).startswith(f"{p}: ") and "\n" not in str(e.value)


def test_text_file_read_as_one_document_without_datasets(tmp_path, monkeypatch):
    from mxq.eval.data import load_texts

    _no_datasets(monkeypatch)
    p = tmp_path / "a.txt"
    p.write_bytes("\ufeffpara one\n\npara twö\n".encode())
    assert load_texts(p) == ["para one\n\npara twö\n"]
    assert load_texts(p, max_chars=6) == ["para o"]


def test_huge_text_file_is_read_only_as_far_as_needed(tmp_path, monkeypatch):
    """A 2 GB file whose first 3 MB are text and the rest a sparse hole (NUL bytes): a few
    windows' worth reads only text, fast; reading it whole fails on the first binary chunk."""
    import time

    from mxq.eval.data import DatasetError, chars_for_tokens, load_texts

    _no_datasets(monkeypatch)
    p = tmp_path / "huge.txt"
    line = "the quick brown fox jumps over the lazy dog\n"
    with open(p, "wb") as f:
        f.write((line * (3 * 2**20 // len(line))).encode())
        f.truncate(2 * 2**30)
    t0 = time.perf_counter()
    (text,) = load_texts(p, max_chars=chars_for_tokens(4 * 512))
    assert time.perf_counter() - t0 < 5 and len(text) == chars_for_tokens(4 * 512) and "\x00" not in text
    with pytest.raises(DatasetError, match=r"huge\.txt: binary data \(a NUL byte in the first 3145728 bytes\)"):
        load_texts(p)
    assert os.path.getsize(p) == 2 * 2**30


def test_calibration_reads_only_what_it_needs(tmp_path, monkeypatch):
    """`mxq calibrate` asks the reader for the characters its windows need, not the whole file."""
    import mxq.eval.data as data

    seen = []
    real = data.load_texts
    monkeypatch.setattr(data, "load_texts", lambda ds, max_chars=None: seen.append(max_chars) or real(ds, max_chars))
    monkeypatch.setattr("mxq.hf.models.load_model", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("stop")))
    from mxq.calib.calibrator import CalibrationOptions
    from mxq.cli import run_calibration
    from mxq.recipe import load_recipe

    p = tmp_path / "c.txt"
    p.write_text("text " * 1000)
    with pytest.raises(RuntimeError, match="stop"):
        run_calibration(None, load_recipe("mxfp8"), CalibrationOptions(dataset=str(p), samples=8, seq_len=128))
    assert seen == [data.chars_for_tokens(8 * 128)]
