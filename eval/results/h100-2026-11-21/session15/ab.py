"""Session 15: interleaved A/B of prefill GEMM variants against cuBLAS bf16 (W8A16 timing, one process).

Single _bench_graph calls in a row drifted by ±8 % between runs on the H200 (rs_bench.json of run1 vs run2),
so here every variant's CUDA graph is built first and then replayed in ROUNDS rounds, the variant order
rotating each round; a variant's figure is the median over all its replays.

    python ab.py [ms] [variants] [models]     (variants: comma list of CFGS keys, or w8a8 / w8a8nopdl: dispatched
                                               W8A8 with / without PDL — the PDL build of run5.sh, reverted
                                               after it measured no gain; cublas is always timed)
"""
import json, os, sys
import torch
from mxq.formats import E4M3, ScaleRule, dequantize_mx, quantize_mx
from mxq.kernels import dispatch as D
from mxq.kernels.gemm_prefill_ws import mx_prefill_gemm_ws, PrefillRSConfig as R
sys.path.insert(0, "eval")
from bench_gemm import _copies, LLAMA_SHAPES

OUT = os.environ.get("OUT", "/tmp")
ROUNDS, REPS = 9, 6
CFGS = {"rs4": R(stages=4, inflight=False), "rs4if": R(stages=4), "rs4ifsw": R(stages=4, split_wg=True),
        "rs4ifp": R(stages=4, persistent=True), "rs3if": R(stages=3), "rs5if": R(stages=5), "rs4ifg16": R(stages=4, group=16),
        "rs4p": R(stages=4, inflight=False, persistent=True), "rs3ifsw": R(stages=3, split_wg=True),
        "rs5ifsw": R(stages=5, split_wg=True), "rs4ifswg16": R(stages=4, split_wg=True, group=16)}
ms = [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "2048").split(",")]
names = (sys.argv[2] if len(sys.argv) > 2 else "rs4,rs4if").split(",")
models = (sys.argv[3] if len(sys.argv) > 3 else "8b,70b").split(",")


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
            gs = {"cublas": graph([lambda w=w: x @ w.t() for w in wbs])}
            for nm in names:
                if nm.startswith("w8a8"):  # dispatched W8A8 (quantizer + GEMM), PDL on / off at capture
                    os.environ["MXQ_PDL"] = "0" if nm == "w8a8nopdl" else "1"
                    gs[nm] = graph([lambda p=p: D.mx_linear(x, p[0], p[1], act_elem=E4M3) for p in packs])
                    os.environ["MXQ_PDL"] = "1"
                else:
                    gs[nm] = graph([lambda p=p, c=CFGS[nm]: mx_prefill_gemm_ws(x, p[0], p[1], config=c) for p in packs])
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
            row = dict(model=model, layer=layer, m=m, n=n, k=k, us={nm: round(v, 1) for nm, v in med.items()},
                       x_cublas={nm: round(med["cublas"] / v, 3) for nm, v in med.items() if nm != "cublas"},
                       spread={nm: round((sorted(v)[int(len(v) * 0.9)] - sorted(v)[int(len(v) * 0.1)]) / med[nm], 3) for nm, v in times.items()})
            res.append(row)
            print(model, layer, m, " ".join(f"{nm}={v}" for nm, v in row["x_cublas"].items()), "cublas_us", row["us"]["cublas"], "spread", row["spread"], flush=True)
            json.dump(res, open(f"{OUT}/ab.json", "w"), indent=1)
            del gs
        del packs, wbs
        torch.cuda.empty_cache()
