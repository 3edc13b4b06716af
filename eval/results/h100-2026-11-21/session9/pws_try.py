"""Session 9: Gluon warp-specialized prefill GEMM (loader warp + converter warpgroup + 2 MMA warpgroups):
correctness on awkward shapes against float64, then speed vs cuBLAS bf16 and the dispatched emulation."""
import json, os, sys, traceback
import torch
from mxq.formats import E4M3, E5M2, ScaleRule, dequantize_mx, quantize_mx
from mxq.kernels.gemm import mx_gemm
from mxq.kernels.gemm_prefill_ws import mx_prefill_gemm_ws, PrefillWSConfig
from mxq.kernels.dispatch import mx_linear
from mxq.kernels.quantize import fake_quantize_mx_rows
sys.path.insert(0, "eval")
from bench_gemm import _bench_graph, _copies, LLAMA_SHAPES
OUT = os.environ.get("OUT", "/tmp")
part = sys.argv[1] if len(sys.argv) > 1 else "all"
res = []
def log(**kw):
    res.append(kw); print(json.dumps(kw), flush=True)
    json.dump(res, open(f"{OUT}/pws_{part}.json", "w"), indent=1)
torch.manual_seed(0)
dev = "cuda"
def mk(n, k, elem=E4M3, spread=False):
    w = torch.randn(n, k, device=dev) * 0.02
    if spread:
        w = w * torch.exp(torch.randn(n, 1, device=dev) * 2)
    t = quantize_mx(w.cpu(), -1, elem, 32, ScaleRule.RCEIL)
    return t.data.to(dev), t.scales.to(dev), dequantize_mx(t, torch.float64).to(dev)
if part in ("smoke",):
    w, s, wdq = mk(256, 256)
    x = torch.randn(256, 256, device=dev, dtype=torch.bfloat16)
    y = mx_prefill_gemm_ws(x, w, s, out_dtype=torch.float32)
    torch.cuda.synchronize()
    ref = x.double() @ wdq.t()
    log(smoke_err=(y.double() - ref).abs().max().item(), ref_max=ref.abs().max().item())
if part in ("all", "check"):
    bad = 0
    cases = [(1, 130, 64, E4M3, None, False), (100, 1000, 96, E4M3, "bias", True), (257, 384, 4224, E5M2, None, True),
             (2048, 4096, 4096, E4M3, None, False), (300, 14336, 1024, E4M3, "bias", False), (2048, 1000, 2080, E4M3, "bias", True),
             (513, 257, 32, E4M3, None, False), (4100, 640, 512, E5M2, "bias", False)]
    for (m, n, k, we, b, spread) in cases:
        w, s, wdq = mk(n, k, we, spread)
        bias = torch.randn(n, device=dev, dtype=torch.bfloat16) if b else None
        x = (torch.randn(m, k, device=dev) * 3).to(torch.bfloat16)
        ref = x.double() @ wdq.t()
        a = x.double().abs() @ wdq.abs().t()
        if bias is not None:
            ref = ref + bias.double()
            a = a + bias.double().abs()
        for cfg in (None, PrefillWSConfig(stages=3), PrefillWSConfig(group=1)):
            for od in (torch.float32, torch.bfloat16):
                try:
                    y = mx_prefill_gemm_ws(x, w, s, bias, out_dtype=od, config=cfg)
                    torch.cuda.synchronize()
                    err = ((y.double() - ref).abs() / (a + 1e-30)).max().item()
                    lim = 2 ** -14 if od == torch.float32 else 2 ** -7
                    ok = err <= lim and not torch.isnan(y).any().item()
                    bad += not ok
                    log(case=[m, n, k, we.name, b, spread, str(od)], cfg=str(cfg), err=err, ok=ok)
                except Exception:
                    bad += 1
                    log(case=[m, n, k], cfg=str(cfg), error=traceback.format_exc()[-800:])
        y0 = mx_gemm(x, w, s, bias, out_dtype=torch.float32)
        y1 = mx_prefill_gemm_ws(x, w, s, bias, out_dtype=torch.float32)
        log(case=[m, n, k], vs_mx_gemm=((y0.double() - y1.double()).abs() / (a + 1e-30)).max().item())
    w, s, wdq = mk(256, 512)
    s[3, 2] = 255
    x = torch.randn(300, 512, device=dev, dtype=torch.bfloat16)
    y = mx_prefill_gemm_ws(x, w, s, None, out_dtype=torch.float32)
    log(nan_col=torch.isnan(y[:, 3]).all().item(), other_finite=torch.isfinite(y[:, torch.arange(256, device=dev) != 3]).all().item())
    log(check_bad=bad)
if part in ("all", "bench"):
    ms = [256, 512, 1024, 2048, 8192] if len(sys.argv) < 3 else [int(v) for v in sys.argv[2].split(",")]
    variants = {"ws": None}
    if len(sys.argv) > 3:
        variants.update({"s3": PrefillWSConfig(stages=3), "w2": PrefillWSConfig(wbuf=2), "g16": PrefillWSConfig(group=16)})
    for model in ["8b", "70b"]:
        for layer, (n, k) in LLAMA_SHAPES[model].items():
            w_bf16 = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)
            t = quantize_mx(w_bf16, -1, E4M3, 32, ScaleRule.RCEIL)
            w_deq = dequantize_mx(t, torch.float32)
            r8, rbf = _copies(n * k), _copies(2 * n * k)
            packs = [(t.data.clone(), t.scales.clone()) for _ in range(r8)]
            wbfs = [w_deq.to(torch.bfloat16) for _ in range(rbf)]
            for m in ms:
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                row = dict(model=model, layer=layer, m=m, n=n, k=k)
                row["cublas"] = _bench_graph([lambda w=w: x @ w.t() for w in wbfs])
                row["emul_w8a16"] = _bench_graph([lambda p=p: mx_gemm(x, p[0], p[1]) for p in packs])
                row["emul_w8a8"] = _bench_graph([lambda p=p: mx_linear(x, p[0], p[1], act_elem=E4M3) for p in packs])
                for name, cfg in variants.items():
                    row[name + "_w8a16"] = _bench_graph([lambda p=p: mx_prefill_gemm_ws(x, p[0], p[1], config=cfg) for p in packs])
                row["ws_w8a8"] = _bench_graph([lambda p=p: mx_prefill_gemm_ws(fake_quantize_mx_rows(x, E4M3, ScaleRule.RCEIL, out_dtype=torch.bfloat16), p[0], p[1]) for p in packs])
                row["quant"] = _bench_graph([lambda: fake_quantize_mx_rows(x, E4M3, ScaleRule.RCEIL, out_dtype=torch.bfloat16)])
                for key in list(row):
                    if key.endswith(("w8a16", "w8a8")):
                        row["x_" + key] = round(row["cublas"] / row[key], 3)
                row["tflops_ws"] = round(2 * m * n * k / row["ws_w8a16"] / 1e6, 1)
                log(**row)
