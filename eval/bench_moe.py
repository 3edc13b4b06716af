"""Benchmark the grouped MX GEMM of mixture-of-experts layers against bf16 baselines, in one process.

    python -m mxq.eval.bench_moe --out bench_moe.json [--tokens 2048,8192] [--batches 1,4,8] [--sweep]

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
"""

# ruff: noqa: B023  (every lambda is timed at once, inside its loop iteration)
from __future__ import annotations

import argparse
import json

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
PREFILL_CANDIDATES = (
    G(256, 128, 64, num_warps=8, num_stages=3),
    G(128, 128, 64, num_warps=8, num_stages=4),
    G(128, 64, 64, num_warps=4, num_stages=4),
    G(64, 128, 64, num_warps=4, num_stages=4),
    G(128, 256, 64, num_warps=8, num_stages=3),
)
DECODE_CANDIDATES = (
    D(1, 16, 256, num_warps=4, num_stages=3),
    D(1, 32, 128, num_warps=4, num_stages=3),
    D(1, 16, 256, num_warps=4, num_stages=1),
    D(1, 32, 256, num_warps=4, num_stages=3),
    D(1, 64, 256, num_warps=8, num_stages=3),
)


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench_moe.json", help="JSON file to write")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="prefill token counts (x top-8 rows)")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)), help="decode batch sizes (x top-8 rows)")
    p.add_argument("--sweep", action="store_true", help="also time every candidate tile")
    a = p.parse_args(argv)
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
