"""Session 7: fp8-MMA W8A8 decode (gemm_decode) vs the dispatched path vs cuBLAS bf16 (CUDA graphs, weight copies)."""
import json, os, sys, time, itertools
import torch, triton
from mxq.formats import E4M3, ScaleRule, dequantize_mx, quantize_mx
from mxq.kernels import gemm as G
from mxq.kernels.gemm_decode import mx_decode_gemm, DecodeF8Config, pick_decode_f8_config
from mxq.kernels.dispatch import mx_linear_triton
from mxq.kernels.quantize import fake_quantize_mx_rows
sys.path.insert(0, "eval")
from bench_gemm import _bench_graph, _copies, LLAMA_SHAPES
OUT = os.environ.get("OUT", "/tmp")
part = sys.argv[1] if len(sys.argv) > 1 else "main"
res = []
def log(**kw):
    res.append(kw); print(json.dumps(kw), flush=True)
    json.dump(res, open(f"{OUT}/f8_{part}.json", "w"), indent=1)
torch.manual_seed(0)
ms = {"main": [1, 4, 16, 64], "sweep": [1, 16], "qx": [1, 4, 16]}[part]
models = ["8b"] if part == "sweep" else ["8b", "70b"]
for model in models:
    for layer, (n, k) in LLAMA_SHAPES[model].items():
        w_bf16 = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
        t = quantize_mx(w_bf16, -1, E4M3, 32, ScaleRule.RCEIL)
        w_deq = dequantize_mx(t, torch.float32)
        r8, rbf = _copies(n * k), _copies(2 * n * k)
        packs = [(t.data.clone(), t.scales.clone()) for _ in range(r8)]
        wbfs = [w_deq.to(torch.bfloat16) for _ in range(rbf)]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xr = fake_quantize_mx_rows(x, E4M3, out_dtype=torch.float32).double()
            ref = xr @ w_deq.double().t()
            def check(y):
                return ((y.double() - ref).norm() / ref.norm()).item()
            row = dict(model=model, layer=layer, m=m, n=n, k=k)
            row["cublas"] = _bench_graph([lambda w=w: x @ w.t() for w in wbfs])
            row["dispatch"] = _bench_graph([lambda p=p: mx_linear_triton(x, p[0], p[1], None, act_elem=E4M3) for p in packs])
            row["dispatch_err"] = check(mx_linear_triton(x, packs[0][0], packs[0][1], None, act_elem=E4M3))
            cfg0 = pick_decode_f8_config(m, n, k, x.device)
            cfgs = [cfg0]
            if part == "sweep":
                for diag, bn, st, sm in itertools.product((False, True), (64, 128), (2, 3, 4), (1, 2)):
                    sp = max(1, int(cfg0.split_k * sm * (128 // bn if sm == 1 else 1)))
                    cfgs.append(DecodeF8Config(block_n=bn, kb=4, num_stages=st, split_k=sp, diag=diag))
                cfgs.append(DecodeF8Config(**{**cfg0.__dict__, "diag": True, "fused": False}))
                cfgs.append(DecodeF8Config(**{**cfg0.__dict__, "diag": True, "tma_w": False}))
                cfgs.append(DecodeF8Config(**{**cfg0.__dict__, "diag": True, "kb": 8}))
                cfgs.append(DecodeF8Config(**{**cfg0.__dict__, "diag": True, "kb": 2}))
            elif part == "qx":
                c = cfg0.__dict__
                cfgs = [DecodeF8Config(**{**c, "num_stages": 2}), DecodeF8Config(**{**c, "diag": True, "kb": 2, "num_stages": 4}),
                        DecodeF8Config(**{**c, "diag": True, "num_stages": 3})]
                cfgs += [DecodeF8Config(**{**c, "quant_x": True, "num_stages": st}) for st in (2, 3, 4)]
                cfgs += [DecodeF8Config(**{**c, "quant_x": True, "num_stages": 3, "split_k": max(1, c["split_k"] // 2)}),
                         DecodeF8Config(**{**c, "quant_x": True, "num_stages": 3, "split_k": c["split_k"] * 2})]
            else:
                cfgs.append(DecodeF8Config(**{**cfg0.__dict__, "fused": False}))
            for cfg in cfgs:
                try:
                    y = mx_decode_gemm(x, packs[0][0], packs[0][1], None, config=cfg, out_dtype=torch.float32)
                    e32 = check(y)
                    yb = mx_decode_gemm(x, packs[0][0], packs[0][1], None, config=cfg)
                    eb = check(yb)
                    us = _bench_graph([lambda p=p: mx_decode_gemm(x, p[0], p[1], None, config=cfg) for p in packs])
                except Exception as ex:
                    log(**row, cfg=str(cfg), error=str(ex)[:300]); continue
                log(**row, cfg=str(cfg), f8_us=us, err_f32=e32, err_bf16=eb, x_cublas=row["cublas"] / us, x_dispatch=row["dispatch"] / us)
        del packs, wbfs, w_deq, t
        torch.cuda.empty_cache()
json.dump(res, open(f"{OUT}/f8_{part}.json", "w"), indent=1)
