"""Submodules as attributes on first use: ``mxq.runtime.fuse`` after ``import mxq``, as Python gives
them only once imported. Each package of mxq sets ``__getattr__ = submodules_on_demand(__name__)``."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable


def submodules_on_demand(package: str) -> Callable[[str], object]:
    def __getattr__(name: str):
        if not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}") is not None:
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
