"""kernels/gemm_prefill_ws.py: the register-operand prefill GEMM, warp-specialized in Gluon (Hopper
only: the Triton interpreter cannot run Gluon, tests/test_sass_dev.py compiles it on the CPU).
On CPU: argument checks, the transposed scales, the byte-move identity the kernel's dequant uses;
on a Hopper GPU: against float64 and the emulation, the kept scales, the dispatched path."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEV, HOPPER, activations, assert_gemm_close, hopper, mx_weight

from mxq.formats import E4M3, E5M2, MXTensor, dequantize_mx
from mxq.kernels import dispatch
from mxq.kernels import gemm as G
from mxq.kernels import gemm_prefill_ws as PWS


def test_prefill_ws_rejects_what_it_cannot_take():
    gen = torch.Generator().manual_seed(5)
    w, ws, _ = mx_weight(64, 256, E4M3, gen)
    with pytest.raises(TypeError, match="takes bf16 X"):
        PWS.mx_prefill_gemm_ws(torch.zeros(4, 256, device=DEV), w, ws)
    if not HOPPER:
        with pytest.raises(ValueError, match="needs Gluon, a Hopper GPU"):
            PWS.mx_prefill_gemm_ws(torch.zeros(4, 256, dtype=torch.bfloat16, device=DEV), w, ws)
    usable = PWS.gluon_api.usable("gemm_prefill_ws")
    assert PWS.takes(1, 32, 32) == PWS.takes(4096, 4096, 32) == usable
    assert not any((PWS.takes(0, 32, 32), PWS.takes(64, 48, 32), PWS.takes(64, 64, 16)))
    assert PWS.pick_prefill_rs_config(4096, 4096, 4096, torch.device(DEV)) == PWS.PrefillRSConfig()


def test_prefill_ws_scales_kn():
    """The scales as the loader's TMA reads them: transposed, rows padded to 16 bytes."""
    s = torch.randint(0, 256, (37, 5), dtype=torch.uint8)
    st = PWS.scales_kn(s)
    assert st.shape == (5, 48) and torch.equal(st[:, :37], s.t())


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
    scale of 2**73, bias, bf16/fp32 out, ring depths, L2 grouping, against float64; equal to the
    emulation within fp32 accumulation order; a NaN scale byte gives a NaN column."""
    gen = torch.Generator().manual_seed(m + n + k + 1)
    w, ws, _ = mx_weight(n, k, wel, gen)
    w, ws = _every_code_rows(w, ws)
    w64 = dequantize_mx(MXTensor(w.cpu(), ws.cpu(), torch.Size((n, k)), -1, 32, wel), torch.float64).to(DEV)
    x = activations(m, k, torch.bfloat16, gen, special=False, decades=(-2, 1))
    bias = torch.randn(n, generator=gen).to(torch.bfloat16).to(DEV)
    R = PWS.PrefillRSConfig
    cfgs = [(R(), None), (R(stages=3), torch.float32), (R(stages=2), torch.bfloat16), (R(group=1), torch.float32)]
    for cfg, out in cfgs:
        y = PWS.mx_prefill_gemm_ws(x, w, ws, bias, out_dtype=out, config=cfg)
        assert y.dtype == (out or torch.bfloat16) and y.shape == (m, n)
        assert_gemm_close(y, x, w64, bias, None)
    y0 = G.mx_gemm(x, w, ws, bias, out_dtype=torch.float32)
    y1 = PWS.mx_prefill_gemm_ws(x, w, ws, bias, out_dtype=torch.float32)
    mag = x.double().abs() @ w64.abs().t()
    assert ((y0.double() - y1.double()).abs() <= 2 * k * 2.0**-24 * mag + 1e-30).all()
    ws[n // 2, 0] = 255
    y = PWS.mx_prefill_gemm_ws(x, w, ws, None, out_dtype=torch.float32)
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
    w, ws, _ = mx_weight(n, k, E4M3, gen)
    x = activations(m, k, torch.bfloat16, gen, special=False, decades=(-2, 1))
    cfg = PWS.PrefillRSConfig()
    st = PWS.scales_kn_cached(ws)
    assert PWS.scales_kn_cached(ws) is st and torch.equal(st[:, :n], ws.t())
    y0 = PWS.mx_prefill_gemm_ws(x, w, ws, None, out_dtype=torch.float32, config=cfg)
    ws[:, 0] += 1  # every row's first block scaled by 2
    st2 = PWS.scales_kn_cached(ws)
    assert st2 is not st and torch.equal(st2[:, :n], ws.t())
    y1 = PWS.mx_prefill_gemm_ws(x, w, ws, None, out_dtype=torch.float32, config=cfg)
    w64 = dequantize_mx(MXTensor(w.cpu(), ws.cpu(), torch.Size((n, k)), -1, 32, E4M3), torch.float64).to(DEV)
    assert_gemm_close(y1, x, w64, None, None)
    assert not torch.equal(y0, y1)
    key = id(ws)
    del ws, st, st2
    gc.collect()
    assert key not in PWS.SCALES_KN_CACHE
    ws2 = torch.randint(100, 140, (n, k // 32), dtype=torch.uint8, device=DEV)
    g = torch.cuda.CUDAGraph()
    PWS.mx_prefill_gemm_ws(x, w, ws2.clone(), None, config=cfg)  # compile outside the capture
    with torch.cuda.graph(g):
        PWS.mx_prefill_gemm_ws(x, w, ws2, None, config=cfg)
    assert id(ws2) not in PWS.SCALES_KN_CACHE


@hopper
@pytest.mark.gpu
@pytest.mark.parametrize("act", [None, E4M3])
def test_gpu_dispatch_prefill_ws(act):
    """mx_linear at M >= PREFILL_WS_MIN_M on Hopper runs the register-operand kernel (by identity
    and by name in the tables) and computes the reference's function (W8A16 and W8A8, 3-D input,
    bias)."""
    gen = torch.Generator().manual_seed(14)
    n, k, m = 8200, 1056, 1031  # 5 x 65 tiles
    w, ws, w64 = mx_weight(n, k, E4M3, gen)
    x = activations(m, k, torch.bfloat16, gen, special=False, decades=(-2, 1)).reshape(1, m, k)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16).to(DEV)
    assert dispatch.linear_path(m, n, k, x.device, w8a8=act is not None) is dispatch.LINEAR["prefill_ws"]
    assert dispatch.path_name(m, n, k, x.device, w8a8=act is not None).startswith("prefill_ws ")
    y = dispatch.mx_linear(x, w, ws, bias, act_elem=act)
    assert y.shape == (1, m, n) and y.dtype == torch.bfloat16
    assert_gemm_close(y.reshape(-1, n), x.reshape(-1, k), w64, bias, act)
