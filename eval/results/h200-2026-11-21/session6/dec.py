# dec_p135.json / dec_p128.json: commit 545dfc5 (merge in chunks of 4 splits); dec_p135b.json: 851fe59 (one step per 16 splits).
"""Session 6: decode with the split merge fused into the decode kernel vs the merge kernel."""
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
res = dict(ptxas=str(toolchain.triton_ptxas()), rows=[], sweep=[])
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
    row["kernel_merge"] = bench(lambda: A.mx_attention_decode(*args, qk_rotation=True, merge="kernel"))
    row["fused"] = bench(lambda: A.mx_attention_decode(*args, qk_rotation=True, counters=cnt))
    row["fused_zeros_per_call"] = bench(lambda: A.mx_attention_decode(*args, qk_rotation=True))
    row["fused_norot"] = bench(lambda: A.mx_attention_decode(*args, qk_rotation=False, counters=cnt))
    row["err_fused"] = rel(A.mx_attention_decode(*args, qk_rotation=True, counters=cnt), want)
    row["err_kernel"] = rel(A.mx_attention_decode(*args, qk_rotation=True, merge="kernel"), want)
    row["counters_zero"] = int(cnt.abs().sum().item()) == 0
    row["speedup_fused"] = row["sdpa"] / row["fused"]
    print({k_: (round(v_, 3) if isinstance(v_, float) else v_) for k_, v_ in row.items()}, flush=True)
    res["rows"].append(row)
    if n in (4096, 16384, 32768) and "nosweep" not in sys.argv:
        for st in (2, 3, 4):
            for progs in (264, 396, 528, 792, 1056):
                chunk = max(64, triton.cdiv(triton.cdiv(n, max(1, progs // (b * hkv))), 64) * 64)
                kw = dict(block_n=64, num_warps=2, num_stages=st, chunk=chunk, qk_rotation=True)
                us = bench(lambda: A.mx_attention_decode(*args, counters=cnt, **kw))
                e = rel(A.mx_attention_decode(*args, counters=cnt, **kw), want)
                res["sweep"].append(dict(n=n, stages=st, progs=progs, chunk=chunk, us=us, err=e))
                print(f"  n={n} st={st} progs={progs} chunk={chunk}: {us:.2f} us err {e:.1e}", flush=True)
    json.dump(res, open(os.environ["OUT"] + f"/dec_{tag}.json", "w"), indent=1)
