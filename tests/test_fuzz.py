"""Random damage to a valid tiny checkpoint, fed to `mxq inspect`, `mxq.load` and the converter.

Mutations: shard header bytes and fields (dtype, shape, offsets, entries), data bytes, the index's
weight_map, config.json (quantization_config keys and layer specs, model keys, its raw text) and,
for the converter, the recipe YAML. Every outcome must be success or one line: an error of mxq's
own (``CheckpointError``, ``ConversionError``, ``RecipeError``, or a ``ValueError`` raised by mxq's
code), or `mxq inspect` exiting 1 with one line naming the checkpoint -- never another exception
type, a traceback, a hang (each example has a deadline), or a file written outside OUT.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import tempfile
import traceback
from pathlib import Path

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from cli_helpers import run_cli  # noqa: E402
from hypothesis import HealthCheck, Phase, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import mxq  # noqa: E402
from mxq.checkpoint.files import CheckpointError  # noqa: E402
from mxq.convert.converter import ConversionError, quantize_checkpoint  # noqa: E402
from mxq.recipe import RecipeError  # noqa: E402

MXQ_DIRS = tuple(str(Path(p).resolve()) for p in (Path(mxq.__file__).parent, Path(mxq.__file__).parent.parent / "eval"))
PROJECT_ERRORS = (CheckpointError, ConversionError, RecipeError)
FUZZ = settings(
    max_examples=int(os.environ.get("MXQ_FUZZ_EXAMPLES", 100)),  # more for a longer hunt
    deadline=None, derandomize=True, database=None,  # a loaded machine is slow, not wrong
    phases=[Phase.explicit, Phase.generate],  # no shrinking: a failure is reported as drawn, in seconds
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)  # fmt: skip

RECIPE = """name: fuzz
description: a recipe to damage
block_size: 32
weights: {elem: e4m3, scale_rule: rceil}
activations: {elem: e4m3, scale_rule: rceil, dynamic: true}
include: ["*"]
exclude: [lm_head]
"""

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8)
    | st.sampled_from(["e4m3", "e5m2", "rceil", "mse", "u8", "e8m0", "mxq", "mxfp8", "32", "LlamaForCausalLM"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)  # fmt: skip
DTYPES = st.sampled_from(["U8", "I8", "BF16", "F32", "F8_E4M3", "F8_E5M2", "F8_E8M0", "BOOL", "X9", 7])


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A tiny bf16 model, its recipe, and its mxq checkpoint in two shards (so it has an index)."""
    root = tmp_path_factory.mktemp("fuzz")
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=64, tie_word_embeddings=False)  # fmt: skip
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(root / "src", max_shard_size="40KB")
    (root / "recipe.yaml").write_text(RECIPE)
    quantize_checkpoint(root / "src", root / "q", root / "recipe.yaml", progress=False, max_shard_bytes=30_000)
    assert len(list((root / "q").glob("*.safetensors"))) > 1 and len(list((root / "src").glob("*.safetensors"))) > 1
    return root


# --- mutations -----------------------------------------------------------------------------------


def _split(f: Path) -> tuple[dict, bytes]:
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _join(f: Path, header: dict, data: bytes) -> None:
    h = json.dumps(header).encode()
    f.write_bytes(struct.pack("<Q", len(h)) + h + data)


def _flip(data, raw: bytes, what: str) -> bytes:
    """Overwrite, insert or cut bytes of ``raw`` at random."""
    if not raw:
        return raw
    kind = data.draw(st.sampled_from(["set", "cut", "insert"]), label=f"{what} byte edit")
    i = data.draw(st.integers(0, len(raw) - 1), label=f"{what} offset")
    if kind == "cut":
        return raw[:i]
    b = bytes([data.draw(st.integers(0, 255), label=f"{what} byte")])
    return raw[:i] + b + raw[i + (kind == "set") :]


