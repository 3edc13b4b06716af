"""Session 17: interleaved A/B of decode GEMM tiles: the dispatched 128-row tile (2 programs per SM at 128
registers) against 64-row tiles at 80 / 64 registers (3 / 4 programs per SM) and 2-4 stages, W8A8, M = 1, 4, 16.

The question (kernels/NOTES.md session 16, "where the rest goes"): at M = 16 on large weights the math
warpgroup's per-step rescale chain is on the critical path. A 64-row tile halves that chain per program and lets
3-4 programs share an SM, so their chains overlap; the bytes in flight per SM stay about the same.

Method of session15/ab.py: all CUDA graphs (over weight copies, so weights stream from HBM) built first, then
ROUNDS rotated rounds x REPS replays; a figure is the median over all replays of a variant.

    python decode_tiles.py [ms] [models] [variants]   -> $OUT/decode_tiles.json and a table of x cuBLAS bf16
"""
import dataclasses, json, os, sys
import torch
from mxq.formats import E4M3, ScaleRule, dequantize_mx, quantize_mx
from mxq.kernels import gemm_decode_ws as WS
from mxq.kernels.gemm import _sm_count
sys.path.insert(0, "eval")
from bench_gemm import _copies, LLAMA_SHAPES

OUT = os.environ.get("OUT", "/tmp")
ROUNDS, REPS = 9, 6
ms = [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "1,4,16").split(",")]
models = (sys.argv[2] if len(sys.argv) > 2 else "8b,70b").split(",")
# name: (block_n, maxnreg, stages, programs per SM for the split rule, split multiplier)
VARIANTS = {
    "b64r80s2": (64, 80, 2, 3, 1), "b64r80s3": (64, 80, 3, 3, 1),
    "b64r64s2": (64, 64, 2, 4, 1), "b64r64s3": (64, 64, 3, 4, 1), "b64r64s4": (64, 64, 4, 4, 1),
    "b64r64s3x2": (64, 64, 3, 4, 2), "b128r128s3": (128, 128, 3, 2, 1),
}
if len(sys.argv) > 3:
    VARIANTS = {k: v for k, v in VARIANTS.items() if k in sys.argv[3].split(",")}


def split_for(n, k, block_n, per_sm, sms):
    tiles, steps, split = -(-n // block_n), k // 128, 1
    while split < 16 and steps // (split * 2) >= 4 and tiles * split * 2 <= per_sm * sms:
        split *= 2
    return split


def graph(fns):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    return g, len(fns)


res = []
torch.manual_seed(0)
sms = _sm_count(torch.device("cuda"))
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
            base = WS.pick_decode_ws_config(m, n, k, x.device)
            cfgs = {"base": base}
            for nm, (bn, reg, st, per_sm, mult) in VARIANTS.items():
                sp = min(16, split_for(n, k, bn, per_sm, sms) * mult)
                cfgs[nm] = dataclasses.replace(base, block_n=bn, maxnreg=reg, stages=st, split_k=sp)
            ref = (x.double() @ wb.double().t())
            ys = {nm: WS.mx_decode_gemm_ws(x, *packs[0], config=c, out_dtype=torch.float32) for nm, c in cfgs.items()}
            scale = ref.abs().max().item()
            err = {nm: round((y.double() - ys["base"].double()).abs().max().item() / scale, 9) for nm, y in ys.items()}
            gs = {"cublas": graph([lambda w=w: x @ w.t() for w in wbs])}
            for nm, c in cfgs.items():
                gs[nm] = graph([lambda p=p, c=c: WS.mx_decode_gemm_ws(x, p[0], p[1], config=c) for p in packs])
            times = {nm: [] for nm in gs}
            order = list(gs)
            for r in range(ROUNDS):
                for nm in order[r % len(order):] + order[: r % len(order)]:
                    g, cnt = gs[nm]
                    for _ in range(REPS):
                        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        a.record()
                        g.replay()
                        b.record()
                        b.synchronize()
                        times[nm].append(a.elapsed_time(b) * 1e3 / cnt)
            med = {nm: sorted(v)[len(v) // 2] for nm, v in times.items()}
            row = dict(model=model, layer=layer, m=m, n=n, k=k, split={nm: c.split_k for nm, c in cfgs.items()},
                       fuse_x=base.fuse_x, err_vs_base=err,
                       us={nm: round(v, 2) for nm, v in med.items()},
                       x_cublas={nm: round(med["cublas"] / v, 3) for nm, v in med.items() if nm != "cublas"},
                       spread={nm: round((sorted(v)[int(len(v) * 0.9)] - sorted(v)[int(len(v) * 0.1)]) / med[nm], 3) for nm, v in times.items()})
            res.append(row)
            print(row["model"], row["layer"], m, row["us"], flush=True)
            json.dump(res, open(f"{OUT}/decode_tiles.json", "w"), indent=1)
            del gs
        del packs, wbs
        torch.cuda.empty_cache()

names = ["base"] + list(VARIANTS)
print(f"\n{torch.cuda.get_device_name()}  (x cuBLAS bf16, higher is faster; median of {ROUNDS * REPS} interleaved graph replays)")
print("| model | layer | M | cuBLAS µs | " + " | ".join(f"{nm} (split) x" for nm in names) + " | best / base | max err / |y| |")
print("|---|---|---|---|" + "---|" * len(names) + "---|---|")
for r in res:
    u, xx = r["us"], r["x_cublas"]
    best = max(names, key=lambda nm: xx[nm])
    print(f"| {r['model']} | {r['layer']} | {r['m']} | {u['cublas']} | " + " | ".join(f"{xx[nm]:.2f} ({r['split'][nm]})" for nm in names)
          + f" | {best} {u['base'] / u[best]:.3f} | {max(r['err_vs_base'].values()):.1e} |")
