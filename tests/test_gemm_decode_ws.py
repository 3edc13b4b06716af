"""kernels/gemm_decode_ws.py: the W8A8 decode GEMM warp-specialized in Gluon (Hopper only: the
Triton interpreter cannot run Gluon, tests/test_sass_dev.py compiles it on the CPU). On CPU: the
tile rule, the tuner's candidates, the tuning cache lookup and the per-shape plan (with the Gluon
launch recorded); on a Hopper GPU: against float64, ``gemm_decode`` and itself (PDL, fused X)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_helpers import (
    CUDA,
    DEV,
    F8_ACC,
    HOPPER,
    activations,
    assert_chain_same_bits,
    assert_gemm_close,
    hopper,
    mx_weight,
    needs_gluon,
)

from mxq.formats import E4M3, E5M2, ScaleRule, quantize_mx
from mxq.kernels import buffers, dispatch, launch
from mxq.kernels import gemm_decode as D
from mxq.kernels import gemm_decode_ws as WS
from mxq.kernels.common import INTERPRET
from mxq.kernels.reference import mx_linear_reference


@pytest.mark.parametrize("n,k,sms,split", [(4096, 4096, 132, 8), (28672, 4096, 132, 1), (4096, 14336, 132, 8), (6144, 4096, 132, 4), (1000, 512, 132, 1), (8192, 28672, 114, 2)])
def test_decode_ws_config_rule(monkeypatch, n, k, sms, split):
    """K splits: the most (a power of two <= 16) with programs <= 2 per SM and >= 4 steps of 128 each."""
    monkeypatch.setattr(WS, "sm_count", lambda device: sms)
    cfg = WS.rule_decode_ws_config(16, n, k, torch.device("cpu"))
    assert cfg.split_k == split and cfg.box == 128 and cfg.fuse_x == (n * k <= 1 << 24)
    tiles = -(-n // 128)
    assert tiles * cfg.split_k <= max(2 * sms, tiles) and (k // 128) // cfg.split_k >= min(4, k // 128)


@pytest.mark.parametrize("n,k,sms", [(4096, 4096, 132), (28672, 4096, 132), (10240, 8192, 132), (1000, 512, 114), (130, 128, 132)])
def test_decode_ws_candidates(monkeypatch, n, k, sms):
    """The tuner's candidates: the rule's config first, no duplicates, the rule with fuse_x flipped,
    and 64-row tiles whose K split keeps their programs within what their registers let share an SM
    (65536 / (256 x maxnreg)) with >= 4 steps of 128 per split (or one split)."""
    monkeypatch.setattr(WS, "sm_count", lambda device: sms)
    dev = torch.device("cpu")
    cands = WS.decode_ws_candidates(16, n, k, dev)
    rule = WS.rule_decode_ws_config(16, n, k, dev)
    assert cands[0] == rule and len(set(cands)) == len(cands) >= 4
    assert dataclasses.replace(rule, fuse_x=not rule.fuse_x) in cands
    for c in cands:
        per_sm = 65536 // (256 * c.maxnreg)
        tiles = -(-n // c.block_n)
        assert c.block_n in (64, 128) and c.box == 128 and 1 <= c.split_k <= 16
        assert c.split_k == 1 or ((k // 128) // c.split_k >= 4 and tiles * c.split_k <= per_sm * sms)
    assert {(c.block_n, c.maxnreg, c.stages) for c in cands} >= {(64, 80, 2), (64, 80, 3), (64, 64, 2), (64, 64, 3)}


def test_pick_decode_ws_config_reads_the_tuning_cache(monkeypatch, tmp_path):
    """With a cache entry for this device, shape and M bucket, the dispatch's config is the entry's;
    other M buckets, shapes and devices, and MXQ_CACHE=off (read at each lookup), get the rule."""
    from mxq.kernels import tune

    monkeypatch.setattr(WS, "sm_count", lambda device: 132)
    monkeypatch.setattr(tune, "device_name", lambda device: "Fake H100")
    monkeypatch.setenv("MXQ_CACHE", str(tmp_path))
    tune.reset()
    gpu = type("Dev", (), {"type": "cuda", "index": 0})()
    rule = WS.rule_decode_ws_config(16, 4096, 4096, gpu)
    chosen = WS.DecodeWSConfig(block_n=64, maxnreg=80, stages=3, split_k=4, box=128, fuse_x=True)
    tune.cache().put("decode_ws", "Fake H100", {tune.shape_key(16, 4096, 4096): tune.record(chosen, 10.0, 11.0, 16, 7)})
    tune.reset()  # read back from the file
    try:
        assert WS.pick_decode_ws_config(12, 4096, 4096, gpu) == chosen  # 9..16 share the entry
        assert WS.pick_decode_ws_config(8, 4096, 4096, gpu) == WS.rule_decode_ws_config(8, 4096, 4096, gpu)
        assert WS.pick_decode_ws_config(16, 4096, 8192, gpu) == WS.rule_decode_ws_config(16, 4096, 8192, gpu)
        assert WS.pick_decode_ws_config(16, 4096, 4096, torch.device("cpu")) == rule
        monkeypatch.setattr(tune, "device_name", lambda device: "Fake H200")
        assert WS.pick_decode_ws_config(16, 4096, 4096, gpu) == rule
        monkeypatch.setattr(tune, "device_name", lambda device: "Fake H100")
        monkeypatch.setenv("MXQ_CACHE", "off")
        assert WS.pick_decode_ws_config(16, 4096, 4096, gpu) == rule
    finally:
        tune.reset()


def test_decode_ws_rejects_what_it_cannot_take():
    gen = torch.Generator().manual_seed(3)
    w, ws, _ = mx_weight(64, 256, E4M3, gen)
    x = torch.randn(4, 256).to(DEV)
    if not HOPPER:
        with pytest.raises(ValueError, match="needs Gluon, a Hopper GPU"):
            WS.mx_decode_gemm_ws(x, w, ws)
        return
    with pytest.raises(ValueError, match="M <= 16"):
        WS.mx_decode_gemm_ws(torch.zeros(17, 256, device=DEV), w, ws)
    w2, ws2, _ = mx_weight(64, 96, E4M3, gen)
    with pytest.raises(ValueError, match="K % 128"):
        WS.mx_decode_gemm_ws(torch.zeros(4, 96, device=DEV), w2, ws2)


def test_decode_ws_takes():
    """The shapes the kernel takes: 1 <= M <= 16, K % 128 == 0, MX block 32, Gluon usable."""
    usable = WS.gluon_api.usable("gemm_decode_ws")
    assert WS.takes(1, 128, 32) == WS.takes(16, 4096, 32) == usable
    assert not any((WS.takes(0, 128, 32), WS.takes(17, 128, 32), WS.takes(4, 96, 32), WS.takes(4, 256, 64)))
    assert not WS.ws_supported(4, 256, 32, torch.device("cpu"))


@needs_gluon
@pytest.mark.skipif(CUDA and not INTERPRET, reason="the X quantizer runs on CPU tensors: the interpreter's job")
@pytest.mark.parametrize("m,n,k,split", [(3, 300, 256, 1), (16, 1000, 4224, 4), (1, 130, 256, 2)])
def test_decode_ws_plan_arguments(monkeypatch, m, n, k, split):
    """The per-shape plan of mx_decode_gemm_ws (runs on the CPU with the Gluon launch recorded):
    X quantized into the plan's one scratch buffer equals the reference bytes, the descriptors
    cover W [N, K] and X [M, K] with the config's boxes, the split partials are [split, M, N]
    fp32 in the same buffer, and a second call reuses the plan (``launch.FAST``)."""
    monkeypatch.setattr(WS, "ws_supported", lambda *a: True)
    monkeypatch.setattr(WS, "pdl_ok", lambda d: False)
    monkeypatch.setattr(WS, "PLANS", WS.PlanCache())
    monkeypatch.setattr(launch, "FAST", True)
    calls = []

    class Recorder:
        def __init__(self, fn, consts, opts):
            self.consts = consts

        def __call__(self, grid, *args):
            calls.append((grid, args, self.consts))

    monkeypatch.setattr(WS, "Launch", Recorder)
    gen = torch.Generator().manual_seed(m + n + k)
    w, ws, _ = mx_weight(n, k, E4M3, gen)
    w, ws = w.cpu(), ws.cpu()
    x = activations(m, k, torch.bfloat16, gen, special=True).cpu()
    cfg = WS.DecodeWSConfig(split_k=split)
    for _ in range(2):
        y = WS.mx_decode_gemm_ws(x, w, ws, None, act_elem=E4M3, config=cfg, out_dtype=torch.float32)
    assert len(WS.PLANS) == 1 and len(calls) == 2 and y.shape == (m, n) and y.dtype == torch.float32
    grid, args, consts = calls[-1]
    w_desc, x_desc, x_arg, s32, xs32, _, y_arg, ws_arg, _ = args[:9]
    assert grid == (-(-n // 128), split) and consts["SPLIT"] == split and consts["FUSED"] == (split > 1)
    assert w_desc.base is w and w_desc.shape == [n, k] and w_desc.block_shape == [128, 128]
    assert x_desc.shape == [m, k] and x_desc.block_shape == [8 if m <= 8 else 16, 128]
    ref = quantize_mx(x, -1, E4M3, 32, ScaleRule.RCEIL)
    assert torch.equal(x_desc.base.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(xs32.view(torch.uint8), ref.scales) and torch.equal(s32.view(torch.uint8), ws)
    assert y_arg is y and (ws_arg is y if split == 1 else ws_arg.shape == (split, m, n))
    assert x_arg is x and args[9:14] == (m, n, k, -(-k // (128 * split)) * 128, k)


@needs_gluon
@pytest.mark.parametrize("rule,fused", [(ScaleRule.RCEIL, True), (ScaleRule.EVEN, True), (ScaleRule.MSE, False)])
def test_decode_ws_plan_fuses_x(monkeypatch, rule, fused):
    """With the hardware fp8 conversion the plan launches one kernel that quantizes X itself
    (raw X, its row stride and the format's constants; no quantizer, no X descriptor); MSE keeps
    the quantizer kernel."""
    monkeypatch.setattr(WS, "ws_supported", lambda *a: True)
    monkeypatch.setattr(WS, "pdl_ok", lambda d: False)
    monkeypatch.setattr(WS, "hw_cvt", lambda d: True)
    monkeypatch.setattr(WS, "PLANS", WS.PlanCache())
    calls = []

    class Recorder:
        def __init__(self, fn, consts, opts):
            self.fn, self.consts = fn, consts

        def __call__(self, grid, *args):
            calls.append((self.fn, grid, args, self.consts))

    monkeypatch.setattr(WS, "Launch", Recorder)
    monkeypatch.setattr(WS, "quantize_launch", lambda *a, **kw: Recorder("quantize", {}, {}))
    gen = torch.Generator().manual_seed(5)
    m, n, k = 5, 300, 640
    w, ws, _ = mx_weight(n, k, E4M3, gen)
    wide = torch.randn(m, k + 40, generator=gen).to(torch.bfloat16)
    x = wide[:, 8 : 8 + k]
    WS.mx_decode_gemm_ws(x, w.cpu(), ws.cpu(), None, act_elem=E5M2, act_rule=rule, config=WS.DecodeWSConfig(split_k=2, fuse_x=True))
    if not fused:
        assert [c[0] for c in calls] == ["quantize", WS.mx_decode_ws_kernel] and "FUSE_X" not in calls[-1][3]
        return
    assert len(calls) == 1
    fn, grid, args, consts = calls[0]
    assert fn is WS.mx_decode_ws_kernel and grid == (3, 2)
    assert consts["FUSE_X"] and consts["RULE"] == {ScaleRule.RCEIL: 1, ScaleRule.EVEN: 2}[rule]
    assert (consts["EMAX"], consts["MBITS"], consts["MAXN"]) == (E5M2.emax, E5M2.mbits, E5M2.max_normal)
    assert args[1] is args[0] and args[2] is x and args[7].shape == (2, m, n) and args[13] == k + 40


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 1000, 640), (3, 257, 4224), (16, 6144, 4096), (9, 14336, 4096), (13, 130, 128)])
@pytest.mark.parametrize("wel,act", [(E4M3, (E4M3, ScaleRule.RCEIL)), (E5M2, (E4M3, ScaleRule.MSE)), (E4M3, (E5M2, ScaleRule.FLOOR))])
def test_gpu_decode_ws_matches_reference(m, n, k, wel, act):
    """Awkward and model shapes, every operand format, bias, bf16/fp32 out, against float64; the
    configs the sweep tried (tile per block or per step, splits incl. uneven, the reduction kernel,
    deeper rings); tickets left at zero; and the result equals gemm_decode's within the bound."""
    gen = torch.Generator().manual_seed(m * 7 + n + k)
    w, ws, w64 = mx_weight(n, k, wel, gen)
    x = activations(m, k, torch.bfloat16, gen, special=False, decades=(-2, 1))
    bias = torch.randn(n, generator=gen).to(torch.bfloat16).to(DEV)
    act_elem, rule = act
    cfgs = [None, WS.DecodeWSConfig(box=32, split_k=3), WS.DecodeWSConfig(split_k=2, fused=False), WS.DecodeWSConfig(stages=4, split_k=5)]
    for cfg, out in zip(cfgs, (None, torch.float32, torch.float32, None)):
        y = WS.mx_decode_gemm_ws(x, w, ws, bias, act_elem=act_elem, act_rule=rule, out_dtype=out, config=cfg)
        assert y.dtype == (out or torch.bfloat16) and y.shape == (m, n)
        assert_gemm_close(y, x, w64, bias, act_elem, rule, acc_rel=F8_ACC)
    counters = buffers.split_counters(torch.device(DEV), 1)
    assert counters is not None and not counters.any()
    y0 = D.mx_decode_gemm(x, w, ws, bias, act_elem=act_elem, act_rule=rule, out_dtype=torch.float32)
    y1 = WS.mx_decode_gemm_ws(x, w, ws, bias, act_elem=act_elem, act_rule=rule, out_dtype=torch.float32)
    mag = (x.double().abs() @ w64.abs().t())
    assert ((y0.double() - y1.double()).abs() <= 2 * F8_ACC * mag + 1e-30).all()


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 1000, 640), (7, 4160, 4096), (16, 6144, 4096), (13, 200, 1152)])
def test_gpu_decode_ws_candidates_agree(m, n, k):
    """Every config the tuner may choose (64-row tiles at 3-4 programs per SM, other splits, X fused
    or not) computes the rule's function: within the fp8-accumulation bound of float64, and equal
    to the rule's output up to the fp32 summation order of the splits; with bias, N not a multiple
    of 64, uneven splits."""
    gen = torch.Generator().manual_seed(m * 31 + n + k)
    w, ws, w64 = mx_weight(n, k, E4M3, gen)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16).to(DEV)
    x = activations(m, k, torch.bfloat16, gen, special=False, decades=(-2, 1))
    cands = WS.decode_ws_candidates(m, n, k, torch.device(DEV))
    cands.append(dataclasses.replace(cands[1], split_k=3))
    y0 = WS.mx_decode_gemm_ws(x, w, ws, bias, out_dtype=torch.float32, config=cands[0])
    for c in cands:
        y = WS.mx_decode_gemm_ws(x, w, ws, bias, out_dtype=torch.float32, config=c)
        torch.testing.assert_close(y, y0, rtol=1e-5, atol=1e-5 * float(y0.abs().max()), msg=lambda s, c=c: f"{c}: {s}")
        assert_gemm_close(y, x, w64, bias, E4M3, ScaleRule.RCEIL, acc_rel=F8_ACC)


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 1000, 640), (16, 6144, 4096), (5, 14336, 4096), (16, 4096, 14336)])
def test_gpu_decode_ws_pdl_same_bits(m, n, k):
    """Programmatic dependent launch (the kernel starts while the X quantizer runs and waits for
    it with griddepcontrol.wait) gives the same bits as two serialized launches; in a CUDA graph
    where X is rewritten right before the call, every replay reads the new X (no stale reads)."""
    gen = torch.Generator().manual_seed(m + n + k)
    w, ws, w64 = mx_weight(n, k, E4M3, gen)
    x = activations(m, k, torch.bfloat16, gen, special=False, decades=(-2, 1))
    cfg = WS.pick_decode_ws_config(m, n, k, torch.device(DEV))
    cfg = dataclasses.replace(cfg, fuse_x=False)
    assert cfg.pdl
    off = dataclasses.replace(cfg, pdl=False)
    y_on = WS.mx_decode_gemm_ws(x, w, ws, out_dtype=torch.float32, config=cfg)
    y_off = WS.mx_decode_gemm_ws(x, w, ws, out_dtype=torch.float32, config=off)
    assert torch.equal(y_on, y_off)
    src = torch.empty_like(x)
    xin = torch.empty_like(x)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        xin.copy_(src)
        yg = WS.mx_decode_gemm_ws(xin, w, ws, out_dtype=torch.float32, config=cfg)
    for _ in range(3):
        src.copy_(activations(m, k, torch.bfloat16, gen, special=False, decades=(-2, 1)))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(yg, WS.mx_decode_gemm_ws(src, w, ws, out_dtype=torch.float32, config=off))


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 1000, 640), (3, 257, 4224), (16, 6144, 4096), (9, 14336, 4096), (13, 130, 128), (16, 4096, 14336)])
def test_gpu_decode_ws_fused_x_same_bits(m, n, k):
    """X quantized inside the kernel (fuse_x, one launch) gives the same bits as the quantizer
    kernel + the same GEMM, for every amax rule and element format, bf16/fp16/fp32 X with NaN,
    Inf, zero and tiny blocks, rows with a stride wider than K, splits incl. uneven, bias; and in
    a CUDA graph each replay reads the X of that moment."""
    gen = torch.Generator().manual_seed(m * 5 + n + k)
    w, ws, w64 = mx_weight(n, k, E4M3, gen)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16).to(DEV)
    base = dataclasses.replace(WS.pick_decode_ws_config(m, n, k, torch.device(DEV)), fuse_x=True)
    acts = [(E4M3, ScaleRule.RCEIL, torch.bfloat16), (E5M2, ScaleRule.FLOOR, torch.float16), (E4M3, ScaleRule.EVEN, torch.float32)]
    for (act_elem, rule, dtype), split in zip(acts, (base.split_k, 3, 1)):
        wide = torch.zeros(m, k + 96, dtype=dtype, device=DEV)
        x = wide[:, 7 : 7 + k]  # row stride k + 96, not 16-byte aligned
        x.copy_(activations(m, k, dtype, gen, special=True, decades=(-3, 2)))
        fused = dataclasses.replace(base, split_k=split)
        plain = dataclasses.replace(fused, fuse_x=False)
        for b in (None, bias):
            y1 = WS.mx_decode_gemm_ws(x, w, ws, b, act_elem=act_elem, act_rule=rule, out_dtype=torch.float32, config=fused)
            y0 = WS.mx_decode_gemm_ws(x, w, ws, b, act_elem=act_elem, act_rule=rule, out_dtype=torch.float32, config=plain)
            torch.testing.assert_close(y1, y0, rtol=0, atol=0, equal_nan=True)
        if m >= 4:
            assert torch.isnan(y1[:2]).all() and not torch.isnan(y1[2:]).any()
        clean = activations(m, k, dtype, gen, special=False, decades=(-2, 1))
        y = WS.mx_decode_gemm_ws(clean, w, ws, bias, act_elem=act_elem, act_rule=rule, config=fused)
        assert_gemm_close(y, clean, w64, bias, act_elem, rule, acc_rel=F8_ACC)
    src = torch.empty(m, k, dtype=torch.bfloat16, device=DEV)
    xin = torch.empty_like(src)
    WS.mx_decode_gemm_ws(xin, w, ws, out_dtype=torch.float32, config=base)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        xin.copy_(src)
        yg = WS.mx_decode_gemm_ws(xin, w, ws, out_dtype=torch.float32, config=base)
    for _ in range(3):
        src.copy_(activations(m, k, torch.bfloat16, gen, special=False, decades=(-2, 1)))
        g.replay()
        torch.cuda.synchronize()
        plain = dataclasses.replace(base, fuse_x=False)
        assert torch.equal(yg, WS.mx_decode_gemm_ws(src, w, ws, out_dtype=torch.float32, config=plain))


