"""kernels/gemm.py: the exact MX GEMM emulation (``mx_gemm``: dequantized weight tiles as the MMA's
left operand) against a float64 product of the dequantized operands; every config variant, split-K,
W8A8 with X rounded inside the kernel; GPU variants at model-like shapes."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import ASYNC_OK, DEV, activations, assert_gemm_close, gpu, mx_weight

from mxq.formats import E4M3, E5M2, ScaleRule
from mxq.kernels import gemm as G
from mxq.kernels.reference import mx_linear_reference


@pytest.mark.parametrize("split_k", [1, 2, 3])
def test_mx_gemm_configs_and_split_k(split_k):
    """Every kernel variant; on CPU the TMA flags fall back to pointer loads."""
    gen = torch.Generator().manual_seed(11 + split_k)
    m, n, k = 17, 72, 416
    w, ws, w64 = mx_weight(n, k, E4M3, gen)
    x = activations(m, k, torch.float32, gen, special=False)
    for xd in (torch.float32, torch.bfloat16):
        xx = x.to(xd)
        cfg = G.GemmConfig(16, 32, 64, num_stages=1, split_k=split_k, tma_x=True, tma_w=True, deq_bf16=True)
        assert_gemm_close(G.mx_gemm(xx, w, ws, None, config=cfg), xx, w64, None, None)
        # The un-peeled loop (accumulator zero-initialised before it) computes the same.
        for zd in (False, True):
            cfg = G.GemmConfig(16, 32, 64, num_stages=1, split_k=split_k, peel=False, zero_dot=zd)
            assert_gemm_close(G.mx_gemm(xx, w, ws, None, config=cfg), xx, w64, None, None)


@pytest.mark.parametrize("m,n,k", [(1, 40, 96), (5, 72, 160), (17, 50, 224)])
@pytest.mark.parametrize("act", [(E4M3, ScaleRule.RCEIL), (E5M2, ScaleRule.FLOOR), (E4M3, ScaleRule.EVEN)])
def test_mx_gemm_quant_inside(m, n, k, act):
    """W8A8 with X MX-rounded inside the MMA kernel (one launch), any X dtype, split-K."""
    gen = torch.Generator().manual_seed(m * 13 + n + k)
    w, ws, w64 = mx_weight(n, k, E4M3 if n % 2 else E5M2, gen)
    elem, rule = act
    for xdtype in (torch.bfloat16, torch.float32):
        x = activations(m, k, xdtype, gen, special=False, decades=(-2, 1))
        bias = torch.randn(n, generator=gen).to(xdtype).to(DEV)
        for split in (1, 3):
            cfg = G.GemmConfig(16, 32, 64, num_stages=1, split_k=split)
            y = G.mx_gemm(x, w, ws, bias, config=cfg, act_elem=elem, act_rule=rule)
            assert y.dtype == xdtype and y.shape == (m, n)
            assert_gemm_close(y, x, w64, bias, elem, rule)
    with pytest.raises(ValueError, match="MSE"):
        G.mx_gemm(x, w, ws, None, act_elem=E4M3, act_rule=ScaleRule.MSE)


def test_mx_gemm_quant_inside_nonfinite():
    """A NaN/Inf activation block makes its output row NaN, as in the reference."""
    gen = torch.Generator().manual_seed(23)
    n, k = 24, 128
    w, ws, _ = mx_weight(n, k, E4M3, gen)
    x = activations(4, k, torch.float32, gen, special=True)
    y = G.mx_gemm(x, w, ws, None, config=G.GemmConfig(16, 32, 64, num_stages=1), act_elem=E4M3)
    ref = mx_linear_reference(x.cpu(), w.cpu(), ws.cpu(), None, act_elem=E4M3)
    assert torch.equal(torch.isnan(y.cpu()), torch.isnan(ref))
    fin = torch.isfinite(ref)
    torch.testing.assert_close(y.cpu()[fin], ref[fin], rtol=1e-5, atol=1e-5)


def test_gemm_errors_are_clear():
    w = torch.zeros(8, 64, dtype=torch.float8_e4m3fn)
    s = torch.full((8, 2), 127, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"weight must be \[N, K=32\]"):
        G.mx_gemm(torch.zeros(2, 32), w, s)
    with pytest.raises(ValueError, match="weight_scale must be uint8"):
        G.mx_gemm(torch.zeros(2, 64), w, s[:, :1])
    with pytest.raises(TypeError, match="float8_e4m3fn or float8_e5m2"):
        G.mx_gemm(torch.zeros(2, 64), w.to(torch.float16), s)
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        G.mx_gemm(torch.zeros(2, 64, dtype=torch.float64), w, s)
    with pytest.raises(ValueError, match="multiple of block_size"):
        G.mx_gemm(torch.zeros(2, 48), w[:, :48], s[:, :1])
    assert G.mx_gemm(torch.zeros(0, 64), w, s).shape == (0, 8)


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
        G.GemmConfig(128, 128, 64, 8, 3),
        G.GemmConfig(16, 64, 128, 4, 6, split_k=4, tma_w=True, deq_bf16=True),
        G.GemmConfig(64, 128, 128, 4, 4, split_k=3, tma_w=True),
        G.GemmConfig(16, 64, 128, 4, 6, split_k=4, tma_w=True, peel=False),
        # In-flight wgmmas: right only when ptxas >= 13.3 assembles them (kernels/toolchain.py).
        pytest.param(
            G.GemmConfig(256, 128, 64, 8, 3, tma_x=True, tma_w=True, deq_bf16=True, peel=False, zero_dot=True),
            marks=pytest.mark.xfail(not ASYNC_OK, reason="ptxas < 13.3: register hazard (triton-lang/triton#9433)"),
        ),
        pytest.param(
            G.GemmConfig(128, 64, 64, 4, 4, tma_x=True, tma_w=True, deq_bf16=True, peel=False, zero_dot=True),
            marks=pytest.mark.xfail(not ASYNC_OK, reason="ptxas < 13.3: register hazard (triton-lang/triton#9433)"),
        ),
        G.GemmConfig(16, 128, 128, 4, 4, split_k=8, tma_w=True),
        G.GemmConfig(16, 128, 256, 8, 3, split_k=2, tma_w=True),
    ],
    ids=str,
)
def test_gpu_gemm_variants(cfg):
    gen = torch.Generator().manual_seed(8)
    w, ws, w64 = mx_weight(1000, 2080, E4M3, gen)
    for m in (5, 256, 300):
        x = torch.randn(m, 2080, generator=gen).to(torch.bfloat16).cuda()
        b = torch.randn(1000, generator=gen).to(torch.bfloat16).cuda()
        assert_gemm_close(G.mx_gemm(x, w, ws, b, config=cfg), x, w64, b, None)
        assert_gemm_close(G.mx_gemm(x, w, ws, None, config=cfg), x, w64, None, None)
        if m == 5 and cfg.block_m <= 64:
            for elem, rule in ((E4M3, ScaleRule.RCEIL), (E5M2, ScaleRule.EVEN)):
                y = G.mx_gemm(x, w, ws, b, config=cfg, act_elem=elem, act_rule=rule)
                assert_gemm_close(y, x, w64, b, elem, rule)
