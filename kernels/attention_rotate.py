"""The Q/K rotation in Triton, and what every attention module shares (the lowest of them).

What it computes: x·R for R = ``reference.qk_rotation(D)`` (random signs times Sylvester
Hadamard blocks along head_dim, entries ±1 and 0), the torch reference being
``reference.rotate_qk`` (float64 accumulation, so within fp32 rounding of it), and with the MX
rounding fused (``round_to``) the format core's rounding of those fp32 products. Attention with
the rotation is ``mx_attention_reference(..., qk_rotation=True)``: Q and K are multiplied by R
before they are MX-rounded and the scores divided by its block size (``mxq.runtime.attention`` uses it).

The kernels compute x·R as MMAs on bf16 pieces of x (1 piece for bf16 input, 2 for fp16, 3 for
fp32), so every product is exact and only the fp32 accumulation rounds: Q inside the prefill and
decode kernels (``rotate_rows``; the decode kernels from the 2 KB factored operand,
``rotate_rows_factored``, where the Hadamard blocks are >= 32 wide), K in ``rotate_qk_rows``
fused with its MX rounding (the prefill's K operand) or before it enters the cache.

Shared by the attention modules (the kernel core, ``common``, holds what the other kernel
families share too: the MX rounding, ``mma``, ``mx_round_consts``): the host helpers
``padded_head_dim`` (head_dim padded for the kernels), ``bf16_parts`` (bf16 pieces per input
dtype), ``mask_args`` (an attention mask as kernel arguments) and the rotation operands
(``rotation_operand``, ``q_rotation_operand``), the Triton functions ``rotate_rows``,
``rotate_rows_factored`` and ``rotate_tile``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mxq.formats import E4M3, ElemFormat, ScaleRule
from mxq.kernels.buffers import persistent
from mxq.kernels.common import INTERPRET, mma, mx_round_consts, mx_round_dequant
from mxq.kernels.launch import call, cdiv, on_input_device
from mxq.kernels.reference import hadamard_block, qk_rotation, sylvester_hadamard

LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------------------------
# Shared by the attention kernels
# ---------------------------------------------------------------------------------------------

def padded_head_dim(d: int) -> int:
    """head_dim as the kernels' BLOCK_D: the next power of two, at least 32 (one MX block)."""
    return max(32, 1 << max(0, d - 1).bit_length())  # (triton.next_power_of_2 costs ~2 µs from Python)


def bf16_parts(dtype: torch.dtype) -> int:
    """How many bf16 pieces hold a value of ``dtype`` exactly (``rotate_rows``' PARTS)."""
    return {torch.bfloat16: 1, torch.float16: 2}.get(dtype, 3)


def mask_args(attention_mask, b, hq, sq, sk):
    """(mask as uint8/float, its [B, Hq, Sq, Sk] strides with 0 for broadcast axes, whether it is
    boolean) for the kernels; (None, zeros, False) without a mask."""
    if attention_mask is None:
        return None, (0, 0, 0, 0), False
    m = attention_mask
    if m.dim() != 4:
        raise ValueError(f"attention_mask must be 4-D [B|1, H|1, Sq, Sk], got shape {tuple(m.shape)}")
    if m.dtype == torch.bool:
        m = m.view(torch.uint8)
    m = m.expand(b, hq, sq, sk)
    strides = tuple(m.stride(i) if m.shape[i] > 1 else 0 for i in range(4))
    return m, strides, attention_mask.dtype == torch.bool


# ---------------------------------------------------------------------------------------------
# Q/K rotation
# ---------------------------------------------------------------------------------------------

@triton.jit
def rotate_rows(x, R, offs_d, BLOCK_D: tl.constexpr, PARTS: tl.constexpr, INTERP: tl.constexpr):
    """x [M, BLOCK_D] (any float dtype, M >= 16) times R [BLOCK_D, BLOCK_D] (±1 and 0, bf16) in fp32.

    x is split into PARTS bf16 pieces (1 for bf16, 2 for fp16, 3 for fp32: together exactly x),
    so every product is exact and only the fp32 accumulation rounds.
    """
    r = tl.load(R + offs_d[:, None] * BLOCK_D + offs_d[None, :])
    xf = x.to(tl.float32)
    acc = tl.zeros([x.shape[0], BLOCK_D], tl.float32)
    for _ in tl.static_range(PARTS):
        part = xf.to(tl.bfloat16)
        acc = mma(part, r, acc, INTERP)
        xf = xf - part.to(tl.float32)
    return acc


