"""Triton kernels for MXFP8 (importable as ``mxq.kernels``).

Every kernel sits beside a torch reference of the same function; ``dispatch`` picks the
implementation per device: native ``tl.dot_scaled`` on sm_100+, an exact emulation on
sm_90, and the torch reference on CPU and wherever Triton is absent.
"""

from mxq.kernels.dispatch import mx_linear
from mxq.kernels.reference import mx_linear_reference

__all__ = ["mx_linear", "mx_linear_reference"]
