"""The Gluon API the Hopper kernels are written for, and what happens where it is missing.

The warp-specialized kernels (``gemm_decode_ws``, ``gemm_prefill_ws``, ``attention_decode_ws``)
are written in Gluon (``triton.experimental.gluon``), an experimental API that changes between
Triton releases. Three calls are spelled differently by the releases mxq supports, and the kernels
call them through the names this module binds to the installed release's spelling:

=================  ===================================================  ==========================
this module        Triton 3.5-3.6                                       Triton 3.7+ (3.9 checked)
=================  ===================================================  ==========================
``cta_barrier``    ``gl.thread_barrier()``                              ``gl.barrier()``
``smem_view``      ``shared_memory_descriptor._reinterpret(d, s, l)``   ``.reinterpret(d, s, l)``
``tma_load``       ``tma.async_copy_global_to_shared(desc, c, b, r)``   ``tma.async_load(...)``
=================  ===================================================  ==========================

This module is the one place that imports Gluon. The kernel modules take ``gluon`` (the JIT),
``gl`` (the language), ``hopper`` (its sm_90 part: ``hopper.mbarrier``, ``hopper.tma``,
``hopper.warpgroup_mma``, ``hopper.warpgroup_mma_wait``, ``hopper.fence_async_shared``) and the
host ``TensorDescriptor`` from here, define their Gluon kernels only where ``HAVE_GLUON`` and put
``unavailable(name)`` in their place otherwise; ``ring_barriers`` / ``invalidate_ring`` are the
mbarriers of their TMA rings. Two guards keep a Triton with another Gluon API
from breaking mxq:

- at import, ``PROBLEM`` says why the kernels cannot be built with the installed Triton (None
  when the API they use is there; ``HAVE_GLUON``); the kernel modules then define nothing Gluon and dispatch
  takes the plain Triton kernels, with one warning on the first Hopper call (``note_unavailable``);
- at the first launch, a compile error of a Gluon kernel (``run_or_fall_back``) turns that kernel
  off for the process, warns once with the reason, and the same call runs on the next kernel in
  dispatch's order. Only Triton's own errors (compilation, ptxas) are caught: a wrong argument
  still raises.
"""

from __future__ import annotations

import warnings

from mxq.compat import installed

PROBLEM: str | None = None
try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia import hopper
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.errors import TritonError
except ImportError as e:  # no Triton, or one without Gluon (< 3.5)
    PROBLEM = f"Gluon is not importable ({e})"
    TritonError = gluon = gl = hopper = TensorDescriptor = None
else:

    def _either(obj, new: str, old: str):
        """``obj.new`` where this release has it, else ``obj.old`` (AttributeError if neither)."""
        return getattr(obj, new) if hasattr(obj, new) else getattr(obj, old)

    # what the kernels call that Gluon releases have renamed or removed
    _NEEDED = (
        ("gl.barrier / gl.thread_barrier", lambda: _either(gl, "barrier", "thread_barrier")),
        ("gl.warp_specialize", lambda: gl.warp_specialize),
        ("shared_memory_descriptor.reinterpret / ._reinterpret",
         lambda: _either(gl.shared_memory_descriptor, "reinterpret", "_reinterpret")),
        ("gl.NVMMASharedLayout.get_default_for", lambda: gl.NVMMASharedLayout.get_default_for),
        ("tma.async_load / tma.async_copy_global_to_shared",
         lambda: _either(hopper.tma, "async_load", "async_copy_global_to_shared")),
        ("mbarrier.expect", lambda: hopper.mbarrier.expect),
        ("hopper.warpgroup_mma", lambda: hopper.warpgroup_mma),
        ("hopper.warpgroup_mma_wait", lambda: hopper.warpgroup_mma_wait),
        ("hopper.fence_async_shared", lambda: hopper.fence_async_shared),
    )
    _missing = []
    for _name, _get in _NEEDED:
        try:
            _get()
        except AttributeError:
            _missing.append(_name)
    if _missing:
        PROBLEM = f"Triton {installed('triton')}'s Gluon has no {', '.join(_missing)}"

