"""On disk: an MXFP8 checkpoint's files, what its config says, and the checks every load runs.

``files`` (safetensors read and written one tensor at a time), ``config`` (the ``quantization_config``
schema; needs no transformers), ``validate`` (the one validator), ``describe`` (``mxq inspect``'s
summary).
"""

from mxq.lazy import submodules_on_demand

__getattr__ = submodules_on_demand(__name__)