@hopper
@pytest.mark.gpu
def test_gpu_decode_ws_nonfinite_and_dispatch():
    """A NaN scale byte / Inf activation gives NaN where the reference does; mx_linear takes this
    path for W8A8 at 1 <= M <= 16 (W8A16 keeps the gemv), also under CUDA-graph capture."""
    gen = torch.Generator().manual_seed(11)
    n, k = 300, 512
    w, ws, w64 = mx_weight(n, k, E4M3, gen)
    ws[7, 3] = 255
    x = activations(6, k, torch.float32, gen, special=True)
    y = WS.mx_decode_gemm_ws(x, w, ws, None, out_dtype=torch.float32)
    ref = mx_linear_reference(x.cpu(), w.cpu(), ws.cpu(), None, act_elem=E4M3)
    assert torch.equal(torch.isnan(y.cpu()), torch.isnan(ref))
    dev = torch.device(DEV)
    for m in (1, 8, 16):
        assert dispatch.linear_path(m, 4096, 4096, dev) is dispatch.LINEAR["decode_ws"]
        assert dispatch.path_name(m, 4096, 4096, dev).startswith("decode_ws ")
    assert dispatch.linear_path(1, 4096, 4096, dev, w8a8=False) is dispatch.LINEAR["gemv"]
    w, ws, w64 = mx_weight(4096, 4096, E4M3, gen)
    x = activations(8, 4096, torch.bfloat16, gen, special=False, decades=(-2, 1))
    y = dispatch.mx_linear(x, w, ws, act_elem=E4M3)
    assert_gemm_close(y, x, w64, None, E4M3, acc_rel=F8_ACC)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        yg = dispatch.mx_linear(x, w, ws, act_elem=E4M3)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(yg, y)


