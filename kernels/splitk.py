"""The GEMMs' split of K: programs that each sum a part of K, and how their partials meet.

- ``split_k_sizes(k, split_k, block_k)``: (splits, K per split, whether no K tile is partial);
- ``split_k_plan``: those, and where the kernel writes: Y itself, or fp32 partials [splits, M, N];
- ``split_k_finish``: the partials summed, with the bias and the cast, by one reduction launch
  (behind the GEMM by programmatic dependent launch where asked);
- ``split_k_epilogue`` (``@triton.jit``; the Gluon decode GEMM calls it too): a decode GEMM's fp32
  Yᵀ tile out, the partials summed by the split that takes the last ticket (one launch, no
  reduction kernel; the tickets are ``buffers.split_counters``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mxq.kernels.common import gdc_follow, pdl_ok
from mxq.kernels.launch import cdiv
from mxq.kernels.toolchain import configure_ptxas


@triton.jit
def _splitk_reduce_kernel(
    p_ptr, b_ptr, y_ptr, MN, N,
    SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    if PDL:
        gdc_follow()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in tl.static_range(SPLIT_K):
        acc += tl.load(p_ptr + i * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def split_k_sizes(k: int, split_k: int, block_k: int) -> tuple[int, int, bool]:
    """(splits, K per split (a multiple of block_k), whether no K tile is partial) for at most
    ``split_k`` splits of K."""
    split = max(1, min(split_k, cdiv(k, block_k)))
    k_split = cdiv(cdiv(k, split), block_k) * block_k
    return cdiv(k, k_split), k_split, k % block_k == 0 and k_split % block_k == 0


def split_k_plan(y: torch.Tensor, k: int, split_k: int, block_k: int):
    """``split_k_sizes`` and where the kernel writes: y itself, or float32 partials
    [splits, M, N] for ``split_k_finish``."""
    split, k_split, even_k = split_k_sizes(k, split_k, block_k)
    target = y if split == 1 else torch.empty((split, *y.shape), dtype=torch.float32, device=y.device)
    return split, k_split, even_k, target


def split_k_finish(target: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None, split: int,
                   pdl: bool = False) -> torch.Tensor:  # fmt: skip
    """Sum the split-K partials (+ bias) into y; nothing to do without a split. ``pdl``: launched
    behind the GEMM that wrote them (programmatic dependent launch, where ``pdl_ok``)."""
    if split > 1:
        block, mn = 1024, y.numel()
        pdl = pdl and pdl_ok(y.device)
        configure_ptxas()
        _splitk_reduce_kernel[(triton.cdiv(mn, block),)](
            target, bias if bias is not None else target, y, mn, y.shape[1],
            SPLIT_K=split, BLOCK=block, HAS_BIAS=bias is not None, PDL=pdl, num_warps=4, launch_pdl=pdl,
        )  # fmt: skip
    return y


@triton.jit
def split_k_epilogue(
    acc, zero, b_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, stride_ym, pid_n, pid_k, offs_n, offs_m, nmask, mmask,
    SPLIT: tl.constexpr, FUSED: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """A decode GEMM's fp32 Yᵀ tile ``acc`` [BLOCK_N, BLOCK_M] (rows ``offs_n`` of N, columns
    ``offs_m`` of M) out: without a split straight to Y (+ bias); else this split's fp32 partial
    into ``ws_ptr`` [SPLIT, M, N] (stored from the accumulator layout, transposed addresses) and,
    FUSED, the split that takes the last ticket of ``cnt_ptr[pid_n]`` sums the partials in split
    order, adds the bias, writes Y and resets the ticket: one launch, no reduction kernel.
    ``zero``: zeros shaped like acc (in Gluon, in acc's layout). Shared by ``gemm_decode`` and the
    Gluon ``gemm_decode_ws``."""
    mask_t = nmask[:, None] & mmask[None, :]
    y_offs_t = offs_m.to(tl.int64)[None, :] * stride_ym + offs_n[:, None]
    if SPLIT == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptr + y_offs_t, acc.to(y_ptr.dtype.element_ty), mask=mask_t)
    else:
        tl.store(ws_ptr + pid_k.to(tl.int64) * M * N + y_offs_t, acc, mask=mask_t)
        if FUSED:
            tl.debug_barrier()  # every thread's partial is stored before the release below
            ticket = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if ticket == SPLIT - 1:
                tot = zero
                for s in tl.static_range(SPLIT):  # split order: the same sum whoever is last
                    tot += tl.load(ws_ptr + s * M * N + y_offs_t, mask=mask_t, other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    tot += tl.load(b_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[:, None]
                tl.store(y_ptr + y_offs_t, tot.to(y_ptr.dtype.element_ty), mask=mask_t)
                tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")  # ready for the next call
