"""kernels/gemv.py: the CUDA-core decode kernel (``mx_gemv``, X rounded inside it for W8A8) against
a float64 product of the dequantized operands: configs, split-K, every X dtype and amax rule,
non-finite activation blocks; GPU variants at model-like shapes."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEV, activations, assert_gemm_close, gpu, mx_weight

from mxq.formats import E4M3, E5M2, ScaleRule
from mxq.kernels import dispatch
from mxq.kernels import gemv as V
from mxq.kernels.reference import mx_linear_reference


@pytest.mark.parametrize("m,n,k", [(1, 40, 96), (3, 72, 160), (17, 50, 224)])
@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("act", [None, (E4M3, ScaleRule.RCEIL), (E5M2, ScaleRule.FLOOR), (E4M3, ScaleRule.EVEN)])
def test_mx_gemv_matches_reference(m, n, k, xdtype, act):
    gen = torch.Generator().manual_seed(m * 77 + n + k)
    w, ws, w64 = mx_weight(n, k, E4M3 if n % 2 else E5M2, gen)
    x = activations(m, k, xdtype, gen, special=False, decades=(-2, 1))
    bias = torch.randn(n, generator=gen).to(xdtype).to(DEV)
    act_elem, rule = act if act else (None, ScaleRule.RCEIL)
    for split, fused in ((1, True), (3, True), (3, False)):  # the last split sums, or a reduction launch
        cfg = V.GemvConfig(block_n=16, block_k=64, num_stages=1, split_k=split, tma_w=True, fused=fused)
        y = V.mx_gemv(x, w, ws, bias, config=cfg, act_elem=act_elem, act_rule=rule)
        assert y.dtype == xdtype and y.shape == (m, n)
        assert_gemm_close(y, x, w64, bias, act_elem, rule)


def test_mx_gemv_nonfinite_blocks_and_mse_dispatch():
    """A NaN/Inf activation block makes its rows NaN (as the reference); MSE rounds outside (the
    dispatched gemv path rounds X first, then runs the kernel as W8A16)."""
    gen = torch.Generator().manual_seed(21)
    n, k = 24, 128
    w, ws, w64 = mx_weight(n, k, E4M3, gen)
    x = activations(4, k, torch.float32, gen, special=True)
    y = V.mx_gemv(x, w, ws, None, act_elem=E4M3)
    ref = mx_linear_reference(x.cpu(), w.cpu(), ws.cpu(), None, act_elem=E4M3)
    assert torch.equal(torch.isnan(y.cpu()), torch.isnan(ref))
    assert torch.isnan(y[:2]).all() and torch.isfinite(y[2:]).all()
    fin = torch.isfinite(ref)
    torch.testing.assert_close(y.cpu()[fin], ref[fin], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="MSE"):
        V.mx_gemv(x, w, ws, None, act_elem=E4M3, act_rule=ScaleRule.MSE)
    y = dispatch.run_path("gemv", x[2:], w, ws, None, act_elem=E4M3, act_rule=ScaleRule.MSE)
    assert_gemm_close(y, x[2:], w64, None, E4M3, ScaleRule.MSE)


def test_mx_gemv_errors_and_config_rule():
    """Bad calls are one-line errors; off CUDA (the interpreter's tiles) K is split from 128 on."""
    gen = torch.Generator().manual_seed(4)
    w, ws, _ = mx_weight(24, 128, E4M3, gen)
    with pytest.raises(ValueError, match="small M"):
        V.mx_gemv(torch.zeros(65, 128, device=DEV), w, ws)
    with pytest.raises(ValueError, match="block_k=64 must be a multiple of block_size=128"):
        V.mx_gemv(torch.zeros(2, 128, device=DEV), w, ws[:, :1].contiguous(), config=V.GemvConfig(block_k=64), block_size=128)
    assert V.mx_gemv(torch.zeros(0, 128, device=DEV), w, ws).shape == (0, 24)
    cpu = torch.device("cpu")
    assert V.pick_gemv_config(1, 24, 96, cpu).split_k == 1 and V.pick_gemv_config(1, 24, 128, cpu).split_k == 2


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    "cfg",
    [V.GemvConfig(32, 256, 4, 3), V.GemvConfig(16, 512, 4, 3, split_k=4), V.GemvConfig(64, 128, 4, 4, split_k=3, tma_w=True)],
    ids=str,
)
@pytest.mark.parametrize("act", [None, (E4M3, ScaleRule.RCEIL), (E5M2, ScaleRule.EVEN)])
def test_gpu_gemv_variants(cfg, act):
    gen = torch.Generator().manual_seed(12)
    w, ws, w64 = mx_weight(1000, 2080, E4M3, gen)
    act_elem, rule = act if act else (None, ScaleRule.RCEIL)
    for m in (1, 3, 16):
        x = activations(m, 2080, torch.bfloat16, gen, special=False, decades=(-2, 1))
        b = torch.randn(1000, generator=gen).to(torch.bfloat16).cuda()
        y = V.mx_gemv(x, w, ws, b, config=cfg, act_elem=act_elem, act_rule=rule)
        assert_gemm_close(y, x, w64, bias=b, act_elem=act_elem, act_rule=rule)
