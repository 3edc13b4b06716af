"""Repeat launches of a compiled Triton or Gluon kernel without the JIT's per-call work.

An eager decode step launches a few kernels per layer on tiny grids, so host time, not GPU
time, sets its speed. ``fn[grid](...)`` spends most of a call on the host: argument binding and specialization,
cache-key hashing, device and stream queries, launch metadata for the hooks, and the launcher
itself (figures: ``kernels/NOTES.md``, "Launch: eager host cost").

``Launch`` is one call site's launch with everything Triton specializes on held fixed: the
constexprs and compile options it is built with, and -- the caller's duty -- the dtypes and
16-byte alignment of its tensors, the ``== 1`` / ``% 16`` classes of its integers and the
descriptors' block shapes and layouts, which callers fold into the *plan key* under which they
keep the ``Launch``. The first call goes through the JIT (compiling if needed) and keeps the
compiled kernel; later calls hand the arguments straight to its launcher.

``call(fn, grid, args, consts, **options)`` needs no plan: it finds its ``Launch`` by each
argument's specialization class (``arg_spec``), the constexprs and the options (``CALLS``), for
launch sites whose shapes vary call to call.

``MXQ_DEBUG=launch-check`` makes every direct launch also run Triton's binder and raise if it would
have chosen another compiled kernel (the GPU tests run with it). ``FAST = False`` (tests, A/B
timings) sends every call through the JIT. The interpreter (``TRITON_INTERPRET=1``) and Triton
releases whose launcher takes other arguments (``direct_launch_abi``) always take the JIT path.
A call through the JIT first makes the process's ptxas choice
(``toolchain.configure_ptxas``), before Triton compiles anything.

Which device: Triton launches on the *current* CUDA device and its current stream, whatever
device the tensors are on, and a compiled kernel's function handle belongs to the device it was
loaded on. A model split over GPUs (accelerate's ``device_map``: its hooks move the hidden
states from layer to layer and leave the current device alone) calls the kernels with tensors on
cuda:1 while cuda:0 is current; launched there, a kernel reads cuda:1's memory from cuda:0
(peer access), unordered with the stream that wrote it. So the kernel modules' host entry points
are wrapped in ``on_input_device`` (their first tensor's device made current for the call), and
the launches that skip those (``Launch.on_device``, the decode lanes) switch by the device index
they hold; both switch only when another device is current (one device query per call
otherwise). Plans and ``call``'s launches are kept per device.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import Tensor as _Tensor

from mxq import settings
from mxq.compat import direct_launch_abi
from mxq.kernels.toolchain import INTERPRET, configure_ptxas

ABI = direct_launch_abi()  # the installed Triton's launcher (0: none, or a release no GPU run checked)
FAST = not INTERPRET and ABI > 0
CHECK = settings.debug("launch-check")

try:
    from triton import knobs as _knobs
    from triton.runtime import driver
    from triton.runtime.jit import compute_cache_key as _cache_key
except ImportError:  # pragma: no cover - no triton: the dispatch never builds a Launch
    _knobs = driver = _cache_key = None
try:  # the CUDA launcher's own expansion of a host tensor descriptor (Triton 3.5+)
    from triton.backends.nvidia import driver as _nv_driver
except ImportError:  # pragma: no cover
    _nv_driver = None


# The current CUDA device's index: torch's own query, without ``torch.cuda.current_device``'s
# lazy-initialization check (only asked where a CUDA tensor exists, so CUDA is initialized).
current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def on_input_device(fn):
    """``fn(x, ...)`` run with ``x``'s CUDA device current (module doc, "Which device"), switching
    only when another device is current; a CPU tensor's call runs as it is."""

    @functools.wraps(fn)
    def run(x, *args, **kwargs):
        index = x.get_device()
        if index < 0 or index == current_device():
            return fn(x, *args, **kwargs)
        with torch.cuda.device(index):
            return fn(x, *args, **kwargs)

    return run


