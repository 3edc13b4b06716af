import cProfile, pstats, io, json, os, time, torch, triton
import mxq
import mxq.attention as MA
from mxq.attention import MXFP8CacheLayer
from mxq.kernels.attention import mx_attention_decode
B, H, D = 4, 8, 128
out = {}
def bench(fn):
    fn(); torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=5, rep=50, return_mode="median") * 1e3
for s in (2048, 16384):
    k = torch.randn(B, H, s, D, device="cuda", dtype=torch.bfloat16); v = torch.randn_like(k)
    def fill():
        layer = MXFP8CacheLayer(); layer.update(k, v); return layer
    t_all = bench(fill); t_v = bench(lambda: MA._quantize_vt(v))
    out[f"update_{s}"] = dict(update_us=t_all, v_only_us=t_v)
    print(f"S={s}: cache update (prefill) {t_all:.1f} us, V pages alone {t_v:.1f} us", flush=True)
# eager per-call overhead of the decode launcher
q = torch.randn(4, 32, 1, D, device="cuda", dtype=torch.bfloat16)
layer = MXFP8CacheLayer(); k = torch.randn(4, 8, 4096, D, device="cuda", dtype=torch.bfloat16); layer.update(k, k)
args = (q, layer.k_data, layer.k_scale, layer.v_data, layer.v_scale, layer.length)
for _ in range(20): mx_attention_decode(*args, qk_rotation=True)
torch.cuda.synchronize(); t0 = time.perf_counter()
for _ in range(500): mx_attention_decode(*args, qk_rotation=True)
t_cpu = (time.perf_counter() - t0) / 500 * 1e6; torch.cuda.synchronize()
print(f"eager decode call, CPU side: {t_cpu:.1f} us per call", flush=True)
sdpa_q = q; kk = torch.randn(4, 8, 4096, D, device="cuda", dtype=torch.bfloat16)
for _ in range(20): torch.nn.functional.scaled_dot_product_attention(q, kk, kk, enable_gqa=True)
torch.cuda.synchronize(); t0 = time.perf_counter()
for _ in range(500): torch.nn.functional.scaled_dot_product_attention(q, kk, kk, enable_gqa=True)
t_sdpa = (time.perf_counter() - t0) / 500 * 1e6; torch.cuda.synchronize()
print(f"eager SDPA call, CPU side: {t_sdpa:.1f} us per call", flush=True)
out["eager_cpu_us"] = dict(mxfp8_decode=t_cpu, sdpa=t_sdpa)
pr = cProfile.Profile(); pr.enable()
for _ in range(300): mx_attention_decode(*args, qk_rotation=True)
pr.disable(); s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14); print(s.getvalue()[-3500:])
json.dump(out, open(os.environ["OUT"] + "/final4.json", "w"), indent=1)
