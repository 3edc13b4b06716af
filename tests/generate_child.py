"""One fresh process of tests/test_e2e.py::test_gpu_generate_8b_widths: a Llama with Llama-3-8B
widths and 2 layers (random bf16 weights), ``mxq.quantize_model(model, "mxfp8")`` right after
building it, then what a user runs: ``generate(cache_implementation="static")`` (inductor,
CUDA-graph trees) and the default ``generate()``, greedy, at one batch size. The reference is the
same model on the torch reference path (``mxq.set_kernels(model, "reference")``), eager, dynamic cache.

Prints one JSON line: the three token tensors; for each fast run, where it first leaves the
reference in each row and the reference's logit margin there (top-1 minus the chosen token,
teacher-forced on the common prefix); and the largest difference between the fast and the
reference logits on the reference's tokens, so the test can tell a near tie from a wrong result.
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import mxq


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--prompt", type=int, default=24)
    p.add_argument("--new", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--kept-in-pool", action="store_true",
                   help="A/B: make kept buffers on the calling thread, as before kernels/buffers.py")
    a = p.parse_args()
    if a.kept_in_pool:
        from mxq.kernels import attention_rotate, buffers, gemm_prefill_ws
        from mxq.runtime import attention as mx_attention

        def in_caller_thread(make, device):
            return None if device.type == "cuda" and torch.cuda.is_current_stream_capturing() else make()

        for mod in (attention_rotate, buffers, gemm_prefill_ws, mx_attention):  # buffers: the split-K tickets
            mod.persistent = in_caller_thread
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=a.vocab, max_position_embeddings=2048,
                      tie_word_embeddings=False)  # fmt: skip
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():  # a random model's logits are nearly flat: spread them so argmax has margins
        model.lm_head.weight.mul_(16)
    mxq.quantize_model(model, "mxfp8")
    g = torch.Generator().manual_seed(100 + a.batch)
    ids = torch.randint(0, a.vocab, (a.batch, a.prompt), generator=g).cuda()
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=a.new, min_new_tokens=a.new, do_sample=False,
              pad_token_id=0)  # fmt: skip
    with torch.no_grad():
        static = model.generate(ids, cache_implementation="static", **kw)
        dynamic = model.generate(ids, **kw)
        mxq.set_kernels(model, "reference")
        ref = model.generate(ids, **kw)

        def divergence(seq):
            out = []
            for row in range(a.batch):
                diff = (seq[row, a.prompt :] != ref[row, a.prompt :]).nonzero()
                if not len(diff):
                    out.append(None)
                    continue
                t = a.prompt + int(diff[0])
                logits = model(ref[row : row + 1, :t]).logits[0, -1].float()
                out.append({"step": t - a.prompt, "margin": float(logits.max() - logits[seq[row, t]]),
                            "top1": float(logits.max())})  # fmt: skip
            return out

        # the fast path's own logit error on the reference tokens (teacher-forced): how far apart
        # the two paths are at any position, the noise a near tie must be judged against
        ref_logits = model(ref).logits.float()
        mxq.set_kernels(model, None)
        fast_logits = model(ref).logits.float()
        report = {
            "logit_err": float((fast_logits - ref_logits).abs().max()),
            "logit_max": float(ref_logits.abs().max()),
            "batch": a.batch,
            "static": static.tolist(),
            "dynamic": dynamic.tolist(),
            "reference": ref.tolist(),
            "static_divergence": divergence(static),
            "dynamic_divergence": divergence(dynamic),
        }
    print("RESULT " + json.dumps(report))


if __name__ == "__main__":
    main()
