"""A test's own mxq cache folder (``MXQ_CACHE``): tuned tiles and perplexity results start empty,
and the compiled CPU kernels and the saved GGUF models are shared with the machine's cache folder,
so they are built once per machine, not once per test (the README says what each costs)."""

from __future__ import annotations

from pathlib import Path

from mxq import settings


def own_cache(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for kind in ("cpu", "gguf"):
        shared = settings.cache_dir(kind, ignore_off=True)  # before the test sets MXQ_CACHE
        shared.mkdir(parents=True, exist_ok=True)
        if not (root / kind).exists():
            (root / kind).symlink_to(shared, target_is_directory=True)
    return root
