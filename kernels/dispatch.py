"""Pick the MX linear implementation for the device at hand.

- CUDA, compute capability >= 10 (Blackwell): ``tl.dot_scaled``, the native MX MMA.
- Hopper (sm_90) with Gluon, W8A8, 1 <= M <= 16, K % 128 == 0: ``gemm_decode_ws`` (the fp8
  tensor-core decode GEMM below, warp-specialized: a TMA loader warp feeds the math warpgroup).
- other CUDA devices (and the shapes above it does not take): M <= ``gemm.GEMV_MAX_M``: the CUDA-core decode kernel
  ``gemm.mx_gemv`` (W8A8 rounds X inside it); W8A8 up to ``DECODE_F8_DISPATCH_M`` rows on fp8
  tensor cores (sm_89+): ``gemm_decode.mx_decode_gemm`` (X quantized to MXFP8 first, one fp8 MMA
  per 32-block, no weight conversion); larger M: the exact emulation in ``gemm.mx_gemm``;
  W8A8 rounds X inside it up to ``gemm.GEMM_QUANT_MAX_M`` rows, above that first
  (``quantize.fake_quantize_mx_rows``, bf16 out, exact) in a separate launch. On Hopper with
  Gluon, bf16 X, M >= ``PREFILL_RS_MIN_M`` and a tile per SM: ``gemm_prefill_ws`` with ``PrefillRSConfig`` (the
  same exact product, warp-specialized: a TMA loader warp, the weight converted in registers).
- CPU, or Triton absent: ``mx_linear_reference`` (the function every path must compute).

Nothing here syncs the host: the path depends only on the device and dtypes, tile shapes only
on tensor shapes, so ``mx_linear`` can be captured in a CUDA graph once it has been compiled.
"""

from __future__ import annotations

import os

import torch

from mxq.formats import ElemFormat, ScaleRule, as_elem_format, as_scale_rule
from mxq.kernels.reference import mx_linear_reference

try:
    from mxq.kernels import gemm as _gemm
    from mxq.kernels import gemm_decode as _decode
    from mxq.kernels import gemm_decode_ws as _decode_ws
    from mxq.kernels import gemm_prefill_ws as _prefill_ws
    from mxq.kernels import gluon_api
    from mxq.kernels import quantize as _quantize
    from mxq.kernels.launch import cdiv

    HAS_TRITON = True
except ImportError:  # no triton wheel (macOS, Windows): the reference runs everywhere
    _gemm = _decode = _decode_ws = _prefill_ws = _quantize = gluon_api = None
    HAS_TRITON = False

_CAPABILITY: dict[int, tuple[int, int]] = {}

# MXQ_KERNELS=reference runs the torch reference on every device (A/B checks of the fast path).
FORCE_REFERENCE = os.environ.get("MXQ_KERNELS", "").lower() == "reference"
# Largest M whose W8A8 runs on fp8 tensor cores (gemm_decode). H200, Llama-3 8B/70B shapes
# (kernels/NOTES.md, "GEMM: W8A8 decode on fp8 tensor cores", H200 2026-11-21): 1.0-1.7x the emulation at M = 4 and 16; M <= 2 stays on the
# CUDA-core kernel (faster on 6 of 8 shapes at M = 1); M > 16 not measured faster yet.
DECODE_F8_DISPATCH_M = 16
# On Hopper (sm_90) with Gluon, K % 128 == 0, W8A8 at 1 <= M <= 16: the warp-specialized version
# of that kernel (gemm_decode_ws: TMA loader warp, 128-byte tiles, block products overlapped with
# the rescale). H200, 2026-11-21 (NOTES.md, "GEMM: the decode GEMM warp-specialized in Gluon"): 1.0-1.3x gemm_decode at M = 16, 1.0-1.3x the gemv at M = 1.
# MXQ_DECODE_WS=0 keeps the session-7 paths.
DECODE_WS = os.environ.get("MXQ_DECODE_WS", "1") != "0"
# On Hopper with Gluon, bf16 operands (W8A16 with bf16 X; W8A8 after rounding X into bf16),
# M >= PREFILL_RS_MIN_M and at least one 256 x 128 output tile per SM: the register-operand
# warp-specialized prefill GEMM (gemm_prefill_ws, PrefillRSConfig). H100, 2026-11-21 (NOTES.md, "GEMM: the register-operand prefill kernel"): faster than
# the emulation on all 12 Llama-3 8B/70B rows at M = 2048 and 8192 (0.73-0.88x cuBLAS bf16 vs
# 0.68-0.85x); slower at M <= 512 and where the tiles leave SMs idle (the emulation splits K
# there). MXQ_PREFILL_RS=0 keeps the emulation.
PREFILL_RS = os.environ.get("MXQ_PREFILL_RS", "1") != "0"
PREFILL_RS_MIN_M = 1024


def _capability(device: torch.device) -> tuple[int, int]:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _CAPABILITY:
        _CAPABILITY[idx] = torch.cuda.get_device_capability(idx)
    return _CAPABILITY[idx]


