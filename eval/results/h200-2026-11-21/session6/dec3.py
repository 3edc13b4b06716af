"""Session 6: eager (no graph) CPU time per decode call, kernel vs fused merge; and a short run for ncu."""
import json, os, sys, time, torch, triton
import mxq
import mxq.kernels.attention as A
from mxq.attention import MXFP8CacheLayer
b, hq, hkv, d = 4, 32, 8, 128
mode = sys.argv[1]
res = []
for n in ((16384,) if mode == "ncu" else (4096, 16384)):
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
    }
    for name, fn in fns.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        if mode == "ncu":
            continue
        t = time.perf_counter()
        for _ in range(300):
            fn()
        cpu = (time.perf_counter() - t) / 300 * 1e6
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / 300 * 1e6
        res.append(dict(n=n, impl=name, cpu_us_per_call=cpu, wall_us_per_call=wall))
        print(res[-1], flush=True)
if mode != "ncu":
    json.dump(res, open(os.environ["OUT"] + "/dec3_eager.json", "w"), indent=1)
