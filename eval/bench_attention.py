"""Benchmark the MXFP8 attention kernels against bf16 SDPA (flash and cuDNN backends) in one process.

    python eval/bench_attention.py [--out results.json] [--quick] [--decode-only | --prefill-only] [--no-sweep]
        [--no-ws-sweep] [--no-tiles]
    python eval/bench_attention.py --bf16-decode [--out results.json]

``--bf16-decode``: the default recipe's attention at one query token (a bf16 KV cache):
``mxq.kernels.attention_sdpa_decode`` against what ran before it (the grouped SDPA: a kv head's
query heads folded into the query rows, SDPA's default backend, cuDNN on an H100) and SDPA with
``enable_gqa`` on each backend that takes the call, boolean mask as transformers makes it, CUDA-graph
replays. Shapes: Qwen3-30B-A3B (32/4 heads), Llama-3-8B (32/8) and -70B (64/8) at contexts 161 to
4096, batch 1 to 32, and a static cache half filled (the mask hides the tail). Then gpt-oss-20b
(64/8 heads of 64, attention sinks, an additive mask): the same kernel with its sinks against
transformers' eager attention of the family, eagerly and under ``torch.compile`` (what the compiled
bf16 step runs), at contexts 161 to 4096, batch 1 to 32, and a sliding layer (128 keys in view) in a
4096-key static cache.

Prefill: B=4, H=32, D=128, S in {1k, 4k, 16k}, causal and not; the MXFP8 call includes the
rounding pre-pass of K and V (it is part of every call); SDPA and MXFP8 alike timed as CUDA-graph
replays (GPU time), the MXFP8 default also eagerly (host launch cost included). Decode: B=4, Hq=32, Hkv=8, D=128, one
query token against a context of 4k..32k, MXFP8 cache (fp8 + E8M0, split-KV kernel) against bf16
SDPA decode (GQA); timed as CUDA-graph replays (launch gaps out) and eagerly. The MXFP8 default
is what the kernel registry chooses under a CUDA graph (``attention.decode_path``: the
warp-specialized kernel on Hopper, ``attention_decode_ws``), the Triton kernel ("gqa") beside it;
the tables name the path that ran. The sweeps try other tiles of both. Ratios are against the
strongest baseline measured in the same run. Medians of ``triton.testing.do_bench``.
The MXFP8 calls include the Q/K rotation as shipped (``mxq.runtime.attention``); ``--no-rotation``
times them without it.
"""

# ruff: noqa: B023  (each lambda is timed at once, inside its loop iteration)
from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from mxq.kernels import attention_decode_ws as W
from mxq.kernels.attention import (
    decode_path,
    mx_attention_decode,
    mx_attention_prefill,
    mx_attention_reference,
)
from mxq.kernels.attention_decode import VARIANTS
from mxq.kernels.attention_decode_common import decode_problem
from mxq.kernels.toolchain import triton_ptxas
from mxq.runtime.attention import MXFP8CacheLayer

ROT = {"qk_rotation": True}


def _bench(fn, graph=False):
    fn()
    torch.cuda.synchronize()
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median")
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def _bench_gpu(fn):
    """GPU time: CUDA-graph replays (a short prefill is faster on the GPU than its launches are
    on the CPU, so eager timings of it measure the host), eager where capture fails."""
    try:
        return _bench(fn, graph=True)
    except RuntimeError:
        torch.cuda.synchronize()
        return _bench(fn)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def prefill(seqs, results):
    b, h, d = 4, 32, 128
    print("\n## Prefill, B=4 H=32 D=128, TFLOP/s (causal counts half the flops)")
    print("| S | causal | SDPA flash | SDPA cuDNN | MXFP8 exact | MXFP8 bf16-P | exact eager | exact / best | bf16-P / best | exact / flash |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for s in seqs:
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for causal in (False, True):
            flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
            row = {"S": s, "causal": causal}
            for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                try:
                    with sdpa_kernel([be]):
                        ms = _bench_gpu(lambda be=be: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal))
                    row[name] = flops / ms / 1e9
                except RuntimeError as e:
                    row[name] = None
                    print(f"<!-- {name} unavailable: {str(e).splitlines()[0]} -->")
            for name, exact in (("mx_exact", True), ("mx_fast", False)):
                ms = _bench_gpu(lambda exact=exact: mx_attention_prefill(q, k, v, causal=causal, exact=exact, **ROT))
                row[name] = flops / ms / 1e9
            ms = _bench(lambda: mx_attention_prefill(q, k, v, causal=causal, **ROT))
            row["mx_exact_eager"] = flops / ms / 1e9  # host launch cost included where it dominates
            if s <= 1024:  # correctness beside the timing
                want = mx_attention_reference(q[:1].float(), k[:1].float(), v[:1].float(), causal=causal, **ROT)
                row["rel_err_exact"] = _rel(mx_attention_prefill(q[:1], k[:1], v[:1], causal=causal, **ROT), want)
            best = max(x for x in (row["flash"], row["cudnn"]) if x)
            results["prefill"].append(row)

            def f(x):
                return f"{x:.0f}" if x else "n/a"

            print(
                f"| {s} | {causal} | {f(row['flash'])} | {f(row['cudnn'])} | {row['mx_exact']:.0f} | {row['mx_fast']:.0f} | {row['mx_exact_eager']:.0f} "
                f"| {row['mx_exact'] / best:.2f} | {row['mx_fast'] / best:.2f} | {row['mx_exact'] / row['flash']:.2f} |"
            )


