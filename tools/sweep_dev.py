"""One-call GPU development sweep (kernels/NOTES.md): correctness on fresh data, then timings.

    PYTHONUNBUFFERED=1 python tools/sweep_dev.py --out $OUT/sweep.json [--parts q,gemv,m256,tma]

Parts: q = activation quantizer (bit-exact vs mxq.formats on the GPU, then bandwidth, hardware
fp8 rounding vs the integer route, tiles); gemv = CUDA-core decode kernel vs the MMA decode
path and cuBLAS; m256 = tile shapes at M=256; tma = the 256x128x64 TMA-tile wrong-value matrix;
dws = the W8A8 decode GEMM's ring depths, alone and chained, beside a copy of the same bytes.
Timing: CUDA graphs over weight copies (eval/bench_gemm.py), median.
"""

# ruff: noqa: B023, BLE001, S307  (lambdas are timed inside their loop iteration)
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import torch

from mxq.eval.bench_gemm import graph_us, median_us, weight_copies
from mxq.formats import E4M3, E5M2, ScaleRule, dequantize_mx, quantize_mx

RES: dict = {}
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def _try_graph(fns):
    try:
        return graph_us(fns)
    except Exception as e:  # noqa: BLE001
        return f"error: {type(e).__name__}: {str(e)[:200]}"


def part_q():
    from mxq.kernels import common
    from mxq.kernels import quantize as Q

    out = {"exact": [], "bw": []}
    gen = torch.Generator(device="cuda").manual_seed(int(time.time()))
    x = torch.randn(1024, 4096, device="cuda", generator=gen) * torch.logspace(-3, 3, 4096, device="cuda")[torch.randperm(4096, device="cuda")]
    x[0, 5], x[1, 4095], x[3, 0:10] = float("nan"), float("inf"), -1e-30
    x[2, 32:64] = 0
    x = x.to(torch.bfloat16)
    for elem in (E4M3, E5M2):
        for rule in ScaleRule:
            q, s = Q.quantize_mx_rows(x, elem, rule)
            ref = quantize_mx(x, -1, elem, 32, rule)
            d = Q.fake_quantize_mx_rows(x, elem, rule, out_dtype=torch.float32)
            dref = dequantize_mx(ref, torch.float32)
            nb = int((s != ref.scales).sum())
            nq = int((q.view(torch.uint8) != ref.data.view(torch.uint8)).sum())
            dq = int(((d != dref) & ~(d.isnan() & dref.isnan())).sum())
            out["exact"].append(dict(elem=elem.name, rule=rule.value, scale_diff=nb, byte_diff=nq, deq_diff=dq))
            log("exact", elem.name, rule.value, "scale diffs", nb, "byte diffs", nq, "deq diffs", dq)
    for m, k in ((8192, 8192), (16384, 8192)):
        xx = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty_like(xx)
        t_copy = median_us(lambda: y.copy_(xx))
        copy_gbs = 4 * m * k / t_copy / 1e3
        for rule in (ScaleRule.RCEIL, ScaleRule.FLOOR):
            for bits in ("0", "1"):
                common.BIT_ROUNDING = bits == "1"
                for tile in ((32, 128, 4), (16, 256, 4), (32, 256, 8), (8, 512, 4)):
                    tq = median_us(lambda: Q.quantize_mx_rows(xx, E4M3, rule, tile=tile))
                    td = median_us(lambda: Q.fake_quantize_mx_rows(xx, E4M3, rule, out_dtype=torch.bfloat16, tile=tile))
                    r = dict(m=m, k=k, rule=rule.value, bit_route=bits == "1", tile=tile, copy_gbs=copy_gbs,
                             mx_frac=(3 + 1 / 32) * m * k / tq / 1e3 / copy_gbs, bf16_frac=4 * m * k / td / 1e3 / copy_gbs)
                    out["bw"].append(r)
                    log("q", m, k, rule.value, "bits" if bits == "1" else "hw", tile, f"mx {r['mx_frac']:.2f} bf16 {r['bf16_frac']:.2f}")
            common.BIT_ROUNDING = False
    RES["q"] = out