def pack_weight(weight: torch.Tensor, weight_scale: torch.Tensor, block_size: int = 32):
    """The weight arranged for the kernels; ``mx_linear(x, packed, None, ...)`` accepts it."""
    if not HAS_TRITON:
        raise RuntimeError("pack_weight needs Triton; call mx_linear with (weight, weight_scale)")
    return _gemm.pack_weight(weight, weight_scale, block_size)


def mx_linear(
    x: torch.Tensor,
    weight,
    weight_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    act_elem: ElemFormat | None = None,
    act_rule: ScaleRule = ScaleRule.RCEIL,
    block_size: int = 32,
) -> torch.Tensor:
    """Y = X · Wᵀ (+ bias) for an MX weight; see ``mx_linear_reference`` for the contract.

    ``weight`` is fp8 [N, K] with ``weight_scale`` uint8 [N, K/block_size], or a
    ``pack_weight`` result with ``weight_scale=None``.
    """
    if HAS_TRITON and isinstance(weight, _gemm.PackedMXWeight):
        if weight.block_size != block_size:
            raise ValueError(f"weight packed with block_size={weight.block_size}, called with {block_size}")
        weight, weight_scale = weight.data, weight.scales
    if weight_scale is None:
        raise ValueError("weight_scale is required unless weight comes from pack_weight")
    if FORCE_REFERENCE or not (HAS_TRITON and x.is_cuda):
        return mx_linear_reference(
            x, weight, weight_scale, bias, act_elem=act_elem, act_rule=act_rule, block_size=block_size
        )
    cap = _capability(x.device)
    return mx_linear_triton(
        x, weight, weight_scale, bias, act_elem=act_elem, act_rule=act_rule,
        block_size=block_size, native=cap[0] >= 10, fp8_mma=cap >= (8, 9), hopper=cap[0] == 9,
    )  # fmt: skip


def path_name(m: int, n: int, k: int, device: torch.device, w8a8: bool = True) -> str:
    """Which kernel and tiles ``mx_linear`` uses for this shape on ``device`` (benchmark tables)."""
    if not (HAS_TRITON and device.type == "cuda") or FORCE_REFERENCE:
        return "torch reference"
    cap = _capability(device)
    if cap[0] >= 10:
        return "tl.dot_scaled"
    if w8a8 and _use_ws(m, k, 32, cap[0] == 9):
        return f"fp8 MMA decode, warp-specialized {_decode_ws.pick_decode_ws_config(m, n, k, device)}"
    if m <= _gemm.GEMV_MAX_M:
        return f"CUDA-core gemv {_gemm.pick_gemv_config(m, n, k, device)}"
    if w8a8 and cap >= (8, 9) and m <= DECODE_F8_DISPATCH_M:
        return f"fp8 MMA decode {_decode.pick_decode_f8_config(m, n, k, device)}"
    cfg = _prefill_rs_config(m, n, k, 32, cap[0] == 9, device)
    if cfg is not None:
        return f"register-operand prefill, warp-specialized {cfg}"
    return f"emulation {_gemm.pick_config(m, n, k, device)}"


def _prefill_rs_config(m: int, n: int, k: int, block_size: int, hopper: bool, device: torch.device):
    """Large M on sm_90: the register-operand prefill kernel's config where it takes the shape
    (Gluon, block 32) and its [256, 128] output tiles fill the SMs once; else None."""
    if hopper:
        gluon_api.note_unavailable()
    if not (PREFILL_RS and hopper and m >= PREFILL_RS_MIN_M and _prefill_ws.takes(m, k, block_size)):
        return None
    cfg = _prefill_ws.pick_prefill_rs_config(m, n, k, device)
    return cfg if cdiv(m, cfg.block_x) * cdiv(n, cfg.block_w) >= _gemm._sm_count(device) else None


def _use_ws(m: int, k: int, block_size: int, hopper: bool) -> bool:
    """W8A8 on sm_90 takes gemm_decode_ws where it takes the shape (1 <= M <= 16, K % 128 == 0, block 32)."""
    if hopper:
        gluon_api.note_unavailable()
    return DECODE_WS and hopper and _decode_ws.takes(m, k, block_size)