def decode(ctxs, results, sweep=True, ws_sweep=True):
    b, hq, hkv, d = 4, 32, 8, 128
    print("\n## Decode, B=4 Hq=32 Hkv=8 D=128, one token, CUDA-graph replays")
    print(
        "| context | SDPA bf16 us | MXFP8 default us (path) | x SDPA | Triton gqa us | x SDPA | best us (config) | x SDPA "
        "| default GB/s | bf16 GB/s | eager us SDPA / default (path) / gqa / ws |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for n in ctxs:
        c = _DecodeCase.make(b, hq, hkv, d, n)
        q, k, v = c.q, c.k, c.v
        ms_sdpa = _bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True), graph=True)
        best = _sweep_gqa(c, results) if sweep else {}  # variant -> (ms, settings, rel_err)
        cnt = dict(counters=c.layer.decode_counters())  # as the cache layer calls it (fused merge)
        if ws_sweep and W.takes(*c.args[:5], None):
            _sweep_ws(c, cnt, results, best)
        graph_path, eager_path = _time_shipped(c, cnt, best)
        eager = _eager_times(c, cnt)
        row = _decode_row(c, ms_sdpa, best, graph_path, eager_path, eager)
        results["decode"].append(row)
        _print_decode_row(row, graph_path.name)
        if results.get("out"):  # write as we go: a run cut short keeps what it measured
            with open(results["out"], "w") as f:
                json.dump(results, f, indent=1)


