"""kernels/cpu.py: the CPU path of ``mx_linear`` computes the reference's function.

- activation rounding (``quantize_rows``) byte for byte against ``formats.quantize_mx`` and value for
  value against ``formats.fake_quantize_mx``: E4M3/E5M2, FLOOR/RCEIL/EVEN, fp32 and bf16 input, with
  zeros, -0, NaN, Inf, fp32 subnormals and blocks at both ends of the scale range;
- the linear (``run_path("cpu", ...)`` and ``mx_linear`` on "auto") against a float64 product of the
  dequantized operands, over M = 1, 2, 3, 17, 300 (each kernel of the path: the byte-table GEMV, the
  16-bit-table GEMV, the fp32 GEMV, bf16 and fp32 matmul on the dequantized weight), K and N not
  powers of two, an odd number of 32-blocks, E4M3/E5M2 weights, W8A16 and W8A8 (RCEIL, FLOOR, EVEN,
  MSE), bias or not, bf16/fp16/fp32 and 2-D/3-D X. The bound allows only float32 accumulation order
  and the final rounding (the operands are exact: module doc of kernels/cpu.py); against the
  reference's own output the same bound doubled, and most bf16 outputs bit-equal;
- non-finite weights (NaN codes, NaN and byte-0 scales) give what the reference gives;
- the producers of ``mxq.runtime.fuse`` (RMSNorm, SiLU·up, MX-rounded) equal their references byte for byte;
- the registry: ``cpu`` before the reference, ``kernels="reference"`` forces the reference, and
  without a compiler one warning and the reference.
"""

from __future__ import annotations

import random
import warnings
import zlib

import pytest
import torch

from mxq.formats import E4M3, E5M2, ScaleRule, dequantize_mx, fake_quantize_mx, quantize_mx
from mxq.kernels import cpu, dispatch, reference
from mxq.kernels.reference import mx_linear_reference

pytestmark = pytest.mark.skipif(not cpu.available(), reason="the CPU kernels did not build here (no C compiler)")

RULES = (ScaleRule.FLOOR, ScaleRule.RCEIL, ScaleRule.EVEN)
OUT_EPS = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


def _special_rows(m: int, k: int, gen: torch.Generator, dtype=torch.float32) -> torch.Tensor:
    x = torch.randn(m, k, generator=gen) * torch.logspace(-30, 30, m)[:, None]
    x[0, :32] = 0.0
    x[1, :32] = -0.0
    x[2, 5] = float("nan")
    x[3, 40] = float("inf")
    x[4, 33] = float("-inf")
    x[5, :] = torch.randn(k, generator=gen) * 1e-39  # fp32 subnormals
    x[6, :32] = torch.randn(32, generator=gen) * 3e38  # the top of fp32
    x[7, :] = torch.randn(k, generator=gen) * 2.0**-120  # block exponents at the clamp
    x[8, 64:96] = 448.0 * 2.0 ** torch.arange(-16, 16).float()  # every binade in one block
    return x.to(dtype)


@pytest.mark.parametrize("elem", [E4M3, E5M2], ids=lambda e: e.name)
@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.value)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_quantize_rows_is_quantize_mx(elem, rule, dtype):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{elem.name}|{rule.value}|{dtype}".encode()))  # the same in every process
    x = _special_rows(37, 352, gen, dtype)
    ref = quantize_mx(x, -1, elem, 32, rule)
    fq = fake_quantize_mx(x.float(), -1, elem, 32, rule)
    vals, codes, scales, smin = cpu.quantize_rows(x, elem, rule, 32, codes=True)
    assert torch.equal(codes.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(scales, ref.scales)
    nan = torch.isnan(fq)
    assert torch.equal(torch.isnan(vals), nan)
    assert torch.equal(vals[~nan].view(torch.int32), fq[~nan].view(torch.int32))  # -0 included
    finite = scales != 0xFF
    assert smin == int(scales[finite].min())
    v16, *_ = cpu.quantize_rows(x, elem, rule, 32, out_dtype=torch.bfloat16)
    assert torch.equal(v16[~nan].view(torch.int16), fq.to(torch.bfloat16)[~nan].view(torch.int16))


def _operands(m, n, k, elem, xdt, has_bias, gen, lead=()):
    w = torch.randn(n, k, generator=gen) * torch.exp(torch.randn(n, 1, generator=gen))
    t = quantize_mx(w, -1, elem, 32, ScaleRule.RCEIL)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-2, 1, k)[torch.randperm(k, generator=gen)]
    x = x.to(xdt).reshape(*lead, k) if lead else x.to(xdt)  # lead: X's leading dims, their product m
    bias = torch.randn(n, generator=gen).to(xdt) if has_bias else None
    return x, t.data, t.scales, dequantize_mx(t, torch.float64), bias


