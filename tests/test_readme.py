"""Every ```python block of README.md runs as written, on the CPU, and raises nothing.

Each block runs in a fresh interpreter (a subprocess) whose working directory holds what the blocks
name: ``out/smollm2-mxfp8``, an MXFP8 checkpoint written by ``mxq.convert.converter.quantize_checkpoint``.
By default that checkpoint is a tiny Llama (2 layers, hidden 64) with a byte-level tokenizer, and
``default`` (the embedded SmolLM2-135M) is redirected to the tiny model's bf16 original by a few
lines run before the block, so the test takes seconds; ``MXQ_README_REAL=1`` runs the blocks as a
reader would, against the embedded model (``mxq quantize default``; minutes on a 2-core CPU).

A block whose preceding line is ``<!-- gpu-only -->`` is skipped without CUDA (none is today: the
blocks choose ``cuda`` when it is there and the CPU otherwise).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from cache_helpers import own_cache

README = Path(__file__).resolve().parent.parent / "README.md"
GPU_ONLY = "<!-- gpu-only -->"
REAL = os.environ.get("MXQ_README_REAL", "") == "1"
CHECKPOINT = "out/smollm2-mxfp8"  # what the README's blocks load


def python_blocks(text: str) -> list[tuple[int, str, bool]]:
    """(line number, code, gpu-only) of every fenced ```python block."""
    blocks, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        if re.fullmatch(r"\s*```python\s*", lines[i]):
            start, body = i + 1, []
            i += 1
            while i < len(lines) and not re.fullmatch(r"\s*```\s*", lines[i]):
                body.append(lines[i])
                i += 1
            prev = next((ln.strip() for ln in reversed(lines[: start - 1]) if ln.strip()), "")
            blocks.append((start, textwrap.dedent("\n".join(body)) + "\n", prev == GPU_ONLY))
        i += 1
    return blocks


BLOCKS = python_blocks(README.read_text(encoding="utf-8"))


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 2, [n for n, _, _ in BLOCKS]
    assert any(CHECKPOINT in code for _, code, _ in BLOCKS)


def _tiny_original(path: Path) -> Path:
    """A tiny bf16 Llama with a byte-level tokenizer (vocab 256), saved as a Hugging Face directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=1024,
                      tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> tuple[Path, str]:
    """(the directory the blocks run in, the code run before each block)."""
    from mxq.convert.converter import quantize_checkpoint

    root = tmp_path_factory.mktemp("readme")
    if REAL:
        quantize_checkpoint(None, root / CHECKPOINT, "mxfp8", progress=False)
        return root, ""
    original = _tiny_original(root / "tiny-bf16")
    quantize_checkpoint(original, root / CHECKPOINT, "mxfp8", progress=False)
    prefix = textwrap.dedent(f"""\
        import mxq.hf.models as mxq_models
        _resolve = mxq_models.resolve_source
        def _tiny_for_default(source=None):
            if source is None or str(source).lower() in mxq_models.DEFAULT_ALIASES:
                return _resolve({str(original)!r})
            return _resolve(source)
        mxq_models.resolve_source = _tiny_for_default
        """)
    return root, prefix


@pytest.mark.parametrize("line, code, gpu_only", BLOCKS, ids=[f"README.md:{n}" for n, _, _ in BLOCKS])
def test_readme_python_block_runs(workdir, line, code, gpu_only):
    if gpu_only and not torch.cuda.is_available():
        pytest.skip(f"README.md:{line} is marked {GPU_ONLY} and there is no CUDA device")
    root, prefix = workdir
    env = {**os.environ, "MXQ_CACHE": str(own_cache(root / f"mxq-cache-{line}")), "PYTHONWARNINGS": "ignore"}
    r = subprocess.run([sys.executable, "-c", prefix + code], cwd=root, env=env, capture_output=True, text=True,
                       timeout=3600 if REAL else 600)  # fmt: skip
    assert r.returncode == 0, f"README.md:{line} failed:\n{r.stderr[-4000:]}"
