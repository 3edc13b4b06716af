"""Session 16: interleaved A/B of the W8A8 decode GEMM with X quantized inside the kernel (fuse_x, one
launch) against the quantizer kernel + GEMM (PDL; 8 or 16 activation rows per tile), and cuBLAS bf16, at M = 1, 4, 16.

Method of session15/ab.py: every variant's CUDA graph (over weight copies, so weights stream from HBM)
is built first, then replayed in ROUNDS rounds with the variant order rotating; a figure is the median
over all replays of a variant.

    python decode_ab.py [ms] [models]        -> $OUT/decode_ab.json and a table of x cuBLAS bf16
"""
import dataclasses, json, os, sys
import torch
from mxq.formats import E4M3, ScaleRule, dequantize_mx, quantize_mx
from mxq.kernels import gemm_decode_ws as WS
sys.path.insert(0, "eval")
from bench_gemm import _copies, LLAMA_SHAPES

OUT = os.environ.get("OUT", "/tmp")
ROUNDS, REPS = 9, 6
ms = [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "1,4,16").split(",")]
models = (sys.argv[2] if len(sys.argv) > 2 else "8b,70b").split(",")


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
            cfgs = {"fused": base, "pdl": dataclasses.replace(base, fuse_x=False),
                    "pdl16": dataclasses.replace(base, fuse_x=False, block_m=16)}
            ys = {nm: WS.mx_decode_gemm_ws(x, *packs[0], config=c, out_dtype=torch.float32) for nm, c in cfgs.items()}
            same = all(torch.equal(ys["fused"], y) for y in ys.values())
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
            row = dict(model=model, layer=layer, m=m, n=n, k=k, split=base.split_k, same_bits=same,
                       us={nm: round(v, 2) for nm, v in med.items()},
                       x_cublas={nm: round(med["cublas"] / v, 3) for nm, v in med.items() if nm != "cublas"},
                       spread={nm: round((sorted(v)[int(len(v) * 0.9)] - sorted(v)[int(len(v) * 0.1)]) / med[nm], 3) for nm, v in times.items()})
            res.append(row)
            json.dump(res, open(f"{OUT}/decode_ab.json", "w"), indent=1)
            del gs
        del packs, wbs
        torch.cuda.empty_cache()

print(f"\n{torch.cuda.get_device_name()}  (x cuBLAS bf16, higher is faster; median of {ROUNDS * REPS} interleaved graph replays)")
print("| model | layer | M | split | cuBLAS µs | fused µs | PDL µs | PDL 16-row µs | fused x | PDL x | PDL 16-row x | fused/PDL | same bits |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in res:
    u, x = r["us"], r["x_cublas"]
    print(f"| {r['model']} | {r['layer']} | {r['m']} | {r['split']} | {u['cublas']} | {u['fused']} | {u['pdl']} | {u['pdl16']} | "
          f"{x['fused']:.2f} | {x['pdl']:.2f} | {x['pdl16']:.2f} | {u['pdl'] / u['fused']:.3f} | {r['same_bits']} |")