@dataclasses.dataclass
class _DecodeCase:
    """One decode problem: the bf16 query and keys/values, the MXFP8 cache layer holding them
    (rotated as shipped), and the reference output from its dequantized contents."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    layer: MXFP8CacheLayer
    want: torch.Tensor
    args: tuple  # the arguments of mx_attention_decode before its keywords

    @classmethod
    def make(cls, b, hq, hkv, d, n):
        q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16)
        layer = MXFP8CacheLayer()
        layer.rotated = ROT["qk_rotation"]
        layer.update(k, v)
        kd, vd = layer.dequantize()
        want = mx_attention_reference(q.float(), kd, vd, k_rotated=True, **ROT)
        return cls(q, k, v, layer, want, args=(q, layer.k_data, layer.k_scale, layer.v_data, layer.v_scale, n))

    @property
    def n(self) -> int:
        return self.args[-1]


def _sweep_gqa(c: _DecodeCase, results) -> dict:
    """The Triton gqa kernel over tiles, warps, stages and split-KV programs; the fastest accurate
    one, as ``{"gqa": (ms, settings, rel_err)}``."""
    b, hkv, n = c.k.shape[0], c.k.shape[1], c.n
    args, want = c.args, c.want
    configs = [
        ("gqa", bn, w, st, p)
        for bn in (64, 128) for w in (2, 4) for st in (2, 3, 4) for p in (264, 528, 1056)
    ]  # fmt: skip
    best = {}
    for variant, bn, w, st, progs in configs:
        chunk = max(bn, triton.cdiv(triton.cdiv(n, max(1, progs // (b * hkv))), bn) * bn)
        kw = dict(variant=variant, block_n=bn, chunk=chunk, num_warps=w, num_stages=st, **ROT)
        try:
            ms = _bench(lambda: mx_attention_decode(*args, **kw), graph=True)
            err = _rel(mx_attention_decode(*args, **kw), want)
        except Exception as e:  # noqa: BLE001  (a config that does not compile is skipped)
            print(f"<!-- {kw}: {type(e).__name__}: {str(e)[:120]} -->")
            continue
        results["decode_configs"].append({"context": n, **kw, "us": ms * 1e3, "rel_err": err})
        if err > 5e-3:
            print(f"<!-- {kw}: rel_err {err:.2e} too large, not counted -->")
            continue
        if variant not in best or ms < best[variant][0]:
            best[variant] = (ms, kw, err)
    return best


def _sweep_ws(c: _DecodeCase, cnt: dict, results, best: dict) -> None:
    """The warp-specialized kernel's settings, each against this device's default; the fastest
    accurate one goes to ``best["ws"]``."""
    args, want = c.args, c.want
    for kw in (
        dict(wide_v=False), dict(fused_merge=True), dict(stages=3), dict(stages=4), dict(programs=396, maxnreg=80),
        dict(programs=264, maxnreg=128), dict(programs=528), dict(merge_pdl=False),
    ):  # fmt: skip
        cfg = dataclasses.replace(W.default_config(c.q.device), **kw)
        try:
            ms = _bench(lambda: W.mx_attention_decode_ws(*args, config=cfg, **cnt, **ROT), graph=True)
            err = _rel(W.mx_attention_decode_ws(*args, config=cfg, **cnt, **ROT), want)
        except Exception as e:  # noqa: BLE001
            print(f"<!-- ws {cfg}: {type(e).__name__}: {str(e)[:120]} -->")
            continue
        kw = {"variant": "ws", **dataclasses.asdict(cfg)}
        results["decode_configs"].append({"context": c.n, **kw, "us": ms * 1e3, "rel_err": err})
        if err < 5e-3 and ("ws" not in best or ms < best["ws"][0]):
            best["ws"] = (ms, kw, err)


def _time_shipped(c: _DecodeCase, cnt: dict, best: dict):
    """The default under a CUDA graph (the ws kernel on Hopper) and the Triton gqa kernel, as the
    cache layer calls them, into ``best`` (the shipped settings compete too); returns the paths the
    registry chooses under a graph and eagerly (asked after the run: a Gluon kernel that did not
    compile is off by then). The default's error comes from the same path run eagerly."""
    args, want = c.args, c.want
    default_ms = _bench(lambda: mx_attention_decode(*args, **cnt, **ROT), graph=True)
    graph_path = decode_path(*args[:5], capturing=True)
    eager_path = decode_path(*args[:5])
    variant = next((v for v, p in VARIANTS.items() if p is graph_path), None)
    forced = {"variant": variant} if variant else {"kernels": "reference"}
    err = _rel(mx_attention_decode(*args, **forced, **cnt, **ROT), want)
    best["default"] = (default_ms, {"default": True}, err)
    triton_ms = _bench(lambda: mx_attention_decode(*args, variant="gqa", **cnt, **ROT), graph=True)
    err_t = _rel(mx_attention_decode(*args, variant="gqa", **cnt, **ROT), want)
    best["triton_gqa"] = (triton_ms, {"variant": "gqa"}, err_t)
    return graph_path, eager_path


def _eager_times(c: _DecodeCase, cnt: dict) -> dict:
    """Without a CUDA graph: what generate() without CUDA graphs pays per call, CPU launch cost included."""
    q, k, v, args = c.q, c.k, c.v, c.args
    eager = {
        "sdpa": _bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)),
        "default": _bench(lambda: mx_attention_decode(*args, **cnt, **ROT)),
        "triton_gqa": _bench(lambda: mx_attention_decode(*args, variant="gqa", **cnt, **ROT)),
    }
    if W.takes(*args[:5], None):
        eager["ws"] = _bench(lambda: mx_attention_decode(*args, variant="ws", **cnt, **ROT))
    return eager


