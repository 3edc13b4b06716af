import json, os, torch, triton
import mxq
import mxq.kernels.attention as A
from mxq.attention import MXFP8CacheLayer
from mxq.kernels.attention import mx_attention_reference
b, hq, hkv, d = 4, 32, 8, 128
def bench(fn, graph=True):
    fn(); torch.cuda.synchronize()
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median") * 1e3
    return triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median") * 1e3
def rel(a, b): return ((a.double() - b.double()).norm() / b.double().norm()).item()
res = []
for n in (1024, 4096, 16384, 32768):
    torch.manual_seed(0)
    q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16)
    layer = MXFP8CacheLayer(); layer.update(k, v)
    kd, vd = layer.dequantize()
    want = mx_attention_reference(q.float(), kd, vd, qk_rotation=True, k_rotated=True).float()
    args = (q, layer.k_data, layer.k_scale, layer.v_data, layer.v_scale, n)
    row = dict(n=n)
    for rep in range(2):
        row[f"sdpa{rep}"] = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        for pdl in (True, False):
            A.PDL_MERGE = pdl
            row[f"pdl{int(pdl)}_{rep}"] = bench(lambda: A.mx_attention_decode(*args, qk_rotation=True))
            row[f"pdl{int(pdl)}_eager{rep}"] = bench(lambda: A.mx_attention_decode(*args, qk_rotation=True), graph=False)
    A.PDL_MERGE = True
    row["err_pdl"] = rel(A.mx_attention_decode(q.float(), *args[1:], qk_rotation=True), want)
    g = torch.cuda.CUDAGraph()
    out = torch.empty(b, 1, hq, d, device="cuda", dtype=torch.float32).transpose(1, 2)
    qf = q.float()
    A.mx_attention_decode(qf, *args[1:], qk_rotation=True, out=out); torch.cuda.synchronize()
    with torch.cuda.graph(g):
        A.mx_attention_decode(qf, *args[1:], qk_rotation=True, out=out)
    out.zero_(); g.replay(); torch.cuda.synchronize()
    row["err_pdl_graph"] = rel(out, want)
    print({k: round(v, 2) if isinstance(v, float) and v > 1e-3 else v for k, v in row.items()}, flush=True)
    res.append(row)
json.dump(res, open(os.environ["OUT"] + "/dec_pdl.json", "w"), indent=1)
