"""The router's choice in one launch: top-k and the routing weights of an MoE layer.

transformers' routers compute the router logits with one GEMM and then, in torch, a softmax, a top-k
(two kernels on a GPU: a radix select and a sort), a normalisation and a cast: five launches of a few
microseconds each per layer, as long as a decode step's whole experts GEMM at one token.
``router_topk`` does everything after the GEMM in one program per token, by the rule of the family
(``mxq.runtime.fuse``, "routers"):

- ``"softmax"`` (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral): p = softmax(logits) in float32, the k
  largest, optionally divided by their sum;
- ``"topk_softmax"`` (gpt-oss): the k largest logits, then the softmax over those k in float32;
- ``"topk_sigmoid"`` (Llama 4): the k largest logits, each through a sigmoid in float32.

The weights come out in ``out_dtype`` (the family's cast), the indices as int64 in descending order
of the logits, a tie going to the lower index. The k experts are chosen on the logits, which order
exactly as the probabilities do (softmax and sigmoid are monotonic; choosing on rounded probabilities
could only add ties).

``router_group_topk`` is DeepSeek-V3's rule (GLM-4-MoE's too): sigmoid scores, the choice made on the
scores plus a per-expert correction bias, only among the ``topk_group`` groups whose two best such
values sum highest; the weights are the chosen experts' scores (without the bias), optionally divided
by their sum, times a scaling factor, in float32.

``router_topk_reference`` and ``router_group_topk_reference`` are the same functions in torch, as the
families write them.
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
    SIGMOID: tl.constexpr,
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
    elif SIGMOID:
        vals = 1.0 / (1.0 + tl.exp(-vals))
    else:
        top = tl.max(tl.where(km, vals, float("-inf")), axis=0)
        e = tl.where(km, tl.exp(vals - top), 0.0)
        vals = e / tl.sum(e, axis=0)
    tl.store(w_ptr + t * K + ko, vals.to(w_ptr.dtype.element_ty), mask=km)
    tl.store(i_ptr + t * K + ko, idxs.to(tl.int64), mask=km)


@jit
def router_group_topk_kernel(
    l_ptr, b_ptr, w_ptr, i_ptr, G, S, stride_l, scale,
    K: tl.constexpr, KP2: tl.constexpr, GP2: tl.constexpr, SP2: tl.constexpr, TOPK_GROUP: tl.constexpr,
    NORM: tl.constexpr,
):  # fmt: skip
    """Token t's k experts by DeepSeek-V3's rule (module doc): one program, the logits as a [group,
    member] tile in registers (expert g·S + j)."""
    t = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, GP2)
    j = tl.arange(0, SP2)
    m = (g[:, None] < G) & (j[None, :] < S)
    e = g[:, None] * S + j[None, :]
    x = tl.load(l_ptr + t * stride_l + e, mask=m, other=0.0).to(tl.float32)
    p = 1.0 / (1.0 + tl.exp(-x))
    c = tl.where(m, p + tl.load(b_ptr + e, mask=m, other=0.0).to(tl.float32), float("-inf"))
    # a group's score: its two largest biased scores
    m1 = tl.max(c, axis=1)
    j1 = tl.min(tl.where(c == m1[:, None], j[None, :], SP2), axis=1)
    m2 = tl.max(tl.where(j[None, :] == j1[:, None], float("-inf"), c), axis=1)
    gs = tl.where(g < G, m1 + m2, float("-inf"))
    chosen = g < 0
    for _ in tl.static_range(TOPK_GROUP):
        best = tl.max(gs, axis=0)
        bg = tl.min(tl.where(gs == best, g, GP2), axis=0)
        chosen = chosen | (g == bg)
        gs = tl.where(g == bg, float("-inf"), gs)
    c = tl.where(chosen[:, None] & m, c, float("-inf"))
    ko = tl.arange(0, KP2)
    vals = tl.zeros((KP2,), tl.float32)
    idxs = tl.zeros((KP2,), tl.int32)
    for r in tl.static_range(K):
        best = tl.max(tl.max(c, axis=1), axis=0)
        bi = tl.min(tl.min(tl.where((c == best) & m, e, GP2 * SP2), axis=1), axis=0)
        pick = tl.sum(tl.sum(tl.where((e == bi) & m, p, 0.0), axis=1), axis=0)
        vals = tl.where(ko == r, pick, vals)
        idxs = tl.where(ko == r, bi, idxs)
        c = tl.where(e == bi, float("-inf"), c)
    km = ko < K
    if NORM:
        vals = vals / (tl.sum(tl.where(km, vals, 0.0), axis=0) + 1e-20)
    vals = vals * scale
    tl.store(w_ptr + t * K + ko, vals, mask=km)
    tl.store(i_ptr + t * K + ko, idxs.to(tl.int64), mask=km)


RULES = ("softmax", "topk_softmax", "topk_sigmoid")


def router_topk_reference(logits: torch.Tensor, k: int, rule: str, normalize: bool,
                          out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``router_topk`` in torch: the families' own arithmetic."""
    if rule == "softmax":
        v, i = torch.topk(torch.softmax(logits.float(), dim=-1), k, dim=-1)
        if normalize:
            v = v / v.sum(dim=-1, keepdim=True)
    else:
        v, i = torch.topk(logits, k, dim=-1)
        v = torch.softmax(v.float(), dim=-1) if rule == "topk_softmax" else torch.sigmoid(v.float())
    return v.to(out_dtype), i