def _decode_row(c: _DecodeCase, ms_sdpa: float, best: dict, graph_path, eager_path, eager: dict) -> dict:
    b, hkv, n, d = c.k.shape
    default_ms, _, err = best["default"]
    triton_ms, _, err_t = best["triton_gqa"]
    ms_mx, kw_best, err_best = min(best.values(), key=lambda t: t[0])
    mx_bytes = 2 * b * hkv * n * d * (1 + 1 / 32)
    bf_bytes = 2 * b * hkv * n * d * 2
    return {
        "context": n, "sdpa_us": ms_sdpa * 1e3, "mx_us": ms_mx * 1e3, "mx_default_us": default_ms * 1e3,
        "best": kw_best, "default_path": graph_path.describe(decode_problem(*c.args[:5], capturing=True)),
        "eager_path": eager_path.name, "speedup": ms_sdpa / ms_mx,
        "default_speedup": ms_sdpa / default_ms, "rel_err": err, "rel_err_best": err_best,
        "mx_GBps": mx_bytes / ms_mx / 1e6, "mx_default_GBps": mx_bytes / default_ms / 1e6,
        "bf16_GBps": bf_bytes / ms_sdpa / 1e6, "triton_gqa_us": triton_ms * 1e3, "rel_err_triton_gqa": err_t,
        "triton_gqa_speedup": ms_sdpa / triton_ms, "eager_us": {k_: v_ * 1e3 for k_, v_ in eager.items()},
    }  # fmt: skip


def _print_decode_row(row: dict, graph_path_name: str) -> None:
    e = row["eager_us"]
    print(
        f"| {row['context']} | {row['sdpa_us']:.1f} | {row['mx_default_us']:.1f} ({graph_path_name}) | {row['default_speedup']:.2f} "
        f"| {row['triton_gqa_us']:.1f} | {row['triton_gqa_speedup']:.2f} | {row['mx_us']:.1f} ({row['best']}) "
        f"| {row['speedup']:.2f} | {row['mx_default_GBps']:.0f} | {row['bf16_GBps']:.0f} "
        f"| {e['sdpa']:.1f} / {e['default']:.1f} ({row['eager_path']}) / {e['triton_gqa']:.1f} "
        f"/ {e.get('ws', float('nan')):.1f} |",
        flush=True,
    )


def tile_sweep(results):
    """Prefill tiles (BLOCK_M, BLOCK_N, warps, stages) at S=4096, non-causal and causal."""
    b, h, d, s = 4, 32, 128, 4096
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    print("\n## Prefill tile sweep, S=4096, TFLOP/s (exact / bf16-P, K/Vᵀ by TMA; exact with pointer loads)")
    for causal in (False, True):
        flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
        for tile in ((64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2)):
            row = {"causal": causal, "tile": tile}
            for name, exact, tma in (("exact", True, True), ("fast", False, True), ("exact_pointer", True, False)):
                try:
                    ms = _bench_gpu(lambda: mx_attention_prefill(q, k, v, causal=causal, exact=exact, tile=tile, tma=tma, **ROT))
                    row[name] = flops / ms / 1e9
                except Exception as e:  # noqa: BLE001
                    row[name] = None
                    print(f"<!-- {tile}: {type(e).__name__}: {str(e)[:80]} -->")
            results["tiles"].append(row)
            print(f"causal={causal} tile={tile}: {row['exact'] or 0:.0f} / {row['fast'] or 0:.0f} (pointer loads: {row['exact_pointer'] or 0:.0f})")


BF16_DECODE = [  # (label, B, Hq, Hkv, D, cache length, keys visible)
    ("qwen3-30b-a3b B=1 ctx 161", 1, 32, 4, 128, 161, 161),
    ("qwen3-30b-a3b B=1 ctx 1024", 1, 32, 4, 128, 1024, 1024),
    ("qwen3-30b-a3b B=1 ctx 4096", 1, 32, 4, 128, 4096, 4096),
    ("qwen3-30b-a3b B=1 static 4096, 600 filled", 1, 32, 4, 128, 4096, 600),
    ("qwen3-30b-a3b B=32 ctx 161", 32, 32, 4, 128, 161, 161),
    ("qwen3-30b-a3b B=32 ctx 2048", 32, 32, 4, 128, 2048, 2048),
    ("llama3-8b B=1 ctx 161", 1, 32, 8, 128, 161, 161),
    ("llama3-8b B=8 ctx 1024", 8, 32, 8, 128, 1024, 1024),
    ("llama3-70b B=1 ctx 4096", 1, 64, 8, 128, 4096, 4096),
]


