"""Session 9: programmatic dependent launch (quantizer -> gemm_decode_ws) on/off, dispatched W8A8 decode, vs cuBLAS bf16."""
import json, os, sys
import torch
from mxq.formats import E4M3, ScaleRule, dequantize_mx, quantize_mx
from mxq.kernels.gemm_decode_ws import mx_decode_gemm_ws, pick_decode_ws_config
from dataclasses import replace
sys.path.insert(0, "eval")
from bench_gemm import _bench_graph, _copies, LLAMA_SHAPES
OUT = os.environ.get("OUT", "/tmp")
res = []
def log(**kw):
    res.append(kw); print(json.dumps(kw), flush=True)
    json.dump(res, open(f"{OUT}/pdl_ab.json", "w"), indent=1)
torch.manual_seed(0)
dev = "cuda"
for model in ["8b", "70b"]:
    for layer, (n, k) in LLAMA_SHAPES[model].items():
        w_bf16 = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)
        t = quantize_mx(w_bf16, -1, E4M3, 32, ScaleRule.RCEIL)
        w_deq = dequantize_mx(t, torch.float32)
        r8, rbf = _copies(n * k), _copies(2 * n * k)
        packs = [(t.data.clone(), t.scales.clone()) for _ in range(r8)]
        wbfs = [w_deq.to(torch.bfloat16) for _ in range(rbf)]
        for m in (1, 4, 16):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            cfg = pick_decode_ws_config(m, n, k, x.device)
            off = replace(cfg, pdl=False)
            y1 = mx_decode_gemm_ws(x, t.data, t.scales, config=cfg, out_dtype=torch.float32)
            y0 = mx_decode_gemm_ws(x, t.data, t.scales, config=off, out_dtype=torch.float32)
            row = dict(model=model, layer=layer, m=m, n=n, k=k, same=bool(torch.equal(y0, y1)))
            row["cublas"] = _bench_graph([lambda w=w: x @ w.t() for w in wbfs])
            row["pdl_off"] = _bench_graph([lambda p=p: mx_decode_gemm_ws(x, p[0], p[1], config=off) for p in packs])
            row["pdl_on"] = _bench_graph([lambda p=p: mx_decode_gemm_ws(x, p[0], p[1], config=cfg) for p in packs])
            row["x_off"] = round(row["cublas"] / row["pdl_off"], 3)
            row["x_on"] = round(row["cublas"] / row["pdl_on"], 3)
            log(**row)
