"""mxq.kernels.launch: direct launches of a compiled kernel (CPU: a recorded stand-in for the JIT)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

triton = pytest.importorskip("triton")

from mxq.kernels import launch as L  # noqa: E402


class FakeJIT:
    """What Launch uses of a JITFunction: arg_names, fn[grid](...) returning the compiled kernel
    whose ``run`` takes (grid, stream, function, metadata, launch_metadata, hooks, *args)."""

    def __init__(self, names):
        self.arg_names = names
        self.__name__ = "fake_kernel"
        self.jit_calls, self.runs = [], []
        self.kernel = SimpleNamespace(function="fn", packed_metadata="meta", run=self._run)

    def _run(self, *a):
        self.runs.append(a)

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.jit_calls.append((grid, args, kwargs))
            return self.kernel

        return call


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(L, "FAST", True)
    monkeypatch.setattr(L, "CHECK", False)
    drv = SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda dev: 1234)
    monkeypatch.setattr(L, "driver", SimpleNamespace(active=drv))


def test_launch_goes_direct_after_the_first_call(fast):
    fn = FakeJIT(["x", "y", "n", "BLOCK", "FLAG"])
    go = L.Launch(fn, {"FLAG": True, "BLOCK": 64}, {"num_warps": 4})
    go((3,), "X", "Y", 7)
    assert fn.jit_calls == [((3,), ("X", "Y", 7, 64, True), {"num_warps": 4})] and not fn.runs
    go((5, 2), "X2", "Y2", 9)
    # grid padded to 3-D, the current stream, no launch metadata or hooks, constexprs in signature order
    assert fn.runs == [(5, 2, 1, 1234, "fn", "meta", None, None, None, "X2", "Y2", 9, 64, True)]
    assert len(fn.jit_calls) == 1


def test_launch_takes_the_jit_with_hooks_or_when_off(fast, monkeypatch):
    fn = FakeJIT(["x", "C"])
    go = L.Launch(fn, {"C": 1})
    go((1,), "a")
    hook = lambda *a: None  # noqa: E731  (a profiler's launch hook)
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        go((1,), "b")
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    assert [c[1] for c in fn.jit_calls] == [("a", 1), ("b", 1)] and not fn.runs
    monkeypatch.setattr(L, "FAST", False)
    go((1,), "c")
    assert len(fn.jit_calls) == 3 and not fn.runs


def test_launch_runtime_parameters_among_constexprs(fast):
    fn = FakeJIT(["x", "C", "y", "D"])
    go = L.Launch(fn, {"D": 2, "C": 1})
    go((1,), "a", "b")
    go((1,), "a2", "b2")
    assert fn.jit_calls == [((1,), ("a", 1, "b", 2), {})]
    assert fn.runs[0][-4:] == ("a2", 1, "b2", 2)
    with pytest.raises(ValueError, match="no parameters named"):
        L.Launch(fn, {"E": 1})


def test_call_keys_on_what_triton_specializes(fast, monkeypatch):
    """``call`` reuses a Launch while dtypes, 16-byte alignment, integer classes, constexprs and
    options stay the same, and takes a new one when any of them changes."""
    monkeypatch.setattr(L, "CALLS", L.PlanCache())
    fn = FakeJIT(["p", "n", "s", "B"])
    t = torch.zeros(64)
    L.call(fn, (1,), (t, 32, 0.5), {"B": 8}, num_warps=4)
    L.call(fn, (2,), (torch.ones(64), 48, 1.5), {"B": 8}, num_warps=4)  # same classes: direct
    assert len(fn.jit_calls) == 1 and len(fn.runs) == 1
    for args, consts, opts in [
        ((t, 1, 0.5), {"B": 8}, {"num_warps": 4}),  # n == 1
        ((t, 33, 0.5), {"B": 8}, {"num_warps": 4}),  # n not a multiple of 16
        ((t[1:], 32, 0.5), {"B": 8}, {"num_warps": 4}),  # misaligned pointer
        ((t.half(), 32, 0.5), {"B": 8}, {"num_warps": 4}),  # dtype
        ((t, 32, 0.5), {"B": 16}, {"num_warps": 4}),  # constexpr
        ((t, 32, 0.5), {"B": 8}, {"num_warps": 8}),  # option
        ((t, 2**33, 0.5), {"B": 8}, {"num_warps": 4}),  # 64-bit integer
    ]:
        L.call(fn, (1,), args, consts, **opts)
    assert len(fn.jit_calls) == 8 and len(L.CALLS) == 8
    assert L.arg_spec(None) is None and L.arg_spec(True) is True and L.arg_spec(2.0) is float
    with pytest.raises(TypeError, match="no specialization rule"):
        L.arg_spec("text")


def test_host_integer_helpers_match_triton():
    rnd = random.Random(5)
    for v in [0, 1, 2, 3, 15, 16, 17, 31, 32, 1000, 4096] + [rnd.randrange(1, 10**6) for _ in range(50)]:
        assert L.next_pow2(v) == triton.next_power_of_2(v)
        for b in (1, 3, 16, 32, 128):
            assert L.cdiv(v, b) == triton.cdiv(v, b)
    assert [L.arg_spec(v) for v in (1, 16, 48, 7, 0, 2**31, 2**35 + 1)] == [1, 16, 16, 0, 16, 16 + 64, 64]
