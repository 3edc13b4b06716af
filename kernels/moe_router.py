"""The router's choice in one launch: softmax, top-k and the routing weights of an MoE layer.

transformers' routers compute the router logits with one GEMM and then, in torch, a softmax, a top-k
(two kernels on a GPU: a radix select and a sort), a normalisation and a cast: five launches of a few
microseconds each per layer, as long as a decode step's whole experts GEMM at one token.
``router_topk`` does everything after the GEMM in one program per token, for the two rules the
known families use (``mxq.fuse``, "routers"):

- ``softmax_first`` (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral): p = softmax(logits) in float32, the k
  largest, optionally divided by their sum;
- otherwise (gpt-oss): the k largest logits, then the softmax over those k in float32.

The weights come out in ``out_dtype`` (the family's cast), the indices as int64 in descending order
of the logits, a tie going to the lower index. The k experts are chosen on the logits, which order
exactly as the probabilities do (the softmax is monotonic; choosing on rounded probabilities could
only add ties). ``router_topk_reference`` is the same function in torch, as the families write it.
"""

from __future__ import annotations

import torch

try:
    import triton.language as tl

    from mxq.kernels.launch import call, next_pow2
    from mxq.kernels.moe import HAS_TRITON, jit
except ImportError:  # no triton: the reference runs
    HAS_TRITON = False

    def jit(fn):
        return fn


@jit
def router_topk_kernel(
    l_ptr, w_ptr, i_ptr, E, stride_l,
    K: tl.constexpr, EP2: tl.constexpr, KP2: tl.constexpr, SOFTMAX_FIRST: tl.constexpr, NORM: tl.constexpr,
):  # fmt: skip
    """Token t's k experts and weights (module doc): one program, its E logits in registers."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, EP2)
    m = offs < E
    x = tl.load(l_ptr + t * stride_l + offs, mask=m, other=float("-inf")).to(tl.float32)
    if SOFTMAX_FIRST:
        mx = tl.max(x, axis=0)
        p = tl.exp(x - mx)
        p = p / tl.sum(p, axis=0)
    ko = tl.arange(0, KP2)
    vals = tl.zeros((KP2,), tl.float32)
    idxs = tl.zeros((KP2,), tl.int32)
    v = tl.where(m, x, float("-inf"))
    for j in tl.static_range(K):
        best = tl.max(v, axis=0)
        bi = tl.min(tl.where(v == best, offs, EP2), axis=0)  # the lowest index among equal logits
        if SOFTMAX_FIRST:
            pick = tl.sum(tl.where(offs == bi, p, 0.0), axis=0)
        else:
            pick = best
        vals = tl.where(ko == j, pick, vals)
        idxs = tl.where(ko == j, bi, idxs)
        v = tl.where(offs == bi, float("-inf"), v)
    km = ko < K
    if SOFTMAX_FIRST:
        if NORM:
            vals = vals / tl.sum(tl.where(km, vals, 0.0), axis=0)
    else:
        top = tl.max(tl.where(km, vals, float("-inf")), axis=0)
        e = tl.where(km, tl.exp(vals - top), 0.0)
        vals = e / tl.sum(e, axis=0)
    tl.store(w_ptr + t * K + ko, vals.to(w_ptr.dtype.element_ty), mask=km)
    tl.store(i_ptr + t * K + ko, idxs.to(tl.int64), mask=km)


def router_topk_reference(logits: torch.Tensor, k: int, softmax_first: bool, normalize: bool,
                          out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``router_topk`` in torch: the families' own arithmetic."""
    if softmax_first:
        v, i = torch.topk(torch.softmax(logits.float(), dim=-1), k, dim=-1)
        if normalize:
            v = v / v.sum(dim=-1, keepdim=True)
    else:
        v, i = torch.topk(logits, k, dim=-1)
        v = torch.softmax(v.float(), dim=-1)
    return v.to(out_dtype), i


def router_topk(logits: torch.Tensor, k: int, softmax_first: bool, normalize: bool,
                out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The routing weights [T, k] in ``out_dtype`` and expert indices [T, k] (int64) from the router
    logits [T, E] (module doc): one launch where Triton runs (a CUDA tensor, or the interpreter),
    else ``router_topk_reference``."""
    t, e = logits.shape
    if not 1 <= k <= e:
        raise ValueError(f"router_topk: k={k} for {e} experts")
    if not HAS_TRITON or not (logits.is_cuda or _interpreting()) or e > 4096:
        return router_topk_reference(logits, k, softmax_first, normalize, out_dtype)
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    w = torch.empty((t, k), dtype=out_dtype, device=logits.device)
    i = torch.empty((t, k), dtype=torch.int64, device=logits.device)
    if t:
        ep2 = max(16, next_pow2(e))
        call(router_topk_kernel, (t,), (logits, w, i, e, logits.stride(0)),
             dict(K=k, EP2=ep2, KP2=max(2, next_pow2(k)), SOFTMAX_FIRST=softmax_first, NORM=normalize),
             num_warps=4 if ep2 <= 256 else 8)  # fmt: skip
    return w, i


def _interpreting() -> bool:
    from mxq.kernels.common import INTERPRET

    return bool(INTERPRET)
