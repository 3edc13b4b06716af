"""Host time per projection call: what the eager decode path pays on the CPU before the GPU runs.

    python -m mxq.eval.bench_host --out host.json [--shapes 8b] [--m 1]

At decode sizes a projection's kernel takes tens of microseconds and the Python that launches it can
take as long. This measures, on the host alone, the time one call takes to return: the GPU is kept
busy behind a long spin kernel first, so every call only queues work (none waits for the device), and
the loop's wall time over N calls, divided by N, is the host cost of one call. Rows: bf16
``F.linear`` (the baseline), ``nn.Linear``, ``mxq.kernels.mx_linear`` (dispatch included) for W8A8 and
W8A16, every registered linear path that supports the problem called directly
(``dispatch.run_path``), and ``MXLinear`` modules as the model calls them, without and with their
kernel lanes (``kernels/lanes.py``; the same process, one after the other). Prints a table of
microseconds and the excess over ``F.linear``, and writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

import torch

SHAPES = {"8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}}


def host_us(fn, calls: int = 200, rounds: int = 5) -> float:
    """Median over rounds of the host wall time per call of ``fn`` with the GPU busy behind a spin
    kernel (calls only queue), in microseconds."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        torch.cuda._sleep(int(5e8))  # ~0.3 s of device time: the queue never drains while the host loops
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(out)


def rows_for(n: int, k: int, m: int, device) -> list[tuple[str, float]]:
    import torch.nn.functional as F

    from mxq.formats import E4M3, ScaleRule, quantize_mx
    from mxq.kernels import dispatch, mx_linear
    from mxq.recipe import TensorSpec
    from mxq.runtime import linear as mxq_linear
    from mxq.runtime.linear import MXLinear

    w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    q = quantize_mx(w, -1, E4M3, 32, ScaleRule.RCEIL)
    lin = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
    rows = [("F.linear bf16", host_us(lambda: F.linear(x, w))), ("nn.Linear bf16", host_us(lambda: lin(x)))]
    act = TensorSpec(E4M3, ScaleRule.RCEIL)
    for label, a in (("W8A8", act), ("W8A16", None)):
        ae = a.elem if a else None
        rows.append((f"mx_linear {label} (dispatch)", host_us(lambda ae=ae: mx_linear(x, q.data, q.scales, act_elem=ae))))
        mod = MXLinear.from_linear(lin, TensorSpec(E4M3, ScaleRule.RCEIL), a)
        xq = None
        if a is not None:  # as the fused model calls most projections: X quantized by its producer
            from mxq.kernels.quantize import quantize_mx_rows

            xq = quantize_mx_rows(x, E4M3, ScaleRule.RCEIL)
        for lanes in (False, True):  # the module's kernel lanes (kernels/lanes.py) off, then on
            mxq_linear.LANES, mod._lanes, tag = lanes, None, "" if lanes else " (no lane)"
            rows.append((f"MXLinear {label} module{tag}", host_us(lambda mod=mod: mod(x))))
            if xq is not None:
                rows.append((f"MXLinear {label} module, X codes from the producer{tag}", host_us(lambda mod=mod, xq=xq: mod(x, xq))))
        for path in dispatch.LINEAR:
            if path.name == "reference":
                continue
            p = dispatch.LinearProblem.of(m, n, k, x.dtype, ae, ScaleRule.RCEIL, 32, x.device, True)
            if not path.supports(p):
                continue
            fn = lambda name=path.name, ae=ae: dispatch.run_path(name, x, q.data, q.scales, act_elem=ae)
            try:
                rows.append((f"path {path.name} {label}", host_us(fn)))
            except Exception as e:  # noqa: BLE001 - a path that cannot launch here is reported, not fatal
                rows.append((f"path {path.name} {label} (failed: {type(e).__name__})", float("nan")))
    return rows


