"""mxq's environment variables: read here and nowhere else (a test holds it). Four, for users:

- ``MXQ_KERNELS``: the kernels where a call names none (``auto``, ``reference`` or registry
  names joined by commas; ``mxq.kernels.registry.default_kernels``). Read at each call.
- ``MXQ_CACHE``: the folder of mxq's caches, else ``$XDG_CACHE_HOME/mxq``, else ``~/.cache/mxq``:
  ``tune.json`` (``mxq tune``'s decode tiles), ``cpu/`` (the compiled CPU kernels), ``ppl/`` (the
  eval harness's results), ``gguf/`` (GGUF models, the embedded default among them, saved as
  transformers dequantizes them: later loads skip the slow GGUF parse). ``off`` (or ``none``, ``0``, ``false``, ``no``): tuned tiles are not read, results are not
  cached, and the CPU kernels are built in a temporary folder of the process.
- ``MXQ_CPU_KERNELS=0``: no compiled C kernels on the CPU (the torch reference, slower).
- ``MXQ_DEBUG``: developer switches, comma-separated: ``launch-check`` (every direct kernel launch
  also runs Triton's binder and raises on a difference; slow), ``no-lanes`` (an eager ``MXLinear``
  call on a GPU goes through the registry, not its lane; A/B timings). Read at import.

Importing this module imports neither torch nor transformers.
"""

from __future__ import annotations

import functools
import os
import tempfile
import warnings
from pathlib import Path

__all__ = ["KERNELS", "CACHE", "CPU_KERNELS", "DEBUG", "VARIABLES", "DEBUG_FLAGS", "OFF",
           "kernels", "cache_dir", "cpu_kernels", "debug", "cache_key_environment"]  # fmt: skip

KERNELS = "MXQ_KERNELS"
CACHE = "MXQ_CACHE"
CPU_KERNELS = "MXQ_CPU_KERNELS"
DEBUG = "MXQ_DEBUG"
VARIABLES = (KERNELS, CACHE, CPU_KERNELS, DEBUG)
DEBUG_FLAGS = {
    "launch-check": "every direct kernel launch also runs Triton's binder and raises on a difference",
    "no-lanes": "eager MXLinear calls on a GPU go through the registry, not their lanes",
}
OFF = ("off", "none", "0", "false", "no")


def kernels() -> str | None:
    """``$MXQ_KERNELS``, or None where unset or empty."""
    return os.environ.get(KERNELS, "").strip() or None


def _cache_root(ignore_off: bool = False) -> Path | None:
    env = os.environ.get(CACHE, "").strip()
    if env.lower() in OFF:
        if not ignore_off:
            return None
        env = ""
    if env:
        return Path(env).expanduser()
    base = os.path.expanduser(os.environ.get("XDG_CACHE_HOME", "").strip())
    return (Path(base) if base and os.path.isabs(base) else Path.home() / ".cache") / "mxq"


def cache_dir(kind: str | None = None, ignore_off: bool = False) -> Path | None:
    """The cache folder (module doc), or its ``kind`` entry (``"tune.json"``, ``"cpu"``, ``"ppl"``);
    None with ``MXQ_CACHE=off`` unless ``ignore_off`` (where to write when a user asks to)."""
    root = _cache_root(ignore_off)
    if root is None:
        return None
    return root / kind if kind else root


@functools.cache
def _process_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="mxq-cpu-"))


def cpu_build_dir() -> Path:
    """Where the CPU kernels are built: ``cache_dir("cpu")``, or with ``MXQ_CACHE=off`` a temporary
    folder of this process."""
    return cache_dir("cpu") or _process_dir()


def cpu_kernels() -> bool:
    """False with ``MXQ_CPU_KERNELS=0``."""
    return os.environ.get(CPU_KERNELS, "1").strip() != "0"


def debug(flag: str) -> bool:
    """Whether ``$MXQ_DEBUG`` names ``flag`` (one of ``DEBUG_FLAGS``); an unknown name warns once."""
    if flag not in DEBUG_FLAGS:
        raise ValueError(f"mxq.settings.debug: unknown flag {flag!r}; known: {', '.join(DEBUG_FLAGS)}")
    return flag in _debug_flags(os.environ.get(DEBUG, ""))


@functools.lru_cache(maxsize=8)
def _debug_flags(value: str) -> frozenset:
    names = frozenset(v.strip().lower() for v in value.split(",") if v.strip())
    unknown = sorted(names - set(DEBUG_FLAGS))
    if unknown:
        warnings.warn(f"{DEBUG}: unknown {', '.join(unknown)} (ignored); known: {', '.join(DEBUG_FLAGS)}", stacklevel=3)
    return names


def cache_key_environment() -> dict[str, str]:
    """The ``MXQ_*`` variables that can change a result (all but ``MXQ_CACHE``), for cache keys."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("MXQ_") and k != CACHE}
