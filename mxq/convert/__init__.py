"""Quantize to disk: a model's tensors in, an MXFP8 safetensors checkpoint out.

``source`` (where the tensors come from), ``layout`` (every output tensor planned before a byte is
written), ``converter`` (``quantize_checkpoint``: the stream that writes them).
"""

from mxq.lazy import submodules_on_demand

__getattr__ = submodules_on_demand(__name__)
