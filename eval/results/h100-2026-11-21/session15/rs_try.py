"""Session 15 (from session 14's rs_try.py): the register-operand prefill GEMM with one step in flight
(inflight) and persistent programs; the register-operand warp-specialized prefill GEMM (gemm_prefill_ws._mx_prefill_rs_kernel):
correctness on awkward shapes against float64 (subnormal codes, large and NaN scales), then speed against cuBLAS
bf16, the dispatched emulation and the session-9 shared x shared kernel, in one process.

    python rs_try.py check
    python rs_try.py bench [ms] [variants: comma list of rs3,rs4,rs4g16,ss]
"""
import json, os, sys, traceback
import torch
from mxq.formats import E4M3, E5M2, ScaleRule, dequantize_mx, quantize_mx
from mxq.kernels.gemm import mx_gemm
from mxq.kernels.gemm_prefill_ws import mx_prefill_gemm_ws, PrefillRSConfig, PrefillWSConfig
from mxq.kernels.quantize import fake_quantize_mx_rows
sys.path.insert(0, "eval")
from bench_gemm import _bench_graph, _copies, LLAMA_SHAPES

OUT = os.environ.get("OUT", "/tmp")
part = sys.argv[1] if len(sys.argv) > 1 else "all"
res = []


def log(**kw):
    res.append(kw)
    print(json.dumps(kw), flush=True)
    json.dump(res, open(f"{OUT}/rs_{part}.json", "w"), indent=1)


torch.manual_seed(0)
dev = "cuda"
R = PrefillRSConfig
CFGS = {"rs4": R(stages=4), "rs3": R(stages=3), "ss": PrefillWSConfig(),
        "rs4if": R(stages=4, inflight=True), "rs3if": R(stages=3, inflight=True),
        "rs4p": R(stages=4, persistent=True), "rs4ifp": R(stages=4, inflight=True, persistent=True),
        "rs3ifp": R(stages=3, inflight=True, persistent=True), "rs4ifpg16": R(stages=4, inflight=True, persistent=True, group=16),
        "rs4ifsw": R(stages=4, inflight=True, split_wg=True), "rs5if": R(stages=5, inflight=True)}