def _assert_linear_close(y, x, w64, bias, act, rule, ref):
    """|y - exact| <= output rounding + float32 accumulation (2 K 2**-24 of sum |x w|); against the
    reference (itself within that bound) both bounds."""
    xf = x.reshape(-1, x.shape[-1]).float()
    if act is not None:
        xf = fake_quantize_mx(xf, -1, act, 32, rule)
    x64 = xf.double()
    exact = x64 @ w64.t() + (bias.double() if bias is not None else 0)
    mag = x64.abs() @ w64.abs().t()
    acc = 2 * x64.shape[1] * 2.0**-24
    eps = OUT_EPS[y.dtype]
    err = (y.reshape(exact.shape).double() - exact).abs()
    assert (err <= eps * exact.abs() + acc * mag + 1e-30).all(), f"max error {err.max().item():.3g}"
    diff = (y.double() - ref.double()).reshape(exact.shape).abs()
    assert (diff <= 2 * eps * exact.abs() + 2 * acc * mag + 1e-30).all(), f"max diff {diff.max().item():.3g}"


# (M, N, K): M covers every kernel of the path (GEMV_MAX_M = 16, VBMI_MAX_M = 2); K = 224 and 352 have
# an odd number of 32-blocks (a tail after the 64-code steps), 576 is SmolLM2's width; N no multiple of 4.
SHAPES = [(1, 37, 224), (2, 100, 352), (3, 45, 576), (17, 37, 352), (300, 100, 224), (1, 1, 32)]
ACTS = [None, (E4M3, ScaleRule.RCEIL), (E5M2, ScaleRule.FLOOR), (E4M3, ScaleRule.EVEN), (E4M3, ScaleRule.MSE)]


