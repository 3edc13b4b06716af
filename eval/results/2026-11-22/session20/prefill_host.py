"""Session 20: host side of the 8B-shaped MXFP8 prefill (B=1, S=2048): issue time vs wall, cProfile.

    python prefill_host.py [layers]
"""
import cProfile
import io
import os
import pstats
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import mxq
from mxq.eval.bench_e2e import SHAPES

layers = int(sys.argv[1]) if len(sys.argv) > 1 else 4
cfg = LlamaConfig(**dict(SHAPES["llama3-8b"], num_hidden_layers=layers), tie_word_embeddings=False)
torch.manual_seed(0)
torch.set_default_dtype(torch.bfloat16)
with torch.device("cuda"):
    model = LlamaForCausalLM(cfg).eval()
torch.set_default_dtype(torch.float32)
ids = torch.randint(0, cfg.vocab_size, (1, 2048), device="cuda")


def times(n=5):
    issue, wall = [], []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        model(ids, use_cache=False)
        issue.append(time.perf_counter() - t)
        torch.cuda.synchronize()
        wall.append(time.perf_counter() - t)
    return sorted(issue)[n // 2] * 1e3, sorted(wall)[n // 2] * 1e3


for tag in ("bf16", "mxfp8"):
    if tag == "mxfp8":
        mxq.quantize_model(model, os.environ.get("RECIPE", "mxfp8"))
    with torch.inference_mode():
        model(ids, use_cache=False)
        i, w = times()
        print(f"== {tag}: {layers} layers, host issue {i:.2f} ms, wall {w:.2f} ms", flush=True)
        pr = cProfile.Profile()
        torch.cuda.synchronize()
        pr.enable()
        model(ids, use_cache=False)
        torch.cuda.synchronize()
        pr.disable()
    s = io.StringIO()
    st = pstats.Stats(pr, stream=s)
    st.sort_stats("tottime").print_stats(25)
    if tag == "mxfp8":
        st.sort_stats("cumulative").print_stats("mxq|kernels|launch|jit", 40)
    print(s.getvalue()[:14000], flush=True)
