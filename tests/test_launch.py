"""mxq.kernels.launch: direct launches of a compiled kernel (CPU: a recorded stand-in for the JIT)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

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
    monkeypatch.setattr(L, "_driver", SimpleNamespace(active=drv))


def test_launch_goes_direct_after_the_first_call(fast):
    fn = FakeJIT(["x", "y", "n", "BLOCK", "FLAG"])
    go = L.Launch(fn, {"FLAG": True, "BLOCK": 64}, {"num_warps": 4})
    go((3,), "X", "Y", 7)
    assert fn.jit_calls == [((3,), ("X", "Y", 7), {"FLAG": True, "BLOCK": 64, "num_warps": 4})] and not fn.runs
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
    assert [c[1] for c in fn.jit_calls] == [("a",), ("b",)] and not fn.runs
    monkeypatch.setattr(L, "FAST", False)
    go((1,), "c")
    assert len(fn.jit_calls) == 3 and not fn.runs


def test_launch_needs_constexprs_last():
    with pytest.raises(ValueError, match="must be the last parameters"):
        L.Launch(FakeJIT(["x", "C", "y"]), {"C": 1})


def test_host_integer_helpers_match_triton():
    rnd = random.Random(5)
    for v in [0, 1, 2, 3, 15, 16, 17, 31, 32, 1000, 4096] + [rnd.randrange(1, 10**6) for _ in range(50)]:
        assert L.next_pow2(v) == triton.next_power_of_2(v)
        for b in (1, 3, 16, 32, 128):
            assert L.cdiv(v, b) == triton.cdiv(v, b)
    assert L.int_classes(1, 16, 48, 7, 2**31, 2**35 + 1) == (1, 16, 16, 0, 16 + 64, 64)
