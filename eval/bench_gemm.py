"""Benchmark the MX GEMM and activation quantizer against the baselines, in one process.

    python -m mxq.eval.bench_gemm --out bench.json [--models 8b,70b,70b-tp2] [--ms 1,16,64,256,2048,8192]

For every Llama-3 linear shape and M: cuBLAS bf16 (``x @ w.T``), ``torch._scaled_mm`` fp8
rowwise (GEMM only, operands pre-quantized: the strongest fp8 baseline), ``tl.dot_scaled``
W8A8 (quantize + GEMM, best of a few tiles) and mxq's ``mx_linear`` W8A8 (quantize + GEMM)
and W8A16. Times are ``triton.testing.do_bench`` medians (L2 flushed before each run). Each
mxq result is checked against a float32 product of the dequantized operands first.
Also: activation quantization bandwidth against device-to-device copy bandwidth, and for decode
sizes (M <= 16) the bytes each GEMM reads per second as a share of a measured copy bandwidth
(``copy_bandwidth``: one 1 GiB device-to-device copy, read + write bytes), beside a copy moving the
GEMM's bytes, timed the same way (``same_bytes_copy``): the share a single launch of that size reaches;
and the W8A8 decode GEMM "chained" (``graph_us`` with ``producer_separator``): on the producer's codes with the residual-add +
RMSNorm producer between calls, as in a fused decode step, where each kernel launches behind the one
before it and overlaps its ramp with that one's tail (programmatic dependent launch).
Prints tables of ratios (baseline time / mxq time, > 1 is faster) and writes JSON.
"""

# ruff: noqa: B023  (every lambda is timed at once, inside its loop iteration)
from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys

import torch

LLAMA_SHAPES = {  # layer: (N, K); qkv and gate/up fused as serving stacks run them
    "8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
    "70b": {"qkv": (10240, 8192), "o": (8192, 8192), "gate_up": (57344, 8192), "down": (8192, 28672)},
}