def cdiv(a: int, b: int) -> int:
    """Host-side ceil(a / b) (``triton.cdiv`` is a constexpr function: ~2 µs a call on the host)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Host-side ``triton.next_power_of_2``."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def descriptor(cls, base, shape: list, strides: list, block_shape: list, layout=None):
    """A host TMA descriptor; past the JIT (``FAST``, not ``CHECK``) built without the dataclass's
    checks (~4 µs), which the plan that calls this has made once for these shapes and strides."""
    if not FAST or CHECK:
        return cls(base, shape, strides, block_shape, layout) if layout is not None else cls(
            base, shape, strides, block_shape
        )
    d = object.__new__(cls)
    d.base, d.shape, d.strides, d.block_shape, d.padding = base, shape, strides, block_shape, "zero"
    d.round_f32_to_tf32 = False  # Triton 3.9's descriptors carry it (read when expanded)
    if layout is not None:
        d.layout = layout
    return d


def hooks_attached() -> bool:
    rt = _knobs.runtime
    return bool(getattr(rt.launch_enter_hook, "calls", rt.launch_enter_hook)) or bool(
        getattr(rt.launch_exit_hook, "calls", rt.launch_exit_hook)
    )


def stream_getter():
    """Triton's function from a CUDA device index to its raw current stream (what launches take),
    looked up once by callers that launch often."""
    return driver.active.get_current_stream


def nv_tensordesc_arg(desc, meta) -> list:
    """A host tensor descriptor as the CUDA launcher takes it (Triton's ``make_tensordesc_arg``; Triton
    3.9's takes a third argument that the CUDA backend does not read)."""
    return _nv_driver.make_tensordesc_arg(desc, meta, None) if ABI == 2 else _nv_driver.make_tensordesc_arg(desc, meta)


def tma_fill_args(meta) -> tuple:
    """(the tiled-descriptor fill function, swizzle, element size, host dtype enum, block shape) for a
    descriptor position's metadata: ``fill(ptr, *rest, shape, strides, padding)`` encodes what
    ``make_tensordesc_arg`` encodes for a zero-padded, non-fp4 descriptor (Triton 3.9 names the
    function ``fill_tma_descriptor_tiled``, 3.6 ``fill_tma_descriptor``)."""
    utils = driver.active.utils
    fill = getattr(utils, "fill_tma_descriptor_tiled", None) or utils.fill_tma_descriptor
    return (fill, meta["swizzle"], meta["elem_size"], _nv_driver.TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]],
            meta["block_size"])  # fmt: skip


class RawLauncher:
    """A compiled kernel's C launcher called without Triton's Python around it: the launcher
    object's call (two scratch allocations of size 0) and the loop that expands host tensor
    descriptors, which visits every argument (``wrap_handle_tensordesc``). ``descs`` are the
    descriptor arguments' positions and their metadata; ``expand`` turns those, and only those,
    into what the C launcher takes, with Triton's own ``make_tensordesc_arg``. ``head`` is
    everything after the grid and the stream and before the kernel's arguments, in the order of
    the release's launcher (``direct_launch_abi``): function, cooperative, PDL, metadata, hooks
    (none), scratch buffers (none), and on Triton 3.9 the argument annotations and kernel signature.
    ``go`` launches with the arguments expanded; ``packed``: the launcher takes them as one tuple."""

    __slots__ = ("launch", "head", "descs", "packed")

    def __init__(self, launch, head: tuple, descs: tuple, packed: bool = False):
        self.launch, self.head, self.descs, self.packed = launch, head, descs, packed

    def go(self, g0: int, g1: int, g2: int, stream: int, args: tuple) -> None:
        """Launch with ``args``, the kernel's arguments with their descriptors already expanded."""
        if self.packed:
            self.launch(g0, g1, g2, stream, *self.head, args)
        else:
            self.launch(g0, g1, g2, stream, *self.head, *args)

    def expand(self, args) -> tuple:
        if not self.descs:
            return args
        out = list(args)
        for i, meta in reversed(self.descs):
            out[i : i + 1] = nv_tensordesc_arg(out[i], meta)
        return tuple(out)

    def __call__(self, g0: int, g1: int, g2: int, stream: int, *args) -> None:
        self.go(g0, g1, g2, stream, self.expand(args))


