"""Session 20: where the 8B-shaped prefill goes (B=1, S=2048), bf16 vs MXFP8, by kernel (torch.profiler).

Llama-3-8B layer shapes with fewer layers (argv[1], default 4), random weights, one warm-up forward,
then one profiled forward; also the wall time of 5 forwards and the same with MXQ_PREFILL_RS=0
semantics is not switchable in-process, so run twice with the env var for that A/B.

    python prefill_prof.py [layers]
"""
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile
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


def wall(n=5):
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        model(ids, use_cache=False)
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[n // 2] * 1e3


def prof(tag):
    with torch.inference_mode():
        model(ids, use_cache=False)
        ms = wall()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            model(ids, use_cache=False)
            torch.cuda.synchronize()
    print(f"== {tag}: forward {ms:.2f} ms (median of 5), {layers} layers; env MXQ_PREFILL_RS={os.environ.get('MXQ_PREFILL_RS', '1')}")
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=90))


prof("bf16")
mxq.quantize_model(model, os.environ.get("RECIPE", "mxfp8"))
prof("mxfp8")
from mxq.kernels import dispatch as Dp  # noqa: E402
for n, k in ((4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)):
    print("path M=2048", n, k, Dp.path_name(2048, n, k, torch.device("cuda"), w8a8=True))