def mk(n, k, elem=E4M3, spread=False, subnormal=False):
    w = torch.randn(n, k) * 0.02
    if spread:
        w = w * torch.exp(torch.randn(n, 1) * 2)
    t = quantize_mx(w, -1, elem, 32, ScaleRule.RCEIL)
    if subnormal:  # every non-NaN code on a few rows (zero, subnormals, both signs), a large scale
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(t.data.dtype)
        codes = codes[torch.isfinite(codes.float())]
        t.data = t.data.clone()
        t.data[: min(n, 3)] = codes.repeat(k // codes.numel() + 1)[:k]
        t.scales[1, :] = 200  # 2**73 on a row of every code
    return t.data.to(dev), t.scales.to(dev), dequantize_mx(t, torch.float64).to(dev)


if part in ("all", "check"):
    bad = 0
    cases = [(1, 130, 64, E4M3, None, False, True), (100, 1000, 96, E4M3, "bias", True, False),
             (257, 384, 4224, E5M2, None, True, True), (2048, 4096, 4096, E4M3, None, False, False),
             (300, 14336, 1024, E4M3, "bias", False, True), (2048, 1000, 2080, E4M3, "bias", True, False),
             (513, 257, 32, E4M3, None, False, False), (4100, 640, 512, E5M2, "bias", False, False),
             (17, 129, 4096, E4M3, "bias", False, True), (2050, 4100, 96, E4M3, None, False, True),
             (1100, 8200, 160, E5M2, "bias", True, False), (4096, 8192, 1024, E4M3, None, False, False)]
    for (m, n, k, we, b, spread, sub) in cases:
        w, s, wdq = mk(n, k, we, spread, sub)
        bias = torch.randn(n, device=dev, dtype=torch.bfloat16) if b else None
        x = (torch.randn(m, k, device=dev) * 3).to(torch.bfloat16)
        ref = x.double() @ wdq.t()
        a = x.double().abs() @ wdq.abs().t()
        if bias is not None:
            ref = ref + bias.double()
            a = a + bias.double().abs()
        for name in os.environ.get("CHECK", "rs4,rs4if,rs4p,rs4ifp").split(","):
            for od in (torch.float32, torch.bfloat16):
                try:
                    y = mx_prefill_gemm_ws(x, w, s, bias, out_dtype=od, config=CFGS[name])
                    torch.cuda.synchronize()
                    err = ((y.double() - ref).abs() / (a + 1e-30)).max().item()
                    lim = 2 ** -14 if od == torch.float32 else 2 ** -7
                    ok = err <= lim and not torch.isnan(y).any().item() and y.shape == (m, n) and y.dtype == od
                    bad += not ok
                    log(case=[m, n, k, we.name, b, spread, sub, str(od)], cfg=name, err=err, ok=ok)
                except Exception:
                    bad += 1
                    log(case=[m, n, k], cfg=name, error=traceback.format_exc()[-1500:])
        try:
            y0 = mx_gemm(x, w, s, bias, out_dtype=torch.float32)
            y1 = mx_prefill_gemm_ws(x, w, s, bias, out_dtype=torch.float32, config=CFGS["rs4ifp"])
            log(case=[m, n, k], vs_mx_gemm=((y0.double() - y1.double()).abs() / (a + 1e-30)).max().item())
        except Exception:
            log(case=[m, n, k], error=traceback.format_exc()[-800:])
    w, s, wdq = mk(256, 512)
    s[3, 2] = 255
    x = torch.randn(300, 512, device=dev, dtype=torch.bfloat16)
    y = mx_prefill_gemm_ws(x, w, s, None, out_dtype=torch.float32, config=CFGS["rs3"])
    nan_ok = torch.isnan(y[:, 3]).all().item() and torch.isfinite(y[:, torch.arange(256, device=dev) != 3]).all().item()
    bad += not nan_ok
    log(nan_col_ok=nan_ok)
    log(check_bad=bad)

if part in ("all", "bench"):
    ms = [2048, 8192] if len(sys.argv) < 3 else [int(v) for v in sys.argv[2].split(",")]
    names = ["rs3", "rs4", "ss"] if len(sys.argv) < 4 else sys.argv[3].split(",")
    models = ["8b", "70b"] if len(sys.argv) < 5 else sys.argv[4].split(",")
    for model in models:
        for layer, (n, k) in LLAMA_SHAPES[model].items():
            w_bf16 = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)
            t = quantize_mx(w_bf16, -1, E4M3, 32, ScaleRule.RCEIL)
            w_deq = dequantize_mx(t, torch.float32)
            r8, rbf = _copies(n * k), _copies(2 * n * k)
            packs = [(t.data.clone(), t.scales.clone()) for _ in range(r8)]
            wbfs = [w_deq.to(torch.bfloat16) for _ in range(rbf)]
            for m in ms:
                if model == "70b" and m > 2048:
                    continue
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                row = dict(model=model, layer=layer, m=m, n=n, k=k)
                row["cublas"] = _bench_graph([lambda w=w: x @ w.t() for w in wbfs])
                row["emul_w8a16"] = _bench_graph([lambda p=p: mx_gemm(x, p[0], p[1]) for p in packs])
                for name in names:
                    try:
                        row[name + "_w8a16"] = _bench_graph([lambda p=p, c=CFGS[name]: mx_prefill_gemm_ws(x, p[0], p[1], config=c) for p in packs])
                    except Exception:
                        row[name + "_error"] = traceback.format_exc()[-600:]
                best = min((row[nm + "_w8a16"], nm) for nm in names if nm.startswith("rs") and nm + "_w8a16" in row)
                c = CFGS[best[1]]
                row["best_rs"] = best[1]
                row["rs_w8a8"] = _bench_graph([lambda p=p: mx_prefill_gemm_ws(fake_quantize_mx_rows(x, E4M3, ScaleRule.RCEIL, out_dtype=torch.bfloat16), p[0], p[1], config=c) for p in packs])
                row["quant"] = _bench_graph([lambda: fake_quantize_mx_rows(x, E4M3, ScaleRule.RCEIL, out_dtype=torch.bfloat16)])
                for key in list(row):
                    if key.endswith(("w8a16", "w8a8")):
                        row["x_" + key] = round(row["cublas"] / row[key], 3)
                row["tflops_best_rs"] = round(2 * m * n * k / best[0] / 1e6, 1)
                row["tflops_cublas"] = round(2 * m * n * k / row["cublas"] / 1e6, 1)
                log(**row)
