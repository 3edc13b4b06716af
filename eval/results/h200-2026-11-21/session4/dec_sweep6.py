"""Decode: V in [P, D, 32] pages vs rows of V^T; configs for the paged layout."""
import json, os, sys, torch, triton
import mxq
from mxq.attention import MXFP8CacheLayer
from mxq.kernels.attention import mx_attention_decode, mx_attention_reference
b, hq, hkv, d = 4, 32, 8, 128
res = []
def bench(fn):
    fn(); torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3
def rel(a, b): return ((a.double() - b.double()).norm() / b.double().norm()).item()
CFGS = [(64, 2, 3), (64, 2, 4), (64, 2, 2), (32, 2, 3), (64, 4, 3), (128, 4, 3), (128, 4, 2)]
PROGS = (264, 528, 1056)
for n in [int(x) for x in sys.argv[1:]] or (16384, 4096):
    torch.manual_seed(0)
    q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16)
    layer = MXFP8CacheLayer(); layer.update(k, v)
    kd, vd = layer.dequantize()
    c = layer.v_data.shape[-1]
    vp = layer.v_data.view(b, hkv, d, c // 32, 32).permute(0, 1, 3, 2, 4).contiguous()
    vsp = layer.v_scale.transpose(2, 3).contiguous()
    want = mx_attention_reference(q.float(), kd, vd, qk_rotation=True, k_rotated=True).float()
    sdpa = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    cl = (q, layer.k_data, layer.k_scale, layer.v_data, layer.v_scale, n)
    pg = (q, layer.k_data, layer.k_scale, vp, vsp, n)
    t_cl = bench(lambda: mx_attention_decode(*cl, qk_rotation=True))
    t_pg = bench(lambda: mx_attention_decode(*pg, qk_rotation=True))
    e_pg = rel(mx_attention_decode(q.float(), *pg[1:], qk_rotation=True), want)
    print(f"n={n} sdpa {sdpa:.1f}  rows-of-Vt {t_cl:.1f} ({sdpa/t_cl:.2f}x)  pages {t_pg:.1f} ({sdpa/t_pg:.2f}x) err {e_pg:.1e}", flush=True)
    res.append(dict(n=n, sdpa=sdpa, rows=t_cl, pages=t_pg, err=e_pg))
    rows = []
    for (bn, w, st) in CFGS:
        for progs in PROGS:
            chunk = max(bn, triton.cdiv(triton.cdiv(n, max(1, progs // (b * hkv))), bn) * bn)
            kw = dict(block_n=bn, chunk=chunk, num_warps=w, num_stages=st, qk_rotation=True)
            try:
                us = bench(lambda: mx_attention_decode(*pg, **kw))
                e = rel(mx_attention_decode(q.float(), *pg[1:], **kw), want)
            except Exception as ex:
                print("fail", kw, type(ex).__name__, str(ex)[:90]); continue
            rows.append((us, e, progs, kw)); res.append(dict(n=n, us=us, err=e, sdpa=sdpa, progs=progs, layout="pages", **kw))
    rows.sort(key=lambda t: t[0])
    for us, e, p, kw in rows[:6]:
        print(f"  {us:.1f} us x{sdpa/us:.2f} err {e:.1e} progs {p} {kw}", flush=True)
    json.dump(res, open(os.environ["OUT"] + "/dec_sweep6.json", "w"), indent=1)
