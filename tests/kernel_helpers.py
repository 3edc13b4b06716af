"""What the kernel tests share: the device, random MX operands and the GEMM error bound.

On CPU the kernels run through the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET
when there is no GPU) at small awkward shapes; GPU tests repeat the checks at model shapes.
Quantization is compared byte for byte, a GEMM against a float64 product of the dequantized
operands with a bound that allows only accumulation order and the final rounding to the output
dtype (``assert_gemm_close``).
"""

from __future__ import annotations

import zlib

import pytest
import torch

from mxq.formats import ScaleRule, dequantize_mx, fake_quantize_mx, quantize_mx

pytest.importorskip("triton")

from mxq.kernels import dispatch, gluon_api  # noqa: E402
from mxq.kernels.common import INTERPRET  # noqa: E402
from mxq.kernels.registry import kernels_spec  # noqa: E402
from mxq.kernels.toolchain import wgmma_async_ok  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
ASYNC_OK = CUDA and wgmma_async_ok()
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
# the warp-specialized kernels exist only where the Gluon API they are written for does
needs_gluon = pytest.mark.skipif(gluon_api.PROBLEM is not None, reason=f"Hopper kernels off: {gluon_api.PROBLEM}")
HOPPER = CUDA and torch.cuda.get_device_capability()[0] == 9 and gluon_api.PROBLEM is None
hopper = pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU and Gluon")

# Half an ulp of the output dtype, relative. The interpreter's fp32->bf16 cast truncates
# instead of rounding to nearest even (triton 3.6), so there it is a whole ulp.
EPS = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
if INTERPRET:
    EPS[torch.bfloat16] = 2.0**-7

# The fp8 tensor cores (decode_f8, decode_ws) sum a block's 32 fp8 products with fewer bits than
# fp32 (module doc of gemm_decode: ~2**-13 of the block's largest term, bound 2**-12 of the sum of
# |products|); the interpreter computes those dots in fp32, so there the usual bound applies.
F8_ACC = None if INTERPRET else 2.0**-12
F8_PATHS = ("decode_f8", "decode_ws")


def path_acc(name: str) -> float | None:
    """The accumulation bound (``assert_gemm_close``'s ``acc_rel``) of the LINEAR path ``name``."""
    return F8_ACC if name in F8_PATHS else None


def chosen(x, w, act_elem=None, act_rule=ScaleRule.RCEIL, kernels=None, block_size=32):
    """The path ``dispatch.mx_linear`` takes for this call (the same problem it builds)."""
    spec = kernels_spec(kernels)
    if spec == "reference" or not dispatch.HAS_TRITON:
        return dispatch.LINEAR["reference"]
    k = x.shape[-1]
    p = dispatch.LinearProblem.of(x.reshape(-1, k).shape[0], w.shape[0], k, x.dtype, act_elem, act_rule, block_size,
                                  x.device, dispatch.triton_runs(x.device, spec))  # fmt: skip
    return dispatch.choose(p, spec)


def seeded(*parts) -> torch.Generator:
    """A generator seeded from the test's parameters: the same inputs in every process (Python's
    ``hash`` of a string changes per process, so a rare failure could not be replayed)."""
    return torch.Generator().manual_seed(zlib.crc32("|".join(map(str, parts)).encode()))


def activations(
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


def mx_weight(n: int, k: int, elem, gen: torch.Generator):
    """An MX weight [n, k] (fp8 data, E8M0 scales, RCEIL) with per-row scale spread, on DEV, and
    its float64 dequantization."""
    w = torch.randn(n, k, generator=gen) * torch.exp(torch.randn(n, 1, generator=gen))
    t = quantize_mx(w.to(DEV), -1, elem, 32, ScaleRule.RCEIL)
    return t.data, t.scales, dequantize_mx(t, torch.float64)


def assert_gemm_close(y, x, w64, bias, act_elem, act_rule=ScaleRule.RCEIL, acc_rel=None, ref=None):
    """|y - exact| <= one output rounding + fp32 accumulation error, for every element
    (``acc_rel``: a coarser accumulation, relative to the sum of |products|). With ``ref`` (the
    torch reference's output, itself computed in fp32 and rounded once) also |y - ref| <= both
    roundings + both accumulation errors."""
    xf = x.to(torch.float32)
    if act_elem is not None:
        xf = fake_quantize_mx(xf, -1, act_elem, 32, act_rule)
    x64 = xf.reshape(-1, xf.shape[-1]).to(torch.float64)
    exact = x64 @ w64.t()
    if bias is not None:
        exact = exact + bias.to(torch.float64)
    mag = x64.abs() @ w64.abs().t()
    k = x64.shape[1]
    fp32_acc = 2 * k * 2.0**-24
    acc = acc_rel if acc_rel is not None else fp32_acc
    bound = EPS[y.dtype] * exact.abs() + acc * mag + 1e-30
    err = (y.reshape(exact.shape).to(torch.float64) - exact).abs()
    worst = (err - bound).max().item()
    assert torch.isfinite(y).all()
    assert worst <= 0, f"max excess over bound {worst:.3g} (err {err.max().item():.3g})"
    if ref is not None:
        assert ref.dtype == y.dtype and ref.shape == y.shape
        both = 2 * EPS[y.dtype] * exact.abs() + (acc + fp32_acc) * mag + 1e-30
        diff = (y.to(torch.float64) - ref.to(torch.float64)).reshape(exact.shape).abs()
        worst = (diff - both).max().item()
        assert worst <= 0, f"max excess over the reference by {worst:.3g} (diff {diff.max().item():.3g})"


def assert_chain_same_bits(chain, inputs, serialized, replays: int = 3) -> None:
    """A decode chain with programmatic dependent launch against the same chain serialized:
    ``chain(x, res)`` and ``serialized(x, res)`` (PDL off) give the same bits on ``inputs()``,
    eagerly and from a CUDA graph of ``chain`` replayed on ``replays`` fresh inputs."""
    x, res = inputs()
    on, off = chain(x, res), serialized(x, res)
    assert all(torch.equal(a, b) for a, b in zip(on, off))
    assert torch.isfinite(on[0]).all()
    xin, rin = torch.empty_like(x), torch.empty_like(res)
    chain(xin, rin)  # buffers (split-K tickets) allocated outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = chain(xin, rin)
    for _ in range(replays):
        x, res = inputs()
        xin.copy_(x)
        rin.copy_(res)
        g.replay()
        torch.cuda.synchronize()
        ref = serialized(x, res)
        assert all(torch.equal(a, b) for a, b in zip(out, ref))
