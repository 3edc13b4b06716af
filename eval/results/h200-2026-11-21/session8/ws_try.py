"""Session 8: Gluon warp-specialized fp8 decode GEMM — correctness on awkward shapes, then speed vs cuBLAS bf16 and the dispatched path."""
import json, os, sys, time, itertools, traceback
import torch, triton
from mxq.formats import E4M3, E5M2, ScaleRule, dequantize_mx, quantize_mx
from mxq.kernels.gemm_decode import mx_decode_gemm, pick_decode_f8_config
from mxq.kernels.gemm_decode_ws import mx_decode_gemm_ws, DecodeWSConfig, pick_decode_ws_config
from mxq.kernels.dispatch import mx_linear_triton
from mxq.kernels.quantize import fake_quantize_mx_rows
sys.path.insert(0, "eval")
from bench_gemm import _bench_graph, _copies, LLAMA_SHAPES
OUT = os.environ.get("OUT", "/tmp")
part = sys.argv[1] if len(sys.argv) > 1 else "all"
res = []
def log(**kw):
    res.append(kw); print(json.dumps(kw), flush=True)
    json.dump(res, open(f"{OUT}/ws_{part}.json", "w"), indent=1)
torch.manual_seed(0)
dev = "cuda"
def mk(n, k, elem=E4M3, spread=False):
    w = torch.randn(n, k, device=dev) * 0.02
    if spread:
        w = w * torch.exp(torch.randn(n, 1, device=dev) * 2)
    t = quantize_mx(w.cpu(), -1, elem, 32, ScaleRule.RCEIL)
    return t.data.to(dev), t.scales.to(dev), dequantize_mx(t, torch.float64).to(dev)
def ref_of(x, wdq, aelem, rule, bias):
    xr = fake_quantize_mx_rows(x, aelem, rule, out_dtype=torch.float32).double()
    r = xr @ wdq.t()
    a = xr.abs() @ wdq.abs().t()
    if bias is not None:
        r = r + bias.double()
    return r, a
if part in ("all", "check"):
    bad = 0
    cases = [
        (1, 1000, 640, E4M3, E4M3, None, False), (3, 1000, 640, E4M3, E4M3, "bias", True), (16, 257, 4224, E4M3, E4M3, None, True),
        (13, 130, 384, E5M2, E4M3, "bias", False), (9, 1000, 128, E4M3, E5M2, None, True), (16, 384, 4096, E4M3, E4M3, "bias", False),
        (5, 4096, 4096, E4M3, E4M3, None, False), (16, 14336, 4096, E4M3, E4M3, None, False), (8, 4096, 14336, E4M3, E4M3, "bias", True),
    ]
    for (m, n, k, we, ae, b, spread) in cases:
        w, s, wdq = mk(n, k, we, spread)
        bias = torch.randn(n, device=dev, dtype=torch.bfloat16) if b else None
        for xdt in (torch.bfloat16, torch.float32):
            x = (torch.randn(m, k, device=dev) * 3).to(xdt)
            for rule in (ScaleRule.RCEIL, ScaleRule.MSE):
                ref, a = ref_of(x, wdq, ae, rule, bias)
                cfgs = [None, DecodeWSConfig(split_k=1, box=128), DecodeWSConfig(split_k=3), DecodeWSConfig(split_k=2, fused=False, box=128), DecodeWSConfig(stages=2, split_k=4, box=128)]
                for cfg in cfgs:
                    try:
                        y = mx_decode_gemm_ws(x, w, s, bias, act_elem=ae, act_rule=rule, out_dtype=torch.float32, config=cfg)
                        torch.cuda.synchronize()
                        err = ((y.double() - ref).abs() / (a + 1e-30)).max().item()
                        yb = mx_decode_gemm_ws(x, w, s, bias, act_elem=ae, act_rule=rule, config=cfg)
                        errb = ((yb.double() - ref).abs() / (a + ref.abs() * 0 + 1e-30)).max().item()
                        ok = err <= 2 ** -12 and not torch.isnan(y).any().item()
                        bad += not ok
                        log(case=[m, n, k, we.name, ae.name, b, spread, str(xdt), rule.name], cfg=str(cfg), err_rel_abs=err, err_bf16=errb, ok=ok)
                    except Exception as ex:
                        bad += 1
                        log(case=[m, n, k], cfg=str(cfg), error=traceback.format_exc()[-600:])
    # NaN block -> NaN rows as the reference
    w, s, wdq = mk(256, 512)
    s[3, 2] = 255
    x = torch.randn(4, 512, device=dev, dtype=torch.bfloat16)
    y = mx_decode_gemm_ws(x, w, s, None, out_dtype=torch.float32)
    log(nan_row=torch.isnan(y[:, 3]).all().item(), other_finite=torch.isfinite(y[:, torch.arange(256, device=dev) != 3]).all().item())
    log(check_bad=bad)
if part in ("all", "bench", "sweep2"):
    ms = [1, 4, 16] if len(sys.argv) < 3 else [int(v) for v in sys.argv[2].split(",")]
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
                row["dispatch"] = _bench_graph([lambda p=p: mx_linear_triton(x, p[0], p[1], None, act_elem=E4M3) for p in packs])
                c0 = pick_decode_ws_config(m, n, k, x.device)
                cfgs = [c0]
                if part == "sweep2":
                    d = c0.__dict__
                    cfgs += [DecodeWSConfig(**{**d, "split_k": d["split_k"] * f, "stages": st}) for f in (1, 2, 4) for st in (2, 3) if (f, st) != (1, 2)]
                    cfgs += [DecodeWSConfig(**{**d, "maxnreg": None, "loader_regs": 40, "stages": 4})]
                if part == "bench":
                    d = c0.__dict__
                    cfgs += [DecodeWSConfig(**{**d, "stages": st}) for st in (2, 3) if st != d["stages"]]
                    cfgs += [DecodeWSConfig(**{**d, "box": 128, "stages": st}) for st in (2, 3, 4)]
                    cfgs += [DecodeWSConfig(**{**d, "box": 128, "stages": 2, "split_k": sp}) for sp in (max(1, d["split_k"] // 2), d["split_k"] * 2)]
                for cfg in cfgs:
                    try:
                        us = _bench_graph([lambda p=p: mx_decode_gemm_ws(x, p[0], p[1], None, config=cfg) for p in packs])
                    except Exception as ex:
                        log(**row, cfg=str(cfg), error=str(ex)[:300]); continue
                    log(**row, cfg=str(cfg), ws_us=us, x_cublas=row["cublas"] / us, x_dispatch=row["dispatch"] / us,
                        tbps=(n * k * 1.03125) / us / 1e6)
            del packs, wbfs, w_deq, t
            torch.cuda.empty_cache()
json.dump(res, open(f"{OUT}/ws_{part}.json", "w"), indent=1)