def producer_rows(k: int, inter: int, m: int, device) -> list[tuple[str, float]]:
    """The producers mxq puts before the projections (RMSNorm, the residual add + RMSNorm, SiLU(gate)·up,
    each with MX output) against what the bf16 model runs there (transformers' ``LlamaRMSNorm``,
    ``residual + x`` then it; ``F.silu(g) * u``). Fewer calls per round than the projections: the
    bf16 norm queues 7 kernels a call, and a full launch queue would make the host wait."""
    import torch.nn.functional as F
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from mxq.formats import E4M3
    from mxq.kernels.producers import add_rmsnorm_mx, rmsnorm_mx, silu_mul_mx

    norm = LlamaRMSNorm(k, eps=1e-5).to(device=device, dtype=torch.bfloat16)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    r = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    gu = torch.randn(m, 2 * inter, device=device, dtype=torch.bfloat16)
    g, u = gu[:, :inter], gu[:, inter:]
    n = 64
    return [
        ("LlamaRMSNorm bf16", host_us(lambda: norm(x), calls=n)),
        ("rmsnorm_mx (MX codes out)", host_us(lambda: rmsnorm_mx(x, norm.weight, 1e-5, E4M3), calls=n)),
        ("residual + x, LlamaRMSNorm bf16", host_us(lambda: norm(r + x), calls=n)),
        ("add_rmsnorm_mx (sum and MX codes out)", host_us(lambda: add_rmsnorm_mx(x, r, norm.weight, 1e-5, E4M3), calls=n)),
        ("F.silu(gate) * up bf16", host_us(lambda: F.silu(g) * u, calls=n)),
        ("silu_mul_mx (MX codes out)", host_us(lambda: silu_mul_mx(gu, E4M3), calls=n)),
    ]


def profile_call(n: int, k: int, m: int, device, calls: int = 3000, top: int = 25) -> str:
    """cProfile of ``calls`` eager ``MXLinear`` W8A8 calls (the GPU kept busy): where the host time goes."""
    import cProfile
    import io
    import pstats

    from mxq.formats import E4M3, ScaleRule
    from mxq.recipe import TensorSpec
    from mxq.runtime.linear import MXLinear

    lin = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
    mod = MXLinear.from_linear(lin, TensorSpec(E4M3, ScaleRule.RCEIL), TensorSpec(E4M3, ScaleRule.RCEIL))
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    for _ in range(5):
        mod(x)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(3e9))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        mod(x)
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="8b")
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--layers", default="o", help="projections of the shape set to measure (comma-separated)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-producers", action="store_true", help="skip the producers' table (RMSNorm, SiLU·up)")
    ap.add_argument("--profile", action="store_true", help="also print a cProfile of MXLinear W8A8 calls (first shape and layer)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_host: needs a CUDA device (host time is measured with the GPU busy)")
        return 2
    device = torch.device("cuda")
    import transformers
    import triton

    res = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(), "torch": torch.__version__,
           "triton": triton.__version__, "transformers": transformers.__version__, "m": a.m, "rows": {}}  # fmt: skip
    for shape in a.shapes.split(","):
        for layer in a.layers.split(","):
            n, k = SHAPES[shape][layer]
            rows = rows_for(n, k, a.m, device)
            base = rows[0][1]
            res["rows"][f"{shape}.{layer}"] = [{"call": c, "host_us": t, "excess_us": t - base} for c, t in rows]
            print(f"\n## host time per call, {shape} {layer} [{n}x{k}], M={a.m}, {res['device']} ({res['date']})\n")
            print("| call | host µs | over F.linear µs |\n|---|---:|---:|")
            for c, t in rows:
                print(f"| {c} | {t:.1f} | {t - base:+.1f} |")
    if not a.no_producers:
        _, k = SHAPES[a.shapes.split(",")[0]]["qkv"]
        inter = SHAPES[a.shapes.split(",")[0]]["gate_up"][0] // 2
        rows = producer_rows(k, inter, a.m, device)
        res["producers"] = [{"call": c, "host_us": t} for c, t in rows]
        print(f"\n## host time per producer call, K={k}, I={inter}, M={a.m}, {res['device']} ({res['date']})\n")
        print("| call | host µs | x the bf16 op |\n|---|---:|---:|")
        for i, (c, t) in enumerate(rows):
            print(f"| {c} | {t:.1f} | {t / rows[i - i % 2][1]:.2f} |")
    if a.profile:
        shape, layer = a.shapes.split(",")[0], a.layers.split(",")[0]
        text = profile_call(*SHAPES[shape][layer], a.m, device)
        res["profile"] = text
        print(f"\n## cProfile, MXLinear W8A8 {shape} {layer}, M={a.m} (tottime order)\n\n{text}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
