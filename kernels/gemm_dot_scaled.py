"""MX GEMM through ``tl.dot_scaled``: the native block-scaled MMA of sm_100+ (Blackwell).

Y = X·Wᵀ (+ bias) with W MXFP8 and X either MXFP8 (data + [M, K/32] E8M0 scales: W8A8) or
bf16/fp16 (W8A16). On sm_90 Triton emulates ``tl.dot_scaled`` by upcasting both operands, and
the Triton interpreter does not run it, so it is dispatched on sm_100+ only and tested on a GPU
against ``mxq.kernels.reference.mx_linear_reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mxq.kernels.launch import on_input_device
from mxq.kernels.toolchain import configure_ptxas


@triton.jit
def _dot_scaled_kernel(
    x_ptr, xs_ptr, w_ptr, s_ptr, b_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_xsm, stride_wn, stride_sn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    X_FMT: tl.constexpr, W_FMT: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    rn = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    offs_b = tl.arange(0, BLOCK_K // 32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        kmask = (k + offs_k) < K
        bmask = (k + offs_b * 32) < K
        a = tl.load(x_ptr + rm[:, None] * stride_xm + (k + offs_k)[None, :], mask=kmask[None, :], other=0.0)
        b = tl.load(w_ptr + rn[None, :] * stride_wn + (k + offs_k)[:, None], mask=kmask[:, None], other=0.0)
        bs = tl.load(s_ptr + rn[:, None] * stride_sn + (k // 32 + offs_b)[None, :], mask=bmask[None, :], other=127)
        if X_FMT == "bf16" or X_FMT == "fp16":
            acc = tl.dot_scaled(a, None, X_FMT, b, bs, W_FMT, acc)
        else:
            xs = tl.load(xs_ptr + rm[:, None] * stride_xsm + (k // 32 + offs_b)[None, :], mask=bmask[None, :], other=127)
            acc = tl.dot_scaled(a, xs, X_FMT, b, bs, W_FMT, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


_FMT = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2", torch.bfloat16: "bf16", torch.float16: "fp16"}


@on_input_device
def mx_gemm_dot_scaled(
    x: torch.Tensor,
    x_scale: torch.Tensor | None,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    block_m: int = 128,
    block_n: int = 128,
    block_k: int = 128,
    num_warps: int = 8,
    num_stages: int = 3,
) -> torch.Tensor:
    """Y = X·Wᵀ through ``tl.dot_scaled``: X MXFP8 (data + [M, K/32] scales) or bf16/fp16.

    Native block-scaled MMA on sm_100+; on sm_90 Triton emulates it (the baseline to beat).
    """
    if x.dtype not in _FMT or weight.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"unsupported dtypes for dot_scaled: X {x.dtype}, W {weight.dtype}")
    m, k = x.shape
    n = weight.shape[0]
    if k % 32 or weight.shape[1] != k or tuple(weight_scale.shape) != (n, k // 32):
        raise ValueError(f"shape mismatch: X {tuple(x.shape)}, W {tuple(weight.shape)}, scales {tuple(weight_scale.shape)}")
    is_mx = x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if is_mx and (x_scale is None or tuple(x_scale.shape) != (m, k // 32)):
        raise ValueError(f"MX activations need x_scale [{m}, {k // 32}]")
    x, weight, weight_scale = x.contiguous(), weight.contiguous(), weight_scale.contiguous()
    xs = x_scale.contiguous() if is_mx else weight_scale
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    configure_ptxas()
    _dot_scaled_kernel[grid](
        x, xs, weight, weight_scale, bias if bias is not None else weight_scale, y,
        m, n, k,
        x.stride(0), xs.stride(0), weight.stride(0), weight_scale.stride(0), n,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        X_FMT=_FMT[x.dtype], W_FMT=_FMT[weight.dtype], HAS_BIAS=bias is not None,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return y
