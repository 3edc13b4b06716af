# Ran at commit 854904c (the LAZY_Q variant, removed in b05d453): see kernels/NOTES.md "Session 6".
"""Session 6: decode, query operand built lazily (first K/V tiles in flight first) x merge fused/kernel."""
import json, os, sys, torch, triton
import mxq
import mxq.kernels.attention as A
from mxq.kernels import toolchain
from mxq.attention import MXFP8CacheLayer
from mxq.kernels.reference import mx_attention_reference
tag = sys.argv[1]
b, hq, hkv, d = 4, 32, 8, 128
def bench(fn):
    fn(); torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median") * 1e3
def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()
res = dict(ptxas=str(toolchain.triton_ptxas()), rows=[])
print(tag, res["ptxas"], flush=True)
for n in (1024, 4096, 8192, 16384, 32768):
    torch.manual_seed(0)
    q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16)
    layer = MXFP8CacheLayer(); layer.update(k, v)
    kd, vd = layer.dequantize()
    want = mx_attention_reference(q.float(), kd, vd, qk_rotation=True, k_rotated=True)
    args = (q, layer.k_data, layer.k_scale, layer.v_data, layer.v_scale, n)
    cnt = layer.decode_counters()
    row = dict(n=n)
    row["sdpa"] = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    for lazy in (False, True):
        for merge in ("kernel", "fused"):
            for st in (3, 4):
                kw = dict(qk_rotation=True, merge=merge, counters=cnt, lazy_q=lazy, num_stages=st)
                name = f"{'lazy' if lazy else 'eager'}_{merge}_s{st}"
                row[name] = bench(lambda: A.mx_attention_decode(*args, **kw))
                row["err_" + name] = rel(A.mx_attention_decode(*args, **kw), want)
    row["lazy_fused_norot"] = bench(lambda: A.mx_attention_decode(*args, qk_rotation=False, counters=cnt, lazy_q=True))
    print({k_: (round(v_, 2) if isinstance(v_, float) and not k_.startswith("err") else v_) for k_, v_ in row.items() if not k_.startswith("err")}, flush=True)
    print("  max err", max(v_ for k_, v_ in row.items() if k_.startswith("err")), flush=True)
    res["rows"].append(row)
    json.dump(res, open(os.environ["OUT"] + f"/dec2_{tag}.json", "w"), indent=1)