def bf16_decode(results) -> None:
    """The ``--bf16-decode`` table (module doc): µs per call and each path's ratio to the fastest
    baseline in the row (> 1: faster than it)."""
    from mxq.kernels.attention_sdpa_decode import plan_splits, sdpa_decode, sdpa_decode_reference
    from mxq.runtime.fuse import grouped_sdpa_forward

    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}  # fmt: skip
    print("\n## bf16 decode attention (one query token, bf16 KV, CUDA-graph replays, µs)")
    print(f"| shape | splits | mxq sdpa_decode | grouped SDPA (before) | {' | '.join('SDPA gqa ' + b for b in backends)} | ratio vs best baseline |")
    print("|---|---:|---:|---:|" + "---:|" * len(backends) + "---:|")
    g = torch.Generator(device="cuda").manual_seed(0)
    for label, b, hq, hkv, d, n, seen in BF16_DECODE:
        q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
        mask = torch.zeros(b, 1, 1, n, device="cuda", dtype=torch.bool)
        mask[..., :seen] = True
        module = torch.nn.Module()
        module.num_key_value_groups, module.is_causal, module.training = hq // hkv, True, False
        mine = sdpa_decode(q, k, v, mask, d**-0.5)
        ref = sdpa_decode_reference(q.float(), k.float(), v.float(), mask, d**-0.5)
        row = dict(shape=label, batch=b, q_heads=hq, kv_heads=hkv, head_dim=d, cache=n, seen=seen,
                   splits=plan_splits(b, hkv, n, torch.cuda.get_device_properties(0).multi_processor_count)[0],
                   rel_err=_rel(mine, ref))  # fmt: skip
        row["mxq_us"] = 1e3 * _bench_gpu(lambda: sdpa_decode(q, k, v, mask, d**-0.5))

        def grouped():
            import mxq.runtime.fuse as F

            F.DECODE_KERNEL = False  # what ran before the kernel
            try:
                return grouped_sdpa_forward(module, q, k, v, mask, scaling=d**-0.5)
            finally:
                F.DECODE_KERNEL = True

        row["grouped_us"] = 1e3 * _bench_gpu(grouped)
        for name, be in backends.items():
            try:
                with sdpa_kernel([be]):
                    fn = lambda: torch.nn.functional.scaled_dot_product_attention(
                        q, k, v, attn_mask=mask, scale=d**-0.5, enable_gqa=True)  # fmt: skip
                    fn()
                    row[name + "_us"] = 1e3 * _bench_gpu(fn)
            except RuntimeError:
                row[name + "_us"] = None
        base = [row[key] for key in ["grouped_us"] + [b + "_us" for b in backends] if row[key] is not None]
        row["ratio_vs_best"] = min(base) / row["mxq_us"]
        cells = " | ".join(f"{row[b + '_us']:.1f}" if row[b + "_us"] is not None else "-" for b in backends)
        print(f"| {label} | {row['splits']} | {row['mxq_us']:.1f} | {row['grouped_us']:.1f} | {cells} | "
              f"{row['ratio_vs_best']:.2f}x |", flush=True)  # fmt: skip
        results["bf16_decode"].append(row)


SINKS_DECODE = [  # (label, B, Hq, Hkv, D, cache length, keys filled, window or 0)
    ("gpt-oss-20b B=1 ctx 161", 1, 64, 8, 64, 161, 161, 0),
    ("gpt-oss-20b B=1 ctx 4096", 1, 64, 8, 64, 4096, 4096, 0),
    ("gpt-oss-20b B=1 sliding 128, static 4096, 600 filled", 1, 64, 8, 64, 4096, 600, 128),
    ("gpt-oss-20b B=8 ctx 1024", 8, 64, 8, 64, 1024, 1024, 0),
    ("gpt-oss-20b B=32 ctx 2048", 32, 64, 8, 64, 2048, 2048, 0),
]


