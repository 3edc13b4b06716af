"""Prefill A/B 2: bit-split P, tiles with maxnreg, prep GPU time (graph). B=4 H=32 D=128 bf16."""
import json, sys, torch, triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from mxq.kernels import attention as A
from mxq.kernels.attention import mx_attention_prefill

def bench(fn, graph=False):
    fn(); torch.cuda.synchronize()
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median")
    return triton.testing.do_bench(fn, warmup=30, rep=200, return_mode="median")

out = {"device": torch.cuda.get_device_name(), "rows": []}
b, h, d = 4, 32, 128
tiles = [(64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 2, 168), (64, 64, 4, 3, 168), (64, 32, 4, 3), (64, 32, 4, 4), (128, 64, 8, 3)]
seqs = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1024, 4096, 16384]
for s in seqs:
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    pk = lambda: A.rotate_qk_rows(k, round_to=(A.E4M3, A.ScaleRule.RCEIL), block_d=128)
    pv = lambda: A._round_vt(v, A.E4M3, A.ScaleRule.RCEIL, 128)
    prep = {"k_graph": bench(pk, True) * 1e3, "v_graph": bench(pv, True) * 1e3, "kv_eager": bench(lambda: (pk(), pv())) * 1e3}
    print(f"S={s} prep us {prep}  (bytes K+V r/w {4*4*b*h*s*d/1e6:.0f} MB)", flush=True)
    for causal in (False, True):
        fl = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            fms = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal))
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            cms = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal))
        row = {"S": s, "causal": causal, "flash": fl / fms / 1e9, "cudnn": fl / cms / 1e9, "prep": prep, "t": {}}
        for tile in tiles:
            for exact in ((True, False) if tile == tiles[0] else (True,)):
                try:
                    ms = bench(lambda: mx_attention_prefill(q, k, v, causal=causal, exact=exact, qk_rotation=True, tile=tile))
                    row["t"][f"{tile}|{exact}"] = fl / ms / 1e9
                except Exception as e:
                    print("ERR", tile, exact, str(e)[:100])
        ms = bench(lambda: mx_attention_prefill(q, k, v, causal=causal, qk_rotation=True), graph=True)
        row["default_graph"] = fl / ms / 1e9
        out["rows"].append(row)
        print(f"S={s} causal={causal} flash {row['flash']:.0f} cudnn {row['cudnn']:.0f} default(graph) {row['default_graph']:.0f}")
        for kk, vv in row["t"].items():
            print(f"   {kk}: {vv:.0f} ({vv/row['flash']:.2f}x flash)", flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