def mx_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    act_elem: ElemFormat | None = None,
    act_rule: ScaleRule = ScaleRule.RCEIL,
    block_size: int = 32,
    native: bool = False,
    fp8_mma: bool = True,
    hopper: bool = False,
) -> torch.Tensor:
    """The Triton path on any device Triton runs on (also the CPU interpreter, for tests).

    ``native`` selects ``tl.dot_scaled`` (sm_100+); it falls back to the emulation where
    dot_scaled cannot take the operands (block_size != 32, fp32 activations in W8A16).
    ``fp8_mma``: the device has fp8 MMA (sm_89+), for the small-M W8A8 path; ``hopper`` (sm_90):
    that path warp-specialized (Gluon) where it takes the shape.
    """
    k = x.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if act_elem is not None:
        act_elem, act_rule = as_elem_format(act_elem), as_scale_rule(act_rule)
    if native and block_size == 32 and (act_elem is not None or x.dtype != torch.float32):
        if act_elem is not None:
            xq, xs = _quantize.quantize_mx_rows(x2, act_elem, act_rule, block_size)
        else:
            xq, xs = x2, None
        y = _gemm.mx_gemm_dot_scaled(xq, xs, weight, weight_scale, bias, out_dtype=x.dtype)
    elif act_elem is not None and _use_ws(x2.shape[0], k, block_size, hopper):
        # Decode, W8A8 on Hopper: fp8 tensor cores, warp-specialized (TMA loader warp); faster
        # than the CUDA-core gemv at M = 1 on all 8 Llama-3 shapes (H200, 2026-11-21; NOTES.md, "GEMM: the decode GEMM warp-specialized in Gluon").
        y = gluon_api.run_or_fall_back(
            "gemm_decode_ws",
            lambda: _decode_ws.mx_decode_gemm_ws(
                x2, weight, weight_scale, bias, act_elem=act_elem, act_rule=act_rule, out_dtype=x.dtype,
            ),
            lambda: _retry(x2, weight, weight_scale, bias, act_elem, act_rule, block_size, native, fp8_mma, hopper),
        )  # fmt: skip
    elif x2.shape[0] <= _gemm.GEMV_MAX_M:
        # Decode: the CUDA-core weight stream, X MX-rounded inside it (one launch) unless MSE.
        if act_elem is not None and act_rule is ScaleRule.MSE:
            x2 = _quantize.fake_quantize_mx_rows(x2, act_elem, act_rule, block_size, out_dtype=torch.float32)
            act_elem = None
        y = _gemm.mx_gemv(
            x2, weight, weight_scale, bias, out_dtype=x.dtype, block_size=block_size,
            act_elem=act_elem, act_rule=act_rule,
        )  # fmt: skip
    elif (
        act_elem is not None and fp8_mma and block_size == 32 and x2.shape[0] <= DECODE_F8_DISPATCH_M
        and (act_rule is not ScaleRule.MSE or k % 128 == 0)
    ):  # fmt: skip
        # Small decode batches, W8A8: fp8 tensor cores, the weight never converted.
        y = _decode.mx_decode_gemm(
            x2, weight, weight_scale, bias, act_elem=act_elem, act_rule=act_rule, out_dtype=x.dtype,
        )  # fmt: skip
    elif x2.shape[0] <= _gemm.GEMV_ROWS_MAX_M:
        # Small decode batches: CUDA cores, per-row partials in registers. X goes in as fp32 (the
        # W8A8 rounding writes it directly): no bf16 -> fp32 conversion per row in the kernel.
        if act_elem is not None:
            x2 = _quantize.fake_quantize_mx_rows(x2, act_elem, act_rule, block_size, out_dtype=torch.float32)
        y = _gemm.mx_gemv_rows(x2, weight, weight_scale, bias, out_dtype=x.dtype, block_size=block_size)
    elif (
        act_elem is not None and act_rule is not ScaleRule.MSE and x2.shape[0] <= _gemm.GEMM_QUANT_MAX_M
        and (not x2.is_cuda or _gemm.pick_config(x2.shape[0], weight.shape[0], k, x2.device).quant_x)
    ):  # fmt: skip
        # Small M, W8A8, where measured faster: X MX-rounded inside the MMA kernel (one launch).
        y = _gemm.mx_gemm(
            x2, weight, weight_scale, bias, out_dtype=x.dtype, block_size=block_size,
            act_elem=act_elem, act_rule=act_rule,
        )  # fmt: skip
    else:
        if act_elem is not None:
            x2 = _quantize.fake_quantize_mx_rows(x2, act_elem, act_rule, block_size, out_dtype=torch.bfloat16)
        rs = _prefill_rs_config(x2.shape[0], weight.shape[0], k, block_size, hopper, x2.device)
        if x2.dtype == torch.bfloat16 and rs is not None:
            # Prefill on Hopper: the weight converted in registers as wgmma's left operand,
            # overlapped with the previous step's MMAs (gemm_prefill_ws; NOTES.md, "GEMM: the register-operand prefill kernel").
            y = gluon_api.run_or_fall_back(
                "gemm_prefill_ws",
                lambda: _prefill_ws.mx_prefill_gemm_ws(
                    x2, weight, weight_scale, bias, out_dtype=x.dtype, block_size=block_size, config=rs,
                ),
                lambda: _gemm.mx_gemm(x2, weight, weight_scale, bias, out_dtype=x.dtype, block_size=block_size),
            )  # fmt: skip
        else:
            y = _gemm.mx_gemm(x2, weight, weight_scale, bias, out_dtype=x.dtype, block_size=block_size)
    return y.reshape(*lead, weight.shape[0])


def _retry(x2, weight, weight_scale, bias, act_elem, act_rule, block_size, native, fp8_mma, hopper):
    """The same call once more, after ``gluon_api`` turned a kernel off: dispatch takes the next path."""
    return mx_linear_triton(
        x2, weight, weight_scale, bias, act_elem=act_elem, act_rule=act_rule, block_size=block_size,
        native=native, fp8_mma=fp8_mma, hopper=hopper,
    )  # fmt: skip
