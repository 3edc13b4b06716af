import json, os, torch, triton
import mxq
import mxq.kernels.attention as A
from mxq.attention import MXFP8CacheLayer
b, hq, hkv, d = 4, 32, 8, 128
def bench(fn):
    fn(); torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median") * 1e3
res = []
for n in (1024, 4096, 16384, 32768):
    torch.manual_seed(0)
    q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16)
    layer = MXFP8CacheLayer(); layer.update(k, v)
    args = (q, layer.k_data, layer.k_scale, layer.v_data, layer.v_scale, n)
    row = dict(n=n)
    for rep in range(2):
        row[f"sdpa{rep}"] = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        A.FACTORED_ROTATION = True
        row[f"factored{rep}"] = bench(lambda: A.mx_attention_decode(*args, qk_rotation=True))
        A.FACTORED_ROTATION = False
        row[f"fullR{rep}"] = bench(lambda: A.mx_attention_decode(*args, qk_rotation=True))
        A.FACTORED_ROTATION = True
        row[f"norot{rep}"] = bench(lambda: A.mx_attention_decode(*args, qk_rotation=False))
    print({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    res.append(row)
json.dump(res, open(os.environ["OUT"] + "/dec_ab.json", "w"), indent=1)
