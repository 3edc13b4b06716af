"""Fused pre-pass A/B (graph GPU time) + host cost. B=4 H=32 D=128 bf16, Q/K rotation on."""
import json, sys, time, torch, triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from mxq.kernels.attention import mx_attention_prefill
g = lambda f: (f(), torch.cuda.synchronize(), triton.testing.do_bench_cudagraph(f, rep=200, return_mode="median"))[2]
rows = []
for s in (1024, 4096, 16384):
    q, k, v = (torch.randn(4, 32, s, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for causal in (False, True):
        fl = 4 * 4 * 32 * s * s * 128 * (0.5 if causal else 1.0)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            fms = g(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal))
        r = {"S": s, "causal": causal, "flash": fl / fms / 1e9}
        for name, kw in (("two_launches", dict(fused_prep=False)), ("fused", dict(fused_prep=True)),
                         ("fused_128x64x8x3", dict(fused_prep=True, tile=(128, 64, 8, 3))), ("fast_fused", dict(fused_prep=True, exact=False))):
            r[name] = fl / g(lambda: mx_attention_prefill(q, k, v, causal=causal, qk_rotation=True, **kw)) / 1e9
        rows.append(r)
        print(" ".join(f"{kk}={vv:.0f}" if isinstance(vv, float) else f"{kk}={vv}" for kk, vv in r.items()), f"fused/flash={r['fused']/r['flash']:.2f}", flush=True)
q, k, v = (torch.randn(1, 4, 64, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for fused in (False, True):
    for _ in range(20): mx_attention_prefill(q, k, v, causal=True, qk_rotation=True, fused_prep=fused)
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(200): mx_attention_prefill(q, k, v, causal=True, qk_rotation=True, fused_prep=fused)
    torch.cuda.synchronize(); print(f"host cost fused={fused}: {(time.perf_counter()-t)/200*1e6:.1f} us per call")
json.dump(rows, open(sys.argv[1], "w"), indent=1)
