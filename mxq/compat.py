"""What depends on a transformers or Triton release, in one place.

mxq runs on the releases CI tests: the pinned ones (``.ci/constraints.txt``: transformers 5.17,
Triton 3.6, the GPU machine's) and the latest pip resolves (transformers 5.24, Triton 3.9 when this
was written). Where those releases differ, mxq probes for the feature and does not compare version
numbers, with one exception: the argument list of Triton's C launcher, which only the release tells
(``direct_launch_abi``). Each behaviour, the releases checked, and where mxq handles it:

transformers
  - ``LOADED_MARK``: every tensor transformers sets from the checkpoint carries
    ``_is_hf_initialized`` (5.17-5.24). The load check (``mxq.hf.quantizer``) reads it through
    ``was_loaded`` to find entries no file wrote; a release without the mark is said, not trusted.
  - ``experts_gate``: a family's experts class computes its gate in ``_apply_gate`` (private; 5.17-5.24).
    transformers documents ``ExpertsInterface`` for other experts kernels, but a function registered
    there runs on the family's own parameters, and ``MXExperts`` holds fp8 codes and E8M0 scales of
    other shapes and dtypes; so the module is swapped (``mxq.runtime.experts``) and only the gate is
    borrowed, through this function.
  - ``mask_overrides``: the mask table's local overrides (``_local_mapping``, private; 5.17-5.24),
    where the graph decoder puts a mask built on the device (``mxq.runtime.decode``).
  - ``update_weight_conversions``: 5.17 passes the conversions, 5.23+ also the model; the
    quantizer hands whatever arrives to its base class (``conversion_hook_takes_model`` says which).
  - Per-expert scales: the family conversion that stacks ``experts.N.*`` carries the ``.weight_scale``
    suffix in 5.17, not in 5.24; mxq reads every per-expert naming itself, the same on both
    (``mxq.hf.quantizer``).
  - Routers: 5.17 with a quantizer leaves a router it renames while loading in the checkpoint's dtype;
    the quantizer casts routers to the model's dtype on every release (a no-op where it is right).
  - ``generate()`` reads the finished flags on the host every step, except on ``mps`` (5.17), so its
    host time adds to every step of a graph-captured forward (BENCHMARKS.md, ``generate`` rows).

Triton
  - ``direct_launch_abi``: the C launcher's argument list, 3.5-3.6 and 3.9 known; other releases
    launch through the JIT (``mxq.kernels.launch``).
  - Gluon's spellings of three calls (3.5-3.6 against 3.7+): bound by probing in
    ``kernels/gluon_api.py``, the one place that imports Gluon.
  - The sm_90 assembler: Triton 3.6 takes it from ``TRITON_PTXAS_PATH``, 3.9 from
    ``TRITON_PTXAS_BLACKWELL_PATH`` (it bundles ptxas 13.4 for sm_90 there); probed from
    ``triton.knobs`` in ``kernels/toolchain.py``.
  - The interpreter (``TRITON_INTERPRET=1``, 3.6) computes a bf16 ``tl.dot`` wrongly: the kernels keep
    the dot's dtype a constexpr (``kernels/common.py``).

``tests/test_compat.py`` checks every probe against this table for the installed releases, in both
CI environments: a release that changes one fails there, by name. Importing this module loads neither
transformers nor Triton.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

# releases CI runs (major, minor): the pinned environment and the latest checked
CHECKED = {"transformers": ((5, 17), (5, 24)), "triton": ((3, 6), (3, 9))}
LOADED_MARK = "_is_hf_initialized"


def installed(package: str) -> str | None:
    """The installed release of ``package`` (from its metadata; nothing is imported), or None."""
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def release(text: str | None) -> tuple[int, int] | None:
    """(major, minor) of a version string such as ``3.6.1+git7f3a``; None where it has no two numbers."""
    nums = [int(n) for n in (text or "").split("+")[0].split(".")[:2] if n.isdigit()]
    return (nums[0], nums[1]) if len(nums) == 2 else None


def versions() -> dict[str, str | None]:
    """The releases a record or a message names."""
    return {p: installed(p) for p in ("torch", "triton", "transformers")}


def direct_launch_abi(text: str | None = None) -> int:
    """Which argument list the compiled-kernel C launcher of Triton ``text`` (default: the installed
    one) takes, as ``mxq.kernels.launch.RawLauncher`` passes it: 1 (3.5-3.6: function, cooperative,
    PDL, two scratch buffers, packed metadata, launch metadata, two hooks, then the kernel's arguments
    one by one), 2 (3.9: function, cooperative, PDL, packed metadata, launch metadata, two hooks, two
    scratch buffers, the argument annotations and kernel signature, then the kernel's arguments as one
    tuple), 0 for a release not checked on a GPU, where every launch goes through the JIT (correct;
    more host time per eager call)."""
    r = release(installed("triton") if text is None else text)
    if r is None:
        return 0
    return 1 if (3, 5) <= r < (3, 7) else 2 if r == (3, 9) else 0


def was_loaded(tensor) -> bool:
    """Whether transformers set ``tensor`` from the checkpoint (``LOADED_MARK``)."""
    return bool(getattr(tensor, LOADED_MARK, False))


def experts_gate(cls: type):
    """The gate function of a transformers experts class (``_apply_gate``), or None where it has none."""
    return getattr(cls, "_apply_gate", None)


def mask_overrides(table) -> dict | None:
    """The dict of local overrides of transformers' mask table, or None where this release has none."""
    local = getattr(table, "_local_mapping", None)
    return local if isinstance(local, dict) else None


def conversion_hook_takes_model() -> bool:
    """Whether this transformers passes the model to ``HfQuantizer.update_weight_conversions`` (5.23+)."""
    import inspect

    from transformers.quantizers.base import HfQuantizer

    return "model" in inspect.signature(HfQuantizer.update_weight_conversions).parameters
