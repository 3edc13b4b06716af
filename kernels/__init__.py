"""Triton kernels for MXFP8 (importable as ``mxq.kernels``).

Every kernel sits beside a torch reference of the same function; ``dispatch`` picks the
implementation per device: native ``tl.dot_scaled`` on sm_100+, an exact emulation on
sm_90, and the torch reference on CPU and wherever Triton is absent.

API for the rest of mxq:
- ``mx_linear(x, weight, weight_scale, bias, *, act_elem, act_rule, block_size)``;
- ``pack_weight(weight, weight_scale)`` -> an object ``mx_linear(x, packed, None, ...)`` takes;
- ``quantize_mx_rows(x, elem, rule, block_size)`` -> (fp8 data, uint8 scales), 1x32 along K.
"""

if __name__ != "mxq.kernels":
    # Run from a checkout (``python -m ...`` puts the repo root on sys.path), this folder is also
    # importable as a top-level ``kernels`` — the name of the Hugging Face kernels package, which
    # transformers probes by importing it. Look like an empty namespace package so the probe
    # reports it absent instead of importing mxq half-way through transformers' own import.
    __file__ = None
else:
    from mxq.kernels.dispatch import HAS_TRITON, mx_linear, pack_weight
    from mxq.kernels.reference import mx_linear_reference

    if HAS_TRITON:
        from mxq.kernels.quantize import fake_quantize_mx_rows, quantize_mx_rows
    else:  # the format core computes the same bytes, on any device
        from mxq.kernels.reference import fake_quantize_mx_rows, quantize_mx_rows

__all__ = [
    "fake_quantize_mx_rows",
    "mx_linear",
    "mx_linear_reference",
    "pack_weight",
    "quantize_mx_rows",
]
