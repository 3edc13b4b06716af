"""mxq: quantize Hugging Face language models to MXFP8 and run them fast.

``import mxq`` is cheap: it loads neither torch nor transformers. The public names below load their
module on first use. What ``import mxq`` promises transformers (the quantization method ``"mxq"``
and the attention implementation ``"mxfp8"``, so that ``from_pretrained`` reads an mxq checkpoint)
is registered as soon as transformers' model code is loaded: at once if it already is, else right
after ``transformers.modeling_utils`` first runs (``_register_after_transformers``), which every
``from_pretrained`` path imports before it reads a checkpoint's quantization config.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from importlib.metadata import PackageNotFoundError, version

from mxq.lazy import submodules_on_demand

try:
    __version__ = version("mxq")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0.0.0+unknown"

# public name -> the module that defines it (loaded on first use)
_PUBLIC = {
    "MXQConfig": "mxq.hf.quantizer",
    "load": "mxq.hf.quantizer",
    "MXLinear": "mxq.runtime.linear",
    "set_kernels": "mxq.runtime.linear",
    "MXEmbedding": "mxq.runtime.embedding",
    "quantize_model": "mxq.hf.quantize",
    "Recipe": "mxq.recipe",
    "load_recipe": "mxq.recipe",
    **dict.fromkeys(("E4M3", "E5M2", "ElemFormat", "MXTensor", "ScaleRule", "quantize_mx", "dequantize_mx",
                     "fake_quantize_mx"), "mxq.formats"),  # fmt: skip
}
__all__ = [*_PUBLIC, "__version__"]
_submodule = submodules_on_demand(__name__)


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
    else:
        value = _submodule(name)  # a subpackage, as ``mxq.runtime`` after ``import mxq``
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})


_TRIGGER = "transformers.modeling_utils"


def _register() -> None:
    """The quantizer and the attention implementation, registered with transformers (importing
    these modules does it). A failure here is said, never raised: it must not break the import of
    transformers' own module that triggered it."""
    try:
        import mxq.hf.quantizer  # noqa: F401
        import mxq.runtime.attention  # noqa: F401
    except Exception as e:  # noqa: BLE001
        warnings.warn(f"mxq: could not register with transformers ({type(e).__name__}: {e}); "
                      "mxq checkpoints will not load through from_pretrained", stacklevel=2)  # fmt: skip


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds ``_TRIGGER`` with the other finders and has its loader call ``_register`` once the
    module has run; then leaves ``sys.meta_path``."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _TRIGGER:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        loader = getattr(spec, "loader", None)
        run = getattr(loader, "exec_module", None)
        if run is None:
            return spec

        def exec_module(module):
            run(module)
            _register()

        loader.exec_module = exec_module
        return spec


def _register_after_transformers() -> None:
    if _TRIGGER in sys.modules:
        _register()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


_register_after_transformers()