def mutate_shard(data, d: Path) -> None:
    f = data.draw(st.sampled_from(sorted(d.glob("*.safetensors"))), label="shard")
    kind = data.draw(st.sampled_from(["raw header", "data byte", "dtype", "shape", "offsets", "drop", "metadata"]), label="shard edit")
    try:
        header, blob = _split(f)
        assert isinstance(header, dict) and any(k != "__metadata__" for k in header)
    except Exception:  # noqa: BLE001 - damaged by an earlier edit: damage it further byte-wise
        kind = "raw header"
    if kind == "raw header":
        raw = f.read_bytes()
        n = struct.unpack("<Q", raw[:8])[0] if len(raw) >= 8 else len(raw)
        head = _flip(data, raw[: 8 + n], "header")
        f.write_bytes(head + raw[8 + n :] if len(head) == 8 + n else head)
        return
    names = sorted(k for k in header if k != "__metadata__")
    name = data.draw(st.sampled_from(names), label="tensor")
    e = header[name]
    if kind == "data byte":
        try:
            b, end = e["data_offsets"]
            assert 0 <= b < end <= len(blob)
        except Exception:  # noqa: BLE001 - an entry an earlier edit damaged: any data byte
            b, end = 0, len(blob)
        if end > b:
            i = data.draw(st.integers(b, end - 1), label="data offset")
            blob = blob[:i] + bytes([data.draw(st.sampled_from([0x7F, 0xFF, 0x7C, 0xFC, 0x7E, 0x00, 0x41]), label="byte")]) + blob[i + 1 :]
    elif kind == "dtype":
        e["dtype"] = data.draw(DTYPES, label="dtype")
    elif kind == "shape":
        e["shape"] = data.draw(st.lists(st.integers(-1, 200), max_size=3) | JSON_VALUES, label="shape")
    elif kind == "offsets":
        e["data_offsets"] = data.draw(st.lists(st.integers(-5, len(blob) + 5), min_size=2, max_size=2) | JSON_VALUES, label="offsets")
    elif kind == "drop":
        del header[name]
    else:
        header["__metadata__"] = data.draw(JSON_VALUES, label="metadata")
    _join(f, header, blob)


def mutate_index(data, d: Path) -> None:
    idx = d / "model.safetensors.index.json"
    kind = data.draw(st.sampled_from(["drop", "repoint", "add", "replace", "raw"]), label="index edit")
    try:
        doc = json.loads(idx.read_text())
        wm = doc["weight_map"]
        assert isinstance(wm, dict) and wm and all(isinstance(v, str) for v in wm.values())
    except Exception:  # noqa: BLE001 - damaged by an earlier edit
        kind = "raw"
    if kind == "raw":
        idx.write_bytes(_flip(data, idx.read_bytes(), "index"))
        return
    name = data.draw(st.sampled_from(sorted(wm)), label="entry")
    if kind == "drop":
        del wm[name]
    elif kind == "repoint":
        wm[name] = data.draw(st.sampled_from(sorted(set(wm.values())) + ["../outside.safetensors", "/etc/passwd", "nope.safetensors", "."]), label="shard")
    elif kind == "add":
        wm[name + ".extra"] = wm[name]
    else:
        doc["weight_map"] = data.draw(JSON_VALUES, label="weight_map")
    idx.write_text(json.dumps(doc))


QC_KEYS = ["quant_method", "format_version", "block_size", "scale_dtype", "layers", "ignore", "attention", "recipe",
           "provenance", "tied", "to_dict", "_x", "extra"]  # fmt: skip
MODEL_KEYS = ["hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size", "num_attention_heads",
              "architectures", "model_type", "tie_word_embeddings", "torch_dtype", "quantization_config"]  # fmt: skip


def mutate_config(data, d: Path) -> None:
    p = d / "config.json"
    try:
        cfg = json.loads(p.read_text())
        qc = cfg.get("quantization_config")
        ok = isinstance(qc, dict) and qc and isinstance(qc.get("layers"), dict) and qc["layers"]
        kinds = ["qc key", "qc drop", "layer", "model key", "raw"] if ok else ["model key", "raw"]
    except Exception:  # noqa: BLE001 - damaged by an earlier edit
        kinds = ["raw"]
    kind = data.draw(st.sampled_from(kinds), label="config edit")
    if kind == "raw":
        p.write_bytes(_flip(data, p.read_bytes(), "config"))
        return
    if kind == "qc key":
        qc[data.draw(st.sampled_from(QC_KEYS), label="key")] = data.draw(JSON_VALUES, label="value")
    elif kind == "qc drop":
        qc.pop(data.draw(st.sampled_from(sorted(qc)), label="key"))
    elif kind == "layer":
        name = data.draw(st.sampled_from(sorted(qc["layers"])), label="layer")
        part = data.draw(st.sampled_from(["weights", "activations", None]), label="part")
        spec = qc["layers"][name]
        if part is None or not isinstance(spec, dict):
            qc["layers"][name] = data.draw(JSON_VALUES, label="spec")
        else:
            key = data.draw(st.sampled_from(["elem", "scale_rule", None]), label="spec key")
            if key is None or not isinstance(spec.get(part), dict):
                spec[part] = data.draw(JSON_VALUES, label="value")
            else:
                spec[part][key] = data.draw(JSON_VALUES, label="value")
    else:
        cfg[data.draw(st.sampled_from(MODEL_KEYS), label="model key")] = data.draw(JSON_VALUES, label="value")
    p.write_text(json.dumps(cfg))


