"""Calibration: statistics from real text, and what they decide before a byte is written.

``calibrator`` (the ``mxq calibrate`` pipeline: statistics, channel order, scale rules, kept layers),
``plan`` (its result and file), ``reorder`` (channel permutations folded into producers),
``sensitivity`` (what one quantized layer costs the model), ``gptq`` with ``gptq_core`` and
``gptq_experts`` (codes rounded against the layer inputs), ``signround`` (codes tuned against a
decoder layer's output).
"""

from mxq.lazy import submodules_on_demand

__getattr__ = submodules_on_demand(__name__)
