"""Decode: scale prefetch (new) vs old kernel; register cap x programs per SM x stages x block_n."""
import json, os, sys, torch, triton, importlib.util
import mxq
from mxq.attention import MXFP8CacheLayer
from mxq.kernels.attention import mx_attention_decode, mx_attention_reference
spec = importlib.util.spec_from_file_location("attention_old", ".data/attention_old.py")
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
b, hq, hkv, d = 4, 32, 8, 128
res = []
def bench(fn):
    fn(); torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3
def rel(a, b): return ((a.double() - b.double()).norm() / b.double().norm()).item()
CFGS = [(bn, 2, st, r) for bn in (64, 32) for st in (3, 4) for r in (None, 168, 128)]
PROGS = (528, 792, 1056)
for n in [int(x) for x in sys.argv[1:]] or (16384, 4096):
    torch.manual_seed(0)
    q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16)
    layer = MXFP8CacheLayer(); layer.update(k, v)
    kd, vd = layer.dequantize()
    want = mx_attention_reference(q.float(), kd, vd, qk_rotation=True, k_rotated=True).float()
    sdpa = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    args = (q, layer.k_data, layer.k_scale, layer.v_data, layer.v_scale, n)
    olddef = bench(lambda: old.mx_attention_decode(*args, qk_rotation=True))
    dflt = bench(lambda: mx_attention_decode(*args, qk_rotation=True))
    err = rel(mx_attention_decode(q.float(), *args[1:], qk_rotation=True), want)
    print(f"n={n} sdpa {sdpa:.1f} old default {olddef:.1f} ({sdpa/olddef:.2f}x)  new default {dflt:.1f} ({sdpa/dflt:.2f}x) err {err:.1e}", flush=True)
    res.append(dict(n=n, sdpa=sdpa, old_default=olddef, new_default=dflt, err=err))
    rows = []
    for (bn, w, st, r) in CFGS:
        for progs in PROGS:
            chunk = max(bn, triton.cdiv(triton.cdiv(n, max(1, progs // (b * hkv))), bn) * bn)
            kw = dict(block_n=bn, chunk=chunk, num_warps=w, num_stages=st, maxnreg=r, qk_rotation=True)
            try:
                us = bench(lambda: mx_attention_decode(*args, **kw))
                e = rel(mx_attention_decode(q.float(), *args[1:], **kw), want)
            except Exception as ex:
                print("fail", kw, type(ex).__name__, str(ex)[:90]); continue
            rows.append((us, e, progs, kw)); res.append(dict(n=n, us=us, err=e, sdpa=sdpa, progs=progs, **kw))
    rows.sort(key=lambda t: t[0])
    for us, e, p, kw in rows[:8]:
        print(f"  {us:.1f} us x{sdpa/us:.2f} err {e:.1e} progs {p} {kw}", flush=True)
    json.dump(res, open(os.environ["OUT"] + "/dec_sweep5.json", "w"), indent=1)
