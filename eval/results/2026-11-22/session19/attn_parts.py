"""Session 19: where the decode attention's fixed part goes (warp-specialized kernel, CUDA graphs).

Ablations of one call (query preparation -> decode kernel -> split merge), each timed as CUDA-graph
replays interleaved with the others and bf16 SDPA (mxq.kernels.tune.time_interleaved), over
several cache copies so that every context streams from HBM:
  full      the call as shipped (default config of the device)
  noprep    the query preparation left out (its outputs computed once beforehand)
  nomerge   the split merge left out (output not valid: timing only)
  kernel    both left out: the decode kernel alone
  prep      the query preparation alone;  merge: the merge kernel alone
plus whole-call tile variants (``CFGS``). B=4 Hq=32 Hkv=8 D=128, bf16 query, Q/K rotation on.

    python attn_parts.py [contexts] [variants]
"""
import contextlib, json, os, sys
import torch
from mxq.attention import MXFP8CacheLayer
from mxq.kernels import attention as A
from mxq.kernels import attention_decode_ws as W
from mxq.kernels.tune import time_interleaved, weight_copies

C = W.DecodeAttnWSConfig
dflt = W.default_config(torch.device("cuda"))
D = dict(programs=dflt.programs, maxnreg=dflt.maxnreg)
CFGS = {
    "s3": dict(D, stages=3), "p264r80": dict(programs=264, maxnreg=80), "p330r80": dict(programs=330, maxnreg=80),
    "p528r64": dict(programs=528, maxnreg=64), "p264": dict(programs=264, maxnreg=128), "nopdl": dict(D, pdl=False),
    "nomergepdl": dict(D, merge_pdl=False), "fm": dict(D, fused_merge=True), "ppdl": dict(D, prep_pdl=True), "fm264": dict(programs=264, maxnreg=128, fused_merge=True),
}


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


ctxs = [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "1024,4096,16384,32768").split(",")]
names = (sys.argv[2] if len(sys.argv) > 2 else ",".join(CFGS)).split(",")
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
    L0 = layers[0]

    def call(L, cfg=dflt, **kw):
        with patched(**kw):
            return W.mx_attention_decode_ws(q, L.k_data, L.k_scale, L.v_data, L.v_scale, n, qk_rotation=L.rotated,
                                            config=cfg, out=out)  # fmt: skip

    ref = call(L0).float().clone()
    chk = {"noprep": (call(L0, prep=prep).float() - ref).norm().item() / ref.norm().item()}
    # the merge alone: its inputs as the kernel leaves them (work buffers of a real call)
    nsplit_work = {}
    orig_merge = A._decode_merge_kernel

    class _Grab:
        def __getitem__(self, grid):
            def f(*a, **k):
                nsplit_work["g"], nsplit_work["a"], nsplit_work["k"] = grid, a, k
                return orig_merge[grid](*a, **k)
            return f

    A._decode_merge_kernel = _Grab()
    call(L0)
    A._decode_merge_kernel = orig_merge
    fns = {"sdpa": [lambda k=k, v=v: sd(q, k, v, enable_gqa=True) for k, v in bf],
           "full": [lambda L=L: call(L) for L in layers],
           "noprep": [lambda L=L: call(L, prep=prep) for L in layers],
           "nomerge": [lambda L=L: call(L, merge=False) for L in layers],
           "kernel": [lambda L=L: call(L, prep=prep, merge=False) for L in layers],
           "prep": [lambda: A.decode_query_blocks(q, hkv, gp=W.GP, qk_rotation=True, codes=True)] * len(layers)}
    if "g" in nsplit_work:
        g, a, k = nsplit_work["g"], nsplit_work["a"], dict(nsplit_work["k"], PDL=False, launch_pdl=False)
        fns["merge"] = [lambda: orig_merge[g](*a, **k)] * len(layers)
    for nm in names:
        cfg = C(**CFGS[nm])
        chk[nm] = (call(L0, cfg).float() - ref).norm().item() / ref.norm().item()
        fns[nm] = [lambda L=L, cfg=cfg: call(L, cfg) for L in layers]
    us = time_interleaved(fns, rounds=9, reps=5)
    row = {"context": n, "copies": len(layers), "check": chk, **us}
    rows.append(row)
    print(f"ctx {n} ({len(layers)} copies): " + " ".join(f"{k} {v:.2f}" for k, v in us.items())
          + " | x sdpa: " + " ".join(f"{k} {us['sdpa'] / v:.3f}" for k, v in us.items() if k not in ("prep", "merge")),
          flush=True)  # fmt: skip
    print("   rel. diff to full:", " ".join(f"{k} {v:.1e}" for k, v in chk.items()), flush=True)
    del layers, bf
dev = torch.cuda.get_device_name()
json.dump({"device": dev, "torch": torch.__version__, "default": repr(dflt), "rows": rows,
           "configs": {k: repr(C(**v)) for k, v in CFGS.items()}},
          open(os.path.join(os.environ.get("OUT", "/tmp"), f"attn_parts_{dev.split()[1].lower()}.json"), "w"), indent=1)  # fmt: skip
