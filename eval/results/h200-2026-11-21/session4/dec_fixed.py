"""Where the fixed cost of a decode call goes: merge kernel, Q rotation prologue, pipeline."""
import json, os, sys, torch, triton
import mxq
import mxq.kernels.attention as A
from mxq.attention import MXFP8CacheLayer
b, hq, hkv, d = 4, 32, 8, 128
def bench(fn):
    fn(); torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3
class _NoLaunch:
    def __getitem__(self, grid): return lambda *a, **k: None
real_merge = A._decode_merge_kernel
res = []
for n, chunk in ((1024, 64), (4096, None), (16384, None), (32768, None)):
    torch.manual_seed(0)
    q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16)
    layer = MXFP8CacheLayer(); layer.update(k, v)
    c = layer.v_data.shape[-1]
    vp = layer.v_data.view(b, hkv, d, c // 32, 32).permute(0, 1, 3, 2, 4).contiguous()
    vsp = layer.v_scale.transpose(2, 3).contiguous()
    pg = (q, layer.k_data, layer.k_scale, vp, vsp, n)
    kw = dict(chunk=chunk) if chunk else {}
    row = dict(n=n, chunk=chunk)
    row["sdpa"] = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    row["full"] = bench(lambda: A.mx_attention_decode(*pg, qk_rotation=True, **kw))
    row["norot"] = bench(lambda: A.mx_attention_decode(*pg, qk_rotation=False, **kw))
    A._decode_merge_kernel = _NoLaunch()
    row["nomerge"] = bench(lambda: A.mx_attention_decode(*pg, qk_rotation=True, **kw))
    row["nomerge_norot"] = bench(lambda: A.mx_attention_decode(*pg, qk_rotation=False, **kw))
    A._decode_merge_kernel = real_merge
    row["empty_graph_call"] = bench(lambda: torch.empty(1, device="cuda"))
    print(row, flush=True); res.append(row)
json.dump(res, open(os.environ["OUT"] + "/dec_fixed.json", "w"), indent=1)
