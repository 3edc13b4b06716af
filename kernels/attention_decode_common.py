"""What both decode kernels share: the call's description, the query operand, the split-KV merge.

Both the Triton kernel (``attention_decode``) and the warp-specialized Gluon kernel
(``attention_decode_ws``) compute ``mx_attention_reference`` for one query token against an
MXFP8 cache (``mx_attention_decode``'s doc), so this module sits below both:

- ``DecodeProblem``: what a decode call is (shapes, dtypes, layout, mask or not, the device's
  capability, CUDA-graph capture), built by ``decode_problem`` from the tensors' metadata alone;
  the kernel registry (``attention_decode.DECODE``) chooses a path from it;
- the query operand (``decode_qn``): the query heads of a kv head, rotated (``qk_rotation``)
  and MX-rounded along head_dim, each 32-block normalized by a power of two so its values are
  exact in fp16 (or as the MX codes and 2**scale); the Triton kernel computes it in its own
  program, the Gluon kernel reads it from ``decode_query_blocks``. The torch reference of the
  rounded query: ``mxq.formats.quantize_mx(reference.rotate_qk(q), -1)``;
- ``decode_merge_kernel``: the partial softmaxes of the splits (m, l in the log2 domain, the
  unnormalized output rows) merged into the output, and ``check_counters`` for the fused merges'
  tickets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mxq.formats import E4M3, ElemFormat, ScaleRule, as_elem_format, as_scale_rule
from mxq.kernels.attention_rotate import (
    bf16_parts,
    padded_head_dim,
    q_rotation_operand,
    rotate_rows,
    rotate_rows_factored,
)
from mxq.kernels.common import (
    INTERPRET,
    capability,
    gdc_follow,
    gdc_launch_dependents,
    gdc_wait,
    mx_round_codes,
    mx_round_consts,
    mx_round_dequant,
    pow2_f32,
)
from mxq.kernels.launch import on_input_device
from mxq.kernels.toolchain import configure_ptxas


@dataclass(frozen=True)
class DecodeProblem:
    """One ``mx_attention_decode`` call as the kernel choice sees it: no tensor contents, so
    choosing syncs nothing and can happen inside a CUDA-graph capture. Tests build problems for
    devices they do not have."""

    batch: int
    q_heads: int
    q_len: int
    head_dim: int
    kv_heads: int
    k_dim: int  # K's stored head_dim: D padded to 32
    capacity: int  # cache slots per sequence (C)
    q_dtype: torch.dtype
    cache_dtype: torch.dtype
    paged: bool  # V in 32-key pages [B, Hkv, C/32, D, 32] (MXFP8CacheLayer), else rows of Vᵀ
    contiguous: bool  # the four cache tensors
    has_mask: bool
    device: torch.device
    capability: tuple[int, int]  # (0, 0) off CUDA
    capturing: bool  # a CUDA graph is being captured on the current stream
    interpret: bool = INTERPRET  # Triton runs through its CPU interpreter


def decode_problem(
    q: torch.Tensor, k_data: torch.Tensor, k_scale: torch.Tensor, v_data: torch.Tensor, v_scale: torch.Tensor,
    attention_mask: torch.Tensor | None = None, *, capturing: bool | None = None,
) -> DecodeProblem:
    """The ``DecodeProblem`` of a call (``mx_attention_decode``'s arguments). ``capturing``: as if
    under CUDA-graph capture (True) or not (False) instead of asking the current stream (None)."""
    b, hq, sq, d = q.shape
    device = q.device
    if capturing is None:
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    contiguous = k_data.is_contiguous() and k_scale.is_contiguous() and v_data.is_contiguous() and v_scale.is_contiguous()
    return DecodeProblem(
        b, hq, sq, d, k_data.shape[1], k_data.shape[-1], k_data.shape[2], q.dtype, k_data.dtype, v_data.dim() == 5,
        contiguous, attention_mask is not None, device, capability(device), capturing,
    )  # fmt: skip


@triton.jit
def decode_qn(
    Q, ROT, b, hk, stride_qb, stride_qh, stride_qd, D,
    GROUP_C: tl.constexpr, GP: tl.constexpr, BLOCK_D: tl.constexpr, DB: tl.constexpr,
    EMAX: tl.constexpr, MBITS: tl.constexpr, MAXN: tl.constexpr, EMIN: tl.constexpr,
    RULE: tl.constexpr, HW_CVT: tl.constexpr, FP8: tl.constexpr, INTERP: tl.constexpr,
    QPARTS: tl.constexpr, QM: tl.constexpr, ROT_NB: tl.constexpr, CODES: tl.constexpr = False,
):  # fmt: skip
    """The GROUP_C query heads of kv head ``hk`` (rotated if QPARTS), MX-rounded along head_dim,
    each 32-block normalized by a power of two: qn [GP, BLOCK_D] fp32 (exact in fp16), cq [GP, DB].
    CODES: qn the MX elements themselves (exact in the element format) and cq = 2**scale (NaN for
    a block with a NaN or Inf, whose elements are then 0)."""
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, BLOCK_D)
    heads = hk * GROUP_C + offs_g
    gmask = offs_g < GROUP_C
    if QPARTS > 0:  # Q·R (the Q/K rotation) on QM >= 16 rows (an MMA's minimum), then the GP used
        offs_r = tl.arange(0, QM)
        q = tl.load(
            Q + b.to(tl.int64) * stride_qb + (hk * GROUP_C + offs_r)[:, None] * stride_qh + offs_d[None, :] * stride_qd,
            mask=(offs_r < GROUP_C)[:, None] & (offs_d < D)[None, :], other=0.0,
        )  # fmt: skip
        if ROT_NB > 0:  # ROT is the 2 KB factored operand
            y = rotate_rows_factored(q, ROT, offs_d, BLOCK_D, ROT_NB, QPARTS, INTERP)
        else:
            y = rotate_rows(q, ROT, offs_d, BLOCK_D, QPARTS, INTERP)
        if QM == GP:
            qf = y
        else:
            qf = tl.sum(tl.where(offs_r[None, :, None] == offs_g[:, None, None], y[None, :, :], 0.0), axis=1)
    else:
        q = tl.load(
            Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
            mask=gmask[:, None] & (offs_d < D)[None, :], other=0.0,
        )  # fmt: skip
        qf = q.to(tl.float32)
    if CODES:
        r, e, nonfinite = mx_round_codes(tl.reshape(qf, (GP, DB, 32)), EMAX, MBITS, MAXN, EMIN, RULE, HW_CVT, FP8)
        cq = tl.where(nonfinite, float("nan"), pow2_f32(e))
        qn = tl.where(nonfinite[:, :, None], 0.0, r)
    else:
        qr = mx_round_dequant(tl.reshape(qf, (GP, DB, 32)), EMAX, MBITS, MAXN, EMIN, RULE, HW_CVT, FP8)
        # Normalize each Q block by a power of two so its MX values are exact in fp16 (|x| < 2;
        # e4m3 spans < 2^18 inside a block, fp16 subnormals reach 2^-24); cq undoes it after the dot.
        cbits = tl.max(qr.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=2) & 0x7F800000
        cbits = tl.where(cbits == 0, 0x3F800000, cbits)
        cq = cbits.to(tl.float32, bitcast=True)  # [GP, DB]
        qn = qr / cq[:, :, None]
    return tl.reshape(qn, (GP, BLOCK_D)), cq


@triton.jit
def _decode_q_prep_kernel(
    Q, ROT, QN, CQ, Hkv, stride_qb, stride_qh, stride_qd, D,
    GROUP_C: tl.constexpr, GP: tl.constexpr, BLOCK_D: tl.constexpr, DB: tl.constexpr,
    EMAX: tl.constexpr, MBITS: tl.constexpr, MAXN: tl.constexpr, EMIN: tl.constexpr,
    RULE: tl.constexpr, HW_CVT: tl.constexpr, FP8: tl.constexpr, INTERP: tl.constexpr,
    QPARTS: tl.constexpr, QM: tl.constexpr, ROT_NB: tl.constexpr, PDL: tl.constexpr, CODES: tl.constexpr = False,
):  # fmt: skip
    """``decode_qn`` for one (batch, kv head) into QN [B*Hkv*GP, BLOCK_D] (fp16, or the element
    format's fp8 with CODES), CQ [B*Hkv*GP, DB]."""
    if PDL:
        # launched behind the kernel that wrote q and the cache (or not: then the wait returns at once):
        # wait for it, and only then let the decode kernel launched behind this one start streaming
        # the cache, which that kernel may still have been writing before the wait
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)
    qn, cq = decode_qn(
        Q, ROT, pid // Hkv, pid % Hkv, stride_qb, stride_qh, stride_qd, D, GROUP_C, GP, BLOCK_D, DB,
        EMAX, MBITS, MAXN, EMIN, RULE, HW_CVT, FP8, INTERP, QPARTS, QM, ROT_NB, CODES,
    )  # fmt: skip
    rows = pid * GP + tl.arange(0, GP)
    tl.store(QN + rows[:, None] * BLOCK_D + tl.arange(0, BLOCK_D)[None, :], qn.to(QN.dtype.element_ty))
    tl.store(CQ + rows[:, None] * DB + tl.arange(0, DB)[None, :], cq)


@on_input_device
def decode_query_blocks(
    q: torch.Tensor, hkv: int, *, gp: int = 8, elem: ElemFormat | str = E4M3, rule: ScaleRule | str = ScaleRule.RCEIL,
    qk_rotation: bool = False, pdl: bool = False, codes: bool = False, launch_pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode query as the warp-specialized decode kernel reads it (``attention_decode_ws``):
    q [B, Hq, 1, D] -> qn fp16 [B*Hkv*gp, BLOCK_D], cq fp32 [B*Hkv*gp, BLOCK_D/32] with
    qn·cq (per 32-block) = the MX-rounded (and, with ``qk_rotation``, rotated) query; rows of
    a kv head's gp slots past its Hq/Hkv query heads are zero. ``codes``: qn holds the MX
    elements in the element format's fp8 dtype and cq = 2**scale (the fp8 MMA's operand);
    otherwise each block is normalized to max |qn| in [1, 2) (cq a power of two, 1 for a zero block).
    ``pdl``: the kernel lets the decode kernel behind it start (after waiting for its own predecessor);
    ``launch_pdl`` (with ``pdl``): it is itself launched with PDL behind that predecessor."""
    elem, rule = as_elem_format(elem), as_scale_rule(rule)
    b, hq, _, d = q.shape
    group = hq // hkv
    if group > gp:
        raise ValueError(f"decode_query_blocks: {group} query heads per kv head, more than gp={gp}")
    bd = padded_head_dim(d)
    qdt = (torch.float8_e4m3fn if elem.mbits == 3 else torch.float8_e5m2) if codes else torch.float16
    qn = torch.empty((b * hkv * gp, bd), dtype=qdt, device=q.device)
    cq = torch.empty((b * hkv * gp, bd // 32), dtype=torch.float32, device=q.device)
    rot_nb, rot = q_rotation_operand(d, bd, q.device) if qk_rotation else (0, q)
    configure_ptxas()
    _decode_q_prep_kernel[(b * hkv,)](
        q, rot, qn, cq, hkv, q.stride(0), q.stride(1), q.stride(3), d,
        GROUP_C=group, GP=gp, BLOCK_D=bd, DB=bd // 32, **mx_round_consts(elem, rule, q.device), INTERP=INTERPRET,
        QPARTS=bf16_parts(q.dtype) if qk_rotation else 0, QM=max(16, gp), ROT_NB=rot_nb, PDL=pdl, CODES=codes, num_warps=4,
        **({"launch_pdl": True} if launch_pdl and pdl else {}),
    )  # fmt: skip
    return qn, cq


@triton.jit
def decode_merge_kernel(
    ML, ACC, Out, Hq, D, NSPLIT,
    stride_ob, stride_oh,
    SPLIT_PAD: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    if PDL:  # the output projection's GEMM may start streaming its weights; wait for the decode kernel's partials
        gdc_follow()
    pid = tl.program_id(0)  # b * Hq + h
    b = pid // Hq
    h = pid % Hq
    offs_s = tl.arange(0, SPLIT_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    smask = offs_s < NSPLIT
    row = pid * NSPLIT + offs_s
    m = tl.load(ML + row * 2, mask=smask, other=float("-inf"))
    ls = tl.load(ML + row * 2 + 1, mask=smask, other=0.0)
    acc = tl.load(ACC + row[:, None] * BLOCK_D + offs_d[None, :], mask=smask[:, None], other=0.0)
    mx = tl.max(m, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.math.exp2(m - mx)
    lt = tl.sum(ls * w, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(lt > 0, lt, 1.0)
    tl.store(Out + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=offs_d < D)


def check_counters(counters: torch.Tensor, n: int, device: torch.device) -> None:
    """A fused split merge's tickets as given by the caller: int32, on ``device``, >= n of them."""
    if counters.dtype != torch.int32 or counters.numel() < n or counters.device != device:
        raise ValueError(f"counters must be int32 on {device} with at least {n} elements")
