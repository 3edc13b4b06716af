"""kernels/gemm_decode.py: W8A8 decode on fp8 tensor cores (``mx_decode_gemm``: one fp8 MMA per
32-block, X rounded inside or by the quantizer first) against a float64 product of the MX-rounded
operands, within the tensor core's in-block accumulation bound on a GPU (``F8_ACC``)."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import (
    DEV,
    F8_ACC,
    activations,
    assert_chain_same_bits,
    assert_gemm_close,
    gpu,
    mx_weight,
)

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


def test_decode_f8_on_producer_codes(monkeypatch):
    """X rounded by its producer (``x_mx``: the rounded values, their codes and scale bytes): the
    kernel reads the codes with no quantizer launch, and its bits equal those of the same call
    rounding X itself; where it cannot read them as they are (scale rows not whole int32 words) it
    rounds X in the kernel, the same bits. The registry's ``decode_f8`` path passes ``x_mx`` on."""
    from mxq.kernels import dispatch, gemm_decode
    from mxq.kernels import quantize as Q

    gen = torch.Generator().manual_seed(23)
    calls = []
    monkeypatch.setattr(gemm_decode, "quantize_mx_rows", lambda *a, **kw: calls.append(1) or Q.quantize_mx_rows(*a, **kw))
    for m, n, k in ((3, 100, 384), (9, 70, 256), (5, 40, 224)):
        w, ws, w64 = mx_weight(n, k, E4M3, gen)
        x = activations(m, k, torch.bfloat16, gen, special=False, decades=(-2, 1))
        q, s = Q.quantize_mx_rows(x, E4M3)
        xr = Q.fake_quantize_mx_rows(x, E4M3, out_dtype=torch.bfloat16)  # the producer's rounded values
        cfg = D.DecodeF8Config(block_n=64, split_k=2)
        want = D.mx_decode_gemm(xr, w, ws, None, config=cfg)  # X rounded in the kernel
        reads_codes = k % 128 == 0
        # where the codes are read, X's values are not: zeros there leave the product unchanged
        got = D.mx_decode_gemm(torch.zeros_like(xr) if reads_codes else xr, w, ws, None, config=cfg, x_mx=(q, s))
        assert torch.equal(got, want) and not calls, (m, n, k)
        assert_gemm_close(got, x, w64, None, E4M3, acc_rel=F8_ACC)
        p = dispatch.LinearProblem.of(m, n, k, xr.dtype, E4M3, ScaleRule.RCEIL, 32, xr.device, True)
        y = dispatch.LINEAR["decode_f8"].run(p, xr, w, ws, None, torch.bfloat16, (q, s))
        assert torch.equal(y, D.mx_decode_gemm(xr, w, ws, None, x_mx=(q, s)))


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


@gpu
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="PDL needs sm_90+")
@pytest.mark.parametrize("m", [1, 5])
def test_gpu_portable_decode_chain_pdl_same_bits(monkeypatch, m):
    """The decode step on the portable paths (``kernels="gemv,decode_f8"``: the CUDA-core gemv at
    M = 1, the plain-Triton fp8 decode GEMM at M = 5 on the producers' codes), with programmatic
    dependent launch where each kernel takes it (the producers, the attention, gemv and its split-K
    reduction): eagerly and in a CUDA graph replayed on new inputs, its bits equal those of the same
    chain with PDL off (every launch serialized)."""
    from mxq.kernels import common, dispatch, launch
    from mxq.kernels import producers as P
    from mxq.kernels.attention_sdpa_decode import sdpa_decode

    gen = torch.Generator().manual_seed(70 + m)
    hid, inter, paths = 2048, 5632, "gemv,decode_f8"
    assert dispatch.linear_path(m, hid, inter, torch.device(DEV), kernels=paths).name == ("gemv" if m == 1 else "decode_f8")
    layers = []
    for i in range(3):
        nw = (1 + 0.1 * torch.randn(hid, generator=gen)).to(torch.bfloat16).to(DEV)
        ws = [mx_weight(n, k, E4M3, gen)[:2] for n, k in ((2 * inter, hid), (hid, inter), (hid, hid))]
        kv = torch.randn(m, 4, (160, 4000)[i % 2], 128, generator=gen).to(torch.bfloat16).to(DEV)
        layers.append((nw, *ws, kv))

    def chain(x, res):
        for nw, gu_w, d_w, o_w, kv in layers:
            h, y, q, s = P.add_rmsnorm_mx(x, res, nw, 1e-5, E4M3)
            gu = dispatch.mx_linear(y, *gu_w, act_elem=E4M3, kernels=paths, x_mx=(q, s))
            y2, q2, s2 = P.silu_mul_mx(gu, E4M3)
            d = dispatch.mx_linear(y2, *d_w, act_elem=E4M3, kernels=paths, x_mx=(q2, s2))
            a = sdpa_decode(d.view(m, 16, 1, 128), kv, kv)
            x, res = dispatch.mx_linear(a.reshape(m, hid), *o_w, act_elem=E4M3, kernels=paths), h
        return x, res

    def inputs():
        return tuple(activations(m, hid, torch.bfloat16, gen, special=False, decades=(-1, 1)) for _ in range(2))

    def serialized(x, res):
        with monkeypatch.context() as mp:
            mp.setattr(common, "PDL", False)
            mp.setattr(P, "PLANS", launch.PlanCache())  # producer plans hold their PDL constexpr
            return chain(x, res)

    assert_chain_same_bits(chain, inputs, serialized)
