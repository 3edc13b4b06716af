"""Session 19: three ways of timing the same decode calls, in one process (H200/H100).

  A  one replay right after a synchronize; the graph makes each copy's call once (sessions <= 18)
  B  the calls cycled to >= 32 in the graph, replays timed behind a spin kernel (launch latency out)
  C  as B, with a separator kernel after every call (a bf16 RMSNorm-sized elementwise op on one
     token: what precedes and follows a GEMM or the attention in a model), minus a graph of the
     separators alone: consecutive calls can no longer overlap through programmatic dependent
     launch (PDL), which chained copies of one kernel do but a model's neighbours do not.
Cases: cuBLAS bf16 vs mxq W8A8 decode GEMM (8B o, 8B gate_up, 70B gate_up at M = 1 and 16) and bf16
SDPA vs the MXFP8 decode attention (4k, 16k)."""
import json, os
import torch
from mxq.attention import MXFP8CacheLayer
from mxq.formats import E4M3, ScaleRule, quantize_mx
from mxq.kernels import gemm as G
from mxq.kernels import attention_decode_ws as W
from mxq.kernels.dispatch import mx_linear
from mxq.kernels.tune import capture_graph, graph_calls, time_replays, weight_copies

L2 = torch.cuda.get_device_properties(0).L2_cache_size
sep_buf = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)


def sep():
    sep_buf.mul_(1.0)


def t_A(calls):
    g = capture_graph(calls)
    ts = []
    for _ in range(25):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record(); g.replay(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / len(calls))
    return sorted(ts)[12]


def t_B(calls):
    c = graph_calls(calls)
    g = capture_graph(c)
    return sorted(time_replays(g) / (2 * len(c)) for _ in range(25))[12]


def t_C(calls):
    c = graph_calls(calls)
    withsep = [f for call in c for f in (call, sep)]
    g = capture_graph(withsep)
    gs = capture_graph([sep] * len(c))
    w = sorted(time_replays(g) / (2 * len(c)) for _ in range(25))[12]
    s = sorted(time_replays(gs) / (2 * len(c)) for _ in range(25))[12]
    return w - s, s


rows = []


def case(name, base, ours):
    r = {"case": name}
    for meth, f in (("A", t_A), ("B", t_B), ("C", t_C)):
        tb, to = f(base), f(ours)
        if meth == "C":
            (tb, sb), (to, so) = tb, to
            r["sep_us"] = sb
        r[meth] = dict(base_us=tb, ours_us=to, ratio=tb / to)
    rows.append(r)
    print(f"{name:24s} " + " | ".join(f"{m}: {r[m]['base_us']:7.2f} / {r[m]['ours_us']:7.2f} = {r[m]['ratio']:.3f}x"
                                     for m in "ABC") + f" | sep {r['sep_us']:.2f}", flush=True)  # fmt: skip


torch.manual_seed(0)
for nm, (n, k) in {"8b o": (4096, 4096), "8b gate_up": (28672, 4096), "70b gate_up": (57344, 8192)}.items():
    w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
    t = quantize_mx(w, -1, E4M3, 32, ScaleRule.RCEIL)
    packs = [G.pack_weight(t.data.clone(), t.scales.clone()) for _ in range(weight_copies(n * k, L2))]
    wb = [w.clone() for _ in range(weight_copies(2 * n * k, L2))]
    for m in (1, 16):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        case(f"{nm} M={m}", [lambda w=w: x @ w.t() for w in wb],
             [lambda p=p: mx_linear(x, p.data, p.scales, None, act_elem=E4M3) for p in packs])
    del packs, wb, w, t
    torch.cuda.empty_cache()
b, hq, hkv, d = 4, 32, 8, 128
for n in (4096, 16384):
    q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
    layers = []
    for _ in range(weight_copies(int(2 * b * hkv * n * d * 1.03), L2)):
        k = torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16)
        L = MXFP8CacheLayer()
        L.update(k, torch.randn_like(k))
        layers.append(L)
    bf = [tuple(torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
          for _ in range(weight_copies(2 * b * hkv * n * d * 2, L2))]  # fmt: skip
    out = torch.empty(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
    sd = torch.nn.functional.scaled_dot_product_attention
    case(f"attention ctx {n}", [lambda k=k, v=v: sd(q, k, v, enable_gqa=True) for k, v in bf],
         [lambda L=L: W.mx_attention_decode_ws(q, L.k_data, L.k_scale, L.v_data, L.v_scale, n, qk_rotation=L.rotated, out=out)
          for L in layers])  # fmt: skip
    del layers, bf
dev = torch.cuda.get_device_name()
json.dump({"device": dev, "torch": torch.__version__, "rows": rows},
          open(os.path.join(os.environ.get("OUT", "/tmp"), f"bench_method_{dev.split()[1].lower()}.json"), "w"), indent=1)
