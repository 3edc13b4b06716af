"""mxq: quantize Hugging Face language models to MXFP8 and run them fast."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("mxq")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

from mxq.formats import (  # noqa: E402
    E4M3,
    E5M2,
    ElemFormat,
    MXTensor,
    ScaleRule,
    dequantize_mx,
    fake_quantize_mx,
    quantize_mx,
)

__all__ = [
    "__version__",
    "E4M3",
    "E5M2",
    "ElemFormat",
    "MXTensor",
    "ScaleRule",
    "quantize_mx",
    "dequantize_mx",
    "fake_quantize_mx",
]