def mutate_recipe(data, recipe: Path) -> None:
    import yaml

    try:
        doc = yaml.safe_load(recipe.read_text())
        raw = not isinstance(doc, dict) or data.draw(st.booleans(), label="raw recipe")
    except Exception:  # noqa: BLE001 - damaged by an earlier edit
        raw = True
    if raw:
        recipe.write_bytes(_flip(data, recipe.read_bytes(), "recipe"))
        return
    key = data.draw(st.sampled_from(sorted(doc) + ["unknown"]), label="recipe key")
    doc[key] = data.draw(JSON_VALUES, label="recipe value")
    recipe.write_text(yaml.safe_dump(doc))


# --- outcomes ------------------------------------------------------------------------------------


def _files(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def _check_error(e: BaseException) -> None:
    """One line, and an error mxq raised on purpose: one of its classes, or a ValueError from its code."""
    msg = str(e)
    ours = isinstance(e, PROJECT_ERRORS) or (
        type(e) in (ValueError, FileNotFoundError) and str(Path(traceback.extract_tb(e.__traceback__)[-1].filename).resolve()).startswith(MXQ_DIRS)
    )
    if not ours or "\n" in msg or not msg.strip():
        raise AssertionError(f"not a one-line mxq error: {type(e).__name__}: {msg[:500]}") from e


@contextlib.contextmanager
def _work(pristine: Path, *names: str):
    with tempfile.TemporaryDirectory(dir=pristine) as tmp:
        tmp = Path(tmp)
        for n in names:
            if (pristine / n).is_dir():
                shutil.copytree(pristine / n, tmp / n)
            else:
                shutil.copy(pristine / n, tmp / n)
        yield tmp


def _damage(data, d: Path) -> None:
    for _ in range(data.draw(st.integers(1, 2), label="edits")):
        data.draw(st.sampled_from([mutate_shard, mutate_index, mutate_config]), label="what")(data, d)


@FUZZ
@given(data=st.data())
def test_inspect_survives_damage(pristine, data):
    with _work(pristine, "q") as tmp:
        d = tmp / "q"
        _damage(data, d)
        before = _files(tmp)
        rc, err = run_cli(["inspect", str(d)])
        lines = err.strip().splitlines()
        assert rc in (0, 1), (rc, err[-2000:])
        event(f"inspect exit {rc}")
        if rc == 1:
            assert len(lines) == 1 and lines[0].startswith("mxq: error: ") and str(d) in lines[0], err[-2000:]
        assert _files(tmp) == before


@FUZZ
@given(data=st.data())
def test_load_survives_damage(pristine, data):
    with _work(pristine, "q") as tmp:
        d = tmp / "q"
        _damage(data, d)
        before = _files(tmp)
        try:
            model = mxq.load(d)
        except Exception as e:  # noqa: BLE001 - what is raised is the point
            _check_error(e)
            event(f"load refused: {type(e).__name__}")
        else:  # loaded: no quantized weight holds a NaN (a large scale may overflow to inf: E8M0 allows 2**127)
            event("loaded")
            for m in mxq.runtime.linear.mx_layers(model).values():
                assert not torch.isnan(m.dequantized_weight()).any()
        assert _files(tmp) == before


@FUZZ
@given(data=st.data())
def test_converter_survives_damage(pristine, data):
    with _work(pristine, "src", "recipe.yaml") as tmp:
        src, recipe, out = tmp / "src", tmp / "recipe.yaml", tmp / "out"
        for _ in range(data.draw(st.integers(1, 2), label="edits")):
            what = data.draw(st.sampled_from([mutate_shard, mutate_index, mutate_config, mutate_recipe]), label="what")
            what(data, recipe) if what is mutate_recipe else what(data, src)
        before = _files(tmp)
        try:
            quantize_checkpoint(src, out, recipe, progress=False)
        except Exception as e:  # noqa: BLE001
            _check_error(e)
            event(f"conversion refused: {type(e).__name__}")
            assert not out.exists()
        else:
            event("converted")
        after = _files(tmp)
        assert {k: v for k, v in after.items() if not k.startswith(str(out) + "/")} == before
        assert not [p for p in tmp.iterdir() if ".mxq-" in p.name]
