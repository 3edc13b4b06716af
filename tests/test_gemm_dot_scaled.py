"""kernels/gemm_dot_scaled.py: the MX GEMM through ``tl.dot_scaled`` (native on sm_100+, emulated by
Triton on sm_90). The Triton interpreter does not run ``tl.dot_scaled``: argument checks on the
CPU, the numerics on a GPU."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEV, assert_gemm_close, gpu, mx_weight

from mxq.formats import E4M3
from mxq.kernels import dispatch
from mxq.kernels.gemm_dot_scaled import mx_gemm_dot_scaled


def test_dot_scaled_rejects_what_it_cannot_take():
    w = torch.zeros(8, 64, dtype=torch.float8_e4m3fn, device=DEV)
    s = torch.full((8, 2), 127, dtype=torch.uint8, device=DEV)
    with pytest.raises(TypeError, match="unsupported dtypes for dot_scaled"):
        mx_gemm_dot_scaled(torch.zeros(2, 64, device=DEV), None, w, s)
    with pytest.raises(ValueError, match="shape mismatch"):
        mx_gemm_dot_scaled(torch.zeros(2, 32, dtype=torch.bfloat16, device=DEV), None, w, s)
    xq = torch.zeros(2, 64, dtype=torch.float8_e4m3fn, device=DEV)
    with pytest.raises(ValueError, match=r"MX activations need x_scale \[2, 2\]"):
        mx_gemm_dot_scaled(xq, None, w, s)


@gpu
@pytest.mark.gpu
def test_gpu_dot_scaled_matches_reference():
    """W8A8 (X quantized to MXFP8 first) and W8A16 (bf16 X) through the dispatch's path."""
    gen = torch.Generator().manual_seed(4)
    w, ws, w64 = mx_weight(1000, 1024, E4M3, gen)
    x = torch.randn(300, 1024, generator=gen).to(torch.bfloat16).cuda()
    y = dispatch.run_path("dot_scaled", x, w, ws, None, act_elem=E4M3)
    assert_gemm_close(y, x, w64, None, E4M3)
    y = dispatch.run_path("dot_scaled", x, w, ws, None)
    assert_gemm_close(y, x, w64, None, None)