@triton.jit
def rotate_rows_factored(x, RF, offs_d, BLOCK_D: tl.constexpr, NB: tl.constexpr, PARTS: tl.constexpr, INTERP: tl.constexpr):
    """``rotate_rows`` for Hadamard blocks of n = 32·NB >= 32, from a 2 KB operand instead of R.

    Sylvester's H_n[i, j] = (-1)^popcount(i & j) = H_NB[i // 32, j // 32]·H_32[i % 32, j % 32], so
    x·diag(s)·blockdiag(H_n) is: signs, an MMA of the 32-column pieces against H_32, then per
    group of NB pieces the ±1 combination H_NB (adds in fp32). RF: bf16 H_32 (32 x 32) followed by
    the BLOCK_D signs (0 past D). The same products as the full MMA; the sums in another order.
    """
    A: tl.constexpr = BLOCK_D // 32
    M: tl.constexpr = x.shape[0]
    offs32 = tl.arange(0, 32)
    h32 = tl.load(RF + offs32[:, None] * 32 + offs32[None, :])
    sg = tl.load(RF + 1024 + offs_d).to(tl.float32)
    xf = tl.reshape(x.to(tl.float32) * sg[None, :], (M * A, 32))
    acc = tl.zeros([M * A, 32], tl.float32)
    for _ in tl.static_range(PARTS):
        part = xf.to(tl.bfloat16)
        acc = mma(part, h32, acc, INTERP)
        xf = xf - part.to(tl.float32)
    y1 = tl.reshape(acc, (M, A, 32))
    offs_a = tl.arange(0, A)
    t = offs_a[:, None] & offs_a[None, :] & (NB - 1)
    par = (t ^ (t >> 1) ^ (t >> 2) ^ (t >> 3)) & 1  # popcount parity (NB <= 16)
    same = (offs_a[:, None] // NB) == (offs_a[None, :] // NB)
    ha = tl.where(same, tl.where(par == 1, -1.0, 1.0), 0.0)  # [A (from), A (to)]: I ⊗ H_NB
    y = tl.sum(y1[:, :, None, :] * ha[None, :, :, None], axis=1)
    return tl.reshape(y, (M, BLOCK_D))


@triton.jit
def rotate_tile(
    X, R, Y, rb, b, H, S, D, OUT_D, stride_xb, stride_xh, stride_xs,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, PARTS: tl.constexpr, ROUND: tl.constexpr,
    EMAX: tl.constexpr, MBITS: tl.constexpr, MAXN: tl.constexpr, EMIN: tl.constexpr,
    RULE: tl.constexpr, HW_CVT: tl.constexpr, FP8: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """Y[row, :OUT_D] = X[row]·R for rows rb·BLOCK_R.. (h, s) of batch entry b (int64) of X
    [B, H, S, D] (unit last stride).

    ROUND: Y gets the MX-rounded values (1x32 blocks along the padded head_dim) of the fp32
    product, in Y's dtype (bf16: exact); otherwise the fp32 product itself.
    """
    rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    src = b * stride_xb + (rows // S).to(tl.int64) * stride_xh + (rows % S).to(tl.int64) * stride_xs
    rok = rows < H * S
    x = tl.load(X + src[:, None] + offs_d[None, :], mask=rok[:, None] & (offs_d < D)[None, :], other=0.0)
    y = rotate_rows(x, R, offs_d, BLOCK_D, PARTS, INTERP)
    if ROUND:
        y = mx_round_dequant(tl.reshape(y, (BLOCK_R, BLOCK_D // 32, 32)), EMAX, MBITS, MAXN, EMIN, RULE, HW_CVT, FP8)
        y = tl.reshape(y, (BLOCK_R, BLOCK_D))
    dst = Y + (b * H * S + rows[:, None]) * OUT_D + offs_d[None, :]
    tl.store(dst, y.to(Y.dtype.element_ty), mask=rok[:, None] & (offs_d < OUT_D)[None, :])


@triton.jit
def _rotate_kernel(
    X, R, Y, H, S, D, OUT_D, stride_xb, stride_xh, stride_xs,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, PARTS: tl.constexpr, ROUND: tl.constexpr,
    EMAX: tl.constexpr, MBITS: tl.constexpr, MAXN: tl.constexpr, EMIN: tl.constexpr,
    RULE: tl.constexpr, HW_CVT: tl.constexpr, FP8: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """``rotate_tile`` over the grid (row blocks, B)."""
    rotate_tile(
        X, R, Y, tl.program_id(0), tl.program_id(1).to(tl.int64), H, S, D, OUT_D, stride_xb, stride_xh, stride_xs,
        BLOCK_R, BLOCK_D, PARTS, ROUND, EMAX, MBITS, MAXN, EMIN, RULE, HW_CVT, FP8, INTERP,
    )  # fmt: skip


_ROTATIONS: dict = {}


def rotation_operand(d: int, block_d: int, device: torch.device) -> torch.Tensor:
    """R = ``qk_rotation(d)`` as bf16 [block_d, block_d] (zero-padded), kept per device."""
    key = (d, block_d, str(device))
    if key not in _ROTATIONS:
        with torch.device("cpu"):  # built on the host whatever the caller's default device, then moved
            r = torch.zeros(block_d, block_d, dtype=torch.bfloat16)
            r[:d, :d] = qk_rotation(d)
        kept = persistent(lambda: r.to(device), device)
        if kept is None:  # under stream capture: made per call, inside the graph
            return r.to(device)
        _ROTATIONS[key] = kept
    return _ROTATIONS[key]


def _rotation_factored(d: int, block_d: int, device: torch.device) -> tuple[int, torch.Tensor | None]:
    """(NB, operand) for ``rotate_rows_factored``: Hadamard blocks of 32·NB columns; (0, None)
    when the blocks are narrower than 32 (head_dim 40, 80: the full R then)."""
    n = hadamard_block(d)
    if n < 32:
        return 0, None
    key = ("factored", d, block_d, str(device))
    if key not in _ROTATIONS:
        with torch.device("cpu"):  # built on the host whatever the caller's default device, then moved
            r = qk_rotation(d)
            rows = torch.arange(d)
            signs = torch.zeros(block_d)
            signs[:d] = r[rows, rows // n * n]  # R[i, first column of i's block] = s[i]·H[., 0] = s[i]
            host = torch.cat([sylvester_hadamard(32).flatten(), signs]).to(torch.bfloat16)
        kept = persistent(lambda: host.to(device), device)
        if kept is None:  # under stream capture: made per call, inside the graph
            return n // 32, host.to(device)
        _ROTATIONS[key] = kept
    return n // 32, _ROTATIONS[key]


def q_rotation_operand(d: int, block_d: int, device: torch.device) -> tuple[int, torch.Tensor]:
    """The decode kernels' Q rotation operand (ROT_NB, ROT): the factored 2 KB operand (H_32 and the
    signs; 32 KB for R at D=128) where the Hadamard blocks are >= 32 wide, else (0, R)."""
    nb, rot = _rotation_factored(d, block_d, device)
    return (nb, rot) if rot is not None else (0, rotation_operand(d, block_d, device))


@on_input_device
def rotate_qk_rows(
    x: torch.Tensor, *, round_to: tuple[ElemFormat, ScaleRule] | None = None, block_d: int | None = None
) -> torch.Tensor:
    """x [B, H, S, D] (any strides, unit last stride) -> x·``qk_rotation(D)``, contiguous.

    Default: float32 [B, H, S, D]. ``round_to=(elem, rule)``: the MX-rounded rotated values
    (1x32 along head_dim) as bf16 [B, H, S, block_d], zero-padded: the prefill kernel's K operand.
    """
    if x.stride(-1) != 1:
        x = x.contiguous()
    b, h, s, d = x.shape
    bd = block_d or padded_head_dim(d)
    out_d = bd if round_to else d
    y = torch.empty((b, h, s, out_d), dtype=torch.bfloat16 if round_to else torch.float32, device=x.device)
    elem, rule = round_to or (E4M3, ScaleRule.RCEIL)
    block_r = 64
    if y.numel():
        call(
            _rotate_kernel, (cdiv(h * s, block_r), b),
            (x, rotation_operand(d, bd, x.device), y, h, s, d, out_d, x.stride(0), x.stride(1), x.stride(2)),
            dict(BLOCK_R=block_r, BLOCK_D=bd, PARTS=bf16_parts(x.dtype), ROUND=round_to is not None,
                 **mx_round_consts(elem, rule, x.device), INTERP=INTERPRET), num_warps=4,
        )  # fmt: skip
    return y
