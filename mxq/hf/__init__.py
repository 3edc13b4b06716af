"""The transformers integration: where a model comes from, and how ``from_pretrained`` builds mxq's.

``models`` (a directory, a GGUF file, a hub id or the embedded default), ``quantizer`` (``quant_method:
"mxq"``, ``mxq.load``), ``quantize`` (``mxq.quantize_model``: a model in memory, swapped and fused).
"""

from mxq.lazy import submodules_on_demand

__getattr__ = submodules_on_demand(__name__)