def tp_shapes(shapes: dict, tp: int) -> dict:
    """One rank's shapes under tensor parallelism ``tp`` as ``mxq.runtime.tp`` shards them: qkv and gate/up by
    output rows (N / tp), o and down by input columns (K / tp)."""
    return {layer: (n // tp, k) if layer in ("qkv", "gate_up") else (n, k // tp) for layer, (n, k) in shapes.items()}


LLAMA_SHAPES["70b-tp2"] = tp_shapes(LLAMA_SHAPES["70b"], 2)
MS = (1, 4, 16, 64, 256, 2048, 8192)


def median_us(fn) -> float:
    """Median µs of ``fn`` by ``triton.testing.do_bench`` (L2 flushed before each run)."""
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3  # µs


def graph_us(fns, sep=None) -> float:
    """Median µs per call of ``fns`` (the same call over different weight copies, so weights come
    from HBM, not L2, as in a model), timed as CUDA-graph replays by ``tune.time_interleaved``: at
    least ``tune.MIN_GRAPH_CALLS`` calls a graph, a model-like separator kernel between calls
    (subtracted), the graph's launch latency hidden behind a spin kernel. Graphs remove launch
    gaps, which at decode sizes would otherwise be most of what is measured. ``sep``: the call put
    between calls instead of the plain kernel (``producer_separator``: the cost of each call in a
    chain of kernels that overlap their launches and ramps, as in a fused decode step)."""
    from mxq.kernels.tune import time_interleaved

    return time_interleaved({"call": fns}, rounds=5, reps=5, sep=sep)["call"]


def producer_separator(k: int = 4096):
    """The decode GEMM's neighbour in a fused model: the residual-add + RMSNorm producer of one token
    row of ``k`` (launched behind the kernel before it, letting the one behind it start: programmatic
    dependent launch)."""
    from mxq.formats import E4M3
    from mxq.kernels.producers import add_rmsnorm_mx

    x, r, w = (torch.ones(1, k, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    return lambda: add_rmsnorm_mx(x, r, w[0], 1e-5, E4M3)


def weight_copies(nbytes: int) -> int:
    """Weight copies whose total exceeds three times an L2 of 60 MB (the H200's), at most 8."""
    from mxq.kernels import tune

    return tune.weight_copies(nbytes, 60_000_000)


def _try(fn, graph=None, sep=None):
    try:
        return graph_us(graph, sep) if graph is not None else median_us(fn)
    except Exception as e:  # a baseline that cannot take the shape is reported, not fatal
        return f"error: {type(e).__name__}: {str(e)[:120]}"


def bench_quantize(sizes=((4096, 4096), (8192, 8192), (16384, 8192))) -> list[dict]:
    from mxq.formats import E4M3, ScaleRule
    from mxq.kernels.quantize import fake_quantize_mx_rows, quantize_mx_rows

    rows = []
    for m, k in sizes:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty_like(x)
        t_copy = median_us(lambda: y.copy_(x))
        copy_gbs = 4 * m * k / t_copy / 1e3
        for rule in (ScaleRule.RCEIL, ScaleRule.FLOOR, ScaleRule.EVEN, ScaleRule.MSE):
            t_q = median_us(lambda: quantize_mx_rows(x, E4M3, rule))
            t_d = median_us(lambda: fake_quantize_mx_rows(x, E4M3, rule, out_dtype=torch.bfloat16))
            tiles = {}
            if rule is not ScaleRule.MSE:
                for tile in ((32, 128, 4), (16, 256, 4), (64, 128, 8), (32, 256, 8), (8, 512, 4), (128, 64, 8)):
                    tiles[str(tile)] = (median_us(lambda: quantize_mx_rows(x, E4M3, rule, tile=tile)),
                                        median_us(lambda: fake_quantize_mx_rows(x, E4M3, rule, out_dtype=torch.bfloat16, tile=tile)))
            q_gbs = (2 + 1 + 1 / 32) * m * k / t_q / 1e3
            d_gbs = 4 * m * k / t_d / 1e3
            rows.append(dict(m=m, k=k, rule=rule.value, copy_us=t_copy, copy_gbs=copy_gbs,
                             mx_us=t_q, mx_gbs=q_gbs, mx_frac_copy=q_gbs / copy_gbs,
                             rounded_bf16_us=t_d, rounded_bf16_gbs=d_gbs,
                             rounded_frac_copy=d_gbs / copy_gbs, tiles_us=tiles))  # fmt: skip
    return rows


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """GB/s of a device-to-device copy of ``nbytes`` (bytes read + bytes written): what an HBM stream
    reaches on this device, the yardstick of the decode table."""
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    gbs = 2 * nbytes / median_us(lambda: y.copy_(x)) / 1e3
    return gbs


# The same-bytes copy's size is rounded up to a multiple of this: torch's byte copy is much slower at
# sizes that are not a multiple of 4 KiB, which made the yardstick depend on the batch size rather than
# on the bytes (figures: BENCHMARKS.md, "Decode GEMMs against a copy of the same bytes"). The rounding
# adds less than 64 KiB to copies of megabytes.
COPY_ROUND = 1 << 16


def copy_half_bytes(nbytes: float) -> int:
    """Bytes one same-bytes copy reads (and writes): half of ``nbytes``, rounded up to ``COPY_ROUND``."""
    return -(-(int(nbytes) // 2) // COPY_ROUND) * COPY_ROUND


def same_bytes_copy(nbytes: float) -> tuple[float, float]:
    """(µs, GB/s) of a device-to-device copy whose bytes read + written equal ``nbytes`` (each half
    rounded up to ``COPY_ROUND``: ``copy_half_bytes``), timed as the GEMMs are (``graph_us`` over copies
    from HBM): what a single launch moving that many bytes reaches, launch and ramp included."""
    half = copy_half_bytes(nbytes)
    srcs = [torch.empty(half, dtype=torch.uint8, device="cuda") for _ in range(weight_copies(half))]
    dst = torch.empty(half, dtype=torch.uint8, device="cuda")
    t = graph_us([lambda s=s: dst.copy_(s) for s in srcs])
    return t, 2 * half / t / 1e3


def read_bytes(m: int, n: int, k: int, weight_bytes_per_elem: float, x_bytes: int = 2) -> float:
    """Bytes a [M, K] x [N, K]ᵀ product must move at least: the weight (with its scales), X and Y (bf16)."""
    return n * k * weight_bytes_per_elem + m * k * x_bytes + m * n * 2


def bench_gemm(models, ms, sweep: bool, sweep_ms=(1, 16, 64, 2048)) -> tuple[list[dict], list[dict]]:
    from mxq.formats import E4M3, ScaleRule, dequantize_mx, quantize_mx
    from mxq.kernels import gemm as G
    from mxq.kernels.dispatch import mx_linear, path_name
    from mxq.kernels.gemm_dot_scaled import mx_gemm_dot_scaled
    from mxq.kernels.quantize import fake_quantize_mx_rows, quantize_mx_rows

    rows, sweeps = [], []
    for model in models:
        for layer, (n, k) in LLAMA_SHAPES[model].items():
            w_bf16 = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
            t = quantize_mx(w_bf16, -1, E4M3, 32, ScaleRule.RCEIL)
            w_deq = dequantize_mx(t, torch.float32)
            # rowwise fp8 weight for _scaled_mm: one scale per output channel
            w_rs = (w_bf16.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0).float()
            w_row8 = (w_bf16.float() / w_rs).to(torch.float8_e4m3fn)
            del w_bf16
            r8, rbf = weight_copies(n * k), weight_copies(2 * n * k)
            packs = [(t.data.clone(), t.scales.clone()) for _ in range(r8)]  # (fp8 data, E8M0 scales)
            rows8 = [w_row8.clone() for _ in range(r8)]
            wbfs = [w_deq.to(torch.bfloat16) for _ in range(rbf)]
            p0 = packs[0]
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                row = dict(model=model, layer=layer, m=m, n=n, k=k, weight_copies=r8)
                # correctness first, on these fresh inputs
                for name, act in (("w8a8", E4M3), ("w8a16", None)):
                    y = mx_linear(x, *p0, None, act_elem=act)
                    xr = x.float() if act is None else fake_quantize_mx_rows(x, E4M3, out_dtype=torch.float32)
                    ref = xr @ w_deq.t()
                    row[f"{name}_relerr"] = ((y.float() - ref).norm() / ref.norm()).item()
                row["cublas_bf16_us"] = _try(None, [lambda w=w: x @ w.t() for w in wbfs])
                x_rs = (x.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0).float()
                x_row8 = (x.float() / x_rs).to(torch.float8_e4m3fn)
                row["scaled_mm_rowwise_us"] = _try(None, [
                    lambda w=w: torch._scaled_mm(x_row8, w.t(), scale_a=x_rs, scale_b=w_rs.t(), out_dtype=torch.bfloat16)
                    for w in rows8
                ])  # fmt: skip
                best_ds = None
                for bm, bn, bk, nw in ((128, 128, 128, 8), (64, 128, 128, 4), (16, 64, 128, 4)):
                    if bm > max(16, triton_next_pow2(m)):
                        continue

                    def ds(p, bm=bm, bn=bn, bk=bk, nw=nw):
                        xq, xs = quantize_mx_rows(x, E4M3, ScaleRule.RCEIL)
                        return mx_gemm_dot_scaled(xq, xs, *p, block_m=bm, block_n=bn, block_k=bk, num_warps=nw)

                    tds = _try(None, [lambda p=p: ds(p) for p in packs])
                    if isinstance(tds, float) and (best_ds is None or tds < best_ds):
                        best_ds = tds
                row["dot_scaled_w8a8_us"] = best_ds
                row["mxq_w8a8_us"] = _try(None, [
                    lambda p=p: mx_linear(x, *p, None, act_elem=E4M3) for p in packs
                ])  # fmt: skip
                row["mxq_w8a16_us"] = _try(None, [lambda p=p: mx_linear(x, *p, None) for p in packs])
                row["mxq_quant_only_us"] = _try(None, [lambda: fake_quantize_mx_rows(x, E4M3, out_dtype=torch.bfloat16)])
                row["mxq_w8a16_eager_us"] = median_us(lambda: mx_linear(x, *p0, None))
                row["config"] = path_name(m, n, k, x.device)
                flops = 2 * m * n * k
                for key in ("mxq_w8a8", "mxq_w8a16", "cublas_bf16"):
                    if isinstance(row[f"{key}_us"], float):
                        row[f"{key}_tflops"] = flops / row[f"{key}_us"] / 1e6
                if isinstance(row["mxq_w8a16_us"], float):
                    row["mxq_w8a16_weight_gbs"] = n * k * (1 + 1 / 32) / row["mxq_w8a16_us"] / 1e3
                for key, per in (("mxq_w8a8", 1 + 1 / 32), ("mxq_w8a16", 1 + 1 / 32), ("cublas_bf16", 2)):
                    if isinstance(row[f"{key}_us"], float):
                        row[f"{key}_gbs"] = read_bytes(m, n, k, per) / row[f"{key}_us"] / 1e3
                if isinstance(row["cublas_bf16_us"], float):
                    row["cublas_weight_gbs"] = 2 * n * k / row["cublas_bf16_us"] / 1e3
                if m <= 16:  # the floor for one launch of this many bytes: a copy moving them, timed alike
                    nbytes = read_bytes(m, n, k, 1 + 1 / 32)
                    row["same_bytes_copy_us"], row["same_bytes_copy_gbs"] = same_bytes_copy(nbytes)
                    # as in a fused decode step: X's codes from the producer, the producer between calls
                    xq, xs = quantize_mx_rows(x, E4M3, ScaleRule.RCEIL)
                    t = _try(None, [lambda p=p: mx_linear(x, *p, None, act_elem=E4M3, x_mx=(xq, xs)) for p in packs],
                             producer_separator(LLAMA_SHAPES[model]["o"][0]))  # fmt: skip
                    row["mxq_w8a8_chained_us"] = t
                    if isinstance(t, float):
                        row["mxq_w8a8_chained_gbs"] = nbytes / t / 1e3
                rows.append(row)
                print(_row_line(row), flush=True)
                if sweep and model == "8b" and m in sweep_ms:
                    for cfg in _sweep_configs(m, n, k):
                        tt = _try(None, [lambda p=p, cfg=cfg: G.mx_gemm(x, *p, None, config=cfg) for p in packs])
                        sweeps.append(dict(model=model, layer=layer, m=m, n=n, k=k, config=str(cfg), us=tt))
                        print(f"   {_fmt(tt):>8} {cfg}", flush=True)
            del packs, rows8, wbfs, w_deq, w_row8, t
            torch.cuda.empty_cache()
    return rows, sweeps


def triton_next_pow2(m: int) -> int:
    return 1 << max(0, (m - 1).bit_length())


def _sweep_configs(m: int, n: int, k: int):
    """Variants around the dispatched config: scale in bf16 or fp32, tile and split choices."""
    import dataclasses

    from mxq.kernels.gemm import pick_config

    R = dataclasses.replace
    base = pick_config(m, n, k, torch.device("cuda"))
    out = [base, R(base, deq_bf16=True)]
    if m <= 64:
        for sp in (base.split_k // 2, base.split_k * 2):
            if sp >= 1:
                out += [R(base, split_k=sp), R(base, split_k=sp, deq_bf16=True)]
        out.append(R(base, block_n=128 if base.block_n == 64 else 64, deq_bf16=True))
    else:  # prefill: the dispatched tile with its K loop, then one change at a time
        out += [
            R(base, num_stages=4), R(base, num_stages=2), R(base, group=16), R(base, group=4),
            R(base, block_k=128, num_stages=2),
            R(base, block_m=128, block_n=256), R(base, block_m=128, block_n=128, num_stages=4),
            R(base, peel=True, zero_dot=False),  # the first K step peeled
        ]
    return out


def _ratio(base, ours):
    return base / ours if isinstance(base, float) and isinstance(ours, float) else None


def _fmt(v, spec=".1f"):
    return format(v, spec) if isinstance(v, float) else "-"


def _row_line(r) -> str:
    return (
        f"{r['model']:>3} {r['layer']:>7} M={r['m']:<5} cuBLAS {_fmt(r['cublas_bf16_us']):>8} "
        f"smm {_fmt(r['scaled_mm_rowwise_us']):>8} ds {_fmt(r['dot_scaled_w8a8_us']):>8} "
        f"w8a8 {_fmt(r['mxq_w8a8_us']):>8} w8a16 {_fmt(r['mxq_w8a16_us']):>8} (q {_fmt(r['mxq_quant_only_us'])}) "
        f"err {r['w8a8_relerr']:.1e}/{r['w8a16_relerr']:.1e}"
    )


def print_tables(res: dict) -> None:
    print("\n## GEMM: speed-up of mxq over each baseline (baseline time / mxq time; > 1 = mxq faster)")
    hdr = "| model | layer | M | N | K | W8A8 µs | ×cuBLAS bf16 | ×scaled_mm rowwise | ×strongest | ×dot_scaled | W8A16 µs | W8A16 ×cuBLAS | W8A8 TFLOP/s | W8A8 path |"
    print(hdr)
    print("|" + "---|" * (hdr.count("|") - 1))
    for r in res["gemm"]:
        base = [v for v in (r["cublas_bf16_us"], r["scaled_mm_rowwise_us"], r["dot_scaled_w8a8_us"]) if isinstance(v, float)]
        strongest = min(base) if base else None
        print(
            f"| {r['model']} | {r['layer']} | {r['m']} | {r['n']} | {r['k']} | {_fmt(r['mxq_w8a8_us'])} | "
            f"{_fmt(_ratio(r['cublas_bf16_us'], r['mxq_w8a8_us']), '.2f')} | "
            f"{_fmt(_ratio(r['scaled_mm_rowwise_us'], r['mxq_w8a8_us']), '.2f')} | "
            f"{_fmt(_ratio(strongest, r['mxq_w8a8_us']), '.2f')} | "
            f"{_fmt(_ratio(r['dot_scaled_w8a8_us'], r['mxq_w8a8_us']), '.2f')} | {_fmt(r['mxq_w8a16_us'])} | "
            f"{_fmt(_ratio(r['cublas_bf16_us'], r['mxq_w8a16_us']), '.2f')} | {_fmt(r['mxq_w8a8_tflops'], '.0f')} | {r.get('config', '-')} |"
        )
    if res.get("copy_gbs") and any(r["m"] <= 16 for r in res["gemm"]):
        cp = res["copy_gbs"]
        print(f"\n## Decode (M <= 16): bytes read per second, share of the copy bandwidth ({cp:.0f} GB/s)")
        print("| model | layer | M | W8A8 µs | W8A8 GB/s | % copy | W8A16 GB/s | % copy | cuBLAS bf16 GB/s | % copy | W8A8 ×cuBLAS "
              "| a copy of the W8A8 bytes: µs | its % copy | W8A8 chained µs | % copy |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        pct = lambda v: f"{100 * v / cp:.0f}" if isinstance(v, float) else "-"
        for r in res["gemm"]:
            if r["m"] > 16:
                continue
            a, b, c = r.get("mxq_w8a8_gbs"), r.get("mxq_w8a16_gbs"), r.get("cublas_bf16_gbs")
            print(f"| {r['model']} | {r['layer']} | {r['m']} | {_fmt(r['mxq_w8a8_us'])} | {_fmt(a, '.0f')} | {pct(a)} | "
                  f"{_fmt(b, '.0f')} | {pct(b)} | {_fmt(c, '.0f')} | {pct(c)} | {_fmt(_ratio(r['cublas_bf16_us'], r['mxq_w8a8_us']), '.2f')} | "
                  f"{_fmt(r.get('same_bytes_copy_us'))} | {pct(r.get('same_bytes_copy_gbs'))} | "
                  f"{_fmt(r.get('mxq_w8a8_chained_us'))} | {pct(r.get('mxq_w8a8_chained_gbs'))} |")
    if res.get("quantize"):
        print("\n## Activation quantization (bf16 in), fraction of copy bandwidth")
        print("| M×K | rule | copy GB/s | MX (fp8+scales) GB/s | frac | MX-rounded bf16 GB/s | frac |")
        print("|---|---|---|---|---|---|---|")
        for q in res["quantize"]:
            print(f"| {q['m']}×{q['k']} | {q['rule']} | {q['copy_gbs']:.0f} | {q['mx_gbs']:.0f} | {q['mx_frac_copy']:.2f} | "
                  f"{q['rounded_bf16_gbs']:.0f} | {q['rounded_frac_copy']:.2f} |")  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench_gemm.json", help="JSON file to write")
    p.add_argument("--models", default="8b,70b,70b-tp2",
                   help="comma-separated: 8b, 70b, 70b-tp2 (one rank's shapes of 70B at tensor parallelism 2)")
    p.add_argument("--ms", default=",".join(map(str, MS)), help="comma-separated M values")
    p.add_argument("--sweep", action="store_true", help="also time a set of tile configs (8b shapes)")
    p.add_argument("--no-quantize", action="store_true", help="skip the quantization bandwidth table")
    p.add_argument("--sweep-ms", default="1,16,64,2048", help="M values to sweep configs at")
    a = p.parse_args(argv)
    env = environment("bench_gemm")
    if env is None:
        return 2
    res = {"env": env, "copy_gbs": copy_bandwidth()}
    print(f"device copy bandwidth: {res['copy_gbs']:.0f} GB/s", flush=True)
    if not a.no_quantize:
        res["quantize"] = bench_quantize()
    res["gemm"], res["sweep"] = bench_gemm(a.models.split(","), [int(v) for v in a.ms.split(",")], a.sweep, [int(v) for v in a.sweep_ms.split(",")])
    return save_results(res, a.out, print_tables)


def environment(bench: str) -> dict | None:
    """A benchmark record's ``env``: device, versions and the ptxas the kernels will be compiled
    with (chosen here, before any kernel compiles), printed as one JSON line; None, after saying
    so, without a CUDA device."""
    if not torch.cuda.is_available():
        print(f"{bench} needs a CUDA device", file=sys.stderr)
        return None
    import triton

    from mxq.kernels import toolchain

    toolchain.configure_ptxas()
    ptxas = toolchain.triton_ptxas()
    env = dict(
        device=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
        torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
        python=platform.python_version(), date=datetime.date.today().isoformat(),
        ptxas=f"{ptxas} {toolchain.ptxas_version(ptxas) if ptxas else None}",
        pipelined_prefill=toolchain.wgmma_async_ok(),
    )  # fmt: skip
    print(json.dumps(env), flush=True)
    return env


def save_results(res: dict, path: str, print_tables) -> int:
    """Write the record as JSON, print its tables; the exit status."""
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print_tables(res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
