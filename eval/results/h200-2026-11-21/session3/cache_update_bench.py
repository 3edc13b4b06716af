import torch, triton
import mxq, mxq.attention as A
from mxq.attention import MXFP8CacheLayer
b, h, d = 4, 8, 128
def t(fn):
    fn(); torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=5, rep=50, return_mode="median") * 1e3
new = A._quantize_vt
old = lambda v: A._quantize_rows(v.transpose(-1, -2))
for s in (2048, 16384):
    k = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16); v = torch.randn_like(k)
    def upd():
        layer = MXFP8CacheLayer(); layer.update(k, v)
    res = {}
    for name, fn in (("old", old), ("new", new)):
        A._quantize_vt = fn
        res[name] = t(upd)
        res[name + "_vonly"] = t(lambda: fn(v))
    A._quantize_vt = new
    L1 = MXFP8CacheLayer(); L1.update(k, v); A._quantize_vt = old; L2 = MXFP8CacheLayer(); L2.update(k, v); A._quantize_vt = new
    same = torch.equal(L1.v_data.view(torch.uint8), L2.v_data.view(torch.uint8)) and torch.equal(L1.v_scale, L2.v_scale)
    mb = b * h * s * d * 2 / 1e6
    print(f"S={s}: cache update (prefill) old {res['old']:.1f} us, new {res['new']:.1f} us; V quantize alone old {res['old_vonly']:.1f} us new {res['new_vonly']:.1f} us ({mb/res['new_vonly']*1e3:.0f} GB/s read); bytes equal: {same}")
