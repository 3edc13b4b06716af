"""Which ptxas Triton assembles our kernels with, and whether its wgmma code is safe to pipeline.

The MX GEMM feeds wgmma its left operand (the dequantized weight) from registers. When the K
loop keeps several wgmmas in flight, the next K step's dequant writes new values into registers
that a previous wgmma may still be reading. PTX leaves that hazard to the assembler, and ptxas
before CUDA 13.3 does not guard it (triton-lang/triton#9433: our zero-tile-start prefill loop
gave inf/garbage with ptxas 12.8, the one Triton 3.6 bundles; 13.3+ orders the register writes
after the matching ``wgmma.wait_group``). ``python tools/sass_dev.py --kernel gemm`` shows
it in the machine code on a CPU machine (``wgmma_register_hazards``).

So the GEMM dispatch uses the pipelined (async-wgmma) prefill loop only when the ptxas Triton
uses is 13.3 or newer, and otherwise the loop whose wgmmas ptxas serializes (slower; kernels/NOTES.md,
"GEMM: the wgmma register hazard and the pipelined prefill loop").

The ptxas choice is configuration, made once per process by ``configure_ptxas``: it points Triton
at a ptxas >= 13.3 from the ``nvidia-cuda-nvcc`` wheel (``pip install mxq[cuda]``) or ``$CUDA_HOME``
when the one Triton would use for sm_90 is older and the user has not chosen one through the
variable Triton reads for sm_90 (``sm90_ptxas_env``: ``TRITON_PTXAS_PATH`` up to Triton 3.6,
``TRITON_PTXAS_BLACKWELL_PATH`` from the release that assembles sm_90 with its newer bundled ptxas;
set it to Triton's bundled ptxas to keep that one), as setting that variable by hand would. Triton
3.9 bundles ptxas 13.4 for sm_90, so there nothing is changed. Importing mxq changes nothing; the
kernel modules call ``configure_ptxas`` before their first launch (``launch.Launch`` and the direct
launch sites) and ``wgmma_async_ok`` calls it before reading Triton's choice, so every kernel the
process compiles, and the dispatch's choice of loop, see the same ptxas. Code that compiles mxq's
kernels by other means (``tools/sass_dev.py``) calls it first.

``INTERPRET``: Triton runs the kernels through its CPU interpreter (``TRITON_INTERPRET=1``, the CPU
tests), read once here for every kernel module; no ptxas is involved then.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import subprocess

MIN_SAFE_PTXAS = (13, 3)
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def ptxas_version(path: str) -> tuple[int, int] | None:
    """(major, minor) of the ptxas at ``path``, None if it does not run."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def candidate_ptxas() -> list[str]:
    """ptxas binaries installed beside Triton's own: the nvidia-cuda-nvcc wheel, $CUDA_HOME."""
    found = []
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for sub in sorted(os.listdir(root), reverse=True) if os.path.isdir(root) else []:
            path = os.path.join(root, sub, "bin", "ptxas")
            if os.path.isfile(path):
                found.append(path)
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            found.append(os.path.join(os.environ[env], "bin", "ptxas"))
    return [p for p in found if os.path.isfile(p) and os.access(p, os.X_OK)]


def _sm90_knob():
    """Triton's knob descriptor for the ptxas it assembles sm_90 with (``get_ptxas(90)`` chooses
    between ``knobs.nvidia.ptxas`` and, in newer releases, ``ptxas_blackwell``); None without Triton."""
    try:
        from triton import knobs
        from triton.backends.nvidia.compiler import get_ptxas

        chosen = get_ptxas(90).path
        for name in ("ptxas", "ptxas_blackwell"):
            knob = type(knobs.nvidia).__dict__.get(name)
            if knob is not None and getattr(knobs.nvidia, name).path == chosen:
                return knob
        return type(knobs.nvidia).__dict__["ptxas"]
    except Exception:  # noqa: BLE001  (no CUDA backend, a release without these names, a missing binary)
        return None


def sm90_ptxas_env() -> str:
    """The environment variable through which Triton takes the ptxas it uses for sm_90."""
    return getattr(_sm90_knob(), "key", None) or "TRITON_PTXAS_PATH"


def prefer_fixed_ptxas() -> str | None:
    """Point Triton at a ptxas >= 13.3 if its own for sm_90 is older, none was chosen and one is
    installed; the path or None."""
    env = sm90_ptxas_env()
    if os.environ.get(env) or _async_ok(triton_ptxas()):
        return None
    for path in candidate_ptxas():
        version = ptxas_version(path)
        if version is not None and version >= MIN_SAFE_PTXAS:
            os.environ[env] = path
            return path
    return None


_CONFIGURED = False


def configure_ptxas() -> None:
    """Make this process's ptxas choice (module doc): ``prefer_fixed_ptxas`` on the first call,
    nothing under the interpreter or on later calls (cheap: the launch paths call it)."""
    global _CONFIGURED
    if not _CONFIGURED:
        _CONFIGURED = True
        if not INTERPRET:
            prefer_fixed_ptxas()


def triton_ptxas() -> str | None:
    """The ptxas Triton will use for sm_90 (its knob's variable, ``sm90_ptxas_env``, else the bundled one)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return get_ptxas(90).path
    except Exception:  # noqa: BLE001  (no CUDA backend, older Triton, a missing binary)
        return None


@functools.cache
def _async_ok(path: str | None) -> bool:
    version = ptxas_version(path) if path else None
    return version is not None and version >= MIN_SAFE_PTXAS


def wgmma_async_ok() -> bool:
    """Whether register-operand wgmmas may stay in flight across K steps (ptxas >= 13.3), for the
    ptxas this process compiles with (``configure_ptxas`` first)."""
    configure_ptxas()
    return _async_ok(triton_ptxas())
