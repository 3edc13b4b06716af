"""mxq: quantize Hugging Face language models to MXFP8 and run them fast."""

from mxq.config import mxq_version

__version__ = mxq_version()

import mxq.attention  # noqa: E402,F401  (registers attn_implementation "mxfp8")
from mxq.embedding import MXEmbedding  # noqa: E402
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
from mxq.hf import MXQConfig, load  # noqa: E402  (registers quant_method "mxq" with transformers)
from mxq.linear import MXLinear, set_kernels  # noqa: E402
from mxq.quantize import quantize_model  # noqa: E402
from mxq.recipe import Recipe, load_recipe  # noqa: E402

__all__ = [
    "MXQConfig",
    "MXLinear",
    "MXEmbedding",
    "Recipe",
    "load",
    "load_recipe",
    "quantize_model",
    "set_kernels",
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
