"""Decode attention on a 16-bit KV cache: one query token per sequence, a KV head's query heads in one program.

The default recipe keeps the KV cache in bf16, and ``mxq.runtime.fuse``'s grouped SDPA (``grouped_sdpa_forward``)
computes its attention. At one query token that was cuDNN's flash kernel: ~8.7 µs a layer for a
160-token context on an H100 (Qwen3-30B-A3B widths; 19.7 µs for the whole grouped call in a CUDA graph),
most of it fixed cost, paid once a layer and step. ``sdpa_decode`` is the same function in one small
launch, two where the context is split (6.8 µs there; kernels/NOTES.md, "Attention: decode on a bf16 KV
cache"):

    out = softmax(q · kᵀ · scale + mask) · v      q [B, Hq, 1, D], k and v [B, Hkv, N, D]

each query head h reading kv head h // (Hq / Hkv) (``enable_gqa``); the mask [Bm, 1, 1, N] (Bm 1 or B)
is boolean (True attends) or additive, or absent. An additive value at or below ``HIDDEN`` (-6e4: the
fp16, bf16 and fp32 ``finfo.min`` transformers writes, and -inf) hides its key as False does: its
weight is 0 beside any key in view. With attention sinks (gpt-oss: one logit a query head, ``sinks``
[Hq]) the softmax's denominator has one more term, exp(sink), that weighs no value:

    out = Σ_n exp(s_n) · v_n / (exp(sink) + Σ_n exp(s_n))

Scores and the softmax in fp32, the P·V product on 16-bit P (as flash attention), the output in q's
dtype, [B, 1, Hq, D] (the layout transformers' attention functions return). A row with no key to
attend to gives zeros.

The program of (sequence, kv head) puts that kv head's query heads in the rows of one small MMA, so K
and V are read once for all of them. Keys a boolean mask hides are predicated off in the K and V loads
(a masked load reads nothing), so a static cache's unused tail, or the keys outside a sliding window,
cost a mask read, not the K/V bytes; the
key loop is software-pipelined (two stages). Where B·Hkv programs would leave SMs idle and the context
is long, the keys split over programs (``plan_splits``: up to ~4 programs an SM) and
``attention_decode_common.decode_merge_kernel`` merges their partial softmaxes (m and l in the log2
domain). A sink starts the running softmax of the first split (m = sink, l = 1, nothing accumulated), so
the merge needs nothing more.

The registry ``SDPA_DECODE`` chooses between this kernel (``sdpa_decode``) and the torch reference
(``torch.nn.functional.scaled_dot_product_attention``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from mxq.kernels.launch import cdiv, next_pow2
from mxq.kernels.registry import KernelPath, Registry, kernels_spec

try:
    import triton
    import triton.language as tl

    from mxq.kernels.attention_decode_common import decode_merge_kernel
    from mxq.kernels.common import (
        INTERPRET,
        gdc_follow,
        pdl_launch,
        pdl_ok,
        sm_count,
    )
    from mxq.kernels.launch import call

    HAS_TRITON = True
except ImportError:  # no Triton: the reference path only
    HAS_TRITON = False

LOG2E = 1.4426950408889634
MASK_NONE, MASK_BOOL, MASK_ADD = 0, 1, 2
HIDDEN = -6.0e4  # an additive mask value at or below it hides the key (module doc)
BLOCK_N = 64  # keys a loop step
SPLIT_MIN = 128  # keys a split takes at least
INTERPRET_SMS = 132


if HAS_TRITON:

    @triton.jit
    def sdpa_decode_kernel(
        Q, K, V, Mask, Sinks, Out, ML, ACC,
        Hkv, N, D, GROUP, qk_scale, SPLIT_N,
        stride_qb, stride_qh, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
        stride_mb, stride_ob, stride_oh,
        G_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, MASK: tl.constexpr,
        DOT: tl.constexpr, SPLIT: tl.constexpr, NUM_STAGES: tl.constexpr, SINKS: tl.constexpr,
        PDL: tl.constexpr = False,
    ):  # fmt: skip
        """Program (b · Hkv + kv head, split): the kv head's GROUP query rows against keys
        [split · SPLIT_N, +SPLIT_N) (module doc). One split: the normalized rows into Out; several: m, l
        (log2 domain) and the unnormalized rows into ML and ACC, row (b · Hq + h) · nsplit + split.
        PDL: the kernel behind this one (the output projection's GEMM, or the merge) may launch at
        once; this one is launched behind its own predecessor and waits for it before any read."""
        if PDL:
            gdc_follow()
        pid = tl.program_id(0)
        sid = tl.program_id(1)
        nsplit = tl.num_programs(1)
        b = pid // Hkv
        kh = pid % Hkv
        b64 = b.to(tl.int64)
        offs_g = tl.arange(0, G_PAD)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        gmask = offs_g < GROUP
        dmask = offs_d < D
        heads = kh * GROUP + offs_g
        q = tl.load(Q + b64 * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=gmask[:, None] & dmask[None, :], other=0.0)  # fmt: skip
        kbase = K + b64 * stride_kb + kh.to(tl.int64) * stride_kh
        vbase = V + b64 * stride_vb + kh.to(tl.int64) * stride_vh
        mbase = Mask + b64 * stride_mb
        m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
        l_i = tl.zeros((G_PAD,), tl.float32)
        if SINKS:  # the first split's running softmax starts with the sink's term: m = sink, l = 1
            sink = tl.load(Sinks + heads, mask=gmask, other=0.0).to(tl.float32) * 1.4426950408889634
            first = sid == 0
            m_i = tl.where(first, sink, m_i)
            l_i = tl.where(first, 1.0, l_i)
        acc = tl.zeros((G_PAD, BLOCK_D), tl.float32)
        start = sid * SPLIT_N
        end = tl.minimum(start + SPLIT_N, N)
        for n0 in tl.range(start, end, BLOCK_N, num_stages=NUM_STAGES):
            cols = n0 + offs_n
            valid = cols < end
            if MASK == 1:  # masked-off keys are predicated off: a hidden block costs no K/V bytes
                valid = valid & (tl.load(mbase + cols, mask=valid, other=0) != 0)
            if MASK == 2:  # additive: a value at or below HIDDEN hides the key the same way
                add = tl.load(mbase + cols, mask=valid, other=0.0).to(tl.float32)
                valid = valid & (add > -6.0e4)
            kv_mask = valid[:, None] & dmask[None, :]
            k = tl.load(kbase + cols[:, None].to(tl.int64) * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(q.to(DOT), tl.trans(k.to(DOT))) * qk_scale  # log2 domain
            if MASK == 2:
                s += tl.where(valid, add, 0.0) * 1.4426950408889634
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(vbase + cols[:, None].to(tl.int64) * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v.to(DOT))
            m_i = m_new
        if SPLIT:
            Hq = Hkv * GROUP
            row = ((b64 * Hq + heads) * nsplit + sid).to(tl.int64)
            tl.store(ML + row * 2, m_i, mask=gmask)
            tl.store(ML + row * 2 + 1, l_i, mask=gmask)
            tl.store(ACC + row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=gmask[:, None])
        else:
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(Out + b64 * stride_ob + heads[:, None] * stride_oh + offs_d[None, :], out.to(Out.dtype.element_ty),
                     mask=gmask[:, None] & dmask[None, :])  # fmt: skip


class SdpaDecodeProblem(NamedTuple):
    """One decode-attention call as the kernel choice sees it (host facts only)."""

    device: torch.device
    dtype: torch.dtype
    q_len: int
    q_heads: int
    kv_heads: int
    head_dim: int
    mask: int  # MASK_*
    spec: str


def plan_splits(batch: int, kv_heads: int, n: int, sms: int) -> tuple[int, int]:
    """(splits, keys a split) for ``n`` keys: one split for a short context (one launch) or where the
    B·Hkv programs are ~4 an SM already; else splits of >= SPLIT_MIN keys (whole loop steps) up to
    ~4 programs an SM (bandwidth needs bytes in flight: one program a kv head streamed a 2048-key
    context at B=32 in 95 µs on an H100, cuDNN in 54)."""
    programs = batch * kv_heads
    if n <= 2 * SPLIT_MIN or programs >= 4 * sms:
        return 1, n
    want = min(cdiv(n, SPLIT_MIN), cdiv(4 * sms, programs))
    if want <= 1:
        return 1, n
    per = cdiv(cdiv(n, want), BLOCK_N) * BLOCK_N
    return cdiv(n, per), per


def _supports(p: SdpaDecodeProblem) -> bool:
    from mxq.kernels.dispatch import triton_runs

    return (HAS_TRITON and triton_runs(p.device, p.spec) and p.q_len == 1 and p.dtype in (torch.bfloat16, torch.float16)
            and p.q_heads % p.kv_heads == 0 and p.head_dim <= 256 and p.q_heads // p.kv_heads <= 64)  # fmt: skip


def _run_kernel(p: SdpaDecodeProblem, q, k, v, mask, scale, sinks=None):
    b, hq, _, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    group = hq // hkv
    out = torch.empty((b, 1, hq, d), dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if q.stride(-1) != 1:
        q = q.contiguous()
    mk = MASK_NONE if mask is None else (MASK_BOOL if mask.dtype == torch.bool else MASK_ADD)
    if mask is not None:
        mask = mask[..., :n]
        if mask.stride(-1) != 1:
            mask = mask.contiguous()
    stride_mb = 0 if mask is None or mask.shape[0] == 1 else mask.stride(0)
    interp = INTERPRET or q.device.type != "cuda"
    # the interpreter plans for an H100's 132 SMs: CPU tests run the splits a GPU runs
    splits, per = plan_splits(b, hkv, n, INTERPRET_SMS if interp else sm_count(q.device))
    block_d = max(16, next_pow2(d))
    dot = tl.float32 if interp else (tl.bfloat16 if q.dtype == torch.bfloat16 else tl.float16)
    # programmatic dependent launch: the output projection's GEMM streams its first weight tiles while
    # this attention runs (kernels/NOTES.md, "GEMM: decode fixed cost")
    pdl = pdl_ok(q.device)
    consts = dict(G_PAD=max(16, next_pow2(group)), BLOCK_N=BLOCK_N, BLOCK_D=block_d, MASK=mk, DOT=dot, SPLIT=splits > 1,
                  NUM_STAGES=2, SINKS=sinks is not None, PDL=pdl)
    if splits > 1:
        ml = torch.empty((b * hq * splits, 2), dtype=torch.float32, device=q.device)
        acc = torch.empty((b * hq * splits, block_d), dtype=torch.float32, device=q.device)
    else:
        ml = acc = out
    m_arg = mask if mask is not None else out
    if sinks is not None and sinks.stride(0) != 1:
        sinks = sinks.contiguous()
    call(sdpa_decode_kernel, (b * hkv, splits),
         (q, k, v, m_arg, sinks if sinks is not None else out, out, ml, acc, hkv, n, d, group, scale * LOG2E, per,
          q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
          stride_mb, out.stride(0), out.stride(2)),
         consts, num_warps=4, **pdl_launch(consts))  # fmt: skip
    if splits > 1:
        merge = dict(SPLIT_PAD=max(2, next_pow2(splits)), BLOCK_D=block_d, PDL=pdl)
        call(decode_merge_kernel, (b * hq,), (ml, acc, out, hq, d, splits, out.stride(0), out.stride(2)),
             merge, num_warps=4, **pdl_launch(merge))  # fmt: skip
    return out


def sdpa_decode_reference(q, k, v, mask, scale, sinks=None):
    """The function in torch, [B, 1, Hq, D]: ``scaled_dot_product_attention`` with ``enable_gqa``; with
    sinks, the softmax with the sink's column in float32 (additive values at or below ``HIDDEN`` and
    False hide a key; a row with none in view gives zeros, as the kernel)."""
    n = k.shape[2]
    m = mask[..., :n] if mask is not None else None
    if sinks is None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=scale,
                                                               enable_gqa=k.shape[1] != q.shape[1])  # fmt: skip
        return out.transpose(1, 2)
    g = q.shape[1] // k.shape[1]
    kf, vf = k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
    s = (q.float() @ kf.transpose(-1, -2)) * scale
    if m is not None:
        keep = m if m.dtype == torch.bool else m > HIDDEN
        s = torch.where(keep, s if m.dtype == torch.bool else s + m.float(), float("-inf"))
    sink = sinks.float().reshape(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)
    p = torch.softmax(torch.cat([s, sink], -1), -1)[..., :-1]
    return (p @ vf).to(q.dtype).transpose(1, 2)


SDPA_DECODE = Registry("sdpa decode", [
    KernelPath("sdpa_decode", "16-bit KV decode attention: a kv head's query heads in one program, masked blocks skipped, "
               "split-KV where the SMs would idle", _supports, _run_kernel),
    KernelPath("reference", "torch scaled_dot_product_attention", lambda p: True,
               lambda p, q, k, v, mask, scale, sinks=None: sdpa_decode_reference(q, k, v, mask, scale, sinks)),
])  # fmt: skip


def sdpa_decode_problem(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, kernels: str | None) -> SdpaDecodeProblem:
    mk = MASK_NONE if mask is None else (MASK_BOOL if mask.dtype == torch.bool else MASK_ADD)
    return SdpaDecodeProblem(q.device, q.dtype, q.shape[2], q.shape[1], k.shape[1], q.shape[3], mk, kernels_spec(kernels))


def run_path(path: KernelPath, p: SdpaDecodeProblem, q, k, v, mask, scale: float, sinks=None) -> torch.Tensor:
    """Run a path ``SDPA_DECODE`` chose for ``p`` (a caller that chose already calls this, not ``sdpa_decode``)."""
    if path.name != "reference" and q.device.type == "cuda":
        with torch.cuda.device(q.device):
            return path.run(p, q, k, v, mask, scale, sinks)
    return path.run(p, q, k, v, mask, scale, sinks)


def sdpa_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                scale: float | None = None, kernels: str | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Attention of one query token (module doc): q [B, Hq, 1, D], k and v [B, Hkv, N, D], mask
    [Bm, 1, 1, >= N] bool or additive, or None, sinks [Hq] or None -> [B, 1, Hq, D] in q's dtype."""
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"sdpa_decode: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} are not "
                         "[B, Hq, 1, D], [B, Hkv, N, D], [B, Hkv, N, D]")  # fmt: skip
    if sinks is not None and tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(f"sdpa_decode: sinks {tuple(sinks.shape)} are not one logit a query head ({q.shape[1]},)")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    p = sdpa_decode_problem(q, k, mask, kernels)
    return run_path(SDPA_DECODE.choose(p, p.spec), p, q, k, v, mask, scale, sinks)
