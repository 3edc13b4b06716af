import torch, triton
import mxq
import mxq.attention as MA
from mxq.attention import MXFP8CacheLayer
B, H, D = 4, 8, 128
def bench(fn):
    fn(); torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3
for rep in range(2):
    for s in (16384, 2048):
        k = torch.randn(B, H, s, D, device="cuda", dtype=torch.bfloat16); v = torch.randn_like(k)
        def fill():
            layer = MXFP8CacheLayer(); layer.update(k, v); return layer
        t_all = bench(fill)
        t_g = triton.testing.do_bench_cudagraph(fill, rep=100, return_mode="median") * 1e3
        print(f"rep {rep} S={s}: cache update {t_all:.1f} us (CUDA graph {t_g:.1f} us)", flush=True)
