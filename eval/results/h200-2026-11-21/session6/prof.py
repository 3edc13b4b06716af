import cProfile, pstats, io, os, torch
import mxq
import mxq.kernels.attention as A
from mxq.attention import MXFP8CacheLayer
b, hq, hkv, d, n = 4, 32, 8, 128, 4096
q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
k = torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16)
v = torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16)
layer = MXFP8CacheLayer(); layer.update(k, v)
args = (q, layer.k_data, layer.k_scale, layer.v_data, layer.v_scale, n)
cnt = layer.decode_counters()
f = lambda: A.mx_attention_decode(*args, qk_rotation=True, counters=cnt)
for _ in range(50): f()
torch.cuda.synchronize()
pr = cProfile.Profile(); pr.enable()
for _ in range(1000): f()
pr.disable(); torch.cuda.synchronize()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25); print(s.getvalue()[:6000])
