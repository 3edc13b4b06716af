"""The forward: the modules a quantized model runs, and the structure that makes it fast.

``linear``, ``experts``, ``embedding``, ``attention`` (the MX modules and the ``mxfp8`` attention),
``fuse`` and ``routing`` (the fused structure), ``tp`` (tensor parallelism), ``decode`` (greedy
decoding from one CUDA graph), ``install`` (the one way mxq sets a module's forward).
"""

from mxq.lazy import submodules_on_demand

__getattr__ = submodules_on_demand(__name__)
