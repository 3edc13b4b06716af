"""Session 17: the decode GEMM as dispatched with the tuning cache (`mxq tune`) against the built-in rule,
interleaved (session15/ab.py's method: all CUDA graphs over weight copies built first, ROUNDS rotated rounds x REPS
replays, medians), with cuBLAS bf16 in the same rounds. A second, independent measurement of the tuner's choices: the
tuner's own figures are the best of ~7 noisy timings (biased to look good); these are not.

    python tuned_ab.py [ms] [models]        -> $OUT/tuned_ab.json and a table of x cuBLAS bf16
"""
import json, os, sys
import torch
from mxq.formats import E4M3, ScaleRule, dequantize_mx, quantize_mx
from mxq.kernels import gemm_decode_ws as WS
from mxq.kernels import tune
sys.path.insert(0, "eval")
from bench_gemm import _copies, LLAMA_SHAPES

OUT = os.environ.get("OUT", "/tmp")
ROUNDS, REPS = 9, 6
ms = [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "1,4,16").split(",")]
models = (sys.argv[2] if len(sys.argv) > 2 else "8b,70b").split(",")
res = []
torch.manual_seed(0)
for model in models:
    for layer, (n, k) in LLAMA_SHAPES[model].items():
        w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
        t = quantize_mx(w, -1, E4M3, 32, ScaleRule.RCEIL)
        wb = dequantize_mx(t, torch.float32).to(torch.bfloat16)
        packs = [(t.data.clone(), t.scales.clone()) for _ in range(_copies(n * k))]
        wbs = [wb.clone() for _ in range(_copies(2 * n * k))]
        del w
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            rule = WS.rule_decode_ws_config(m, n, k, x.device)
            tuned = WS.pick_decode_ws_config(m, n, k, x.device)
            cfgs = {"rule": rule, "tuned": tuned}
            y0 = WS.mx_decode_gemm_ws(x, *packs[0], config=rule, out_dtype=torch.float32)
            y1 = WS.mx_decode_gemm_ws(x, *packs[0], config=tuned, out_dtype=torch.float32)
            rel = float((y1 - y0).abs().max() / y0.abs().max())
            fns = {"cublas": [lambda w=w: x @ w.t() for w in wbs]}
            for nm, c in cfgs.items():
                fns[nm] = [lambda p=p, c=c: WS.mx_decode_gemm_ws(x, p[0], p[1], config=c) for p in packs]
            med = tune.time_interleaved(fns, ROUNDS, REPS)
            row = dict(model=model, layer=layer, m=m, n=n, k=k, rule=WS.describe(rule), tuned=WS.describe(tuned),
                       rel_diff=rel, us={nm: round(v, 2) for nm, v in med.items()},
                       x_cublas={nm: round(med["cublas"] / v, 3) for nm, v in med.items() if nm != "cublas"})
            res.append(row)
            print(model, layer, m, row["tuned"], row["us"], flush=True)
            json.dump(res, open(f"{OUT}/tuned_ab.json", "w"), indent=1)
        del packs, wbs
        torch.cuda.empty_cache()

print(f"\n{torch.cuda.get_device_name()}  (x cuBLAS bf16, higher is faster; median of {ROUNDS * REPS} interleaved graph replays)")
print("| model | layer | M | cuBLAS µs | rule µs | tuned µs | rule x | tuned x | tuned / rule speed | tuned config |")
print("|---|---|---|---|---|---|---|---|---|---|")
for r in res:
    u, xx = r["us"], r["x_cublas"]
    print(f"| {r['model']} | {r['layer']} | {r['m']} | {u['cublas']} | {u['rule']} | {u['tuned']} | {xx['rule']:.2f} | "
          f"{xx['tuned']:.2f} | {u['rule'] / u['tuned']:.3f} | {r['tuned']} |")