def _decode_chain(x, res, layers, eps=1e-5):
    """The decode step's kernels in a row, as a fused model launches them: per layer the residual
    add + RMSNorm producer, the gate/up GEMM on its codes, the SiLU·up producer, the down GEMM on
    its codes, attention of that output (as 16 query heads of 128) over a cache of 4 kv heads (one
    launch, and a split context: kernel + merge), then a GEMM that quantizes its X itself
    (``fuse_x`` on) and one behind the quantizer kernel (``fuse_x`` off); each output is the next
    one's input."""
    from mxq.kernels import producers as P
    from mxq.kernels.attention_sdpa_decode import sdpa_decode

    for nw, gu_w, d_w, o_w, o_cfg, q_cfg, kv in layers:
        h, y, q, s = P.add_rmsnorm_mx(x, res, nw, eps, E4M3)
        gu = WS.mx_decode_gemm_ws(y, *gu_w, x_mx=(q, s))
        y2, q2, s2 = P.silu_mul_mx(gu, E4M3)
        d = WS.mx_decode_gemm_ws(y2, *d_w, x_mx=(q2, s2))
        a = sdpa_decode(d.view(d.shape[0], 16, 1, 128), kv, kv)
        o = WS.mx_decode_gemm_ws(a.reshape(d.shape), *o_w, config=o_cfg)
        x, res = WS.mx_decode_gemm_ws(o, *o_w, config=q_cfg), h
    return x, res


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 5])
def test_gpu_decode_chain_pdl_same_bits(monkeypatch, m):
    """Programmatic dependent launch along a decode step: every GEMM and the attention let the
    kernel behind them start at once, and the producers, the attention, the quantizer and the
    fused-X GEMM are themselves launched behind their predecessor (each waits for it before
    reading). Eagerly and in a CUDA graph
    replayed on new inputs, the chain's bits equal those of the same chain with PDL off (every
    launch serialized): no kernel reads an input before its writer finished."""
    from mxq.kernels import common
    from mxq.kernels import producers as P

    gen = torch.Generator().manual_seed(7 + m)
    hid, inter = 2048, 5632
    layers = []
    for _ in range(3):
        nw = (1 + 0.1 * torch.randn(hid, generator=gen)).to(torch.bfloat16).to(DEV)
        gu_w, d_w, o_w = (mx_weight(n, k, E4M3, gen)[:2] for n, k in ((2 * inter, hid), (hid, inter), (hid, hid)))
        o_cfg = WS.pick_decode_ws_config(m, hid, hid, torch.device(DEV))
        assert o_cfg.pdl
        kv = torch.randn(m, 4, (160, 4000)[len(layers) % 2], 128, generator=gen).to(torch.bfloat16).to(DEV)
        layers.append((nw, gu_w, d_w, o_w, dataclasses.replace(o_cfg, fuse_x=True), dataclasses.replace(o_cfg, fuse_x=False), kv))

    def inputs():
        return (activations(m, hid, torch.bfloat16, gen, special=False, decades=(-1, 1)),
                activations(m, hid, torch.bfloat16, gen, special=False, decades=(-1, 1)))  # fmt: skip

    def serialized(x, res):
        with monkeypatch.context() as mp:
            mp.setattr(common, "PDL", False)
            mp.setattr(P, "PLANS", launch.PlanCache())  # producer plans hold their PDL constexpr
            return _decode_chain(x, res, layers)

    assert_chain_same_bits(lambda x, res: _decode_chain(x, res, layers), inputs, serialized)
