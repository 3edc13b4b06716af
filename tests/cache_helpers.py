"""A test's own mxq cache folder (``MXQ_CACHE``): tuned tiles and perplexity results start empty,
and the compiled CPU kernels are shared with the machine's cache folder, so they are built once per
machine, not once per test (about 2-5 s each on the 2-core CPU)."""

from __future__ import annotations

from pathlib import Path

from mxq import settings


def own_cache(root: Path) -> Path:
    shared = settings.cache_dir("cpu", ignore_off=True)  # before the test sets MXQ_CACHE
    shared.mkdir(parents=True, exist_ok=True)
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "cpu").exists():
        (root / "cpu").symlink_to(shared, target_is_directory=True)
    return root