def router_topk(logits: torch.Tensor, k: int, rule: str, normalize: bool,
                out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The routing weights [T, k] in ``out_dtype`` and expert indices [T, k] (int64) from the router
    logits [T, E] (module doc): one launch where Triton runs (a CUDA tensor, or the interpreter),
    else ``router_topk_reference``."""
    t, e = logits.shape
    if not 1 <= k <= e:
        raise ValueError(f"router_topk: k={k} for {e} experts")
    if rule not in RULES:
        raise ValueError(f"router_topk: rule {rule!r} is none of {', '.join(RULES)}")
    if not _kernel_runs(logits):
        return router_topk_reference(logits, k, rule, normalize, out_dtype)
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    w = torch.empty((t, k), dtype=out_dtype, device=logits.device)
    i = torch.empty((t, k), dtype=torch.int64, device=logits.device)
    if t:
        ep2 = max(16, next_pow2(e))
        call(router_topk_kernel, (t,), (logits, w, i, e, logits.stride(0)),
             dict(K=k, EP2=ep2, KP2=max(2, next_pow2(k)), SOFTMAX_FIRST=rule == "softmax", NORM=normalize,
                  SIGMOID=rule == "topk_sigmoid"),
             num_warps=4 if ep2 <= 256 else 8)  # fmt: skip
    return w, i


def router_group_topk_reference(logits: torch.Tensor, bias: torch.Tensor, k: int, n_group: int, topk_group: int,
                                normalize: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``router_group_topk`` in torch: DeepSeek-V3's arithmetic (float32 throughout)."""
    t, e = logits.shape
    p = logits.float().sigmoid()
    c = p + bias.float()
    groups = c.view(t, n_group, e // n_group).topk(2, dim=-1).values.sum(-1)
    keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, groups.topk(topk_group, dim=-1).indices, True)
    c = c.masked_fill(~keep.repeat_interleave(e // n_group, dim=1), float("-inf"))
    i = c.topk(k, dim=-1).indices
    w = p.gather(1, i)
    if normalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * scale, i


def router_group_topk(logits: torch.Tensor, bias: torch.Tensor, k: int, n_group: int, topk_group: int,
                      normalize: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The routing weights [T, k] (float32) and expert indices [T, k] (int64) by DeepSeek-V3's rule
    (module doc) from the router logits [T, E] and the correction bias [E]: one launch where Triton
    runs, else ``router_group_topk_reference``. Indices in descending order of the biased scores, a
    tie going to the lower index (groups likewise)."""
    t, e = logits.shape
    if n_group < 1 or e % n_group or e // n_group < 2 or not 1 <= topk_group <= n_group:
        raise ValueError(f"router_group_topk: {e} experts in {n_group} groups, {topk_group} chosen (need >= 2 a group)")
    if not 1 <= k <= topk_group * (e // n_group):
        raise ValueError(f"router_group_topk: k={k} for {topk_group} groups of {e // n_group} experts")
    if not _kernel_runs(logits):
        return router_group_topk_reference(logits, bias, k, n_group, topk_group, normalize, scale)
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    w = torch.empty((t, k), dtype=torch.float32, device=logits.device)
    i = torch.empty((t, k), dtype=torch.int64, device=logits.device)
    if t:
        gp2, sp2 = max(2, next_pow2(n_group)), max(16, next_pow2(e // n_group))
        call(router_group_topk_kernel, (t,), (logits, bias.contiguous(), w, i, n_group, e // n_group, logits.stride(0), float(scale)),
             dict(K=k, KP2=max(2, next_pow2(k)), GP2=gp2, SP2=sp2, TOPK_GROUP=topk_group, NORM=normalize),
             num_warps=4 if gp2 * sp2 <= 256 else 8)  # fmt: skip
    return w, i


def _kernel_runs(logits: torch.Tensor) -> bool:
    """Whether the kernels run on ``logits``: Triton, a CUDA tensor or the interpreter, and the E logits
    of a token fit one program's registers."""
    if not HAS_TRITON or logits.shape[1] > 4096:
        return False
    from mxq.kernels.common import INTERPRET

    return logits.is_cuda or bool(INTERPRET)
