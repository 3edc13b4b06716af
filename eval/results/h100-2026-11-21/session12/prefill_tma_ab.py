"""Prefill A/B: TMA vs pointer K/V tiles, tiles, the pre-pass share. B=4 H=32 D=128 bf16."""
import json, sys, torch, triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from mxq.kernels import attention as A
from mxq.kernels.attention import mx_attention_prefill

def bench(fn):
    fn(); torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=30, rep=200, return_mode="median")

out = {"device": torch.cuda.get_device_name(), "rows": []}
b, h, d = 4, 32, 128
tiles = [(64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 128, 4, 2), (64, 64, 4, 4)]
seqs = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1024, 4096, 16384]
for s in seqs:
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    prep = bench(lambda: (A.rotate_qk_rows(k, round_to=(A.E4M3, A.ScaleRule.RCEIL), block_d=128), A._round_vt(v, A.E4M3, A.ScaleRule.RCEIL, 128)))
    print(f"S={s} prep (K rotate+round, V round) {prep*1e3:.1f} us", flush=True)
    for causal in (False, True):
        fl = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            fms = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal))
        row = {"S": s, "causal": causal, "flash": fl / fms / 1e9, "prep_us": prep * 1e3, "t": {}}
        for tile in tiles:
            for tma in (True, False):
                for exact in (True, False):
                    try:
                        ms = bench(lambda: mx_attention_prefill(q, k, v, causal=causal, exact=exact, qk_rotation=True, tile=tile, tma=tma))
                        row["t"][f"{tile}|{tma}|{exact}"] = fl / ms / 1e9
                    except Exception as e:
                        print("ERR", tile, tma, exact, str(e)[:100])
        out["rows"].append(row)
        best = max((v_, k_) for k_, v_ in row["t"].items() if k_.endswith("True"))
        print(f"S={s} causal={causal} flash {row['flash']:.0f} | best exact {best[0]:.0f} {best[1]} ({best[0]/row['flash']:.2f}x)")
        for tile in tiles:
            g = lambda tma, ex: row["t"].get(f"{tile}|{tma}|{ex}", 0)
            print(f"   {tile}: tma exact/fast {g(True,True):.0f}/{g(True,False):.0f}   ptr {g(False,True):.0f}/{g(False,False):.0f}", flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