@pytest.mark.parametrize("m,n,k", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("act", ACTS, ids=lambda a: "w8a16" if a is None else f"{a[0].name}-{a[1].value}")
@pytest.mark.parametrize("xdt", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_cpu_linear_matches_reference(m, n, k, act, xdt):
    i = SHAPES.index((m, n, k)) + ACTS.index(act)
    gen = torch.Generator().manual_seed(1000 * m + n + k + i)
    elem = E5M2 if i % 2 else E4M3
    x, w, ws, w64, bias = _operands(m, n, k, elem, xdt, i % 3 == 1, gen)
    act_elem, rule = act if act is not None else (None, ScaleRule.RCEIL)
    y = dispatch.run_path("cpu", x, w, ws, bias, act_elem=act_elem, act_rule=rule)
    ref = mx_linear_reference(x, w, ws, bias, act_elem=act_elem, act_rule=rule)
    assert y.dtype == xdt and y.shape == (m, n)
    _assert_linear_close(y, x, w64, bias, act_elem, rule, ref)
    if xdt == torch.bfloat16:  # the same function: the fp32 sums rarely straddle a bf16 rounding boundary
        assert (y == ref).float().mean() >= 0.97


@pytest.mark.parametrize("lead,m", [((2, 3), 6), ((1, 1), 1), ((3, 1), 3), ((1, 17), 17)])
def test_cpu_linear_3d_through_mx_linear(lead, m):
    """3-D X through ``mx_linear`` on "auto" (the cpu path on a CPU), W8A8 and W8A16, bias or not."""
    gen = torch.Generator().manual_seed(m)
    x, w, ws, w64, bias = _operands(m, 70, 288, E4M3, torch.bfloat16, m % 2 == 0, gen, lead)
    assert dispatch.linear_path(m, 70, 288, torch.device("cpu")) is dispatch.LINEAR["cpu"]
    for act in (None, E4M3):
        y = dispatch.mx_linear(x, w, ws, bias, act_elem=act)
        ref = mx_linear_reference(x.reshape(-1, 288), w, ws, bias, act_elem=act)
        assert y.shape == (*lead, 70)
        _assert_linear_close(y.reshape(m, 70), x, w64, bias, act, ScaleRule.RCEIL, ref)
        assert torch.equal(dispatch.mx_linear(x, w, ws, bias, act_elem=act, kernels="reference").reshape(m, 70), ref)


@pytest.mark.parametrize("m", [1, 3, 40])
def test_cpu_linear_nonfinite_weights(m):
    """NaN scale bytes and E4M3 NaN codes make NaN outputs where the reference has them; byte-0
    scales (2**-127) and byte 254 (2**127, the top) are decoded as the reference decodes them."""
    gen = torch.Generator().manual_seed(m)
    n, k = 12, 128
    x, w, ws, _, _ = _operands(m, n, k, E4M3, torch.float32, False, gen)
    ws = ws.clone()
    w = w.clone()
    ws[0, 1] = 0xFF
    w.view(torch.uint8)[1, 70] = 0x7F
    w.view(torch.uint8)[2, 3] = 0xFF
    ws[3, :] = 0
    ws[4, 0] = 254
    ws[4, 1:] = 1
    for act in (None, E4M3):
        y = dispatch.run_path("cpu", x, w, ws, None, act_elem=act)
        ref = mx_linear_reference(x, w, ws, None, act_elem=act)
        assert torch.equal(torch.isnan(y), torch.isnan(ref))
        ok = ~torch.isnan(ref)
        torch.testing.assert_close(y[ok], ref[ok], rtol=1e-5, atol=0)


def test_producers_are_their_references():
    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.bfloat16, torch.float32):
        x = (torch.randn(5, 288, generator=gen) * 3).to(dtype)
        wn = (torch.rand(288, generator=gen) + 0.5).to(dtype)
        for elem in (E4M3, E5M2):
            got = cpu.rmsnorm_mx(x, wn, 1e-5, elem, 32)
            want = reference.rmsnorm_mx_reference(x, wn, 1e-5, elem, 32)
            gu = (torch.randn(2, 3, 2 * 160, generator=gen) * 4).to(dtype)
            got2 = cpu.silu_mul_mx(gu, elem, 32)
            want2 = reference.silu_mul_mx_reference(gu, elem, 32)
            for a, b in (*zip(got, want), *zip(got2, want2)):
                assert a.dtype == b.dtype and a.shape == b.shape
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_registry_order_and_reference_override():
    names = dispatch.LINEAR.names()
    assert names[-2:] == ["cpu", "reference"]
    p = dispatch.LinearProblem.of(1, 64, 64, torch.bfloat16, E4M3, ScaleRule.RCEIL, 32, torch.device("cpu"), False)
    assert dispatch.choose(p) is dispatch.LINEAR["cpu"]
    assert dispatch.choose(p, "reference") is dispatch.LINEAR["reference"]
    assert dispatch.choose(p, "cpu") is dispatch.LINEAR["cpu"]
    assert not dispatch.LINEAR["cpu"].supports(p._replace(device=torch.device("cuda")))


def test_remembered_choices_stay_bounded(monkeypatch):
    """``choose`` remembers each problem's path in a bounded cache: a long run of distinct shapes
    (a server seeing every prompt length) keeps at most its limit, and every answer is the
    registry's own."""
    from mxq.kernels.launch import PlanCache

    monkeypatch.setattr(dispatch, "CHOICES", PlanCache(5))
    rnd = random.Random(5)
    for _ in range(23):
        m, n = rnd.randrange(1, 3000), 32 * rnd.randrange(1, 40)
        p = dispatch.LinearProblem.of(m, n, 64, torch.bfloat16, E4M3, ScaleRule.RCEIL, 32, torch.device("cpu"), False)
        assert dispatch.choose(p) is dispatch.LINEAR.choose(p, None)
        assert len(dispatch.CHOICES) <= 5


def test_no_compiler_falls_back_with_one_warning(monkeypatch):
    """Without a C compiler: one warning, then the reference for every call (same bits)."""
    gen = torch.Generator().manual_seed(1)
    x, w, ws, _, _ = _operands(3, 40, 96, E4M3, torch.bfloat16, False, gen)
    monkeypatch.setattr(cpu, "_compiler", lambda: None)
    cpu.library.cache_clear()
    dispatch.CHOICES.clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                y = dispatch.mx_linear(x, w, ws, None, act_elem=E4M3)
                assert torch.equal(y, mx_linear_reference(x, w, ws, None, act_elem=E4M3))
            assert dispatch.linear_path(3, 40, 96, torch.device("cpu")) is dispatch.LINEAR["reference"]
        msgs = [str(c.message) for c in caught if "C compiler" in str(c.message)]
        assert len(msgs) == 1 and "torch reference" in msgs[0]
    finally:
        monkeypatch.undo()
        cpu.library.cache_clear()
        dispatch.CHOICES.clear()
    assert cpu.available()


def test_build_is_cached(tmp_path, monkeypatch):
    """The library is built once per cache folder (a second build finds it) and turned off by
    MXQ_CPU_KERNELS=0."""
    monkeypatch.setenv("MXQ_CACHE", str(tmp_path))
    cc = cpu._compiler()
    first = cpu.build(cc)
    mtime = first.stat().st_mtime_ns
    assert cpu.build(cc) == first and first.stat().st_mtime_ns == mtime
    assert [p.name for p in (tmp_path / "cpu").iterdir()] == [first.name]
    monkeypatch.setenv("MXQ_CPU_KERNELS", "0")
    cpu.library.cache_clear()
    try:
        assert not cpu.available()
    finally:
        monkeypatch.delenv("MXQ_CPU_KERNELS")
        cpu.library.cache_clear()
        dispatch.CHOICES.clear()
    assert cpu.available()