def raw_launcher(kernel) -> RawLauncher | None:
    """``kernel``'s C launcher as a ``RawLauncher``, or None where its launcher is not the CUDA one
    this reads (another backend or Triton release, a stand-in in tests), needs scratch memory or
    runs under Triton 3.9's sanitizer."""
    try:
        run = kernel.run
        if ABI == 0 or run.global_scratch_size or run.profile_scratch_size or getattr(run, "gsan_enabled", False):
            return None
        fn, descs = run.launch, ()
        if getattr(fn, "__closure__", None):  # wrap_handle_tensordesc's ``inner``: the C launch inside
            cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__)))
            if "tensordesc_indices" in cells:  # Triton 3.5-3.6: the descriptors' positions
                idx = sorted(cells["tensordesc_indices"])
            else:  # Triton 3.9: paths into the (possibly nested) signature; only top-level ones here
                paths = cells["relevant_paths"]
                if any(paths.values()):
                    return None
                idx = sorted(paths)
            fn = cells["launcher"]
            metas = cells["tensordesc_meta"] or [None] * len(idx)
            if len(metas) != len(idx):
                return None
            descs = tuple(zip(idx, metas))
        if not callable(fn) or getattr(fn, "__closure__", None) or _nv_driver is None:
            return None
        if ABI == 2:
            head = (kernel.function, run.launch_cooperative_grid, run.launch_pdl, kernel.packed_metadata, None, None,
                    None, None, None, run.arg_annotations, run.kernel_signature)  # fmt: skip
            return RawLauncher(fn, head, descs, packed=True)
        head = (kernel.function, run.launch_cooperative_grid, run.launch_pdl, None, None, kernel.packed_metadata,
                None, None, None)  # fmt: skip
        return RawLauncher(fn, head, descs)
    except Exception:  # noqa: BLE001 - anything unexpected: Triton's own launcher
        return None


class Launch:
    """``fn[grid](*args, **consts, **options)`` for one plan; see the module docstring.

    ``args`` are the kernel's runtime parameters in signature order, passed positionally;
    ``consts`` the constexpr parameters by name; ``options`` the compile options (``num_warps``,
    ``maxnreg``, ``launch_pdl``, ...).
    """

    __slots__ = ("fn", "consts", "options", "tail", "template", "slots", "kernel", "raw", "stream")

    def __init__(self, fn, consts: dict, options: dict | None = None):
        self.fn = fn
        consts = dict(consts)
        params = getattr(fn, "params", None)
        if params is not None:  # constexprs left at their defaults
            for p in params:
                if p.is_constexpr and p.name not in consts and p.default is not inspect.Parameter.empty:
                    consts[p.name] = p.default
        elif callable(getattr(fn, "fn", None)):  # the interpreter's function: constexprs by their annotation
            for name, p in inspect.signature(fn.fn).parameters.items():
                ann = p.annotation
                const = ann.endswith("constexpr") if isinstance(ann, str) else getattr(ann, "__name__", "") == "constexpr"
                if const and name not in consts and p.default is not inspect.Parameter.empty:
                    consts[name] = p.default
        self.consts = consts
        self.options = options or {}
        names = fn.arg_names
        unknown = sorted(set(consts) - set(names))
        if unknown:
            raise ValueError(f"Launch({fn.__name__}): no parameters named {unknown}")
        slots = [i for i, n in enumerate(names) if n not in consts]
        if slots == list(range(len(slots))):  # constexprs last: arguments + a fixed tail
            self.tail, self.template, self.slots = tuple(consts[n] for n in names[len(slots) :]), None, None
        else:  # runtime parameters among the constexprs: fill a template
            self.tail, self.template, self.slots = (), [consts.get(n) for n in names], slots
        self.kernel = self.raw = self.stream = None

    def _full(self, args) -> tuple:
        if self.template is None:
            return (*args, *self.tail)
        full = list(self.template)
        for i, a in zip(self.slots, args):
            full[i] = a
        return tuple(full)

    def __call__(self, grid: tuple[int, ...], *args) -> None:
        k = self.kernel
        full = self._full(args)
        if k is None or not FAST or hooks_attached():
            configure_ptxas()
            k = self.fn[grid](*full, **self.options)
            if FAST and not hasattr(k, "result"):
                self.kernel, self.raw = k, raw_launcher(k)
            return
        if CHECK:
            self._check(full)
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        dev = driver.active.get_current_device()
        if self.raw is not None:
            self.raw(grid[0], g1, g2, driver.active.get_current_stream(dev), *full)
            return
        k.run(grid[0], g1, g2, driver.active.get_current_stream(dev), k.function, k.packed_metadata,
              None, None, None, *full)  # fmt: skip

    def on_device(self, grid: tuple[int, ...], dev_index: int, *args) -> None:
        """``self(grid, *args)`` for a caller that holds its tensors' device index (-1: not a CUDA
        device, the interpreter), with that device current (switched to for the call where another
        is: module doc, "Which device"): past the first call the compiled kernel's C launcher
        directly, without the argument template or the descriptor walk (kernels whose arguments
        are all in signature order, no host descriptors); anything else through ``__call__``."""
        if dev_index >= 0 and dev_index != current_device():
            with torch.cuda.device(dev_index):
                self.on_device(grid, dev_index, *args)
            return
        raw = self.raw
        if raw is None or raw.descs or CHECK or self.template is not None or hooks_attached():
            self(grid, *args)
            return
        if self.stream is None:
            self.stream = stream_getter()
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        raw.go(grid[0], g1, g2, self.stream(dev_index), (*args, *self.tail))

    def _check(self, args) -> None:
        """Raise unless Triton's own binder picks the kernel this Launch holds for ``args`` (all
        parameters, in signature order)."""
        dev = driver.active.get_current_device()
        kernel_cache, key_cache, _, _, binder = self.fn.device_caches[dev]
        kw = dict(self.options)  # as JITFunction.run completes them
        kw["debug"] = kw.get("debug", self.fn.debug) or _knobs.runtime.debug
        kw["instrumentation_mode"] = _knobs.compilation.instrumentation_mode
        if hasattr(_knobs.compilation, "fpsan_homomorphic_casts"):  # Triton 3.9 adds it
            kw["fpsan_homomorphic_casts"] = _knobs.compilation.fpsan_homomorphic_casts
        _, spec, opts = binder(*args, **kw)
        if kernel_cache.get(_cache_key(key_cache, spec, opts)) is not self.kernel:
            raise RuntimeError(
                f"Launch({self.fn.__name__}): the plan key missed a specialization (Triton would "
                f"choose another compiled kernel for these arguments): {spec}"
            )


