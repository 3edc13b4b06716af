"""Session 20: does the decode attention's time follow the longest split (tiles per program) or the bytes?

Contexts chosen so that the default split plan (chunks of whole 64-key tiles, the last one short)
gives the longest split 20, 21, 22, 22, 23 tiles while the bytes grow evenly. Bandwidth model:
time grows ~0.95 µs per 512 keys (H200); longest-split model: ~1.4 µs per tile of the longest
split and nothing for 16384 -> 16896. Also DecodeAttnWSConfig(balanced=True): the pages dealt out
evenly (longest split 21.5 tiles at 16k instead of 22). Variants, each CUDA-graph replays
interleaved (mxq.kernels.tune.time_interleaved) over cache copies beyond L2:
  sdpa   bf16 SDPA;   full / bal   the call (default / balanced split);
  kernel / balk   the decode kernel alone (query preparation done beforehand, no merge).
B=4 Hq=32 Hkv=8 D=128, bf16 query, Q/K rotation on.

    (DecodeAttnWSConfig.balanced existed in commit 3ab8ec0 only; removed after this A/B.)

    python balance.py [contexts] [extra configs as name=field:value/field:value,...]
"""
import contextlib, dataclasses, json, os, sys
import torch
from mxq.attention import MXFP8CacheLayer
from mxq.kernels import attention as A
from mxq.kernels import attention_decode_ws as W
from mxq.kernels.tune import time_interleaved, weight_copies

dflt = W.default_config(torch.device("cuda"))
bal = dataclasses.replace(dflt, balanced=True)
extra = {}
for spec in (sys.argv[2].split(",") if len(sys.argv) > 2 else []):
    nm, fields = spec.split("=")
    kv = {}
    for f in fields.split("/"):
        k, v = f.split(":")
        kv[k] = {"True": True, "False": False}.get(v, int(v) if v.isdigit() else v)
    extra[nm] = dataclasses.replace(dflt, **kv)


class _Skip:
    def __getitem__(self, grid):
        return lambda *a, **k: None


@contextlib.contextmanager
def patched(prep=None, merge=True):
    old_p, old_m = A.decode_query_blocks, A._decode_merge_kernel
    if prep is not None:
        A.decode_query_blocks = lambda *a, **k: prep
    if not merge:
        A._decode_merge_kernel = _Skip()
    try:
        yield
    finally:
        A.decode_query_blocks, A._decode_merge_kernel = old_p, old_m


def plan(n, cfg, bh=32):
    cdiv = A._cdiv
    want = max(1, cfg.programs // bh)
    if cfg.balanced:
        pages = cdiv(n, 32)
        ns = min(want, pages)
        sizes = [min(n, (s + 1) * pages // ns * 32) - s * pages // ns * 32 for s in range(ns)]
    else:
        chunk = max(64, cdiv(cdiv(n, want), 64) * 64)
        ns = cdiv(n, chunk)
        sizes = [min(chunk, n - s * chunk) for s in range(ns)]
    return {"nsplit": ns, "programs": ns * bh, "longest_tiles": max(sizes) / 64, "mean_tiles": n / ns / 64}


ctxs = [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "15360,16128,16384,16896,17408").split(",")]
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
    prep = A.decode_query_blocks(q, hkv, gp=W.GP, qk_rotation=True, codes=True)

    def call(L, cfg=dflt, **kw):
        with patched(**kw):
            return W.mx_attention_decode_ws(q, L.k_data, L.k_scale, L.v_data, L.v_scale, n, qk_rotation=L.rotated,
                                            config=cfg, out=out)  # fmt: skip

    ref = call(layers[0]).float().clone()
    chk = {}
    fns = {"sdpa": [lambda k=k, v=v: sd(q, k, v, enable_gqa=True) for k, v in bf],
           "full": [lambda L=L: call(L) for L in layers],
           "kernel": [lambda L=L: call(L, prep=prep, merge=False) for L in layers],
           "bal": [lambda L=L: call(L, bal) for L in layers],
           "balk": [lambda L=L: call(L, bal, prep=prep, merge=False) for L in layers]}
    chk["bal"] = ((call(layers[0], bal).float() - ref).norm() / ref.norm()).item()
    for nm, cfg in extra.items():
        chk[nm] = ((call(layers[0], cfg).float() - ref).norm() / ref.norm()).item()
        fns[nm] = [lambda L=L, cfg=cfg: call(L, cfg) for L in layers]
    us = time_interleaved(fns, rounds=9, reps=5)
    row = {"context": n, "copies": len(layers), "plan_default": plan(n, dflt), "plan_balanced": plan(n, bal),
           "check": chk, **us}
    rows.append(row)
    print(f"ctx {n} ({len(layers)} copies) default {row['plan_default']} balanced {row['plan_balanced']}", flush=True)
    print("   " + " ".join(f"{k} {v:.2f}" for k, v in us.items())
          + " | x sdpa: " + " ".join(f"{k} {us['sdpa'] / v:.3f}" for k, v in us.items() if k != "sdpa"), flush=True)
    print("   rel. diff to full:", " ".join(f"{k} {v:.1e}" for k, v in chk.items()), flush=True)
    del layers, bf
dev = torch.cuda.get_device_name()
json.dump({"device": dev, "torch": torch.__version__, "default": repr(dflt), "rows": rows,
           "extra": {k: repr(v) for k, v in extra.items()}},
          open(os.path.join(os.environ.get("OUT", "/tmp"), f"balance_{dev.split()[1].lower()}.json"), "w"), indent=1)  # fmt: skip
