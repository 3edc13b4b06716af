"""Triton kernels (mxq.kernels) against the torch reference.

On CPU the kernels run through the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET
when there is no GPU) at small awkward shapes; GPU tests repeat the checks at model shapes.
Every check draws fresh random inputs; quantization is compared byte for byte, the GEMM against
a float64 product of the dequantized operands with a bound that allows only accumulation order
and the final rounding to the output dtype.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from mxq.formats import (
    E4M3,
    E5M2,
    MXTensor,
    ScaleRule,
    dequantize_mx,
    fake_quantize_mx,
    quantize_mx,
)
from mxq.kernels import mx_linear, mx_linear_reference, pack_weight

triton = pytest.importorskip("triton")
tl = triton.language

from mxq.kernels import gemm as G  # noqa: E402
from mxq.kernels import gluon_api  # noqa: E402
from mxq.kernels import quantize as Q  # noqa: E402
from mxq.kernels.dispatch import mx_linear_triton  # noqa: E402
from mxq.kernels.quantize import fake_quantize_mx_rows, quantize_mx_rows  # noqa: E402
from mxq.kernels.toolchain import wgmma_async_ok  # noqa: E402

CUDA = torch.cuda.is_available()
ASYNC_OK = CUDA and wgmma_async_ok()
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
DEV = "cuda" if CUDA else "cpu"
# the warp-specialized kernels' plans exist only where the Gluon API they are written for does
needs_gluon = pytest.mark.skipif(gluon_api.PROBLEM is not None, reason=f"Hopper kernels off: {gluon_api.PROBLEM}")
# Half an ulp of the output dtype, relative. The interpreter's fp32->bf16 cast truncates
# instead of rounding to nearest even (triton 3.6), so there it is a whole ulp.
EPS = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
if G.INTERPRET:
    EPS[torch.bfloat16] = 2.0**-7


def _activations(
    m: int, k: int, dtype: torch.dtype, gen: torch.Generator, special: bool, decades: tuple = (-3, 3)
) -> torch.Tensor:
    """Gaussian rows over several decades of magnitude, optionally with NaN/Inf/zero/-tiny blocks."""
    x = torch.randn(m, k, generator=gen) * torch.logspace(*decades, k)[torch.randperm(k, generator=gen)]
    if special and m >= 4 and k >= 64:
        x[0, 5] = float("nan")
        x[1, k - 1] = float("inf")
        x[2, 32:64] = 0.0
        x[3, 0:10] = -1e-30
    return x.to(dtype).to(DEV)


def _weight(n: int, k: int, elem, gen: torch.Generator):
    w = torch.randn(n, k, generator=gen) * torch.exp(torch.randn(n, 1, generator=gen))
    t = quantize_mx(w.to(DEV), -1, elem, 32, ScaleRule.RCEIL)
    return t.data, t.scales, dequantize_mx(t, torch.float64)


def _dispatch_acc(m, act_elem, k=None):
    """The accumulation bound of the path ``mx_linear`` takes: fp8 tensor cores (W8A8; gemm_decode
    at 3 <= M <= 16, gemm_decode_ws on Hopper at 1 <= M <= 16 with K % 128 == 0, given ``k``) sum
    a block in fewer bits than fp32; elsewhere fp32 (None)."""
    from mxq.kernels import dispatch

    if act_elem is None or G.INTERPRET:
        return None
    hopper = CUDA and torch.cuda.get_device_capability()[0] == 9
    if G.GEMV_MAX_M < m <= dispatch.DECODE_F8_DISPATCH_M or (k is not None and dispatch._use_ws(m, k, 32, hopper)):
        return 2.0**-12
    return None


def _assert_gemm_close(y, x, w64, bias, act_elem, act_rule=ScaleRule.RCEIL, acc_rel=None):
    """|y - exact| <= one output rounding + fp32 accumulation error, for every element
    (``acc_rel``: a coarser accumulation, relative to the sum of |products|)."""
    xf = x.to(torch.float32)
    if act_elem is not None:
        xf = fake_quantize_mx(xf, -1, act_elem, 32, act_rule)
    x64 = xf.reshape(-1, xf.shape[-1]).to(torch.float64)
    exact = x64 @ w64.t()
    if bias is not None:
        exact = exact + bias.to(torch.float64)
    mag = x64.abs() @ w64.abs().t()
    k = x64.shape[1]
    bound = EPS[y.dtype] * exact.abs() + (acc_rel if acc_rel is not None else 2 * k * 2.0**-24) * mag + 1e-30
    err = (y.reshape(exact.shape).to(torch.float64) - exact).abs()
    worst = (err - bound).max().item()
    assert torch.isfinite(y).all()
    assert worst <= 0, f"max excess over bound {worst:.3g} (err {err.max().item():.3g})"


# --------------------------------------------------------------------------------------
# Activation quantization: byte-identical to the format core
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("elem", [E4M3, E5M2])
@pytest.mark.parametrize("rule", list(ScaleRule))
def test_quantize_rows_bit_identical(dtype, elem, rule):
    gen = torch.Generator().manual_seed(hash((str(dtype), elem.name, rule.value)) % 2**31)
    for m, k in [(17, 200), (3, 40)]:
        x = _activations(m, k, dtype, gen, special=True)
        q, s = quantize_mx_rows(x, elem, rule)
        ref = quantize_mx(x, -1, elem, 32, rule)
        assert q.dtype == elem.torch_dtype and q.shape == ref.data.shape
        assert torch.equal(q.view(torch.uint8), ref.data.view(torch.uint8))
        assert torch.equal(s, ref.scales)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rule", [ScaleRule.RCEIL, ScaleRule.FLOOR])
def test_fake_quantize_rows_values(dtype, rule):
    gen = torch.Generator().manual_seed(7)
    x = _activations(17, 136, dtype, gen, special=True)
    ref = fake_quantize_mx(x, -1, E4M3, 32, rule)
    for out_dtype in (dtype, torch.bfloat16):
        d = fake_quantize_mx_rows(x, E4M3, rule, out_dtype=out_dtype)
        torch.testing.assert_close(d, ref.to(out_dtype), rtol=0, atol=0, equal_nan=True)


def test_quantize_rows_pdl_flag_keeps_the_bytes(monkeypatch):
    """``pdl=True`` (release a dependent kernel early) changes nothing in the output; it is on only
    on sm_90+ GPUs outside the interpreter, and MXQ_PDL=0 turns it off."""
    gen = torch.Generator().manual_seed(9)
    x = _activations(7, 200, torch.bfloat16, gen, special=True)
    q0, s0 = Q.quantize_mx_rows(x, E4M3, ScaleRule.RCEIL)
    q1, s1 = Q.quantize_mx_rows(x, E4M3, ScaleRule.RCEIL, pdl=True)
    assert torch.equal(q0.view(torch.uint8), q1.view(torch.uint8)) and torch.equal(s0, s1)
    assert not Q.pdl_ok(torch.device("cpu"))
    if CUDA and not Q.INTERPRET:
        assert Q.pdl_ok(torch.device(DEV)) == (torch.cuda.get_device_capability() >= (9, 0))
        monkeypatch.setenv("MXQ_PDL", "0")
        assert not Q.pdl_ok(torch.device(DEV))


def test_quantize_rows_leading_dims_and_errors():
    gen = torch.Generator().manual_seed(3)
    x = _activations(6, 96, torch.bfloat16, gen, special=False).reshape(2, 3, 96)
    q, s = quantize_mx_rows(x, E4M3, ScaleRule.RCEIL)
    assert q.shape == (2, 3, 96) and s.shape == (2, 3, 3)
    ref = quantize_mx(x, -1, E4M3)
    assert torch.equal(q.view(torch.uint8), ref.data.view(torch.uint8))
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        quantize_mx_rows(x.to(torch.int32), E4M3)
    with pytest.raises(ValueError, match="block_size"):
        quantize_mx_rows(x, E4M3, block_size=24)


# --------------------------------------------------------------------------------------
# GEMM through the Triton path (interpreter on CPU)
# --------------------------------------------------------------------------------------

SHAPES = [(1, 40, 96), (3, 72, 160), (17, 200, 224)]


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("act_elem", [None, E4M3])
def test_mx_linear_triton_matches_reference(m, n, k, xdtype, act_elem):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    welem = E5M2 if (m + n) % 2 else E4M3
    w, ws, w64 = _weight(n, k, welem, gen)
    x = _activations(m, k, xdtype, gen, special=False, decades=(-2, 1))
    bias = (torch.randn(n, generator=gen)).to(xdtype).to(DEV)
    y = mx_linear_triton(x, w, ws, bias, act_elem=act_elem)
    assert y.dtype == xdtype and y.shape == (m, n)
    _assert_gemm_close(y, x, w64, bias, act_elem, acc_rel=_dispatch_acc(m, act_elem))


@pytest.mark.parametrize("split_k,gather", [(1, False), (3, False), (2, True)])
def test_mx_gemm_configs_and_split_k(split_k, gather):
    """Every kernel variant; on CPU the TMA flags fall back to pointer loads."""
    gen = torch.Generator().manual_seed(11 + split_k)
    m, n, k = 17, 72, 416
    w, ws, w64 = _weight(n, k, E4M3, gen)
    x = _activations(m, k, torch.float32, gen, special=False)
    for xd in (torch.float32, torch.bfloat16):
        xx = x.to(xd)
        cfg = G.GemmConfig(16, 32, 64, num_stages=1, split_k=split_k, scale_gather=gather, tma_x=True, tma_w=True, deq_bf16=True)
        _assert_gemm_close(G.mx_gemm(xx, w, ws, None, config=cfg), xx, w64, None, None)
        if not gather:  # fp8 -> bf16 by bit moves
            cfg = G.GemmConfig(16, 32, 64, num_stages=1, split_k=split_k, tma_x=True, tma_w=True, deq_bits=True)
            _assert_gemm_close(G.mx_gemm(xx, w, ws, None, config=cfg), xx, w64, None, None)
        # The un-peeled loop (accumulator zero-initialised before it) computes the same.
        for zd in (False, True):
            cfg = G.GemmConfig(16, 32, 64, num_stages=1, split_k=split_k, scale_gather=gather, peel=False, zero_dot=zd)
            _assert_gemm_close(G.mx_gemm(xx, w, ws, None, config=cfg), xx, w64, None, None)


@pytest.mark.parametrize("m,n,k", [(1, 40, 96), (5, 72, 160), (17, 50, 224)])
@pytest.mark.parametrize("act", [(E4M3, ScaleRule.RCEIL), (E5M2, ScaleRule.FLOOR), (E4M3, ScaleRule.EVEN)])
def test_mx_gemm_quant_inside(m, n, k, act):
    """W8A8 with X MX-rounded inside the MMA kernel (one launch), any X dtype, split-K."""
    gen = torch.Generator().manual_seed(m * 13 + n + k)
    w, ws, w64 = _weight(n, k, E4M3 if n % 2 else E5M2, gen)
    elem, rule = act
    for xdtype in (torch.bfloat16, torch.float32):
        x = _activations(m, k, xdtype, gen, special=False, decades=(-2, 1))
        bias = torch.randn(n, generator=gen).to(xdtype).to(DEV)
        for split in (1, 3):
            cfg = G.GemmConfig(16, 32, 64, num_stages=1, split_k=split)
            y = G.mx_gemm(x, w, ws, bias, config=cfg, act_elem=elem, act_rule=rule)
            assert y.dtype == xdtype and y.shape == (m, n)
            _assert_gemm_close(y, x, w64, bias, elem, rule)
    with pytest.raises(ValueError, match="MSE"):
        G.mx_gemm(x, w, ws, None, act_elem=E4M3, act_rule=ScaleRule.MSE)


@triton.jit
def _deq_bits_probe(w_ptr, s_ptr, y_ptr, BLOCK_N: tl.constexpr, NB: tl.constexpr, E5M2: tl.constexpr, DOT: tl.constexpr):
    rows = tl.arange(0, BLOCK_N)[:, None]
    w = tl.load(w_ptr + rows * (NB * 32) + tl.arange(0, NB * 32)[None, :])
    sc = tl.load(s_ptr + rows * NB + tl.arange(0, NB)[None, :])
    y = G._fp8_bits_dequant(w, sc, BLOCK_N, NB, 32, E5M2, DOT)
    tl.store(y_ptr + rows * (NB * 32) + tl.arange(0, NB * 32)[None, :], y)


def _finite_codes(elem) -> torch.Tensor:
    codes = torch.arange(256, dtype=torch.int32)
    mag = codes & 0x7F
    bad = (mag == 0x7F) if elem is E4M3 else (mag >= 0x7C)  # NaN (E4M3); Inf/NaN (E5M2)
    return codes[~bad].to(torch.uint8)


@pytest.mark.parametrize("elem", [E4M3, E5M2])
def test_deq_bits_every_code_and_scale(elem):
    """The bit-move dequant (deq_bits) against the format core's decode: every finite fp8 code
    under scale bytes across the whole range: 0 (2**-127), tiny, typical, the largest the first
    power-of-two factor holds (134 / 142), past it, 254 and 255 (NaN). Bit-exact in fp32 (the
    interpreter path); on a GPU the bf16 path equals the exact value rounded once to bf16."""
    gen = torch.Generator().manual_seed(101)
    codes = _finite_codes(elem)
    scales = torch.tensor([0, 1, 5, 60, 100, 115, 127, 133, 134, 135, 142, 143, 200, 254, 255, 120], dtype=torch.uint8)
    n, nb = len(scales), 8
    data = codes[torch.randint(len(codes), (n, nb * 32), generator=gen)]
    data[:, : len(codes)] = codes  # every code under every scale (first blocks)
    sc = scales[:, None].repeat(1, nb)
    sc[:, -1] = scales[torch.randperm(n, generator=gen)]  # mixed scales within a row
    w = data.view(torch.float8_e4m3fn if elem is E4M3 else torch.float8_e5m2)
    ref = dequantize_mx(MXTensor(w, sc, w.shape, -1, 32, elem), torch.float32)
    for dot in [tl.float32, tl.bfloat16] if CUDA else [tl.float32]:
        y = torch.empty(n, nb * 32, dtype=torch.float32 if dot == tl.float32 else torch.bfloat16, device=DEV)
        _deq_bits_probe[(1,)](w.to(DEV), sc.to(DEV), y, BLOCK_N=n, NB=nb, E5M2=elem is E5M2, DOT=dot)
        got = y.cpu()
        want = ref if dot == tl.float32 else ref.to(torch.bfloat16)
        same = (got.float() == want.float()) | (got.isnan() & want.isnan())
        bad = ~same
        assert same.all(), (
            f"{elem.name} {dot}: {int(bad.sum())} of {same.numel()} differ, e.g. codes {data[bad][:4].tolist()} "
            f"scales {sc.repeat_interleave(32, 1)[bad][:4].tolist()}: {got[bad][:4].tolist()} vs {want[bad][:4].tolist()}"
        )
        nan_rows = sc.repeat_interleave(32, 1) == 255
        assert got[nan_rows].isnan().all() and not got[~nan_rows].isnan().any()


def test_mx_gemm_quant_inside_nonfinite():
    """A NaN/Inf activation block makes its output row NaN, as in the reference."""
    gen = torch.Generator().manual_seed(23)
    n, k = 24, 128
    w, ws, _ = _weight(n, k, E4M3, gen)
    x = _activations(4, k, torch.float32, gen, special=True)
    y = G.mx_gemm(x, w, ws, None, config=G.GemmConfig(16, 32, 64, num_stages=1), act_elem=E4M3)
    ref = mx_linear_reference(x.cpu(), w.cpu(), ws.cpu(), None, act_elem=E4M3)
    assert torch.equal(torch.isnan(y.cpu()), torch.isnan(ref))
    fin = torch.isfinite(ref)
    torch.testing.assert_close(y.cpu()[fin], ref[fin], rtol=1e-5, atol=1e-5)


def test_mx_linear_leading_dims_rules_and_packed():
    gen = torch.Generator().manual_seed(5)
    n, k = 48, 128
    w, ws, w64 = _weight(n, k, E4M3, gen)
    x = _activations(6, k, torch.float32, gen, special=False).reshape(2, 3, k)
    for rule in (ScaleRule.FLOOR, ScaleRule.MSE):
        y = mx_linear_triton(x, w, ws, None, act_elem=E5M2, act_rule=rule)
        assert y.shape == (2, 3, n)
        _assert_gemm_close(y, x, w64, None, E5M2, rule, acc_rel=_dispatch_acc(6, E5M2))
    packed = pack_weight(w, ws)
    ref = mx_linear_reference(x, w, ws)
    # The dispatcher takes the packed weight; on CPU it is exactly the reference.
    y = mx_linear(x, packed, None)
    if not CUDA:
        assert torch.equal(y, ref)
    else:
        _assert_gemm_close(y, x, w64, None, None)


def test_dispatch_cpu_is_reference():
    gen = torch.Generator().manual_seed(9)
    w, ws, _ = _weight(40, 64, E4M3, gen)
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    b = torch.randn(40, generator=gen).to(torch.bfloat16)
    ws_cpu, w_cpu = ws.cpu(), w.cpu()
    for act in (None, E4M3):
        y = mx_linear(x, w_cpu, ws_cpu, b, act_elem=act)
        assert torch.equal(y, mx_linear_reference(x, w_cpu, ws_cpu, b, act_elem=act))


def test_gemm_errors_are_clear():
    w = torch.zeros(8, 64, dtype=torch.float8_e4m3fn)
    s = torch.full((8, 2), 127, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"weight must be \[N, K=32\]"):
        G.mx_gemm(torch.zeros(2, 32), w, s)
    with pytest.raises(ValueError, match="weight_scale must be uint8"):
        G.mx_gemm(torch.zeros(2, 64), w, s[:, :1])
    with pytest.raises(TypeError, match="float8_e4m3fn or float8_e5m2"):
        pack_weight(w.to(torch.float16), s)
    with pytest.raises(ValueError, match="weight_scale is required"):
        mx_linear(torch.zeros(2, 64), w, None)


# --------------------------------------------------------------------------------------
# GPU: model shapes, the dispatched path, dot_scaled, graph capture
# --------------------------------------------------------------------------------------


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("rule", list(ScaleRule))
def test_gpu_quantize_large(rule):
    gen = torch.Generator().manual_seed(1)
    x = _activations(1024, 4096, torch.bfloat16, gen, special=True)
    for elem in (E4M3, E5M2):
        q, s = quantize_mx_rows(x, elem, rule)
        # The format core derives exponents with integer ops now, exact on CUDA too (the
        # earlier float64-ldexp version was not): compare on the device. On the GPU the kernel
        # rounds with the hardware fp8 conversion, so this also checks that route bit by bit.
        ref = quantize_mx(x, -1, elem, 32, rule)
        bad = (s != ref.scales).nonzero()
        if rule is ScaleRule.MSE and len(bad) <= s.numel() // 10_000:
            # MSE compares float64 error sums whose order differs from torch's (quantize.py):
            # near-ties may break the other way; seen once in 131072 blocks on an H200.
            keep = (s == ref.scales).unsqueeze(-1).expand(-1, -1, 32).reshape(q.shape)
            assert torch.equal(q.view(torch.uint8)[keep], ref.data.view(torch.uint8)[keep])
            continue
        if len(bad):
            r, b = bad[0].tolist()
            blk = x[r, 32 * b : 32 * b + 32].float()
            amax = blk.abs().max().item()
            msg = f"{elem} {rule}: {len(bad)} scales differ, first row {r} block {b}: ours {s[r, b].item()} ref {ref.scales[r, b].item()} amax {amax!r} ({amax.hex()})"
            raise AssertionError(msg)
        assert torch.equal(q.view(torch.uint8), ref.data.view(torch.uint8))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 16, 17, 64, 100, 256, 2048])
@pytest.mark.parametrize("n,k", [(4096, 4096), (1000, 14336), (6144, 1056)])
def test_gpu_mx_linear(m, n, k):
    gen = torch.Generator().manual_seed(m + n)
    w, ws, w64 = _weight(n, k, E4M3, gen)
    x = (torch.randn(m, k, generator=gen)).to(torch.bfloat16).cuda()
    bias = torch.randn(n, generator=gen).to(torch.bfloat16).cuda()
    for act in (None, E4M3):
        y = mx_linear(x, w, ws, bias, act_elem=act)
        _assert_gemm_close(y, x, w64, bias, act, acc_rel=_dispatch_acc(m, act, k))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("xdtype", [torch.float16, torch.float32])
def test_gpu_mx_linear_other_dtypes(xdtype):
    gen = torch.Generator().manual_seed(2)
    w, ws, w64 = _weight(1000, 1024, E5M2, gen)
    x = torch.randn(300, 1024, generator=gen).to(xdtype).cuda()
    for act in (None, E4M3):
        _assert_gemm_close(mx_linear(x, w, ws, None, act_elem=act), x, w64, None, act)


@gpu
@pytest.mark.gpu
def test_gpu_dot_scaled_matches_reference():
    gen = torch.Generator().manual_seed(4)
    w, ws, w64 = _weight(1000, 1024, E4M3, gen)
    x = torch.randn(300, 1024, generator=gen).to(torch.bfloat16).cuda()
    y = mx_linear_triton(x, w, ws, None, act_elem=E4M3, native=True)
    _assert_gemm_close(y, x, w64, None, E4M3)
    y = mx_linear_triton(x, w, ws, None, native=True)
    _assert_gemm_close(y, x, w64, None, None)


@gpu
@pytest.mark.gpu
def test_gpu_cuda_graph_capture():
    gen = torch.Generator().manual_seed(6)
    w, ws, _ = _weight(4096, 4096, E4M3, gen)
    packed = pack_weight(w, ws)
    x = torch.randn(4, 4096, generator=gen).to(torch.bfloat16).cuda()
    y0 = mx_linear(x, packed, None, act_elem=E4M3)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = mx_linear(x, packed, None, act_elem=E4M3)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, y0)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    "cfg",
    [
        # inf/garbage with a bias at N=1000 (H200, triton 3.6), also with the bias added before
        # tl.trans(acc) (H200, 2026-11-21); dispatch uses 256-wide tiles only when N % 128 == 0.
        pytest.param(
            G.GemmConfig(256, 128, 64, 8, 3, tma_x=True, tma_w=True),
            marks=pytest.mark.xfail(reason="wrong values at N=1000 with 256x128 tiles; not dispatched"),
        ),
        # Gave inf (unwritten partials) at M=256 with the partials stored after tl.trans(acc).
        G.GemmConfig(128, 128, 64, 8, 4, split_k=2, tma_x=True, tma_w=True, deq_bf16=True),
        G.GemmConfig(128, 128, 64, 8, 4, tma_x=True, tma_w=True, deq_bf16=True),
        G.GemmConfig(128, 128, 64, 8, 3, scale_gather=True),
        G.GemmConfig(16, 64, 128, 4, 6, split_k=4, tma_w=True, deq_bf16=True),
        G.GemmConfig(64, 128, 128, 4, 4, split_k=3, tma_w=True),
        G.GemmConfig(16, 64, 128, 4, 6, split_k=4, tma_w=True, peel=False),
        # In-flight wgmmas: right only when ptxas >= 13.3 assembles them (kernels/toolchain.py).
        pytest.param(
            G.GemmConfig(256, 128, 64, 8, 3, tma_x=True, tma_w=True, deq_bf16=True, peel=False, zero_dot=True),
            marks=pytest.mark.xfail(not ASYNC_OK, reason="ptxas < 13.3: register hazard (triton-lang/triton#9433)"),
        ),
        pytest.param(
            G.GemmConfig(256, 128, 64, 8, 3, tma_x=True, tma_w=True, deq_bits=True, peel=False, zero_dot=True),
            marks=pytest.mark.xfail(not ASYNC_OK, reason="ptxas < 13.3: register hazard (triton-lang/triton#9433)"),
        ),
        pytest.param(
            G.GemmConfig(128, 64, 64, 4, 4, tma_x=True, tma_w=True, deq_bf16=True, peel=False, zero_dot=True),
            marks=pytest.mark.xfail(not ASYNC_OK, reason="ptxas < 13.3: register hazard (triton-lang/triton#9433)"),
        ),
        G.GemmConfig(128, 128, 64, 8, 4, tma_x=True, tma_w=True, deq_bits=True),
        G.GemmConfig(16, 128, 128, 4, 4, split_k=8, tma_w=True, deq_bits=True),
        G.GemmConfig(16, 128, 256, 8, 3, split_k=2, tma_w=True),
    ],
    ids=str,
)
def test_gpu_gemm_variants(cfg):
    gen = torch.Generator().manual_seed(8)
    w, ws, w64 = _weight(1000, 2080, E4M3, gen)
    for m in (5, 256, 300):
        x = torch.randn(m, 2080, generator=gen).to(torch.bfloat16).cuda()
        b = torch.randn(1000, generator=gen).to(torch.bfloat16).cuda()
        _assert_gemm_close(G.mx_gemm(x, w, ws, b, config=cfg), x, w64, b, None)
        _assert_gemm_close(G.mx_gemm(x, w, ws, None, config=cfg), x, w64, None, None)
        if m == 5 and cfg.block_m <= 64:
            for elem, rule in ((E4M3, ScaleRule.RCEIL), (E5M2, ScaleRule.EVEN)):
                y = G.mx_gemm(x, w, ws, b, config=cfg, act_elem=elem, act_rule=rule)
                _assert_gemm_close(y, x, w64, b, elem, rule)


# --------------------------------------------------------------------------------------
# Decode kernel (CUDA cores, X rounded inside for W8A8)
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("m,n,k", [(1, 40, 96), (3, 72, 160), (17, 50, 224)])
@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("act", [None, (E4M3, ScaleRule.RCEIL), (E5M2, ScaleRule.FLOOR), (E4M3, ScaleRule.EVEN)])
def test_mx_gemv_matches_reference(m, n, k, xdtype, act):
    gen = torch.Generator().manual_seed(m * 77 + n + k)
    w, ws, w64 = _weight(n, k, E4M3 if n % 2 else E5M2, gen)
    x = _activations(m, k, xdtype, gen, special=False, decades=(-2, 1))
    bias = torch.randn(n, generator=gen).to(xdtype).to(DEV)
    act_elem, rule = act if act else (None, ScaleRule.RCEIL)
    for split in (1, 3):
        cfg = G.GemvConfig(block_n=16, block_k=64, num_stages=1, split_k=split, tma_w=True)
        y = G.mx_gemv(x, w, ws, bias, config=cfg, act_elem=act_elem, act_rule=rule)
        assert y.dtype == xdtype and y.shape == (m, n)
        _assert_gemm_close(y, x, w64, bias, act_elem, rule)


def test_mx_gemv_nonfinite_blocks_and_mse_dispatch():
    """A NaN/Inf activation block makes its rows NaN (as the reference); MSE rounds outside."""
    gen = torch.Generator().manual_seed(21)
    n, k = 24, 128
    w, ws, w64 = _weight(n, k, E4M3, gen)
    x = _activations(4, k, torch.float32, gen, special=True)
    y = G.mx_gemv(x, w, ws, None, act_elem=E4M3)
    ref = mx_linear_reference(x.cpu(), w.cpu(), ws.cpu(), None, act_elem=E4M3)
    assert torch.equal(torch.isnan(y.cpu()), torch.isnan(ref))
    assert torch.isnan(y[:2]).all() and torch.isfinite(y[2:]).all()
    fin = torch.isfinite(ref)
    torch.testing.assert_close(y.cpu()[fin], ref[fin], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="MSE"):
        G.mx_gemv(x, w, ws, None, act_elem=E4M3, act_rule=ScaleRule.MSE)
    y = mx_linear_triton(x[2:], w, ws, None, act_elem=E4M3, act_rule=ScaleRule.MSE)
    _assert_gemm_close(y, x[2:], w64, None, E4M3, ScaleRule.MSE)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    "cfg",
    [G.GemvConfig(32, 256, 4, 3), G.GemvConfig(16, 512, 4, 3, split_k=4), G.GemvConfig(64, 128, 4, 4, split_k=3, tma_w=True)],
    ids=str,
)
@pytest.mark.parametrize("act", [None, (E4M3, ScaleRule.RCEIL), (E5M2, ScaleRule.EVEN)])
def test_gpu_gemv_variants(cfg, act):
    gen = torch.Generator().manual_seed(12)
    w, ws, w64 = _weight(1000, 2080, E4M3, gen)
    act_elem, rule = act if act else (None, ScaleRule.RCEIL)
    for m in (1, 3, 16):
        x = _activations(m, 2080, torch.bfloat16, gen, special=False, decades=(-2, 1))
        b = torch.randn(1000, generator=gen).to(torch.bfloat16).cuda()
        y = G.mx_gemv(x, w, ws, b, config=cfg, act_elem=act_elem, act_rule=rule)
        _assert_gemm_close(y, x, w64, b, act_elem, rule)


# --------------------------------------------------------------------------------------
# Decode kernel for 3 <= M <= 16 (CUDA cores, per-row partials in registers)
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("m,n,k", [(1, 40, 96), (3, 72, 160), (11, 50, 224)])
@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float32])
def test_mx_gemv_rows_matches_reference(m, n, k, xdtype):
    gen = torch.Generator().manual_seed(m * 31 + n + k)
    w, ws, w64 = _weight(n, k, E4M3 if n % 2 else E5M2, gen)
    x = _activations(m, k, xdtype, gen, special=False, decades=(-2, 1))
    bias = torch.randn(n, generator=gen).to(xdtype).to(DEV)
    for split, vec, b, l2d in ((1, 16, bias, False), (3, 32, None, False), (2, 16, bias, True)):
        cfg = G.GemvRowsConfig(block_n=16, block_k=64, vec=vec, split_k=split, load2d=l2d)
        y = G.mx_gemv_rows(x, w, ws, b, config=cfg)
        assert y.dtype == xdtype and y.shape == (m, n)
        _assert_gemm_close(y, x, w64, b, None)
    with pytest.raises(ValueError, match="M <= 16"):
        G.mx_gemv_rows(torch.zeros(17, k, dtype=xdtype, device=DEV), w, ws)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    "cfg",
    [
        G.GemvRowsConfig(128, 64, 16),
        G.GemvRowsConfig(256, 32, 16, split_k=4),
        G.GemvRowsConfig(64, 64, 16, split_k=3),
        G.GemvRowsConfig(128, 64, 32, split_k=2, prefetch=True),
        G.GemvRowsConfig(32, 256, 16, split_k=3, load2d=True),
    ],
    ids=str,
)
def test_gpu_gemv_rows_variants(cfg):
    gen = torch.Generator().manual_seed(13)
    w, ws, w64 = _weight(1000, 2080, E4M3, gen)
    for m in (3, 8, 16):
        for xd in (torch.bfloat16, torch.float32):
            x = _activations(m, 2080, xd, gen, special=False, decades=(-2, 1))
            b = torch.randn(1000, generator=gen).to(xd).cuda()
            _assert_gemm_close(G.mx_gemv_rows(x, w, ws, b, config=cfg, out_dtype=torch.bfloat16), x, w64, b, None)


# --------------------------------------------------------------------------------------
# W8A8 decode on fp8 tensor cores (gemm_decode): one fp8 MMA per 32-block, X rounded inside
# --------------------------------------------------------------------------------------

from mxq.kernels import gemm_decode as D  # noqa: E402

# The tensor core sums a block's 32 fp8 products with fewer bits than fp32 (module doc of
# gemm_decode); the interpreter computes the dot in fp32, so there the usual bound applies.
F8_ACC = None if G.INTERPRET else 2.0**-12


@pytest.mark.parametrize("m,n,k", [(1, 70, 96), (3, 100, 384), (17, 33, 224), (40, 64, 512)])
@pytest.mark.parametrize("wel,act", [(E4M3, (E4M3, ScaleRule.RCEIL)), (E5M2, (E4M3, ScaleRule.FLOOR)), (E4M3, (E5M2, ScaleRule.EVEN))])
def test_decode_f8_matches_reference(m, n, k, wel, act):
    gen = torch.Generator().manual_seed(m * 31 + n + k)
    w, ws, w64 = _weight(n, k, wel, gen)
    x = _activations(m, k, torch.bfloat16, gen, special=False, decades=(-2, 1))
    bias = torch.randn(n, generator=gen).to(torch.bfloat16).to(DEV)
    act_elem, rule = act
    variants = ((1, True, None, 2, False), (2, True, torch.float32, 2, False), (3, True, None, 4, True), (3, False, torch.float32, 4, False))
    for split, fused, out, kb, qx in variants:
        # kb = 4 with K % 128 == 0 takes the int32 scale words; quant_x the quantizer launch
        cfg = D.DecodeF8Config(block_n=64, kb=kb, split_k=split, fused=fused, tma_w=split != 2, quant_x=qx)
        y = D.mx_decode_gemm(x, w, ws, bias if split != 2 else None, act_elem=act_elem, act_rule=rule, out_dtype=out, config=cfg)
        assert y.dtype == (out or torch.bfloat16) and y.shape == (m, n)
        _assert_gemm_close(y, x, w64, bias if split != 2 else None, act_elem, rule, acc_rel=F8_ACC)
    counters = D.split_counters(torch.device(DEV), 1)
    assert counters is not None and not counters.any(), "fused split-K must leave its tickets at zero"


def test_decode_f8_nonfinite_and_errors():
    """A NaN/Inf activation block makes its row NaN (as the reference); bad calls are one-line errors."""
    gen = torch.Generator().manual_seed(5)
    n, k = 48, 128
    w, ws, w64 = _weight(n, k, E4M3, gen)
    x = _activations(5, k, torch.float32, gen, special=True)
    y = D.mx_decode_gemm(x, w, ws, None, out_dtype=torch.float32, config=D.DecodeF8Config(block_n=64, kb=2, split_k=2))
    ref = mx_linear_reference(x.cpu(), w.cpu(), ws.cpu(), None, act_elem=E4M3)
    assert torch.equal(torch.isnan(y.cpu()), torch.isnan(ref))
    assert torch.isnan(y[:2]).all() and torch.isfinite(y[2:]).all()
    _assert_gemm_close(y[2:], x[2:], w64, None, E4M3, acc_rel=F8_ACC)
    # MSE (and quant_x) quantize X first with the quantizer kernel; the kernel's own rounding
    # (kb = 2 here) has no MSE.
    y = D.mx_decode_gemm(x[2:], w, ws, act_rule=ScaleRule.MSE, out_dtype=torch.float32)
    _assert_gemm_close(y, x[2:], w64, None, E4M3, ScaleRule.MSE, acc_rel=F8_ACC)
    with pytest.raises(ValueError, match="MSE"):
        D.mx_decode_gemm(x, w, ws, act_rule=ScaleRule.MSE, config=D.DecodeF8Config(kb=2))
    with pytest.raises(ValueError, match="M <= 64"):
        D.mx_decode_gemm(torch.zeros(65, k, device=DEV), w, ws)
    with pytest.raises(ValueError, match="block_size=32"):
        D.mx_decode_gemm(x, w, ws[:, : k // 64].contiguous(), block_size=64)
    assert D.mx_decode_gemm(x[:0], w, ws).shape == (0, n)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (5, 1000, 2080), (16, 6144, 4096), (33, 14336, 4096), (64, 4096, 14336)])
def test_gpu_decode_f8(m, n, k):
    """Model shapes and awkward ones, the dispatched config, bf16 and fp32 out, with bias;
    then the tensor core's in-block accumulation measured against float64."""
    gen = torch.Generator().manual_seed(m + n)
    w, ws, w64 = _weight(n, k, E4M3, gen)
    x = _activations(m, k, torch.bfloat16, gen, special=False, decades=(-2, 1))
    bias = torch.randn(n, generator=gen).to(torch.bfloat16).to(DEV)
    for out in (None, torch.float32):
        y = D.mx_decode_gemm(x, w, ws, bias, out_dtype=out)
        _assert_gemm_close(y, x, w64, bias, E4M3, acc_rel=F8_ACC)
    y = D.mx_decode_gemm(x, w, ws, bias, out_dtype=torch.float32, config=D.DecodeF8Config(split_k=4, fused=False))
    _assert_gemm_close(y, x, w64, bias, E4M3, acc_rel=F8_ACC)