def sinks_decode(results) -> None:
    """gpt-oss's one-token attention (module doc): µs per call, ratio to the faster of transformers'
    eager attention and the same compiled."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from mxq.kernels.attention_sdpa_decode import plan_splits, sdpa_decode

    print("\n## gpt-oss decode attention with sinks (one query token, bf16 KV, additive mask, CUDA-graph replays, µs)")
    print("| shape | splits | mxq sdpa_decode | eager | eager compiled | ratio vs best baseline | rel. err vs fp32 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    g = torch.Generator(device="cuda").manual_seed(1)
    compiled = torch.compile(eager_attention_forward, dynamic=False)
    for label, b, hq, hkv, d, n, filled, window in SINKS_DECODE:
        q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
        sinks = torch.randn(hq, device="cuda", dtype=torch.bfloat16, generator=g)
        pos = torch.arange(n, device="cuda")
        keep = (pos < filled) & (pos >= (filled - window if window else 0))
        mask = torch.where(keep, 0.0, torch.finfo(torch.bfloat16).min).to(torch.bfloat16).expand(b, 1, 1, n)
        module = torch.nn.Module()
        module.num_key_value_groups, module.training, module.sinks = hq // hkv, False, sinks
        scale = d**-0.5
        mine = sdpa_decode(q, k, v, mask, scale, sinks=sinks)
        module32 = torch.nn.Module()
        module32.num_key_value_groups, module32.training, module32.sinks = hq // hkv, False, sinks.float()
        ref = eager_attention_forward(module32, q.float(), k.float(), v.float(), mask.float(), scale)[0]
        row = dict(shape=label, batch=b, q_heads=hq, kv_heads=hkv, head_dim=d, cache=n, filled=filled, window=window,
                   splits=plan_splits(b, hkv, n, torch.cuda.get_device_properties(0).multi_processor_count)[0],
                   rel_err=_rel(mine, ref))  # fmt: skip
        row["mxq_us"] = 1e3 * _bench_gpu(lambda: sdpa_decode(q, k, v, mask, scale, sinks=sinks))
        row["eager_us"] = 1e3 * _bench_gpu(lambda: eager_attention_forward(module, q, k, v, mask, scale))
        compiled(module, q, k, v, mask, scale)
        row["compiled_us"] = 1e3 * _bench_gpu(lambda: compiled(module, q, k, v, mask, scale))
        row["ratio_vs_best"] = min(row["eager_us"], row["compiled_us"]) / row["mxq_us"]
        print(f"| {label} | {row['splits']} | {row['mxq_us']:.1f} | {row['eager_us']:.1f} | {row['compiled_us']:.1f} | "
              f"{row['ratio_vs_best']:.2f}x | {row['rel_err']:.1e} |", flush=True)  # fmt: skip
        results["sinks_decode"].append(row)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--decode-only", action="store_true")
    ap.add_argument("--prefill-only", action="store_true")
    ap.add_argument("--no-sweep", action="store_true", help="decode: the defaults only, no tile sweep")
    ap.add_argument("--no-ws-sweep", action="store_true", help="decode: the warp-specialized kernel's defaults only")
    ap.add_argument("--no-rotation", action="store_true", help="time the MXFP8 kernels without the Q/K rotation")
    ap.add_argument("--no-tiles", action="store_true", help="skip the prefill tile sweep")
    ap.add_argument("--bf16-decode", action="store_true", help="only the bf16-KV decode table (module doc)")
    args = ap.parse_args()
    ROT["qk_rotation"] = not args.no_rotation
    results = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "date": time.strftime("%Y-%m-%d"), "ptxas": str(triton_ptxas()), "qk_rotation": ROT["qk_rotation"], "prefill": [], "decode": [], "decode_configs": [], "tiles": [], "bf16_decode": [], "sinks_decode": [],
    }  # fmt: skip
    results["out"] = args.out
    print(f"# {results['device']}  torch {results['torch']}  triton {results['triton']}  {results['date']}")
    if args.bf16_decode:
        bf16_decode(results)
        sinks_decode(results)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
        return
    if not args.prefill_only:
        ctxs = [4096, 8192, 16384, 32768] if not args.quick else [16384]
        decode(ctxs, results, sweep=not args.no_sweep, ws_sweep=not args.no_ws_sweep)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    if args.decode_only:
        return
    prefill([1024, 4096, 16384] if not args.quick else [4096], results)
    if not args.no_tiles:
        tile_sweep(results)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
