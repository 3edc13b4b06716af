"""Benchmark the grouped MX GEMM of mixture-of-experts layers against bf16 baselines, in one process.

    python -m mxq.eval.bench_moe --out bench_moe.json [--tokens 2048,8192] [--batches 1,4,8] [--sweep]
    python -m mxq.eval.bench_moe --layer --family qwen3 --out layer_qwen3.json      # one whole experts layer
    python -m mxq.eval.bench_moe --layer --family gpt-oss --out layer_gpt_oss.json

Qwen3-30B-A3B widths: 128 experts, top-8, gate_up [128, 1536, 2048], down [128, 2048, 768]; random
top-8 routing (rows sorted by expert, ``group_end`` int32 as ``MXExperts`` builds it).

- Prefill (2048 and 8192 tokens): mxq's ``mx_grouped_linear`` W8A16 (bf16 X) and W8A8 (X rounded
  to MX in the call) against ``torch._grouped_mm`` bf16 on the dequantized weights (both weight
  layouts, the faster kept) and a bf16 per-expert loop (``torch.mm`` per group, boundaries known on
  the host). Weights (200-800 MB) and X exceed L2, so one copy of each is timed.
- Decode (B = 1, 4, 8 tokens x top-8): ``mx_grouped_linear`` per projection and both in sequence,
  as CUDA-graph replays of 16 calls over different routings (different experts, so the weights
  come from HBM), with GB/s over the bytes read (codes + scales of the active experts, X, Y) and the
  fraction of the device copy bandwidth measured in the same run; ``torch._grouped_mm`` bf16 the
  same way for scale.

Times are ``triton.testing.do_bench`` medians (L2 flushed before each run). Every mxq result is
checked first against an fp32 product of the dequantized operands. Prints tables of ratios (the
strongest baseline's time / mxq's, > 1 = mxq faster) and writes JSON with device, date, versions.
``--sweep`` also times every tile in ``PREFILL_CANDIDATES`` / ``DECODE_CANDIDATES``.

``--layer``: ONE whole experts layer as a user's model runs it, instead of the tables above. The
module is transformers' own experts module of the family (``--family qwen3``: Qwen3-30B-A3B's
128 experts top-8, hidden 2048, width 768; ``gpt-oss``: gpt-oss-20b's 32 experts top-4, hidden 2880,
width 2880, with biases and its clamped GLU), bf16 random weights, run with transformers'
``grouped_mm`` experts implementation (the baseline), and ``mxq.runtime.experts.MXExperts.from_experts`` of
it in W8A16 and W8A8 (E4M3, RCEIL). Every call takes what the model's router hands over: hidden
[T, H] bf16, ``top_k_index`` [T, k] int64 (random distinct experts), ``top_k_weights`` [T, k] bf16,
at T = ``--layer-tokens`` (1, 8, 32, 128, 2048). First, at every T, mxq's output is checked against
an fp32 reference built here from its dequantized weights (``MXExperts.dequantized_weight``) and
the family's gate (relative error < 2e-2, else FAIL and exit 1, nothing timed). Then per T and
module: device time (T <= 128: CUDA-graph replays of 16 calls on different routings, which hide the
host; above: ``do_bench`` medians), eager ``do_bench`` time, the host time of one eager call (the
call until it returns, the device idle before it), and at T <= 128 bytes / time: codes + scales
(bf16: the weights) + biases of the distinct experts the routing activates + X + Y, as GB/s and as
a fraction of the copy bandwidth measured in the same run. Table: bf16 time / mxq time (> 1: mxq
faster). ``--experts/--top-k/--hidden/--width`` override the family's widths and ``--device cpu``
runs the code path and the check on a CPU (the tests; times there are the CPU's wall time).
"""

# ruff: noqa: B023  (every lambda is timed at once, inside its loop iteration)
from __future__ import annotations

import argparse
import json
import statistics

import torch

from mxq.eval.bench_gemm import environment, save_results
from mxq.formats import E4M3, ScaleRule
from mxq.kernels.moe import GroupedDecodeConfig as D
from mxq.kernels.moe import GroupedGemmConfig as G