DEC_SHAPES = [("8b", "o", 4096, 4096), ("8b", "qkv", 6144, 4096), ("8b", "down", 4096, 14336),
              ("8b", "gate_up", 28672, 4096), ("70b", "o", 8192, 8192), ("70b", "down", 8192, 28672)]


def _weights(n, k, copies):
    w = torch.randn(n, k, device="cuda") * 0.02
    t = quantize_mx(w, -1, E4M3, 32, ScaleRule.RCEIL)
    return [(t.data.clone(), t.scales.clone()) for _ in range(copies)], dequantize_mx(t, torch.float64)


def part_gemv(ms=(1, 16), extra_ms=(2, 4, 8)):
    from mxq.kernels import gemm as G
    from mxq.kernels import gemv as V
    from mxq.kernels.quantize import fake_quantize_mx_rows

    C = V.GemvConfig
    cands = [C(32, 256, 4, 3), C(16, 512, 4, 3), C(64, 256, 8, 3), C(32, 512, 8, 3), C(16, 256, 2, 3),
             C(64, 128, 4, 4, tma_w=True), C(32, 256, 4, 4, tma_w=True), C(128, 128, 8, 4, tma_w=True)]
    rows = []
    best_by_shape = {}
    for model, layer, n, k in DEC_SHAPES:
        copies = weight_copies(n * k)
        ws, w64 = _weights(n, k, copies)
        wb = [w64.to(torch.bfloat16) for _ in range(weight_copies(2 * n * k))]
        for m in ms + extra_ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = fake_quantize_mx_rows(x, E4M3, out_dtype=torch.float32).double() @ w64.t()
            row = dict(model=model, layer=layer, n=n, k=k, m=m)
            row["cublas"] = _try_graph([lambda w=w: x @ w.t() for w in wb])

            def old(p, x=x):
                xr = fake_quantize_mx_rows(x, E4M3, out_dtype=torch.bfloat16)
                return G.mx_gemm(xr, p[0], p[1], None, out_dtype=torch.bfloat16)

            row["mma_w8a8"] = _try_graph([lambda p=p: old(p) for p in ws])
            cl = cands if m in ms else [best_by_shape.get((n, k), cands[0])]
            for cfg in cl:
                sms = 132
                tiles = -(-n // cfg.block_n)
                auto = 1
                while tiles * auto < 2 * sms and k // (auto * 2) >= 4 * cfg.block_k and auto < 8:
                    auto *= 2
                for split in sorted({1, auto, min(8, auto * 2)}):
                    c = V.GemvConfig(cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages, split, cfg.tma_w)
                    try:
                        y = V.mx_gemv(x, ws[0][0], ws[0][1], None, config=c, act_elem=E4M3)
                        err = ((y.double() - ref).norm() / ref.norm()).item()
                    except Exception as e:  # noqa: BLE001
                        row[str(c)] = f"error: {type(e).__name__}: {str(e)[:200]}"
                        log("gemv", model, layer, m, c, row[str(c)])
                        continue
                    t = _try_graph([lambda p=p, c=c: V.mx_gemv(x, p[0], p[1], None, config=c, act_elem=E4M3) for p in ws])
                    row[str(c)] = dict(us=t, err=err)
                    log("gemv", model, layer, f"M={m}", c, f"{t if isinstance(t, str) else round(t, 2)} err {err:.1e}")
            times = {kk: v["us"] for kk, v in row.items() if isinstance(v, dict) and isinstance(v["us"], float) and v["err"] < 1e-2}
            if times:
                bk = min(times, key=times.get)
                row["best"], row["best_us"] = bk, times[bk]
                if m in ms and m == 1:
                    best_by_shape[(n, k)] = eval("V." + bk)  # noqa: S307 (our own repr)
                log(f"BEST {model} {layer} M={m}: {times[bk]:.2f} us ({bk}); cuBLAS {row['cublas']}, mma {row['mma_w8a8']}",
                    f"x{row['cublas'] / times[bk]:.2f} cuBLAS" if isinstance(row["cublas"], float) else "")
            rows.append(row)
        del ws, wb, w64
        torch.cuda.empty_cache()
    RES["gemv"] = rows


def part_m256():
    from mxq.kernels import gemm as G
    from mxq.kernels.quantize import fake_quantize_mx_rows

    C = G.GemmConfig
    kw = dict(tma_x=True, tma_w=True, deq_bf16=True)
    cands = [C(256, 128, 64, 8, 3, **kw), C(128, 128, 64, 8, 4, **kw), C(64, 128, 64, 4, 4, **kw), C(128, 64, 64, 4, 4, **kw),
             C(64, 64, 128, 4, 4, **kw), C(128, 128, 64, 8, 4, split_k=2, **kw), C(64, 128, 128, 4, 3, **kw),
             C(64, 128, 64, 4, 4, split_k=2, **kw), C(128, 128, 128, 8, 3, **kw)]
    rows = []
    for model, layer, n, k in DEC_SHAPES:
        copies = weight_copies(n * k)
        ws, w64 = _weights(n, k, copies)
        wb = [w64.to(torch.bfloat16) for _ in range(weight_copies(2 * n * k))]
        for m in (256, 128):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xr = fake_quantize_mx_rows(x, E4M3, out_dtype=torch.bfloat16)
            ref = xr.double() @ w64.t()
            row = dict(model=model, layer=layer, n=n, k=k, m=m, cublas=_try_graph([lambda w=w: x @ w.t() for w in wb]))
            row["quant_us"] = _try_graph([lambda: fake_quantize_mx_rows(x, E4M3, out_dtype=torch.bfloat16)])
            for c in cands:
                try:
                    y = G.mx_gemm(xr, ws[0][0], ws[0][1], None, config=c)
                    err = ((y.double() - ref).norm() / ref.norm()).item()
                except Exception as e:  # noqa: BLE001
                    row[str(c)] = f"error: {e!s:.200}"
                    continue
                t = _try_graph([lambda p=p, c=c: G.mx_gemm(xr, p[0], p[1], None, config=c) for p in ws])
                row[str(c)] = dict(us=t, err=err)
                log("m256", model, layer, m, c, t, f"err {err:.1e}")
            rows.append(row)
        del ws, wb, w64
        torch.cuda.empty_cache()
    RES["m256"] = rows


def part_tma():
    from mxq.kernels import gemm as G

    rows = []
    for n in (1000, 1024):
        for k in (2048, 2080):
            gen = torch.Generator().manual_seed(n + k)
            w = torch.randn(n, k, generator=gen) * torch.exp(torch.randn(n, 1, generator=gen))
            t = quantize_mx(w.cuda(), -1, E4M3, 32, ScaleRule.RCEIL)
            w64 = dequantize_mx(t, torch.float64)
            x = torch.randn(300, k, generator=gen).to(torch.bfloat16).cuda()
            ref = x.double() @ w64.t()
            for deq, tx, st in ((False, True, 3), (True, True, 3), (False, False, 3), (False, True, 1)):
                if True:
                    if True:
                        c = G.GemmConfig(256, 128, 64, 8, st, tma_x=tx, tma_w=True, deq_bf16=deq)
                        errs = []
                        for _ in range(3):
                            y = G.mx_gemm(x, t.data, t.scales, None, config=c)
                            torch.cuda.synchronize()
                            e = (y.double() - ref).abs()
                            bad = e > 1e-2 * ref.abs() + 1e-2 * ref.abs().max()
                            errs.append((((y.double() - ref).norm() / ref.norm()).item(), int(bad.sum()),
                                         bad.nonzero()[:3].tolist()))
                        rows.append(dict(n=n, k=k, deq_bf16=deq, tma_x=tx, stages=st, runs=errs))
                        log("tma", n, k, "deq" if deq else "f32", "tmaX" if tx else "ptrX", st, errs)
    RES["tma"] = rows


def part_tma2():
    from mxq.kernels import gemm as G

    gen = torch.Generator().manual_seed(8)
    w = torch.randn(1000, 2080, generator=gen) * torch.exp(torch.randn(1000, 1, generator=gen))
    t = quantize_mx(w.cuda(), -1, E4M3, 32, ScaleRule.RCEIL)
    w64 = dequantize_mx(t, torch.float64)
    c = G.GemmConfig(256, 128, 64, 8, 3, tma_x=True, tma_w=True)
    for m in (5, 300):
        x = torch.randn(m, 2080, generator=gen).to(torch.bfloat16).cuda()
        b = torch.randn(1000, generator=gen).to(torch.bfloat16).cuda()
        for bias in (None, b):
            ref = x.double() @ w64.t() + (0 if bias is None else bias.double())
            y = G.mx_gemm(x, t.data, t.scales, bias, config=c)
            bad = ((y.double() - ref).abs() > 1e-2 * ref.abs().max()).nonzero()
            log("tma2 m", m, "bias", bias is not None, "bad", len(bad), bad[:4].tolist(), y.double().abs().max().item())


def part_peel(ms=(1, 4, 16), pre_m=2048):
    """Peeled first K step (wgmma pipelined, no C7515 serialization) and W8A8 with X
    rounded inside the MMA kernel; decode tiles at M <= 16, prefill tiles at M = 2048 (8B shapes)."""
    import dataclasses

    from mxq.eval.bench_gemm import LLAMA_SHAPES
    from mxq.kernels import gemm as G
    from mxq.kernels import gemv as V
    from mxq.kernels.quantize import fake_quantize_mx_rows

    C = G.GemmConfig
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for layer, (n, k) in LLAMA_SHAPES["8b"].items():
        ws, w64 = _weights(n, k, weight_copies(n * k))
        wd = w64.float()
        wb = [wd.to(torch.bfloat16) for _ in range(weight_copies(2 * n * k))]
        for m in ms + (pre_m,):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = fake_quantize_mx_rows(x, E4M3, out_dtype=torch.float32) @ wd.t()
            r = dict(layer=layer, n=n, k=k, m=m, cublas=_try_graph([lambda w=w: x @ w.t() for w in wb]))
            base = G.pick_config(m, n, k, x.device)
            old = dataclasses.replace(base, peel=False)

            def two(p, c):
                xr = fake_quantize_mx_rows(x, E4M3, out_dtype=torch.bfloat16)
                return G.mx_gemm(xr, p[0], p[1], None, config=c)

            cands = []
            if m <= 64:
                for bn, bk, wp, st in ((64, 128, 4, 6), (128, 128, 4, 4), (64, 256, 4, 4), (128, 256, 8, 3), (256, 128, 8, 3)):
                    tiles = -(-n // bn)
                    auto = 1
                    while tiles * auto < 2 * sms and k // (auto * 2) >= 4 * bk and auto < 8:
                        auto *= 2
                    for sp in sorted({auto, min(16, auto * 2)}):
                        cands.append(C(max(16, 1 << (m - 1).bit_length()), bn, bk, wp, st, split_k=sp, tma_w=True))
            else:
                kw = dict(tma_x=True, tma_w=True, deq_bf16=True)
                cands = [C(256, 128, 64, 8, 3, **kw), C(128, 128, 64, 8, 4, **kw), C(256, 128, 128, 8, 2, **kw), C(128, 256, 64, 8, 3, **kw)]
            variants = [("old_2launch", old, False), ("peel_2launch", base, False)]
            variants += [(f"q_{c.block_n}x{c.block_k}w{c.num_warps}s{c.num_stages}k{c.split_k}", c, True) for c in cands if m <= 64]
            variants += [(f"p_{c.block_m}x{c.block_n}x{c.block_k}w{c.num_warps}s{c.num_stages}", c, False) for c in cands if m > 64]
            if m <= 2:
                r["gemv"] = _try_graph([lambda p=p: V.mx_gemv(x, p[0], p[1], None, act_elem=E4M3) for p in ws])
            best = None
            for name, c, q in variants:
                try:
                    y = G.mx_gemm(x, ws[0][0], ws[0][1], None, config=c, act_elem=E4M3) if q else two(ws[0], c)
                    err = ((y.float() - ref).norm() / ref.norm()).item()
                except Exception as e:  # noqa: BLE001
                    r[name] = f"error: {e!r}"[:200]
                    continue
                if q:
                    t = _try_graph([lambda p=p, c=c: G.mx_gemm(x, p[0], p[1], None, config=c, act_elem=E4M3) for p in ws])
                else:
                    t = _try_graph([lambda p=p, c=c: two(p, c) for p in ws])
                r[name] = dict(us=t, err=err, cfg=str(c))
                if isinstance(t, float) and err < 5e-3 and (best is None or t < r[best]["us"]):
                    best = name
            r["best"] = best
            if best and isinstance(r["cublas"], float):
                r["best_x_cublas"] = r["cublas"] / r[best]["us"]
            brief = {kk: round(v["us"], 1) for kk, v in r.items() if isinstance(v, dict) and isinstance(v.get("us"), float)}
            log("peel", layer, f"M={m}", "cublas", r["cublas"], "gemv", r.get("gemv"), "best", best,
                r.get("best_x_cublas"), "old", brief.get("old_2launch"), "peel2", brief.get("peel_2launch"))
            log("   all", brief)
            rows.append(r)
        del ws, wb, w64, wd
        torch.cuda.empty_cache()
    RES["peel"] = rows


def part_init():
    """Prefill/M=256 accumulator start (old loop, peeled, zero-tile wgmma): 3 checks
    on fresh inputs each (a moving error is a race), then timing (quantizer + GEMM)."""
    import dataclasses

    from mxq.eval.bench_gemm import LLAMA_SHAPES
    from mxq.kernels import gemm as G
    from mxq.kernels.quantize import fake_quantize_mx_rows

    kw = dict(tma_x=True, tma_w=True, deq_bf16=True)
    rows = []
    for layer, (n, k) in LLAMA_SHAPES["8b"].items():
        ws, w64 = _weights(n, k, weight_copies(n * k))
        wd = w64.float()
        for m in (256, 2048):
            base = G.pick_config(m, n, k, torch.device("cuda"))
            tiles = [base] if m == 256 else [base, G.GemmConfig(128, 128, 64, 8, 4, **kw), G.GemmConfig(256, 128, 128, 8, 2, **kw)]
            for tile in tiles:
                for name, c in (("old", dataclasses.replace(tile, peel=False, zero_dot=False)), ("peel", dataclasses.replace(tile, peel=True)),
                                ("zdot", dataclasses.replace(tile, peel=False, zero_dot=True))):
                    errs = []
                    for _ in range(3):
                        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                        xr = fake_quantize_mx_rows(x, E4M3, out_dtype=torch.bfloat16)
                        y = G.mx_gemm(xr, ws[0][0], ws[0][1], None, config=c)
                        ref = xr.float() @ wd.t()
                        errs.append(((y.float() - ref).norm() / ref.norm()).item())
                    t = _try_graph([lambda p=p, c=c: G.mx_gemm(xr, p[0], p[1], None, config=c) for p in ws])
                    rows.append(dict(layer=layer, m=m, n=n, k=k, variant=name, cfg=str(c), us=t, errs=errs))
                    log("init", layer, m, f"{c.block_m}x{c.block_n}x{c.block_k}w{c.num_warps}s{c.num_stages}", name, t, [f"{e:.1e}" for e in errs])
        del ws, w64, wd
        torch.cuda.empty_cache()
    RES["init"] = rows


def part_dec2(ms=(4, 16)):
    """Decode MMA tiles with the bf16 scale multiply (fewer ALU ops per weight) and 8
    warps, X rounded inside (q) or by the quantizer launch first (2l); 8B shapes."""
    import dataclasses

    from mxq.eval.bench_gemm import LLAMA_SHAPES
    from mxq.kernels import gemm as G
    from mxq.kernels.quantize import fake_quantize_mx_rows

    rows = []
    for layer, (n, k) in LLAMA_SHAPES["8b"].items():
        ws, w64 = _weights(n, k, weight_copies(n * k))
        wd = w64.float()
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = fake_quantize_mx_rows(x, E4M3, out_dtype=torch.float32) @ wd.t()
            base = G.pick_config(m, n, k, x.device)
            vs = {"base": base, "bf16": dataclasses.replace(base, deq_bf16=True),
                  "w8bf16": dataclasses.replace(base, deq_bf16=True, num_warps=8),
                  "n128bf16": dataclasses.replace(base, block_n=128, block_k=128, num_stages=4, deq_bf16=True),
                  "n256k128w8bf16": dataclasses.replace(base, block_n=256, block_k=128, num_warps=8, num_stages=3, deq_bf16=True)}
            r = dict(layer=layer, m=m, n=n, k=k)
            for name, c in vs.items():
                for q in (True, False):
                    key = name + ("_q" if q else "_2l")

                    def f(p, c=c, q=q):
                        if q:
                            return G.mx_gemm(x, p[0], p[1], None, config=c, act_elem=E4M3)
                        return G.mx_gemm(fake_quantize_mx_rows(x, E4M3, out_dtype=torch.bfloat16), p[0], p[1], None, config=c)

                    try:
                        err = ((f(ws[0]).float() - ref).norm() / ref.norm()).item()
                    except Exception as e:  # noqa: BLE001
                        r[key] = f"error: {e!r}"[:200]
                        continue
                    r[key] = dict(us=_try_graph([lambda p=p, f=f: f(p) for p in ws]), err=err, cfg=str(c))
            brief = {kk: (round(v["us"], 1), f"{v['err']:.0e}") for kk, v in r.items() if isinstance(v, dict) and isinstance(v["us"], float)}
            log("dec2", layer, m, brief)
            rows.append(r)
        del ws, w64, wd
        torch.cuda.empty_cache()
    RES["dec2"] = rows


def _deq_variants(m, base):
    """A/B: each tile with the serialized / zero-tile-start / peeled loop."""
    from mxq.kernels.gemm import GemmConfig as C

    if m >= 2048:
        kw = dict(tma_x=True, tma_w=True, deq_bf16=True)
        tiles = [("256x128x64s3", C(256, 128, 64, 8, 3, **kw)), ("128x128x64s4", C(128, 128, 64, 8, 4, **kw)),
                 ("128x256x64s3", C(128, 256, 64, 8, 3, **kw)), ("128x64x64w4", C(128, 64, 64, 4, 4, **kw))]
    else:
        tiles = [("base", base)]
    R = dataclasses.replace
    return [v for name, t in tiles for v in (
        (f"{name}_old", R(t, peel=False, zero_dot=False)), (f"{name}_zdot", R(t, peel=False, zero_dot=True)),
        (f"{name}_peel", R(t, peel=True)))]  # fmt: skip


def _tile_variants(m, base):
    """Prefill tiles with the pipelined loop."""
    from mxq.kernels.gemm import GemmConfig as C

    kw = dict(tma_x=True, tma_w=True, deq_bf16=True, peel=False, zero_dot=True)
    tiles = [("256x128x64s3", C(256, 128, 64, 8, 3, **kw)), ("256x128x64s4", C(256, 128, 64, 8, 4, **kw)),
             ("256x128x128s2", C(256, 128, 128, 8, 2, **kw)), ("128x256x64s3", C(128, 256, 64, 8, 3, **kw)),
             ("256x128x64s3g16", C(256, 128, 64, 8, 3, group=16, **kw)), ("128x128x64s5", C(128, 128, 64, 8, 5, **kw)),
             ("128x128x128s3w4", C(128, 128, 128, 4, 3, **kw))]  # fmt: skip
    return tiles


def _m256_variants(m, base):
    """M = 256 tiles and K splits with the pipelined loop."""
    from mxq.kernels.gemm import GemmConfig as C

    kw = dict(tma_x=True, tma_w=True, deq_bf16=True, peel=False, zero_dot=True)
    return [("128x64x64w4", C(128, 64, 64, 4, 4, **kw)), ("128x64x64w4k2", C(128, 64, 64, 4, 4, split_k=2, **kw)),
            ("128x128x64w8", C(128, 128, 64, 8, 4, **kw)), ("128x128x64w8k2", C(128, 128, 64, 8, 4, split_k=2, **kw)),
            ("256x128x64w8k2", C(256, 128, 64, 8, 3, split_k=2, **kw)), ("256x128x64w8k4", C(256, 128, 64, 8, 3, split_k=4, **kw)),
            ("64x128x64w4", C(64, 128, 64, 4, 4, **kw)), ("64x128x128w4k2", C(64, 128, 128, 4, 3, split_k=2, **kw))]  # fmt: skip


def part_tiles():
    """With ptxas >= 13.3 (the pipelined loop): prefill tiles at M = 2048 and 8192."""
    part_deq(ms=(2048, 8192), layers=("o", "gate_up"), variants_of=_tile_variants)


def part_m256b():
    """With ptxas >= 13.3: M = 256 tiles and K splits with the pipelined loop."""
    part_deq(ms=(256,), variants_of=_m256_variants, key="m256b")


def part_deq(ms=(16, 256, 2048), layers=None, variants_of=_deq_variants, key="deq"):
    """The serialized-wgmma loop against the zero-tile start and the peeled first
    step (zero_dot / peel), on the 8B shapes. Each variant is checked on 3 fresh
    inputs (a moving error is a race), then timed (quantizer + GEMM, CUDA graphs over weight
    copies). Run once per ptxas (TRITON_PTXAS_PATH): ptxas < 13.3 lets the next K step's
    dequant overwrite the registers of a wgmma still in flight (triton-lang/triton#9433)."""
    from mxq.eval.bench_gemm import LLAMA_SHAPES
    from mxq.kernels import gemm as G
    from mxq.kernels import toolchain
    from mxq.kernels.quantize import fake_quantize_mx_rows

    rows = []
    toolchain.configure_ptxas()  # what the launches below will use
    RES["ptxas"] = os.environ.get("TRITON_PTXAS_PATH", "bundled")
    for layer, (n, k) in LLAMA_SHAPES["8b"].items():
        if layers and layer not in layers:
            continue
        ws, w64 = _weights(n, k, weight_copies(n * k))
        wd = w64.float()
        wb = [wd.to(torch.bfloat16) for _ in range(weight_copies(2 * n * k))]
        for m in ms:
            variants = variants_of(m, G.pick_config(m, n, k, torch.device("cuda")))
            r = dict(layer=layer, n=n, k=k, m=m)
            xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
            r["cublas"] = _try_graph([lambda w=w: xs[0] @ w.t() for w in wb])
            for name, c in variants:
                quant = c.quant_x

                def f(p, x, c=c, quant=quant):
                    if quant:
                        return G.mx_gemm(x, p[0], p[1], None, config=c, act_elem=E4M3)
                    return G.mx_gemm(fake_quantize_mx_rows(x, E4M3, out_dtype=torch.bfloat16), p[0], p[1], None, config=c)

                try:
                    errs = []
                    for x in xs:
                        ref = fake_quantize_mx_rows(x, E4M3, out_dtype=torch.float32) @ wd.t()
                        errs.append(((f(ws[0], x).float() - ref).norm() / ref.norm()).item())
                except Exception as e:  # noqa: BLE001
                    r[name] = f"error: {e!r}"[:200]
                    continue
                t = _try_graph([lambda p=p, f=f: f(p, xs[0]) for p in ws])
                r[name] = dict(us=t, errs=errs, cfg=str(c))
            ok = {kk: v["us"] for kk, v in r.items() if isinstance(v, dict) and isinstance(v.get("us"), float) and max(v["errs"]) < 5e-3}
            r["best"] = min(ok, key=ok.get) if ok else None
            if r["best"] and isinstance(r["cublas"], float):
                r["best_x_cublas"] = r["cublas"] / ok[r["best"]]
            brief = {kk: (round(v["us"], 1) if isinstance(v.get("us"), float) else v.get("us"), f"{max(v['errs']):.0e}")
                     for kk, v in r.items() if isinstance(v, dict)}
            log("deq", layer, f"M={m}", "cublas", r["cublas"], "best", r["best"], r.get("best_x_cublas"))
            log("   all", brief)
            rows.append(r)
        del ws, wb, w64, wd
        torch.cuda.empty_cache()
    RES[key] = rows


def part_dws(ms=(1, 8, 16), stages=(2, 3, 4, 6)):
    """The W8A8 decode GEMM (``gemm_decode_ws``): ring depth against the dispatched config and the rule,
    on the Llama-3-8B and 70B TP=2 shapes, each variant checked against an fp32 product first, then timed
    interleaved alone (plain separator) and chained (the producer's codes, the residual-add + RMSNorm
    producer between calls, as in a fused decode step), beside a copy of the same bytes. With PDL a
    program's first ``stages`` weight tiles are requested before it waits for the kernel before it."""
    from mxq.eval.bench_gemm import LLAMA_SHAPES, producer_separator, read_bytes, same_bytes_copy
    from mxq.kernels import gemm_decode_ws as WS
    from mxq.kernels import tune
    from mxq.kernels.quantize import fake_quantize_mx_rows, quantize_mx_rows

    R = dataclasses.replace
    rows = []
    dev = torch.device("cuda")
    for model in ("8b", "70b-tp2"):
        for layer, (n, k) in LLAMA_SHAPES[model].items():
            w = torch.randn(n, k, device="cuda") * 0.02
            t = quantize_mx(w, -1, E4M3, 32, ScaleRule.RCEIL)
            w_deq = dequantize_mx(t, torch.float32)
            packs = [(t.data.clone(), t.scales.clone()) for _ in range(weight_copies(n * k))]
            for m in ms:
                disp, rule = WS.pick_decode_ws_config(m, n, k, dev), WS.rule_decode_ws_config(m, n, k, dev)
                var = {"dispatched": disp, "rule": rule}
                for st in stages:
                    for name, c in (("disp", disp), ("rule", rule)):
                        stage_bytes = (c.block_n + (8 if m <= 8 else 16)) * 128  # W and X tiles of one step
                        if st != c.stages and st * stage_bytes * (65536 // (256 * c.maxnreg)) <= 220 * 1024:
                            var[f"{name} s{st}"] = R(c, stages=st)
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                xq, xs = quantize_mx_rows(x, E4M3, ScaleRule.RCEIL)
                ref = fake_quantize_mx_rows(x, E4M3, out_dtype=torch.float32) @ w_deq.t()
                row = dict(model=model, layer=layer, m=m, n=n, k=k, configs={kk: WS.describe(c) for kk, c in var.items()})
                errs = {}
                for kk, c in var.items():
                    y = WS.mx_decode_gemm_ws(x, *packs[0], None, config=c, x_mx=(xq, xs), out_dtype=torch.float32)
                    errs[kk] = ((y - ref).norm() / ref.norm()).item()
                row["relerr"] = errs
                alone = {kk: [lambda p=p, c=c: WS.mx_decode_gemm_ws(x, *p, None, config=c) for p in packs] for kk, c in var.items()}
                chained = {kk: [lambda p=p, c=c: WS.mx_decode_gemm_ws(x, *p, None, config=c, x_mx=(xq, xs)) for p in packs]
                           for kk, c in var.items()}  # fmt: skip
                row["alone_us"] = tune.time_interleaved(alone, rounds=5, reps=5)
                row["chained_us"] = tune.time_interleaved(chained, rounds=5, reps=5, sep=producer_separator(LLAMA_SHAPES[model]["o"][0]))
                nbytes = read_bytes(m, n, k, 1 + 1 / 32)
                row["bytes"] = nbytes
                row["copy_us"], row["copy_gbs"] = same_bytes_copy(nbytes)
                row["copy_again_us"], _ = same_bytes_copy(nbytes)
                best_a = min(row["alone_us"], key=row["alone_us"].get)
                best_c = min(row["chained_us"], key=row["chained_us"].get)
                log("dws", model, layer, f"M={m}", f"copy {row['copy_us']:.1f}/{row['copy_again_us']:.1f}", "disp",
                    f"{row['alone_us']['dispatched']:.1f} / {row['chained_us']['dispatched']:.1f}", "best alone", best_a,
                    f"{row['alone_us'][best_a]:.1f}", "best chained", best_c, f"{row['chained_us'][best_c]:.1f}",
                    "maxerr", f"{max(errs.values()):.1e}")  # fmt: skip
                log("   alone", {kk: round(v, 2) for kk, v in row["alone_us"].items()})
                log("   chain", {kk: round(v, 2) for kk, v in row["chained_us"].items()})
                rows.append(row)
            del packs, w, w_deq, t
            torch.cuda.empty_cache()
    RES["dws"] = rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="sweep.json")
    p.add_argument("--parts", default="q,gemv,m256,tma")
    a = p.parse_args()
    for part in a.parts.split(","):
        try:
            globals()["part_" + part]()
        except Exception as e:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            RES[part + "_error"] = repr(e)
        with open(a.out, "w") as f:
            json.dump(RES, f, indent=1, default=str)


if __name__ == "__main__":
    main()
