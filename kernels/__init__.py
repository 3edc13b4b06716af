"""Triton kernels for MXFP8 (importable as ``mxq.kernels``).

Every kernel sits beside the torch reference of the function it computes (``reference``); a
registry per function (``registry``) picks the kernel for each call: ``dispatch.LINEAR`` for the
linear layers, the attention registries for MX attention. On a CPU, or where Triton is absent,
the torch reference runs.

API for the rest of mxq:
- ``mx_linear(x, weight, weight_scale, bias, *, act_elem, act_rule, block_size, kernels)``;
- ``mx_grouped_linear(x, group_end, weight, weight_scale, bias, *, act_elem, act_rule, block_size,
  kernels)``: the same per expert group of rows sorted by expert (``moe``); ``gather_mx_rows``
  puts X's rows in that order, MX-rounded;
- ``quantize_mx_rows(x, elem, rule, block_size)`` -> (fp8 data, uint8 scales), 1x32 along K;
- ``check_kernels(spec)``: validates a ``kernels`` argument ("auto", "reference" or path names).
"""

if __name__ != "mxq.kernels":
    # Run from a checkout (``python -m ...`` puts the repo root on sys.path), this folder is also
    # importable as a top-level ``kernels`` — the name of the Hugging Face kernels package, which
    # transformers probes by importing it. Look like an empty namespace package so the probe
    # reports it absent instead of importing mxq half-way through transformers' own import.
    __file__ = None
else:
    from mxq.kernels.dispatch import HAS_TRITON, mx_linear
    from mxq.kernels.moe import gather_mx_rows, mx_grouped_linear
    from mxq.kernels.reference import mx_linear_reference
    from mxq.kernels.registry import check_kernels

    if HAS_TRITON:
        from mxq.kernels.quantize import fake_quantize_mx_rows, quantize_mx_rows
    else:  # the format core computes the same bytes, on any device
        from mxq.kernels.reference import fake_quantize_mx_rows, quantize_mx_rows

__all__ = [
    "check_kernels",
    "fake_quantize_mx_rows",
    "gather_mx_rows",
    "mx_grouped_linear",
    "mx_linear",
    "mx_linear_reference",
    "quantize_mx_rows",
]