E, TOP_K = 128, 8
PROJ = {"gate_up": (1536, 2048), "down": (2048, 768)}  # (N, K) of Qwen3-30B-A3B's experts
TOKENS = (2048, 8192)
BATCHES = (1, 4, 8)
ROUTINGS = 16  # decode calls per graph, each on its own routing
# Tiles tried, as (block_m, block_n, block_k, warps, stages).
PREFILL_TILES = ((256, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (128, 256, 64, 8, 3))
DECODE_TILES = ((1, 16, 256, 4, 3), (1, 32, 128, 4, 3), (1, 16, 256, 4, 1), (1, 32, 256, 4, 3), (1, 64, 256, 8, 3))
PREFILL_CANDIDATES = tuple(G(m, n, k, num_warps=w, num_stages=s) for m, n, k, w, s in PREFILL_TILES)
DECODE_CANDIDATES = tuple(D(m, n, k, num_warps=w, num_stages=s) for m, n, k, w, s in DECODE_TILES)


def _bench(fn, rep: int = 60) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median") * 1e3  # µs


def _try(fn, rep: int = 60):
    try:
        return _bench(fn, rep)
    except Exception as e:  # a baseline that cannot take the shape is reported, not fatal
        return f"error: {type(e).__name__}: {str(e)[:160]}"


def _graph_us(calls):
    """Median µs per call of ``calls`` timed as replays of one graph (no launch gaps)."""
    from mxq.kernels.tune import capture_graph

    try:
        g = capture_graph(calls)
        return _bench(g.replay, rep=40) / len(calls)
    except Exception as e:
        return f"error: {type(e).__name__}: {str(e)[:160]}"


def make_experts(n: int, k: int, seed: int):
    """(fp8 codes [E, n, k], scales [E, n, k/32], bf16 dequantized [E, n, k]) of random weights."""
    from mxq.kernels.quantize import quantize_mx_rows

    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(E * n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    codes, scales = quantize_mx_rows(w, E4M3, ScaleRule.RCEIL)
    del w
    deq = codes.float().view(E * n, k // 32, 32) * torch.exp2(scales.float() - 127)[:, :, None]
    return codes.view(E, n, k), scales.view(E, n, k // 32), deq.view(E, n, k).to(torch.bfloat16)


def routing(tokens: int, gen: torch.Generator, token_of_row: bool = False):
    """Random top-k routing (distinct experts per token): int32 row ends per expert of the rows
    sorted by expert (and, with ``token_of_row``, each sorted row's token)."""
    ids = torch.rand(tokens, E, generator=gen).topk(TOP_K, dim=1).indices.reshape(-1)
    ends = torch.bincount(ids, minlength=E).cumsum(0).to(torch.int32).cuda()
    return (ends, (torch.argsort(ids, stable=True) // TOP_K).cuda()) if token_of_row else ends


def _check(y, x, ge, deq, act):
    """Relative error of y against an fp32 product of the dequantized weights over the rows of experts
    0-63 (inf if a row past group_end[-1] is not zero)."""
    from mxq.kernels.quantize import fake_quantize_mx_rows

    xf = x.float() if act is None else fake_quantize_mx_rows(x, act, out_dtype=torch.float32)
    ends, start, num, den = ge.tolist(), 0, 0.0, 0.0
    for e, end in enumerate(ends):
        if end > start and e < 64:
            ref = xf[start:end] @ deq[e].float().t()
            num += (y[start:end].float() - ref).norm().item() ** 2
            den += ref.norm().item() ** 2
        start = max(start, end)
    if start < y.shape[0] and y[start:].abs().max().item() != 0:
        return float("inf")
    return (num / max(den, 1e-30)) ** 0.5


def bench_prefill(tokens_list, sweep: bool) -> list[dict]:
    from mxq.kernels import moe
    from mxq.kernels.quantize import fake_quantize_mx_rows

    rows = []
    gen = torch.Generator().manual_seed(0)
    for proj, (n, k) in PROJ.items():
        codes, scales, deq = make_experts(n, k, seed=n + k)
        deq_t = deq.transpose(-2, -1)  # [E, K, N], column-major: F.linear's layout
        deq_tc = None
        for tokens in tokens_list:
            ge, token_of_row = routing(tokens, gen, token_of_row=True)
            s = tokens * TOP_K
            x_tokens = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
            x = x_tokens[token_of_row]
            ends = ge.tolist()
            row = dict(phase="prefill", proj=proj, tokens=tokens, s=s, n=n, k=k, e=E, top_k=TOP_K,
                       rows_min=min(b - a for a, b in zip([0] + ends, ends)), rows_max=max(b - a for a, b in zip([0] + ends, ends)))  # fmt: skip
            for name, act in (("w8a16", None), ("w8a8", E4M3)):
                y = moe.mx_grouped_linear(x, ge, codes, scales, act_elem=act)
                row[f"{name}_relerr"] = _check(y, x, ge, deq, act)
            p = moe.grouped_problem(x, codes, None, ScaleRule.RCEIL, 32, "auto")
            row["path"] = moe.grouped_path(p).describe(p)
            row["grouped_mm_bf16_us"] = _try(lambda: torch._grouped_mm(x, deq_t, offs=ge))
            if deq_tc is None:
                deq_tc = deq_t.contiguous()
            row["grouped_mm_bf16_rowmajor_us"] = _try(lambda: torch._grouped_mm(x, deq_tc, offs=ge))
            y_loop = torch.empty(s, n, device="cuda", dtype=torch.bfloat16)

            def loop():
                start = 0
                for e, end in enumerate(ends):
                    if end > start:
                        torch.mm(x[start:end], deq[e].t(), out=y_loop[start:end])
                    start = end

            row["loop_bf16_us"] = _try(loop)
            row["mxq_w8a16_us"] = _try(lambda: moe.mx_grouped_linear(x, ge, codes, scales))
            row["mxq_w8a8_us"] = _try(lambda: moe.mx_grouped_linear(x, ge, codes, scales, act_elem=E4M3))
            # X into sorted order, MX-rounded (W8A8): one pass against a gather then the quantizer
            row["gather_round_us"] = _try(lambda: moe.gather_mx_rows(x_tokens, token_of_row, E4M3, out_dtype=torch.bfloat16))
            row["gather_then_round_us"] = _try(lambda: fake_quantize_mx_rows(x_tokens[token_of_row], E4M3, out_dtype=torch.bfloat16))
            if sweep:
                row["sweep_w8a16_us"] = {}
                for cfg in PREFILL_CANDIDATES:
                    yc = moe.mx_grouped_gemm(x, ge, codes, scales, config=cfg)
                    err = _check(yc, x, ge, deq, None)
                    t = _try(lambda: moe.mx_grouped_gemm(x, ge, codes, scales, config=cfg)) if err < 1e-2 else f"wrong: relerr {err:.2e}"
                    row["sweep_w8a16_us"][str(cfg)] = t
            flops = 2 * s * n * k
            for key in ("mxq_w8a16", "mxq_w8a8", "grouped_mm_bf16", "grouped_mm_bf16_rowmajor", "loop_bf16"):
                if isinstance(row[f"{key}_us"], float):
                    row[f"{key}_tflops"] = flops / row[f"{key}_us"] / 1e6
            rows.append(row)
            print(json.dumps(row), flush=True)
        codes = scales = deq = deq_t = deq_tc = None  # free before the next projection's weights
        torch.cuda.empty_cache()
    return rows


def copy_bandwidth() -> float:
    """Device-to-device copy GB/s (bytes read + written) of a 1 GiB buffer."""
    x = torch.empty(1 << 29, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    t = _bench(lambda: y.copy_(x), rep=100)
    return 2 * x.numel() * 2 / t / 1e3


def bench_decode(batches, copy_gbs: float, sweep: bool) -> list[dict]:
    from mxq.kernels import moe
    from mxq.kernels.quantize import fake_quantize_mx_rows

    rows = []
    weights = {p: make_experts(n, k, seed=n * 3 + k) for p, (n, k) in PROJ.items()}
    gen = torch.Generator().manual_seed(1)
    for b in batches:
        s = b * TOP_K
        ges = [routing(b, gen) for _ in range(ROUTINGS)]
        active = [int((torch.diff(g, prepend=g.new_zeros(1)) > 0).sum()) for g in ges]
        xs = {p: [torch.randn(s, k, device="cuda", dtype=torch.bfloat16) for _ in ges] for p, (n, k) in PROJ.items()}
        both = dict(us=0.0, bytes=0.0)
        for proj, (n, k) in PROJ.items():
            codes, scales, deq = weights[proj]
            deq_t = deq.transpose(-2, -1)
            xl = xs[proj]
            row = dict(phase="decode", proj=proj, batch=b, s=s, n=n, k=k, e=E, top_k=TOP_K,
                       active_experts=sum(active) / len(active))  # fmt: skip
            weight_bytes = row["active_experts"] * n * k * (1 + 1 / 32)
            row["bytes"] = weight_bytes + s * k * 2 + s * n * 2 + E * 4
            p = moe.grouped_problem(xl[0], codes, None, ScaleRule.RCEIL, 32, "auto")
            row["path"] = moe.grouped_path(p).describe(p)
            for name, act in (("w8a16", None), ("w8a8", E4M3)):
                y = moe.mx_grouped_linear(xl[0], ges[0], codes, scales, act_elem=act)
                row[f"{name}_relerr"] = _check(y, xl[0], ges[0], deq, act)
                t = _graph_us([lambda x=x, g=g: moe.mx_grouped_linear(x, g, codes, scales, act_elem=act) for x, g in zip(xl, ges)])
                row[f"mxq_{name}_us"] = t
                if isinstance(t, float):
                    row[f"mxq_{name}_gbs"] = row["bytes"] / t / 1e3
                    row[f"mxq_{name}_frac_copy"] = row[f"mxq_{name}_gbs"] / copy_gbs
            if sweep:
                row["sweep_us"] = {}
                for cfg in DECODE_CANDIDATES:
                    for name, act in (("w8a16", None), ("w8a8", E4M3)):
                        yc = moe.mx_grouped_decode(xl[0], ges[0], codes, scales, act_elem=act, config=cfg)
                        err = _check(yc, xl[0], ges[0], deq, act)
                        row["sweep_us"][f"{name} {cfg}"] = _graph_us(
                            [lambda x=x, g=g: moe.mx_grouped_decode(x, g, codes, scales, act_elem=act, config=cfg) for x, g in zip(xl, ges)]
                        ) if err < 1e-2 else f"wrong: relerr {err:.2e}"  # fmt: skip
                # W8A8 as the quantizer launch, then the W8A16 kernel on the rounded rows
                row["sweep_us"][f"w8a8 quantizer first {cfg}"] = _graph_us([
                    lambda x=x, g=g: moe.mx_grouped_decode(fake_quantize_mx_rows(x, E4M3, out_dtype=torch.bfloat16), g, codes, scales, config=cfg)
                    for x, g in zip(xl, ges)
                ])  # fmt: skip
            # last: a baseline that fails under capture cannot disturb mxq's timings
            row["grouped_mm_bf16_us"] = _graph_us([lambda x=x, g=g: torch._grouped_mm(x, deq_t, offs=g) for x, g in zip(xl, ges)])
            if isinstance(row["mxq_w8a16_us"], float):
                both["us"] += row["mxq_w8a16_us"]
                both["bytes"] += row["bytes"]
            rows.append(row)
            print(json.dumps(row), flush=True)
        # both projections back to back in one graph (the gate between them left out)
        calls = [lambda i=i: (moe.mx_grouped_linear(xs["gate_up"][i], ges[i], *weights["gate_up"][:2]),
                              moe.mx_grouped_linear(xs["down"][i], ges[i], *weights["down"][:2])) for i in range(ROUTINGS)]  # fmt: skip
        t = _graph_us(calls)
        row = dict(phase="decode", proj="gate_up+down", batch=b, s=s, bytes=both["bytes"], mxq_w8a16_us=t)
        if isinstance(t, float):
            row["mxq_w8a16_gbs"] = both["bytes"] / t / 1e3
            row["mxq_w8a16_frac_copy"] = row["mxq_w8a16_gbs"] / copy_gbs
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _fmt(v, spec=".1f"):
    return format(v, spec) if isinstance(v, float) else "-"


def _ratio(base, ours):
    return base / ours if isinstance(base, float) and isinstance(ours, float) else None


def print_tables(res: dict) -> None:
    print("\n## Prefill: speed-up of mxq over the strongest bf16 baseline (its time / mxq time; > 1 = mxq faster)")
    print("| tokens | proj | N | K | grouped_mm bf16 µs | loop bf16 µs | W8A16 µs | ×strongest | W8A8 µs | ×strongest | W8A16 TFLOP/s | relerr | path |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in res.get("prefill", []):
        gm = [v for v in (r["grouped_mm_bf16_us"], r["grouped_mm_bf16_rowmajor_us"]) if isinstance(v, float)]
        base = [v for v in gm + [r["loop_bf16_us"]] if isinstance(v, float)]
        strongest = min(base) if base else None
        print(
            f"| {r['tokens']} | {r['proj']} | {r['n']} | {r['k']} | {_fmt(min(gm) if gm else None)} | {_fmt(r['loop_bf16_us'])} | "
            f"{_fmt(r['mxq_w8a16_us'])} | {_fmt(_ratio(strongest, r['mxq_w8a16_us']), '.2f')} | {_fmt(r['mxq_w8a8_us'])} | "
            f"{_fmt(_ratio(strongest, r['mxq_w8a8_us']), '.2f')} | {_fmt(r.get('mxq_w8a16_tflops'), '.0f')} | "
            f"{r['w8a16_relerr']:.1e}/{r['w8a8_relerr']:.1e} | {r['path']} |"
        )
    for r in res.get("prefill", []):
        print(f"gather+round {r['tokens']}x{r['k']}: one pass {_fmt(r.get('gather_round_us'))} µs, gather then quantizer {_fmt(r.get('gather_then_round_us'))} µs")
    print(f"\n## Decode: bytes read / time, against the copy bandwidth measured here ({_fmt(res.get('copy_gbs'), '.0f')} GB/s)")
    print("| B | proj | active experts | MB read | W8A16 µs | GB/s | % copy | W8A8 µs | % copy | grouped_mm bf16 µs | ×bf16 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in res.get("decode", []):
        print(
            f"| {r['batch']} | {r['proj']} | {_fmt(r.get('active_experts'))} | {r['bytes'] / 1e6:.1f} | {_fmt(r['mxq_w8a16_us'])} | "
            f"{_fmt(r.get('mxq_w8a16_gbs'), '.0f')} | {_fmt(100 * r['mxq_w8a16_frac_copy'] if 'mxq_w8a16_frac_copy' in r else None, '.0f')} | "
            f"{_fmt(r.get('mxq_w8a8_us'))} | {_fmt(100 * r['mxq_w8a8_frac_copy'] if 'mxq_w8a8_frac_copy' in r else None, '.0f')} | "
            f"{_fmt(r.get('grouped_mm_bf16_us'))} | {_fmt(_ratio(r.get('grouped_mm_bf16_us'), r['mxq_w8a16_us']), '.2f')} |"
        )
    for r in res.get("prefill", []) + res.get("decode", []):
        for key in ("sweep_w8a16_us", "sweep_us"):
            for cfg, t in r.get(key, {}).items():
                print(f"sweep {r['phase']} {r['proj']} {r.get('tokens', r.get('batch'))}: {_fmt(t)} µs  {cfg}")


# --- one whole experts layer as a model runs it (--layer) -------------------------------------------

# The experts module of a family at a real model's widths: transformers model_type, experts, top-k,
# hidden, expert width (intermediate size). gpt-oss adds biases, interleaved gate/up and a clamped GLU.
LAYER_FAMILIES = {
    "qwen3": dict(model_type="qwen3_moe", experts=128, top_k=8, hidden=2048, width=768),  # Qwen3-30B-A3B
    "gpt-oss": dict(model_type="gpt_oss", experts=32, top_k=4, hidden=2880, width=2880),  # gpt-oss-20b
}
LAYER_TOKENS = (1, 8, 32, 128, 2048)
GRAPH_MAX_TOKENS = 128  # up to here (decode sizes) CUDA-graph replays over ROUTINGS routings; above, do_bench medians
LAYER_RELERR = 2e-2  # mxq's output against the fp32 reference of its own dequantized weights


def build_experts_layer(family: str, experts: int, top_k: int, hidden: int, width: int, device: torch.device, seed: int = 0):
    """transformers' experts module of ``family`` (``Qwen3MoeExperts`` / ``GptOssExperts``) in bf16 on
    ``device``, its forward set to ``grouped_mm`` (transformers 5.17's default for a model, set here
    because a module built alone has no model to choose it). Random weights N(0, 0.02) (transformers'
    initializer_range); gpt-oss's biases, zero in transformers' initialisation, drawn the same way so
    that they count in the check."""
    from transformers import AutoConfig

    model_type = LAYER_FAMILIES[family]["model_type"]
    if model_type == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts as cls

        kw = dict(moe_intermediate_size=width, num_experts=experts)
    else:
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts as cls

        kw = dict(intermediate_size=width, num_local_experts=experts)
    cfg = AutoConfig.for_model(model_type, hidden_size=hidden, num_experts_per_tok=top_k, **kw)
    cfg._experts_implementation = "grouped_mm"
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            module = cls(cfg)
    finally:
        torch.set_default_dtype(prev)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32) * 0.02)
    return module.requires_grad_(False).eval()


def layer_inputs(tokens: int, experts: int, top_k: int, hidden: int, gen: torch.Generator, device: torch.device):
    """One call's inputs as the model's router hands them over: hidden [T, H] bf16, ``top_k_index``
    [T, k] int64 (k distinct random experts per token), ``top_k_weights`` [T, k] bf16 (softmax, sums to 1)."""
    x = torch.randn(tokens, hidden, generator=gen).to(device, torch.bfloat16)
    idx = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=1).indices.to(device)
    w = torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=-1).to(device, torch.bfloat16)
    return x, idx, w


def family_gate(family: str, h: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """The family's gate on the gate-up product, written out here (not the module's): Qwen3 SiLU(gate)·up
    on [gate | up] halves; gpt-oss (up + 1)·gate·sigmoid(alpha·gate) on interleaved columns, gate clamped
    above at ``limit`` and up to [-limit, limit]."""
    if family == "qwen3":
        g, u = h.chunk(2, dim=-1)
        return torch.nn.functional.silu(g) * u
    g, u = h[..., ::2].clamp(max=limit), h[..., 1::2].clamp(-limit, limit)
    return (u + 1) * (g * torch.sigmoid(g * alpha))  # transformers' order of operations (bf16 rounds each)


def reference_weights(q) -> tuple:
    """(w1, b1, w2, b2) of an ``MXExperts``: its dequantized weights (``MXExperts.dequantized_weight``,
    float32 [E, N, K]) and its biases in float32 (None without)."""
    up, down = q.projections
    bias = lambda p: getattr(q, p + "_bias").float() if getattr(q, p + "_bias", None) is not None else None
    return q.dequantized_weight(up), bias(up), q.dequantized_weight(down), bias(down)


def layer_reference(weights: tuple, family: str, x, idx, w, alpha: float, limit: float, act, block_size: int = 32) -> torch.Tensor:
    """The layer's output in fp32 from ``reference_weights`` of the quantized module, independent of
    mxq's kernels and of its forward: per expert, its tokens' product, ``family_gate``, the down
    product, and the routing-weighted sum over the slots. For W8A8 (``act``, the activations'
    TensorSpec) X and the down projection's input are MX-rounded along K as the spec says
    (``mxq.formats.fake_quantize_mx``, the format's definition). Products and sums in fp32; the
    gate-up product is rounded to X's dtype (bf16), as the layer's (and transformers') projection
    returns it, and the gate runs in that dtype, every op rounding, as the model's own gate does.
    Without those roundings W8A8's MX rounding of the gate's output lands one E4M3 step away wherever
    a bf16 rounding moved a value across a rounding boundary: ~1e-2 of difference that is no error."""
    from mxq.formats import fake_quantize_mx

    w1, b1, w2, b2 = weights
    rnd = (lambda t: fake_quantize_mx(t, -1, act.elem, block_size, act.scale_rule)) if act is not None else (lambda t: t)
    xf = rnd(x.float())
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    for e in idx.unique().tolist():
        tok, slot = (idx == e).nonzero(as_tuple=True)
        h = (xf[tok] @ w1[e].t() + (b1[e] if b1 is not None else 0.0)).to(x.dtype)
        y = rnd(family_gate(family, h, alpha, limit).float()) @ w2[e].t() + (b2[e] if b2 is not None else 0.0)
        out.index_add_(0, tok, y * w[tok, slot].float()[:, None])
    return out


def host_us(fn, device: torch.device, calls: int = 20) -> float:
    """Median wall µs of one eager call until it returns to Python, with the device idle before it
    (synchronized, then the clock, the call, the clock, before synchronizing): what the host spends
    issuing the call. On a CPU the call is the whole computation."""
    import time

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    ts = []
    for _ in range(calls):
        sync()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    sync()
    return 1e6 * statistics.median(ts)


def _fused_block(q, x) -> bool | None:
    """Whether mxq's fused experts block (``mxq.kernels.moe_block``) runs this call; None where the
    module cannot say (informative only)."""
    try:
        return bool(q.gate_kind and q.block_runs(x))
    except Exception:  # noqa: BLE001
        return None


def bench_layer(family: str, experts: int, top_k: int, hidden: int, width: int, tokens_list, device: torch.device,
                copy_gbs: float | None) -> tuple[list[dict], list[str]]:  # fmt: skip
    """One experts layer of ``family`` at each token count: transformers' bf16 module (``grouped_mm``)
    against ``MXExperts.from_experts`` of it in W8A16 (bf16 activations) and W8A8 (E4M3 RCEIL
    activations), on the same routing. Per token count, after the correctness check (module doc):

    * ``<role>_us``: device time of one call. On a GPU, at T <= ``GRAPH_MAX_TOKENS`` CUDA-graph replays of
      ``ROUTINGS`` calls, each on its own routing (the weights come from HBM; no launch gaps: the
      host does not count), above a ``do_bench`` median (L2 flushed). On a CPU, ``host_us``.
    * ``<role>_eager_us``: ``do_bench`` median of eager calls back to back (host and device overlap:
      the larger of the two); ``<role>_host_us``: ``host_us``.
    * at T <= ``GRAPH_MAX_TOKENS`` on a GPU: ``<role>_gbs`` = bytes / time, bytes = the codes and scales
      (bf16: the weights) and biases of the distinct experts the routings activate + X + Y, and
      ``<role>_frac_copy``, that over ``copy_gbs``.

    Returns the rows and the failed checks (empty when every check passed; then nothing is timed)."""
    from mxq.formats import E4M3
    from mxq.recipe import TensorSpec
    from mxq.runtime.experts import MXExperts

    cuda = device.type == "cuda"
    bf16 = build_experts_layer(family, experts, top_k, hidden, width, device)
    mods = {"bf16": bf16}
    for role, act in (("w8a16", None), ("w8a8", TensorSpec(E4M3, ScaleRule.RCEIL))):
        mods[role] = MXExperts.from_experts(bf16, TensorSpec(E4M3, ScaleRule.RCEIL), act).eval()
    alpha, limit = float(getattr(bf16, "alpha", 1.702)), float(getattr(bf16, "limit", 7.0))
    has_bias = mods["w8a16"].has_bias
    # bytes one active expert costs: gate_up [2I, H] and down [H, I] (fp8 codes + one E8M0 scale per 32,
    # or bf16), and bf16 biases [2I] and [H]
    weights, bias_elems = 3 * width * hidden, (2 * width + hidden if has_bias else 0)
    mx_bytes_expert, bf16_bytes_expert = weights * (1 + 1 / 32) + 2 * bias_elems, weights * 2 + 2 * bias_elems
    gen = torch.Generator().manual_seed(0)
    inputs = {t: [layer_inputs(t, experts, top_k, hidden, gen, device)
                  for _ in range(ROUTINGS if cuda and t <= GRAPH_MAX_TOKENS else 1)] for t in tokens_list}  # fmt: skip
    rows, failed, ref_weights = [], [], {}
    with torch.inference_mode():
        for t in tokens_list:  # correctness first, every size
            x, idx, w = inputs[t][0]
            row = dict(family=family, tokens=t, experts=experts, top_k=top_k, hidden=hidden, width=width, bias=has_bias)
            ref_bf16 = bf16(x, idx, w).float()
            for role in ("w8a16", "w8a8"):
                q = mods[role]
                row[f"{role}_fused"] = _fused_block(q, x)
                if role not in ref_weights:
                    ref_weights[role] = reference_weights(q)
                ref = layer_reference(ref_weights[role], family, x, idx, w, alpha, limit, q.act, q.block_size)
                y = q(x, idx, w).float()
                row[f"{role}_relerr"] = float((y - ref).norm() / ref.norm())
                row[f"{role}_vs_bf16"] = float((y - ref_bf16).norm() / ref_bf16.norm())  # information: the quantization's effect
                if not row[f"{role}_relerr"] < LAYER_RELERR:  # NaN fails too
                    failed.append(f"{family} T={t} {role}: relative error {row[f'{role}_relerr']:.3e} against the fp32 "
                                  f"reference (limit {LAYER_RELERR})")  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
        ref_weights.clear()  # float32 copies of the weights: not kept while timing
        if failed:
            return rows, failed
        for row in rows:
            t, calls = row["tokens"], inputs[row["tokens"]]
            x, idx, w = calls[0]
            if t <= GRAPH_MAX_TOKENS:
                active = statistics.mean([int(i.unique().numel()) for _, i, _ in calls])
                row["active_experts"] = active
                io = 2 * 2 * t * hidden  # X read, Y written, bf16
                row["mxq_bytes"] = active * mx_bytes_expert + io
                row["bf16_bytes"] = active * bf16_bytes_expert + io
            for role in ("w8a16", "w8a8", "bf16"):  # the baseline last: a capture it failed cannot disturb mxq's timings
                m = mods[role]
                row[f"{role}_host_us"] = host_us(lambda: m(x, idx, w), device, calls=20 if cuda else 3)
                if not cuda:
                    row[f"{role}_us"] = row[f"{role}_eager_us"] = row[f"{role}_host_us"]
                    continue
                row[f"{role}_eager_us"] = _try(lambda: m(x, idx, w))
                if t <= GRAPH_MAX_TOKENS:
                    row[f"{role}_us"] = _graph_us([lambda xc=xc, ic=ic, wc=wc: m(xc, ic, wc) for xc, ic, wc in calls])
                    nbytes = row["bf16_bytes" if role == "bf16" else "mxq_bytes"]
                    if isinstance(row[f"{role}_us"], float):
                        row[f"{role}_gbs"] = nbytes / row[f"{role}_us"] / 1e3
                        row[f"{role}_frac_copy"] = row[f"{role}_gbs"] / copy_gbs if copy_gbs else None
                else:
                    row[f"{role}_us"] = row[f"{role}_eager_us"]
            row["timed_as"] = ("graph" if t <= GRAPH_MAX_TOKENS else "do_bench") if cuda else "cpu wall"
            print(json.dumps(row), flush=True)
    return rows, failed


def print_layer_table(res: dict) -> None:
    """The ``--layer`` record as markdown: times, ratios bf16 / mxq (> 1: mxq faster), host times, bandwidth."""
    lay = res["layer"]
    print(f"\n## One experts layer, {res['family']}: {lay['experts']} experts top-{lay['top_k']}, hidden {lay['hidden']}, "
          f"expert width {lay['width']}{', biases' if lay['bias'] else ''} ({res['env']['device']}); "
          f"bf16 = transformers' grouped_mm module; ×bf16 = bf16 time / mxq time (> 1: mxq faster)")  # fmt: skip
    print("| T | timed as | bf16 µs | W8A16 µs | ×bf16 | W8A8 µs | ×bf16 | eager µs bf16 / W8A16 / W8A8 | "
          "host µs bf16 / W8A16 / W8A8 | active experts | W8A16 GB/s | % copy W8A16 / W8A8 / bf16 | relerr W8A16 / W8A8 | "
          "fused block W8A16 / W8A8 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    pct = lambda r, k: _fmt(100 * r[k] if isinstance(r.get(k), float) else None, ".0f")
    for r in res.get("layer_rows", []):
        print(
            f"| {r['tokens']} | {r.get('timed_as', '-')} | {_fmt(r.get('bf16_us'))} | {_fmt(r.get('w8a16_us'))} | "
            f"{_fmt(_ratio(r.get('bf16_us'), r.get('w8a16_us')), '.2f')} | {_fmt(r.get('w8a8_us'))} | "
            f"{_fmt(_ratio(r.get('bf16_us'), r.get('w8a8_us')), '.2f')} | "
            f"{' / '.join(_fmt(r.get(f'{k}_eager_us')) for k in ('bf16', 'w8a16', 'w8a8'))} | "
            f"{' / '.join(_fmt(r.get(f'{k}_host_us')) for k in ('bf16', 'w8a16', 'w8a8'))} | {_fmt(r.get('active_experts'))} | "
            f"{_fmt(r.get('w8a16_gbs'), '.0f')} | {' / '.join(pct(r, f'{k}_frac_copy') for k in ('w8a16', 'w8a8', 'bf16'))} | "
            f"{r['w8a16_relerr']:.1e} / {r['w8a8_relerr']:.1e} | {r.get('w8a16_fused', '-')} / {r.get('w8a8_fused', '-')} |"
        )


def run_layer(a) -> int:
    """``--layer``: ``bench_layer`` for ``--family`` (widths overridable), JSON through ``save_results``;
    exit 1 (after printing FAIL) when a correctness check fails."""
    import platform

    device = torch.device(a.device)
    if device.type == "cuda":
        env = environment("bench_moe")
        if env is None:
            return 2
        copy_gbs = copy_bandwidth()
        print(f"copy {copy_gbs:.0f} GB/s", flush=True)
    else:  # a smoke run: the code path and the correctness check; the times are the CPU's
        import datetime

        env = dict(device="cpu", torch=torch.__version__, python=platform.python_version(), date=datetime.date.today().isoformat())
        copy_gbs = None
    f = LAYER_FAMILIES[a.family]
    dims = {k: getattr(a, k) if getattr(a, k) is not None else f[k] for k in ("experts", "top_k", "hidden", "width")}
    tokens = [int(v) for v in a.layer_tokens.split(",")]
    rows, failed = bench_layer(a.family, dims["experts"], dims["top_k"], dims["hidden"], dims["width"], tokens, device, copy_gbs)
    res = {"env": env, "mode": "layer", "family": a.family, "layer": dict(dims, bias=bool(rows and rows[0]["bias"])),
           "copy_gbs": copy_gbs, "layer_rows": rows, "failed": failed}  # fmt: skip
    if failed:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)
        for line in failed:
            print(f"FAIL {line}", flush=True)
        return 1
    return save_results(res, a.out, print_layer_table)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench_moe.json", help="JSON file to write")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="prefill token counts (x top-8 rows)")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)), help="decode batch sizes (x top-8 rows)")
    p.add_argument("--sweep", action="store_true", help="also time every candidate tile")
    lay = p.add_argument_group("one experts layer (--layer)")
    lay.add_argument("--layer", action="store_true",
                     help="time one whole experts layer (transformers' bf16 grouped_mm module against MXExperts W8A16 and W8A8) "
                          "instead of the grouped GEMM tables")
    lay.add_argument("--family", choices=sorted(LAYER_FAMILIES), default="qwen3",
                     help="qwen3: Qwen3-30B-A3B widths (128 experts top-8, hidden 2048, width 768); gpt-oss: gpt-oss-20b "
                          "(32 experts top-4, hidden 2880, width 2880, biases)")
    lay.add_argument("--layer-tokens", default=",".join(map(str, LAYER_TOKENS)), help="tokens per call")
    for flag, what in (("--experts", "number of experts"), ("--top-k", "experts per token"), ("--hidden", "hidden size"),
                       ("--width", "expert width (intermediate size)")):
        lay.add_argument(flag, type=int, default=None, help=f"override the family's {what} (tests: tiny widths on a CPU)")
    lay.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run of the code path and the check")
    a = p.parse_args(argv)
    if a.layer:
        return run_layer(a)
    env = environment("bench_moe")
    if env is None:
        return 2
    res = {"env": env, "copy_gbs": copy_bandwidth()}
    print(f"copy {res['copy_gbs']:.0f} GB/s", flush=True)
    if a.batches:
        res["decode"] = bench_decode([int(v) for v in a.batches.split(",")], res["copy_gbs"], a.sweep)
    if a.tokens:
        res["prefill"] = bench_prefill([int(v) for v in a.tokens.split(",")], a.sweep)
    return save_results(res, a.out, print_tables)


if __name__ == "__main__":
    raise SystemExit(main())
