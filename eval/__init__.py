"""The eval harness (importable as ``mxq.eval``): perplexity, per-layer error, speed.

``mxq.eval.perplexity`` is the function (the submodule's other names import as
``from mxq.eval.perplexity import make_windows``).
"""

from mxq.eval.data import DatasetError, load_texts
from mxq.eval.layers import LayerSQNR, layer_sqnr
from mxq.eval.perplexity import (
    PerplexityResult,
    Windows,
    check_same_tokenizer,
    make_windows,
    perplexity,
)

__all__ = [
    "DatasetError",
    "LayerSQNR",
    "PerplexityResult",
    "Windows",
    "check_same_tokenizer",
    "layer_sqnr",
    "load_texts",
    "make_windows",
    "perplexity",
]