# --------------------------------------------------------------------------------------
# The same decode GEMM, warp-specialized (gemm_decode_ws, Gluon; Hopper only: the interpreter
# cannot run Gluon, tests/test_sass_dev.py compiles it on the CPU)
# --------------------------------------------------------------------------------------

from mxq.kernels import gemm_decode_ws as WS  # noqa: E402

HOPPER = CUDA and torch.cuda.get_device_capability()[0] == 9 and WS.HAVE_GLUON
hopper = pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU and Gluon")


@pytest.mark.parametrize("n,k,sms,split", [(4096, 4096, 132, 8), (28672, 4096, 132, 1), (4096, 14336, 132, 8), (6144, 4096, 132, 4), (1000, 512, 132, 1), (8192, 28672, 114, 2)])
def test_decode_ws_config_rule(monkeypatch, n, k, sms, split):
    """K splits: the most (a power of two <= 16) with programs <= 2 per SM and >= 4 steps of 128 each."""
    monkeypatch.setattr(WS, "_sm_count", lambda device: sms)
    cfg = WS.rule_decode_ws_config(16, n, k, torch.device("cpu"))
    assert cfg.split_k == split and cfg.box == 128 and cfg.fuse_x == (n * k <= 1 << 24)
    tiles = -(-n // 128)
    assert tiles * cfg.split_k <= max(2 * sms, tiles) and (k // 128) // cfg.split_k >= min(4, k // 128)


@pytest.mark.parametrize("n,k,sms", [(4096, 4096, 132), (28672, 4096, 132), (10240, 8192, 132), (1000, 512, 114), (130, 128, 132)])
def test_decode_ws_candidates(monkeypatch, n, k, sms):
    """The tuner's candidates: the rule's config first, no duplicates, the rule with fuse_x flipped,
    and 64-row tiles whose K split keeps their programs within what their registers let share an SM
    (65536 / (256 x maxnreg)) with >= 4 steps of 128 per split (or one split)."""
    monkeypatch.setattr(WS, "_sm_count", lambda device: sms)
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
    other M buckets, shapes and devices, and MXQ_TUNE=0, get the rule."""
    from mxq.kernels import tune

    monkeypatch.setattr(WS, "_sm_count", lambda device: 132)
    monkeypatch.setattr(tune, "device_name", lambda device: "Fake H100")
    monkeypatch.setenv("MXQ_TUNE_CACHE", str(tmp_path / "t.json"))
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
        monkeypatch.setattr(tune, "ENABLED", False)
        assert WS.pick_decode_ws_config(16, 4096, 4096, gpu) == rule
    finally:
        tune.reset()


def test_decode_ws_rejects_what_it_cannot_take():
    gen = torch.Generator().manual_seed(3)
    w, ws, _ = _weight(64, 256, E4M3, gen)
    x = torch.randn(4, 256).to(DEV)
    if not HOPPER:
        with pytest.raises(ValueError, match="needs Gluon, a Hopper GPU"):
            WS.mx_decode_gemm_ws(x, w, ws)
        return
    with pytest.raises(ValueError, match="M <= 16"):
        WS.mx_decode_gemm_ws(torch.zeros(17, 256, device=DEV), w, ws)
    w2, ws2, _ = _weight(64, 96, E4M3, gen)
    with pytest.raises(ValueError, match="K % 128"):
        WS.mx_decode_gemm_ws(torch.zeros(4, 96, device=DEV), w2, ws2)


@needs_gluon
@pytest.mark.skipif(CUDA and not G.INTERPRET, reason="the X quantizer runs on CPU tensors: the interpreter's job")
@pytest.mark.parametrize("m,n,k,split", [(3, 300, 256, 1), (16, 1000, 4224, 4), (1, 130, 256, 2)])
def test_decode_ws_plan_arguments(monkeypatch, m, n, k, split):
    """The per-shape plan of mx_decode_gemm_ws (runs on the CPU with the Gluon launch recorded):
    X quantized into the plan's one scratch buffer equals the reference bytes, the descriptors
    cover W [N, K] and X [M, K] with the config's boxes, the split partials are [split, M, N]
    fp32 in the same buffer, and a second call reuses the plan."""
    monkeypatch.setattr(WS, "ws_supported", lambda *a: True)
    monkeypatch.setattr(WS, "pdl_ok", lambda d: False)
    monkeypatch.setattr(WS, "_PLANS", WS.PlanCache())
    monkeypatch.setattr(WS, "FAST", True)
    calls = []

    class Recorder:
        def __init__(self, fn, consts, opts):
            self.consts = consts

        def __call__(self, grid, *args):
            calls.append((grid, args, self.consts))

    monkeypatch.setattr(WS, "Launch", Recorder)
    gen = torch.Generator().manual_seed(m + n + k)
    w, ws, _ = _weight(n, k, E4M3, gen)
    w, ws = w.cpu(), ws.cpu()
    x = _activations(m, k, torch.bfloat16, gen, special=True).cpu()
    cfg = WS.DecodeWSConfig(split_k=split)
    for _ in range(2):
        y = WS.mx_decode_gemm_ws(x, w, ws, None, act_elem=E4M3, config=cfg, out_dtype=torch.float32)
    assert len(WS._PLANS) == 1 and len(calls) == 2 and y.shape == (m, n) and y.dtype == torch.float32
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
    monkeypatch.setattr(WS, "_PLANS", WS.PlanCache())
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
    w, ws, _ = _weight(n, k, E4M3, gen)
    wide = torch.randn(m, k + 40, generator=gen).to(torch.bfloat16)
    x = wide[:, 8 : 8 + k]
    WS.mx_decode_gemm_ws(x, w.cpu(), ws.cpu(), None, act_elem=E5M2, act_rule=rule, config=WS.DecodeWSConfig(split_k=2, fuse_x=True))
    if not fused:
        assert [c[0] for c in calls] == ["quantize", WS._mx_decode_ws_kernel] and "FUSE_X" not in calls[-1][3]
        return
    assert len(calls) == 1
    fn, grid, args, consts = calls[0]
    assert fn is WS._mx_decode_ws_kernel and grid == (3, 2)
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
    w, ws, w64 = _weight(n, k, wel, gen)
    x = _activations(m, k, torch.bfloat16, gen, special=False, decades=(-2, 1))
    bias = torch.randn(n, generator=gen).to(torch.bfloat16).to(DEV)
    act_elem, rule = act
    cfgs = [None, WS.DecodeWSConfig(box=32, split_k=3), WS.DecodeWSConfig(split_k=2, fused=False), WS.DecodeWSConfig(stages=4, split_k=5)]
    for cfg, out in zip(cfgs, (None, torch.float32, torch.float32, None)):
        y = WS.mx_decode_gemm_ws(x, w, ws, bias, act_elem=act_elem, act_rule=rule, out_dtype=out, config=cfg)
        assert y.dtype == (out or torch.bfloat16) and y.shape == (m, n)
        _assert_gemm_close(y, x, w64, bias, act_elem, rule, acc_rel=F8_ACC)
    counters = D.split_counters(torch.device(DEV), 1)
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
    w, ws, w64 = _weight(n, k, E4M3, gen)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16).to(DEV)
    x = _activations(m, k, torch.bfloat16, gen, special=False, decades=(-2, 1))
    cands = WS.decode_ws_candidates(m, n, k, torch.device(DEV))
    cands.append(dataclasses.replace(cands[1], split_k=3))
    y0 = WS.mx_decode_gemm_ws(x, w, ws, bias, out_dtype=torch.float32, config=cands[0])
    for c in cands:
        y = WS.mx_decode_gemm_ws(x, w, ws, bias, out_dtype=torch.float32, config=c)
        torch.testing.assert_close(y, y0, rtol=1e-5, atol=1e-5 * float(y0.abs().max()), msg=lambda s, c=c: f"{c}: {s}")
        _assert_gemm_close(y, x, w64, bias, E4M3, ScaleRule.RCEIL, acc_rel=F8_ACC)


@hopper
@pytest.mark.gpu
def test_gpu_tune_decode_ws_writes_and_dispatch_reads(monkeypatch, tmp_path):
    """``tune_decode_ws`` times the candidates, writes one entry per (shape, M bucket) with the
    fastest config (or the rule's when nothing beats it by MIN_GAIN), and ``mx_linear`` then runs
    that config: same output as the config run directly."""
    from mxq.kernels import tune

    monkeypatch.setenv("MXQ_TUNE_CACHE", str(tmp_path / "tune.json"))
    tune.reset()
    try:
        rows = tune.tune_decode_ws([(1536, 1024)], (1, 16), log=lambda s: None)
        assert [(r["n"], r["k"], r["m"]) for r in rows] == [(1536, 1024, 1), (1536, 1024, 16)]
        data = json.loads((tmp_path / "tune.json").read_text())
        entries = data["devices"][torch.cuda.get_device_name()]["decode_ws"]
        assert set(entries) == {"m1_n1536_k1024", "m16_n1536_k1024"}
        for r in rows:
            assert r["best"] == tune.pick(r["us"], r["default"])
            rec = entries[tune.shape_key(r["m"], 1536, 1024)]
            assert WS.describe(WS.DecodeWSConfig(**rec["config"])) == r["best"] and rec["us"] == round(r["us"][r["best"]], 3)
        tune.reset()
        gen = torch.Generator().manual_seed(5)
        w, ws, _ = _weight(1536, 1024, E4M3, gen)
        x = _activations(16, 1024, torch.bfloat16, gen, special=False, decades=(-2, 1))
        cfg = WS.pick_decode_ws_config(16, 1536, 1024, x.device)
        assert cfg == WS.DecodeWSConfig(**entries["m16_n1536_k1024"]["config"])
        y = mx_linear(x, w, ws, act_elem=E4M3)
        assert torch.equal(y, WS.mx_decode_gemm_ws(x, w, ws, act_elem=E4M3, config=cfg))
    finally:
        tune.reset()


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 1000, 640), (16, 6144, 4096), (5, 14336, 4096), (16, 4096, 14336)])
def test_gpu_decode_ws_pdl_same_bits(m, n, k):
    """Programmatic dependent launch (the kernel starts while the X quantizer runs and waits for
    it with griddepcontrol.wait) gives the same bits as two serialized launches; in a CUDA graph
    where X is rewritten right before the call, every replay reads the new X (no stale reads)."""
    gen = torch.Generator().manual_seed(m + n + k)
    w, ws, w64 = _weight(n, k, E4M3, gen)
    x = _activations(m, k, torch.bfloat16, gen, special=False, decades=(-2, 1))
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
        src.copy_(_activations(m, k, torch.bfloat16, gen, special=False, decades=(-2, 1)))
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
    w, ws, w64 = _weight(n, k, E4M3, gen)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16).to(DEV)
    base = dataclasses.replace(WS.pick_decode_ws_config(m, n, k, torch.device(DEV)), fuse_x=True)
    acts = [(E4M3, ScaleRule.RCEIL, torch.bfloat16), (E5M2, ScaleRule.FLOOR, torch.float16), (E4M3, ScaleRule.EVEN, torch.float32)]
    for (act_elem, rule, dtype), split in zip(acts, (base.split_k, 3, 1)):
        wide = torch.zeros(m, k + 96, dtype=dtype, device=DEV)
        x = wide[:, 7 : 7 + k]  # row stride k + 96, not 16-byte aligned
        x.copy_(_activations(m, k, dtype, gen, special=True, decades=(-3, 2)))
        fused = dataclasses.replace(base, split_k=split)
        plain = dataclasses.replace(fused, fuse_x=False)
        for b in (None, bias):
            y1 = WS.mx_decode_gemm_ws(x, w, ws, b, act_elem=act_elem, act_rule=rule, out_dtype=torch.float32, config=fused)
            y0 = WS.mx_decode_gemm_ws(x, w, ws, b, act_elem=act_elem, act_rule=rule, out_dtype=torch.float32, config=plain)
            torch.testing.assert_close(y1, y0, rtol=0, atol=0, equal_nan=True)
        if m >= 4:
            assert torch.isnan(y1[:2]).all() and not torch.isnan(y1[2:]).any()
        clean = _activations(m, k, dtype, gen, special=False, decades=(-2, 1))
        y = WS.mx_decode_gemm_ws(clean, w, ws, bias, act_elem=act_elem, act_rule=rule, config=fused)
        _assert_gemm_close(y, clean, w64, bias, act_elem, rule, acc_rel=F8_ACC)
    src = torch.empty(m, k, dtype=torch.bfloat16, device=DEV)
    xin = torch.empty_like(src)
    WS.mx_decode_gemm_ws(xin, w, ws, out_dtype=torch.float32, config=base)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        xin.copy_(src)
        yg = WS.mx_decode_gemm_ws(xin, w, ws, out_dtype=torch.float32, config=base)
    for _ in range(3):
        src.copy_(_activations(m, k, torch.bfloat16, gen, special=False, decades=(-2, 1)))
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
    w, ws, w64 = _weight(n, k, E4M3, gen)
    ws[7, 3] = 255
    x = _activations(6, k, torch.float32, gen, special=True)
    y = WS.mx_decode_gemm_ws(x, w, ws, None, out_dtype=torch.float32)
    ref = mx_linear_reference(x.cpu(), w.cpu(), ws.cpu(), None, act_elem=E4M3)
    assert torch.equal(torch.isnan(y.cpu()), torch.isnan(ref))
    from mxq.kernels import dispatch

    for m in (1, 8, 16):
        assert "warp-specialized" in dispatch.path_name(m, 4096, 4096, torch.device(DEV))
    assert "gemv" in dispatch.path_name(1, 4096, 4096, torch.device(DEV), w8a8=False)
    w, ws, w64 = _weight(4096, 4096, E4M3, gen)
    x = _activations(8, 4096, torch.bfloat16, gen, special=False, decades=(-2, 1))
    y = dispatch.mx_linear(x, w, ws, act_elem=E4M3)
    _assert_gemm_close(y, x, w64, None, E4M3, acc_rel=F8_ACC)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        yg = dispatch.mx_linear(x, w, ws, act_elem=E4M3)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(yg, y)


# --------------------------------------------------------------------------------------
# Warp-specialized prefill GEMM (gemm_prefill_ws, Gluon; Hopper only). Not dispatched: slower
# than the emulation on the H100 (kernels/NOTES.md, "GEMM: a warp-specialized prefill GEMM; PDL for decode"); kept right for the work it starts.
# --------------------------------------------------------------------------------------

from mxq.kernels import gemm_prefill_ws as PWS  # noqa: E402


def test_prefill_ws_rejects_what_it_cannot_take():
    gen = torch.Generator().manual_seed(5)
    w, ws, _ = _weight(64, 256, E4M3, gen)
    with pytest.raises(TypeError, match="takes bf16 X"):
        PWS.mx_prefill_gemm_ws(torch.zeros(4, 256, device=DEV), w, ws)
    if not HOPPER:
        with pytest.raises(ValueError, match="needs Gluon, a Hopper GPU"):
            PWS.mx_prefill_gemm_ws(torch.zeros(4, 256, dtype=torch.bfloat16, device=DEV), w, ws)


def test_prefill_ws_scales_kn():
    """The scales as the loader's TMA reads them: transposed, rows padded to 16 bytes."""
    s = torch.randint(0, 256, (37, 5), dtype=torch.uint8)
    st = PWS.scales_kn(s)
    assert st.shape == (5, 48) and torch.equal(st[:, :37], s.t())


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,wel", [(1, 130, 64, E4M3), (100, 1000, 96, E4M3), (257, 384, 4224, E5M2), (513, 257, 32, E4M3), (2048, 1000, 2080, E4M3), (300, 4096, 4096, E5M2)])
def test_gpu_prefill_ws_matches_reference(m, n, k, wel):
    """Awkward shapes (ragged last K step, N and M not multiples of the tile), both weight formats,
    bias, bf16/fp32 out, two ring depths, against float64; equal to the emulation (mx_gemm) within
    fp32 accumulation order; a NaN scale byte gives a NaN column."""
    gen = torch.Generator().manual_seed(m + n + k)
    w, ws, w64 = _weight(n, k, wel, gen)
    x = _activations(m, k, torch.bfloat16, gen, special=False, decades=(-2, 1))
    bias = torch.randn(n, generator=gen).to(torch.bfloat16).to(DEV)
    for cfg, out in ((None, None), (PWS.PrefillWSConfig(stages=3, wbuf=2, group=1), torch.float32)):
        y = PWS.mx_prefill_gemm_ws(x, w, ws, bias, out_dtype=out, config=cfg)
        assert y.dtype == (out or torch.bfloat16) and y.shape == (m, n)
        _assert_gemm_close(y, x, w64, bias, None)
    y0 = G.mx_gemm(x, w, ws, bias, out_dtype=torch.float32)
    y1 = PWS.mx_prefill_gemm_ws(x, w, ws, bias, out_dtype=torch.float32)
    mag = x.double().abs() @ w64.abs().t()
    assert ((y0.double() - y1.double()).abs() <= 2 * k * 2.0**-24 * mag + 1e-30).all()
    ws[n // 2, 0] = 255
    y = PWS.mx_prefill_gemm_ws(x, w, ws, None, out_dtype=torch.float32)
    assert torch.isnan(y[:, n // 2]).all() and torch.isfinite(y[:, : n // 2]).all()


# --------------------------------------------------------------------------------------
# Register-operand warp-specialized prefill GEMM (gemm_prefill_ws, PrefillRSConfig; Hopper).
# Dispatched for bf16 operands at M >= dispatch.PREFILL_RS_MIN_M.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("elem,shift,msh", [(E4M3, 120, 4), (E5M2, 112, 5)])
def test_prefill_rs_fp8_bit_moves(elem, shift, msh):
    """The identity the kernel's byte moves use (``_fp8_bits_bf16``): for every finite code, the
    bf16 with bits (sign << 15) | (code & 0x7F) << MSH is the fp8 value times 2**-SHIFT exactly —
    subnormal codes and zero included — and two bf16 powers of two restore any scale byte."""
    dt = torch.float8_e4m3fn if elem is E4M3 else torch.float8_e5m2
    codes = torch.arange(256, dtype=torch.int32)
    vals = codes.to(torch.uint8).view(dt).double()
    ok = torch.isfinite(vals)
    bits = ((codes & 0x80) << 8) | ((codes & 0x7F) << msh)
    bf = bits.to(torch.int16).view(torch.bfloat16).double()  # low 16 bits
    assert torch.equal(bf[ok], vals[ok] * 2.0**-shift)
    for sb in (0, 1, 7, 100, 127, 134, 135, 200, 254):  # e_lo = min(sb - 127 + SHIFT, 127), e_hi = the rest
        e = sb - 127 + shift
        e_lo = min(e, 127)
        assert -126 <= e_lo <= 127 and 0 <= e - e_lo <= 127


@pytest.mark.skipif(not PWS.HAVE_GLUON, reason="needs Gluon")
def test_prefill_rs_dispatch_rule(monkeypatch):
    """Hopper, M >= PREFILL_RS_MIN_M, block 32, at least one [256, 128] tile per SM: the
    register-operand kernel; fewer tiles (8B o_proj at M = 1024 on 132 SMs), smaller M, other
    blocks, other devices or MXQ_PREFILL_RS=0: not."""
    from mxq.kernels import dispatch as D

    monkeypatch.setattr(G, "_sm_count", lambda device: 132)
    dev = torch.device("cuda", 0)
    m0 = D.PREFILL_RS_MIN_M
    assert D._prefill_rs_config(2048, 4096, 4096, 32, True, dev)  # 8 x 32 = 256 tiles
    assert D._prefill_rs_config(1024, 6144, 4096, 32, True, dev)  # 4 x 48 = 192
    assert not D._prefill_rs_config(1024, 4096, 4096, 32, True, dev)  # 4 x 32 = 128 < 132
    assert not D._prefill_rs_config(m0 - 1, 57344, 8192, 32, True, dev)
    assert not D._prefill_rs_config(4096, 4096, 4096, 32, False, dev)
    assert not D._prefill_rs_config(4096, 4096, 4096, 16, True, dev)
    monkeypatch.setattr(D, "PREFILL_RS", False)
    assert not D._prefill_rs_config(4096, 4096, 4096, 32, True, dev)


def _every_code_rows(w, ws, rows=3):
    """Rows holding every finite fp8 code (zero, subnormals, both signs), one at scale byte 200."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(w.dtype)
    codes = codes[torch.isfinite(codes.float())].to(w.device)
    w[:rows] = codes.repeat(w.shape[1] // codes.numel() + 1)[: w.shape[1]]
    ws[1] = 200
    return w, ws


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,wel", [(1, 130, 64, E4M3), (300, 1000, 96, E4M3), (257, 384, 4224, E5M2), (513, 257, 32, E4M3), (2048, 1000, 2080, E4M3), (300, 4096, 4096, E5M2), (2050, 4100, 96, E4M3), (1100, 8200, 160, E5M2)])
def test_gpu_prefill_rs_matches_reference(m, n, k, wel):
    """The register-operand kernel on awkward shapes (ragged last K step, M and N not multiples of
    the tile, odd and even step counts, more tiles than SMs), every fp8 code on some rows and a
    scale of 2**73, bias, bf16/fp32 out, both byte routes, split warpgroups, ring depths, one step
    in flight, persistent programs, against float64; equal to the emulation within fp32
    accumulation order; a NaN scale byte gives a NaN column."""
    gen = torch.Generator().manual_seed(m + n + k + 1)
    w, ws, _ = _weight(n, k, wel, gen)
    w, ws = _every_code_rows(w, ws)
    w64 = dequantize_mx(MXTensor(w.cpu(), ws.cpu(), torch.Size((n, k)), -1, 32, wel), torch.float64).to(DEV)
    x = _activations(m, k, torch.bfloat16, gen, special=False, decades=(-2, 1))
    bias = torch.randn(n, generator=gen).to(torch.bfloat16).to(DEV)
    R = PWS.PrefillRSConfig
    cfgs = [(R(), None), (R(stages=3), torch.float32), (R(stages=2, deq_bits=False), torch.bfloat16),
            (R(split_wg=False), torch.float32), (R(inflight=False), None), (R(stages=3, inflight=False, split_wg=False), torch.float32),
            (R(inflight=False, split_wg=False, persistent=True), torch.float32), (R(split_wg=False, persistent=True), None),
            (R(stages=3, split_wg=False, persistent=True), torch.float32)]  # fmt: skip
    for cfg, out in cfgs:
        y = PWS.mx_prefill_gemm_ws(x, w, ws, bias, out_dtype=out, config=cfg)
        assert y.dtype == (out or torch.bfloat16) and y.shape == (m, n)
        _assert_gemm_close(y, x, w64, bias, None)
    y0 = G.mx_gemm(x, w, ws, bias, out_dtype=torch.float32)
    y1 = PWS.mx_prefill_gemm_ws(x, w, ws, bias, out_dtype=torch.float32, config=PWS.PrefillRSConfig())
    mag = x.double().abs() @ w64.abs().t()
    assert ((y0.double() - y1.double()).abs() <= 2 * k * 2.0**-24 * mag + 1e-30).all()
    ws[n // 2, 0] = 255
    y = PWS.mx_prefill_gemm_ws(x, w, ws, None, out_dtype=torch.float32, config=PWS.PrefillRSConfig())
    assert torch.isnan(y[:, n // 2]).all() and torch.isfinite(y[:, : n // 2]).all()


@hopper
@pytest.mark.gpu
def test_gpu_prefill_rs_scales_kept_per_weight():
    """The transposed scales the register-operand kernel reads are made once per scales tensor:
    the same tensor on a repeat call, a fresh one after an in-place write (the GEMM then uses the
    new scales), none kept for a tensor that is gone or for a call under CUDA-graph capture."""
    import gc

    gen = torch.Generator().manual_seed(20)
    n, k, m = 300, 1056, 1031
    w, ws, _ = _weight(n, k, E4M3, gen)
    x = _activations(m, k, torch.bfloat16, gen, special=False, decades=(-2, 1))
    cfg = PWS.PrefillRSConfig()
    st = PWS._scales_kn_cached(ws)
    assert PWS._scales_kn_cached(ws) is st and torch.equal(st[:, :n], ws.t())
    y0 = PWS.mx_prefill_gemm_ws(x, w, ws, None, out_dtype=torch.float32, config=cfg)
    ws[:, 0] += 1  # every row's first block scaled by 2
    st2 = PWS._scales_kn_cached(ws)
    assert st2 is not st and torch.equal(st2[:, :n], ws.t())
    y1 = PWS.mx_prefill_gemm_ws(x, w, ws, None, out_dtype=torch.float32, config=cfg)
    w64 = dequantize_mx(MXTensor(w.cpu(), ws.cpu(), torch.Size((n, k)), -1, 32, E4M3), torch.float64).to(DEV)
    _assert_gemm_close(y1, x, w64, None, None)
    assert not torch.equal(y0, y1)
    key = id(ws)
    del ws, st, st2
    gc.collect()
    assert key not in PWS._ST_CACHE
    ws2 = torch.randint(100, 140, (n, k // 32), dtype=torch.uint8, device=DEV)
    g = torch.cuda.CUDAGraph()
    PWS.mx_prefill_gemm_ws(x, w, ws2.clone(), None, config=cfg)  # compile outside the capture
    with torch.cuda.graph(g):
        PWS.mx_prefill_gemm_ws(x, w, ws2, None, config=cfg)
    assert id(ws2) not in PWS._ST_CACHE


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("act", [None, E4M3])
def test_gpu_dispatch_prefill_rs(act):
    """mx_linear at M >= PREFILL_RS_MIN_M on Hopper runs the register-operand kernel (path_name)
    and computes the reference's function (W8A16 and W8A8, 3-D input, bias)."""
    from mxq.kernels import dispatch as D

    gen = torch.Generator().manual_seed(14)
    n, k, m = 8200, 1056, 1031  # 5 x 65 tiles
    w, ws, w64 = _weight(n, k, E4M3, gen)
    x = _activations(m, k, torch.bfloat16, gen, special=False, decades=(-2, 1)).reshape(1, m, k)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16).to(DEV)
    assert D.path_name(m, n, k, x.device, w8a8=act is not None).startswith("register-operand prefill")
    y = D.mx_linear(x, w, ws, bias, act_elem=act)
    assert y.shape == (1, m, n) and y.dtype == torch.bfloat16
    _assert_gemm_close(y.reshape(-1, n), x.reshape(-1, k), w64, bias, act)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.gpu
def test_gpu_kept_buffers_live_outside_graph_pools():
    """What the kernels keep between calls (split-K tickets, transposed scales) is made outside a
    CUDA-graph memory pool even when the first call runs while that pool takes the thread's
    allocations (inductor's CUDA-graph trees warm up and record that way); a control tensor made
    in the same window lands in the pool, so the check can see the difference."""
    from torch._inductor.cudagraph_trees import _use_cuda_memory_pool_manager

    from mxq.kernels import gemm_decode, gemm_prefill_ws

    dev = torch.device("cuda", torch.cuda.current_device())
    pool = torch.cuda.graph_pool_handle()
    side = torch.cuda.Stream()
    x = torch.randn(64, device=dev)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(g, pool=pool):
        y = x * 2
    ws = torch.randint(100, 140, (96, 8), dtype=torch.uint8, device=dev)
    need = max(t.numel() for t in gemm_decode._COUNTERS.values()) + 1 if gemm_decode._COUNTERS else 8192
    with _use_cuda_memory_pool_manager(dev.index, pool, side):
        control = torch.empty(1000, device=dev)
        counters = gemm_decode.split_counters(dev, need)
        st = gemm_prefill_ws._scales_kn_cached(ws)
    live = {y.untyped_storage().data_ptr(), control.untyped_storage().data_ptr()}
    assert torch._C._cuda_checkPoolLiveAllocations(dev.index, pool, live)
    assert not torch._C._cuda_checkPoolLiveAllocations(dev.index, pool, {y.untyped_storage().data_ptr()})
    assert counters.numel() >= need and not counters.any()
    assert torch.equal(st[:, :96].cpu(), ws.t().cpu()) and gemm_prefill_ws._scales_kn_cached(ws) is st