HAVE_GLUON = PROBLEM is None  # the Gluon API as the kernels spell it: their modules define them

cta_barrier = smem_view = tma_load = None  # the renamed calls (table above), bound where HAVE_GLUON
if HAVE_GLUON:
    # builtins under another name are still builtins to the JIT: a kernel calls ``cta_barrier()``,
    # ``smem_view(desc, dtype, shape, layout)`` and ``tma_load(desc, coord, barrier, dest)``
    cta_barrier = _either(gl, "barrier", "thread_barrier")
    smem_view = _either(gl.shared_memory_descriptor, "reinterpret", "_reinterpret")
    tma_load = _either(hopper.tma, "async_load", "async_copy_global_to_shared")

# kernel name -> why it stopped being used in this process (a compile error at its first launch)
DISABLED: dict[str, str] = {}
NEWER_API = HAVE_GLUON and not hasattr(gl, "thread_barrier")  # the right-hand column of the table above
WARNED: set[str] = set()  # what has been warned about once ("import", kernel names)


if HAVE_GLUON:

    @gluon.jit
    def ring_barriers(STAGES: gl.constexpr, EMPTY_COUNT: gl.constexpr = 1):
        """The mbarriers of a STAGES-deep TMA ring, allocated and initialized: ``ready`` (a stage's
        TMA bytes have landed; one arrival, the loader's ``expect``) and ``empty`` (EMPTY_COUNT
        consumers have released the stage)."""
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], hopper.mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], hopper.mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            hopper.mbarrier.init(ready.index(s), count=1)
            hopper.mbarrier.init(empty.index(s), count=EMPTY_COUNT)
        return ready, empty

    @gluon.jit
    def invalidate_ring(ready, empty, STAGES: gl.constexpr):
        """``ring_barriers``' mbarriers invalidated, at the end of the kernel."""
        for s in gl.static_range(STAGES):
            hopper.mbarrier.invalidate(ready.index(s))
            hopper.mbarrier.invalidate(empty.index(s))


def unavailable(name: str):
    """What a kernel module puts in place of its Gluon kernel where ``HAVE_GLUON`` is false: a
    function that raises (dispatch never calls it: ``usable`` is false there)."""

    def stub(*args, **kwargs):  # pragma: no cover
        raise RuntimeError(f"{name} needs Gluon (triton >= 3.5)")

    return stub


def usable(name: str) -> bool:
    """The Gluon kernel ``name`` may be dispatched: the API is there and it has not failed to compile."""
    return PROBLEM is None and name not in DISABLED


def note_unavailable() -> None:
    """One warning per process when a Hopper call finds the Gluon kernels unavailable."""
    if PROBLEM is not None and "import" not in WARNED:
        WARNED.add("import")
        warnings.warn(
            f"mxq: the Hopper kernels are off ({PROBLEM}); the plain Triton kernels run instead (slower). "
            f"Triton 3.6 has the API they are written for.",
            RuntimeWarning,
            stacklevel=3,
        )


def run_or_fall_back(name: str, run, fall_back):
    """``run()``; if the Gluon kernel ``name`` does not compile with this Triton, turn it off for the
    process, warn once naming the reason, and return ``fall_back()`` instead."""
    try:
        return run()
    except Exception as e:
        if TritonError is None or not isinstance(e, TritonError):
            raise
        reason = " ".join(str(e).split())[-300:] or type(e).__name__
        DISABLED[name] = f"{type(e).__name__}: {reason}"
        if name not in WARNED:
            WARNED.add(name)
            warnings.warn(
                f"mxq: {name} does not compile with Triton {installed('triton')} ({DISABLED[name]}); "
                f"using the next kernel in dispatch order",
                RuntimeWarning,
                stacklevel=3,
            )
        return fall_back()


__all__ = [
    "DISABLED", "HAVE_GLUON", "NEWER_API", "PROBLEM", "WARNED", "TensorDescriptor",
    "cta_barrier", "gl", "gluon", "hopper", "invalidate_ring", "note_unavailable", "ring_barriers",
    "run_or_fall_back", "smem_view", "tma_load", "unavailable", "usable",
]  # fmt: skip
