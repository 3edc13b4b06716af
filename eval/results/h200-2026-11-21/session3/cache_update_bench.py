"""MXFP8Cache prefill update on CUDA: V pages quantized in one pass (shipped) vs the old route
(rows of Vᵀ through the generic row quantizer). Printed results: cache_update.txt beside this file.

    python eval/results/h200-2026-11-21/session3/cache_update_bench.py
"""

# ruff: noqa: B023  (each lambda is timed at once, inside its loop iteration)
import torch
import triton

import mxq.attention as A
from mxq.attention import MXFP8CacheLayer

B, H, D = 4, 8, 128


def bench(fn):
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=5, rep=50, return_mode="median") * 1e3


def filled(k, v, quantize_vt):
    A._quantize_vt = quantize_vt
    layer = MXFP8CacheLayer()
    layer.update(k, v)
    A._quantize_vt = new
    return layer


new = A._quantize_vt


def old(v):
    return A._quantize_rows(v.transpose(-1, -2))


for s in (2048, 16384):
    k = torch.randn(B, H, s, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    res = {}
    for name, fn in (("old", old), ("new", new)):
        res[name] = bench(lambda: filled(k, v, fn))
        res[name + "_vonly"] = bench(lambda: fn(v))
    a, b = filled(k, v, new), filled(k, v, old)
    same = torch.equal(a.v_data.view(torch.uint8), b.v_data.view(torch.uint8)) and torch.equal(a.v_scale, b.v_scale)
    mb = B * H * s * D * 2 / 1e6
    print(
        f"S={s}: cache update (prefill) old {res['old']:.1f} us, new {res['new']:.1f} us; V quantize alone "
        f"old {res['old_vonly']:.1f} us new {res['new_vonly']:.1f} us ({mb / res['new_vonly'] * 1e3:.0f} GB/s read); "
        f"bytes equal: {same}"
    )
