"""kernels/gemm_decode.py: W8A8 decode on fp8 tensor cores (``mx_decode_gemm``: one fp8 MMA per
32-block, X rounded inside or by the quantizer first) against a float64 product of the MX-rounded
operands, within the tensor core's in-block accumulation bound on a GPU (``F8_ACC``)."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEV, F8_ACC, activations, assert_gemm_close, gpu, mx_weight

from mxq.formats import E4M3, E5M2, ScaleRule
from mxq.kernels import buffers
from mxq.kernels import gemm_decode as D
from mxq.kernels.reference import mx_linear_reference


@pytest.mark.parametrize("m,n,k", [(1, 70, 96), (3, 100, 384), (17, 33, 224), (40, 64, 512)])
@pytest.mark.parametrize("wel,act", [(E4M3, (E4M3, ScaleRule.RCEIL)), (E5M2, (E4M3, ScaleRule.FLOOR)), (E4M3, (E5M2, ScaleRule.EVEN))])
def test_decode_f8_matches_reference(m, n, k, wel, act):
    gen = torch.Generator().manual_seed(m * 31 + n + k)
    w, ws, w64 = mx_weight(n, k, wel, gen)
    x = activations(m, k, torch.bfloat16, gen, special=False, decades=(-2, 1))
    bias = torch.randn(n, generator=gen).to(torch.bfloat16).to(DEV)
    act_elem, rule = act
    variants = ((1, True, None, 2, False), (2, True, torch.float32, 2, False), (3, True, None, 4, True), (3, False, torch.float32, 4, False))
    for split, fused, out, kb, qx in variants:
        # kb = 4 with K % 128 == 0 takes the int32 scale words; quant_x the quantizer launch
        cfg = D.DecodeF8Config(block_n=64, kb=kb, split_k=split, fused=fused, tma_w=split != 2, quant_x=qx)
        y = D.mx_decode_gemm(x, w, ws, bias if split != 2 else None, act_elem=act_elem, act_rule=rule, out_dtype=out, config=cfg)
        assert y.dtype == (out or torch.bfloat16) and y.shape == (m, n)
        assert_gemm_close(y, x, w64, bias if split != 2 else None, act_elem, rule, acc_rel=F8_ACC)
    counters = buffers.split_counters(torch.device(DEV), 1)
    assert counters is not None and not counters.any(), "fused split-K must leave its tickets at zero"


def test_decode_f8_nonfinite_and_errors():
    """A NaN/Inf activation block makes its row NaN (as the reference); bad calls are one-line errors."""
    gen = torch.Generator().manual_seed(5)
    n, k = 48, 128
    w, ws, w64 = mx_weight(n, k, E4M3, gen)
    x = activations(5, k, torch.float32, gen, special=True)
    y = D.mx_decode_gemm(x, w, ws, None, out_dtype=torch.float32, config=D.DecodeF8Config(block_n=64, kb=2, split_k=2))
    ref = mx_linear_reference(x.cpu(), w.cpu(), ws.cpu(), None, act_elem=E4M3)
    assert torch.equal(torch.isnan(y.cpu()), torch.isnan(ref))
    assert torch.isnan(y[:2]).all() and torch.isfinite(y[2:]).all()
    assert_gemm_close(y[2:], x[2:], w64, None, E4M3, acc_rel=F8_ACC)
    # MSE (and quant_x) quantize X first with the quantizer kernel; the kernel's own rounding
    # (kb = 2 here) has no MSE.
    y = D.mx_decode_gemm(x[2:], w, ws, act_rule=ScaleRule.MSE, out_dtype=torch.float32)
    assert_gemm_close(y, x[2:], w64, None, E4M3, ScaleRule.MSE, acc_rel=F8_ACC)
    with pytest.raises(ValueError, match="MSE"):
        D.mx_decode_gemm(x, w, ws, act_rule=ScaleRule.MSE, config=D.DecodeF8Config(kb=2))
    with pytest.raises(ValueError, match="M <= 64"):
        D.mx_decode_gemm(torch.zeros(65, k, device=DEV), w, ws)
    with pytest.raises(ValueError, match="block_size=32"):
        D.mx_decode_gemm(x, w, ws[:, : k // 64].contiguous(), block_size=64)
    assert D.mx_decode_gemm(x[:0], w, ws).shape == (0, n)


def test_decode_f8_config_rule():
    """Off CUDA (the interpreter) 64-row tiles, X quantized first, K split from 256 on; the GPU
    rule's splits are measured on the GPU (test_gpu_decode_f8 runs them)."""
    cpu = torch.device("cpu")
    for k, split in ((128, 1), (224, 1), (256, 2), (4096, 2)):
        cfg = D.pick_decode_f8_config(4, 100, k, cpu)
        assert cfg.split_k == split and cfg.block_n == 64 and cfg.quant_x and not cfg.tma_w


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (5, 1000, 2080), (16, 6144, 4096), (33, 14336, 4096), (64, 4096, 14336)])
def test_gpu_decode_f8(m, n, k):
    """Model shapes and awkward ones, the dispatched config, bf16 and fp32 out, with bias;
    then the tensor core's in-block accumulation measured against float64."""
    gen = torch.Generator().manual_seed(m + n)
    w, ws, w64 = mx_weight(n, k, E4M3, gen)
    x = activations(m, k, torch.bfloat16, gen, special=False, decades=(-2, 1))
    bias = torch.randn(n, generator=gen).to(torch.bfloat16).to(DEV)
    for out in (None, torch.float32):
        y = D.mx_decode_gemm(x, w, ws, bias, out_dtype=out)
        assert_gemm_close(y, x, w64, bias, E4M3, acc_rel=F8_ACC)
    y = D.mx_decode_gemm(x, w, ws, bias, out_dtype=torch.float32, config=D.DecodeF8Config(split_k=4, fused=False))
    assert_gemm_close(y, x, w64, bias, E4M3, acc_rel=F8_ACC)
