"""Session 18: interleaved A/B of the warp-specialized decode attention's tiles, with and without
Q·Kᵀ on the fp8 codes (DecodeAttnWSConfig.qk_fp8), against bf16 SDPA (enable_gqa), one process.

Every variant's CUDA graph (the call over several cache copies, so small contexts stream from HBM,
not L2) is captured first, then replayed in rotated rounds (mxq.kernels.tune.time_interleaved).
B=4 Hq=32 Hkv=8 D=128, bf16 query, Q/K rotation on (the cache layer's default).

    python attn_ab.py [contexts] [variants]      e.g. 4096,16384 base264,f8_264

The *pf* variants (DecodeAttnWSConfig.l2_prefetch) need commit cf385c0: the option measured slower
and was taken out again. Runs 2-3 (attn_ab_h100/h200.json) predate the qk_fp8 default, so their
base* rows are the fp16 route; in later runs base* = f8_* (the default config).
"""
import json, os, sys
import torch
from mxq.attention import MXFP8CacheLayer
from mxq.kernels import attention_decode_ws as W
from mxq.kernels.tune import time_interleaved, weight_copies

C = W.DecodeAttnWSConfig
CFGS = {
    "base264": dict(), "base396": dict(programs=396, maxnreg=80), "base528": dict(programs=528, maxnreg=64),
    "f8_264": dict(qk_fp8=True), "f8_396": dict(programs=396, maxnreg=80, qk_fp8=True),
    "f8_396s3": dict(programs=396, maxnreg=80, stages=3, qk_fp8=True), "f8_528": dict(programs=528, maxnreg=64, qk_fp8=True),
    "f8_264s3": dict(stages=3, qk_fp8=True), "f8_396fm": dict(programs=396, maxnreg=80, qk_fp8=True, fused_merge=True),
    "f8_264fm": dict(qk_fp8=True, fused_merge=True),
    "f8_396pf2": dict(programs=396, maxnreg=80, qk_fp8=True, l2_prefetch=2), "f8_396pf4": dict(programs=396, maxnreg=80, qk_fp8=True, l2_prefetch=4),
    "f8_264pf2": dict(qk_fp8=True, l2_prefetch=2), "f8_264pf4": dict(qk_fp8=True, l2_prefetch=4),
}
ctxs = [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "4096,8192,16384,32768").split(",")]
names = (sys.argv[2] if len(sys.argv) > 2 else ",".join(k for k in CFGS if "pf" not in k)).split(",")
b, hq, hkv, d = 4, 32, 8, 128
l2 = torch.cuda.get_device_properties(0).L2_cache_size
rows = []
torch.manual_seed(0)
for n in ctxs:
    q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
    kv_bytes = 2 * b * hkv * n * d * (1 + 1 / 32)
    layers = []
    for _ in range(weight_copies(int(kv_bytes), l2)):
        k = torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16)
        L = MXFP8CacheLayer()
        L.update(k, torch.randn_like(k))
        layers.append(L)
    bf = [tuple(torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
          for _ in range(weight_copies(2 * b * hkv * n * d * 2, l2))]  # fmt: skip
    out = torch.empty(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
    sd = torch.nn.functional.scaled_dot_product_attention
    fns = {"sdpa": [lambda k=k, v=v: sd(q, k, v, enable_gqa=True) for k, v in bf]}
    L0 = layers[0]
    args0 = (q, L0.k_data, L0.k_scale, L0.v_data, L0.v_scale, n)
    ref = W.mx_attention_decode_ws(*args0, qk_rotation=L0.rotated, config=C()).float()
    row = {"context": n, "copies": len(layers), "check": {}}
    for nm in names:
        cfg = C(**CFGS[nm])  # built when asked for: the *pf* ones need commit cf385c0
        got = W.mx_attention_decode_ws(*args0, qk_rotation=L0.rotated, config=cfg).float()
        row["check"][nm] = ((got - ref).norm() / ref.norm()).item()
        fns[nm] = [lambda L=L, cfg=cfg: W.mx_attention_decode_ws(q, L.k_data, L.k_scale, L.v_data, L.v_scale, n,
                                                                  qk_rotation=L.rotated, config=cfg, out=out)
                   for L in layers]  # fmt: skip
    us = time_interleaved(fns, rounds=9, reps=5)
    row.update(us)
    rows.append(row)
    best = min(us[nm] for nm in names)
    print(f"ctx {n} ({len(layers)} copies): sdpa {us['sdpa']:.1f} µs | "
          + " ".join(f"{nm} {us[nm]:.1f} ({us['sdpa'] / us[nm]:.2f}x{'*' if us[nm] == best else ''})" for nm in names), flush=True)
    print("   rel. diff to base264:", " ".join(f"{nm} {row['check'][nm]:.1e}" for nm in names), flush=True)
    del layers, bf
dev = torch.cuda.get_device_name()
json.dump({"device": dev, "torch": torch.__version__, "rows": rows, "configs": {k: repr(v) for k, v in CFGS.items()}},
          open(os.path.join(os.environ.get("OUT", "/tmp"), f"attn_ab_{dev.split()[1].lower()}.json"), "w"), indent=1)