def arg_spec(a):
    """What Triton specializes a runtime argument on (tensors: dtype and 16-byte alignment;
    integers: 1 (== 1), 16 (divisible by 16) or 0, plus 64 beyond 32 bits; floats: none; host
    TMA descriptors: dtype, block shape, layout)."""
    if isinstance(a, _Tensor):
        return a.dtype, a.data_ptr() & 15 == 0
    t = type(a)
    if t is int:
        return (1 if a == 1 else 16 if a % 16 == 0 else 0) + (0 if -(2**31) <= a < 2**31 else 64)
    if t is float:
        return float
    if a is None or t is bool:
        return a
    if hasattr(a, "block_shape"):
        return a.base.dtype, tuple(a.block_shape), getattr(a, "layout", None), a.padding
    raise TypeError(f"arg_spec: no specialization rule for {t.__name__}")


def call(fn, grid: tuple[int, ...], args: tuple, consts: dict, **options) -> None:
    """``fn[grid](*args, **consts, **options)``, through a ``Launch`` found by the arguments'
    specializations (``arg_spec``), the constexprs and the options: no plan needed at the call
    site, ~half the host time of the JIT's launch for a kernel with ~45 arguments."""
    if not FAST:
        Launch(fn, consts, options)(grid, *args)
        return
    key = (fn, driver.active.get_current_device(), tuple(consts.items()), tuple(options.items()),
           tuple(map(arg_spec, args)))  # fmt: skip
    go = CALLS.get(key)
    if go is None:
        go = CALLS.put(key, Launch(fn, consts, options))
    go(grid, *args)


class PlanCache(dict):
    """Plans by key, at most ``limit`` of them (cleared when full: shapes of one model are few)."""

    def __init__(self, limit: int = 4096):
        super().__init__()
        self.limit = limit

    def put(self, key, plan):
        if len(self) >= self.limit:
            self.clear()
        self[key] = plan
        return plan


CALLS = PlanCache()  # call()'s launches
