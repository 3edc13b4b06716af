"""kernels/gluon_api.py: a Triton whose Gluon API differs from the one the Hopper kernels are
written for never breaks mxq. Dispatch is driven as on an sm_90 device (``hopper=True``) with CPU
tensors (CUDA tensors where there is a GPU), so the fallback kernels run through the Triton
interpreter (or on the GPU) and are compared with the torch reference."""

import importlib
import sys
import warnings

import pytest
import torch

pytest.importorskip("triton")

from triton.runtime.errors import PTXASError  # noqa: E402

from mxq.formats import E4M3, quantize_mx  # noqa: E402
from mxq.kernels import dispatch, gluon_api  # noqa: E402
from mxq.kernels import gemm_decode_ws as WS  # noqa: E402
from mxq.kernels.reference import mx_linear_reference  # noqa: E402


@pytest.fixture
def fresh_state(monkeypatch):
    monkeypatch.setattr(gluon_api, "DISABLED", {})
    monkeypatch.setattr(gluon_api, "_WARNED", set())
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
    return dispatch.mx_linear_triton(x, w, s, b, act_elem=E4M3, hopper=True, fp8_mma=True)


def test_compile_error_turns_the_kernel_off_and_falls_back(fresh_state):
    """A Gluon kernel that does not compile: one warning naming it and the reason, the same call
    answered by the next kernel in dispatch order, and no second attempt in this process."""
    fresh_state.setattr(gluon_api, "PROBLEM", None)  # as if the API probe had passed
    tries = []

    def broken(*args, **kwargs):
        tries.append(1)
        raise PTXASError("ptxas fatal: unknown instruction 'wgmma.fence.sync.aligned'")

    fresh_state.setattr(WS, "mx_decode_gemm_ws", broken)
    x, w, s, b = _problem(3, 72, 256, seed=11)  # W8A8, M <= 16, K % 128 == 0: the decode_ws shape
    assert dispatch._use_ws(3, 256, 32, True)
    with pytest.warns(RuntimeWarning, match=r"gemm_decode_ws does not compile .*PTXASError.*unknown instruction"):
        y = _hopper_call(x, w, s, b)
    ref = mx_linear_reference(x.float(), w, s, b.float(), act_elem=E4M3)
    torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=1e-2)
    assert "gemm_decode_ws" in gluon_api.DISABLED and not dispatch._use_ws(3, 256, 32, True)
    x2 = _problem(5, 40, 128, seed=12)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        y2 = _hopper_call(*x2)
    assert not _mxq_warnings(seen)  # no second warning, no second compile attempt
    torch.testing.assert_close(y2.float(), mx_linear_reference(x2[0].float(), x2[1], x2[2], x2[3].float(), act_elem=E4M3),
                               rtol=1e-2, atol=1e-2)  # fmt: skip
    assert len(tries) == 1


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
    x, w, s, b = _problem(4, 48, 384, seed=5)
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
