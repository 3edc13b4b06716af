"""kernels/gluon_api.py: a Triton whose Gluon API differs from the one the Hopper kernels are
written for never breaks mxq. Dispatch is driven as on an sm_90 device (``LinearProblem.of``
answering capability (9, 0)) with CPU tensors (CUDA tensors where there is a GPU), so the
fallback kernels run through the Triton interpreter (or on the GPU) and are compared with the
torch reference. The fall-back from a Gluon kernel that fails to compile at its first launch is
tests/test_dispatch.py::test_gluon_compile_failure_falls_back_to_the_next_path."""

import importlib
import sys
import warnings

import pytest
import torch

pytest.importorskip("triton")

from mxq.formats import E4M3, ScaleRule, quantize_mx  # noqa: E402
from mxq.kernels import dispatch, gluon_api  # noqa: E402
from mxq.kernels import gemm_decode_ws as WS  # noqa: E402
from mxq.kernels import gemm_prefill_ws as PWS  # noqa: E402
from mxq.kernels.launch import PlanCache  # noqa: E402
from mxq.kernels.reference import mx_linear_reference  # noqa: E402


@pytest.fixture
def fresh_state(monkeypatch):
    """Fresh Gluon state, no remembered dispatch choices, and every problem seen as on sm_90."""
    monkeypatch.setattr(gluon_api, "DISABLED", {})
    monkeypatch.setattr(gluon_api, "WARNED", set())
    monkeypatch.setattr(dispatch, "CHOICES", PlanCache())
    of = dispatch.LinearProblem.of
    monkeypatch.setattr(dispatch.LinearProblem, "of", classmethod(
        lambda cls, *a, **kw: of(*a, **kw)._replace(capability=(9, 0), sms=132, triton=True)))  # fmt: skip
    return monkeypatch


DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the fallback kernels run on the GPU there


def _problem(m: int, n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    q = quantize_mx(torch.randn(n, k, generator=gen), -1, E4M3)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    return x.to(DEV), q.data.to(DEV), q.scales.to(DEV), bias.to(DEV)


def _mxq_warnings(seen) -> list[str]:
    return [str(w.message) for w in seen if str(w.message).startswith("mxq:")]


def _hopper_call(x, w, s, b):
    return dispatch.mx_linear(x, w, s, b, act_elem=E4M3)


def test_other_errors_are_not_swallowed(fresh_state):
    """Only Triton's own compile errors turn a kernel off; a bug in the call still raises."""
    fresh_state.setattr(gluon_api, "PROBLEM", None)

    def wrong(*args, **kwargs):
        raise ValueError("bad shape")

    fresh_state.setattr(WS, "mx_decode_gemm_ws", wrong)
    with pytest.raises(ValueError, match="bad shape"):
        _hopper_call(*_problem(2, 64, 128, seed=3))
    assert not gluon_api.DISABLED


def test_missing_api_warns_once_and_never_calls_the_kernel(fresh_state):
    """The import-time probe found the API missing: Hopper calls warn once with the reason and run
    the plain Triton kernels; the Gluon entry points are never reached."""
    fresh_state.setattr(gluon_api, "PROBLEM", "Triton 9.9's Gluon has no gl.thread_barrier")
    fresh_state.setattr(WS, "mx_decode_gemm_ws", lambda *a, **k: pytest.fail("Gluon kernel called"))
    fresh_state.setattr(PWS, "mx_prefill_gemm_ws", lambda *a, **k: pytest.fail("Gluon kernel called"))
    x, w, s, b = _problem(4, 48, 384, seed=5)
    p = dispatch.LinearProblem.of(4, 48, 384, x.dtype, E4M3, ScaleRule.RCEIL, 32, x.device, triton=True)
    assert dispatch.choose(p) is dispatch.LINEAR["decode_f8"]  # not decode_ws: the next path
    with pytest.warns(RuntimeWarning, match=r"Hopper kernels are off \(Triton 9.9's Gluon has no gl.thread_barrier\)"):
        y = _hopper_call(x, w, s, b)
    torch.testing.assert_close(y.float(), mx_linear_reference(x.float(), w, s, b.float(), act_elem=E4M3),
                               rtol=1e-2, atol=1e-2)  # fmt: skip
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _hopper_call(x, w, s, b)
    assert not _mxq_warnings(seen)


def test_gluon_import_failure_is_a_problem_not_a_crash(monkeypatch):
    """Without an importable Gluon the module still imports, with PROBLEM naming the cause, and
    every kernel name reads as unusable."""
    monkeypatch.setitem(sys.modules, "triton.experimental.gluon", None)
    try:
        mod = importlib.reload(gluon_api)
        assert mod.PROBLEM is not None and "not importable" in mod.PROBLEM
        assert not mod.usable("gemm_decode_ws") and not WS.takes(1, 128, 32)
    finally:
        monkeypatch.undo()
        importlib.reload(gluon_api)
    assert gluon_api.PROBLEM is None or "Gluon has no" in gluon_api.PROBLEM


def test_the_hopper_kernels_build_with_each_ci_triton():
    """Both CI Tritons (3.6 and the latest) have the Gluon API the kernels call, each under its own
    spelling, and none of the three Hopper kernels is turned off on either."""
    assert gluon_api.HAVE_GLUON, gluon_api.PROBLEM
    gl, tma = gluon_api.gl, gluon_api.hopper.tma
    if gluon_api.NEWER_API:
        assert (gluon_api.cta_barrier, gluon_api.tma_load) == (gl.barrier, tma.async_load)
        assert gluon_api.smem_view is gl.shared_memory_descriptor.reinterpret
    else:
        assert (gluon_api.cta_barrier, gluon_api.tma_load) == (gl.thread_barrier, tma.async_copy_global_to_shared)
        assert gluon_api.smem_view is gl.shared_memory_descriptor._reinterpret
    assert not gluon_api.DISABLED
    for name in ("gemm_decode_ws", "gemm_prefill_ws", "attention_decode_ws"):
        assert gluon_api.usable(name), name
