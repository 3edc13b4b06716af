"""Eager (no CUDA graph) cost per decode call: interleaved batches, min per-call wall time (CPU-bound)."""
import json, os, time, torch
import mxq
import mxq.kernels.attention as A
from mxq.attention import MXFP8CacheLayer
b, hq, hkv, d = 4, 32, 8, 128
res = []
for n in (1024, 4096, 16384):
    torch.manual_seed(0)
    q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16)
    layer = MXFP8CacheLayer(); layer.update(k, v)
    args = (q, layer.k_data, layer.k_scale, layer.v_data, layer.v_scale, n)
    cnt = layer.decode_counters()
    fns = {
        "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        "kernel": lambda: A.mx_attention_decode(*args, qk_rotation=True, merge="kernel"),
        "fused": lambda: A.mx_attention_decode(*args, qk_rotation=True, merge="fused", counters=cnt),
        "default": lambda: A.mx_attention_decode(*args, qk_rotation=True, counters=cnt),
    }
    best = {k_: 1e9 for k_ in fns}
    for fn in fns.values():
        for _ in range(20):
            fn()
    for rep in range(7):
        for name, fn in fns.items():
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(200):
                fn()
            torch.cuda.synchronize()
            best[name] = min(best[name], (time.perf_counter() - t) / 200 * 1e6)
    row = dict(n=n, **{f"{k_}_us": round(v_, 1) for k_, v_ in best.items()})
    print(row, flush=True); res.append(row)
json.dump(res, open(os.environ["OUT"] + "/eager.json", "w"), indent=1)
