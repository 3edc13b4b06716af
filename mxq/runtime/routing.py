"""MoE routers in one kernel, and Llama 4's MoE block on the chosen experts only (``mxq.runtime.fuse`` step 5).

A router class whose forward is one of ``ROUTER_RULES`` (``mxq.runtime.install.forward_hash``: a release that changes it keeps its own forward, with a warning for the
classes of ``ROUTERS``; other classes with the very same forward source, DeepSeek-V3's in a dozen
families, get the rule too) gets a forward that computes the same logits with the same GEMM and
everything after them in one kernel (``mxq.kernels.moe_router``; the ops ``mxq::router_topk`` and
``mxq::router_group_topk``): five to a dozen launches fewer per layer. On a CPU, or with the
router's weight a DTensor, the module's own forward runs. The rules, as transformers 5.17-5.24
write them:
- Qwen3-MoE, Qwen2-MoE, OLMoE: softmax in float32, top k, divided by their sum if ``norm_topk_prob``,
  cast to the logits' dtype;
- Mixtral: the same, always divided, kept in float32;
- gpt-oss: the logits with the router's bias, top k, softmax over those k, in the logits' dtype;
- DeepSeek-V3, GLM-4-MoE (and every class with their forward): a float32 GEMM, sigmoid scores, the
  choice on the scores plus ``e_score_correction_bias`` among the ``topk_group`` best of ``num_group``
  groups, weights divided by their sum if ``norm_topk_prob``, times ``routed_scaling_factor``.

Llama 4's router returns dense [T, E] scores (-inf → 0 where not chosen) and its MoE block runs every
expert on every token, scaled by those scores (transformers' ``Llama4TextMoe``): E / k times the
expert work of the tokens' choice. A ``Llama4TextMoe`` whose forward and router are the known ones
(``LLAMA4_MOE``) and whose experts are ``MXExperts`` gets ``_llama4_moe_forward``: the same function
on the chosen rows only (an unchosen expert's row is zero in and zero out, and adds nothing).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch import nn

from mxq.runtime.install import forward_hash, install_forward, restore_forward, warn_unknown_forward

ROUTERS = ("Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter", "OlmoeTopKRouter", "MixtralTopKRouter", "GptOssTopKRouter",
           "DeepseekV3TopkRouter", "Glm4MoeTopkRouter")  # fmt: skip


class RouterRule(NamedTuple):
    kind: str  # ``mxq.kernels.moe_router``: "softmax", "topk_softmax", or "group_sigmoid" (DeepSeek-V3)
    norm: bool | str  # always, never, or the module attribute that says
    cast: bool  # weights in the logits' dtype (else float32)
    bias: bool  # the router's bias is added to the logits
    flat: bool  # the forward flattens the tokens to [T, H] first


ROUTER_RULES = {
    "0b6a7b1ab2be0f92": RouterRule("softmax", "norm_topk_prob", True, False, True),
    "bfaa8bbbaf2564e5": RouterRule("softmax", True, False, False, True),
    "471f06ea0bac9fc6": RouterRule("topk_softmax", False, True, True, False),
    "b70233da004197b2": RouterRule("group_sigmoid", "norm_topk_prob", False, False, True),
}
LLAMA4_MOE = ("6f9863fcc8313ee9", "e67ac26ae72620fe")  # Llama4TextMoe.forward, Llama4Router.forward


@functools.cache
def known_router(cls: type) -> RouterRule | None:
    """The rule of a router class whose forward mxq knows; None (and a warning, once, for a class of
    ``ROUTERS`` whose forward changed) otherwise."""
    if not cls.__name__.endswith("Router") or not issubclass(cls, nn.Module):
        return None
    rule = ROUTER_RULES.get(forward_hash(cls))
    if rule is None and cls.__name__ in ROUTERS:
        warn_unknown_forward(cls, "fused top-k kernel")
    return rule


@functools.cache
def known_llama4_moe(cls: type, router: type) -> bool:
    return cls.__name__ == "Llama4TextMoe" and (forward_hash(cls), forward_hash(router)) == LLAMA4_MOE


def fuse_routers(model: nn.Module) -> list[str]:
    """Give each known router (``known_router``) the one-kernel forward, and each known Llama 4 MoE
    block with MX experts the forward that runs the chosen experts only (module doc)."""
    from mxq.runtime.experts import MXExperts

    done = []
    for name, m in model.named_modules():
        rule = known_router(type(m))
        if rule is not None and "_mxq_router" not in m.__dict__:
            if install_forward(m, _router_forward, "fuse"):
                m.__dict__["_mxq_router"] = rule
                done.append(f"{name} (router)")
        elif (isinstance(getattr(m, "experts", None), MXExperts) and "_mxq_router" not in m.__dict__
              and known_llama4_moe(type(m), type(getattr(m, "router", None)))):  # fmt: skip
            if install_forward(m, _llama4_moe_forward, "fuse"):
                m.__dict__["_mxq_router"] = "llama4"
                done.append(f"{name} (router, chosen experts only)")
    return done


def unfuse_routers(model: nn.Module) -> None:
    for m in model.modules():
        if m.__dict__.pop("_mxq_router", None) is not None:
            restore_forward(m, "fuse")


def _on_kernels(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a router's choice runs in the kernels: on a GPU, with a plain (not a DTensor) weight."""
    return x.is_cuda and type(weight).__name__ != "DTensor"


def _router_forward(self, hidden_states: torch.Tensor):
    if not _on_kernels(hidden_states, self.weight):
        return type(self).forward(self, hidden_states)
    return fused_router_forward(self, hidden_states, self.__dict__["_mxq_router"])


def fused_router_forward(self, hidden_states: torch.Tensor, rule: RouterRule):
    """The router's (logits, weights, indices) by ``rule``: its GEMM, then ``mxq::router_topk`` (or
    ``mxq::router_group_topk``)."""
    lead = hidden_states.shape[:-1]
    h = hidden_states.reshape(-1, hidden_states.shape[-1])
    norm = rule.norm if isinstance(rule.norm, bool) else bool(getattr(self, rule.norm))
    op = torch.compiler.is_compiling()  # the op: opaque to the compiler; eager calls skip its dispatch
    if rule.kind == "group_sigmoid":
        logits = torch.nn.functional.linear(h.float(), self.weight.float())
        args = (logits, self.e_score_correction_bias, int(self.top_k), int(self.num_group), int(self.topk_group), norm,
                float(self.routed_scaling_factor))  # fmt: skip
        weights, index = router_group_topk_op(*args) if op else _router_group_topk(*args)
    else:
        logits = torch.nn.functional.linear(h, self.weight, self.bias if rule.bias else None)
        args = (logits, int(self.top_k), rule.kind, norm, rule.cast)
        weights, index = router_topk_op(*args) if op else _router_topk(*args)
    if not rule.flat:
        logits, weights, index = (t.reshape(*lead, t.shape[-1]) for t in (logits, weights, index))
    return logits, weights, index


def _llama4_moe_forward(self, hidden_states: torch.Tensor):
    """``Llama4TextMoe.forward`` on the chosen experts' rows (module doc): the router's GEMM, its
    top k with their sigmoids (one kernel on a GPU), each chosen row scaled as transformers scales it,
    the experts by their index, the k rows of a token summed, the shared expert added."""
    from mxq.kernels.moe_router import router_topk_reference

    h = hidden_states.reshape(-1, self.hidden_dim)
    logits = torch.nn.functional.linear(h, self.router.weight, self.router.bias)
    k = int(self.router.top_k)
    if not _on_kernels(h, self.router.weight):
        scores, index = router_topk_reference(logits, k, "topk_sigmoid", False, logits.dtype)
    elif torch.compiler.is_compiling():
        scores, index = router_topk_op(logits, k, "topk_sigmoid", False, True)
    else:
        scores, index = _router_topk(logits, k, "topk_sigmoid", False, True)
    rows = (h.unsqueeze(1) * scores.unsqueeze(-1)).reshape(-1, h.shape[-1])  # token-major: row t·k + j
    y = self.experts(rows, index.reshape(-1, 1), scores.new_ones((rows.shape[0], 1)))
    routed = y if k == 1 else y.view(-1, k, y.shape[-1]).sum(1)
    out = self.shared_expert(h)
    out.add_(routed)
    return out, logits


@torch.library.custom_op("mxq::router_topk", mutates_args=())
def router_topk_op(logits: torch.Tensor, k: int, rule: str, normalize: bool,
                   cast: bool) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``mxq.kernels.moe_router.router_topk`` as a torch custom op (opaque to ``torch.compile``)."""
    return _router_topk(logits, k, rule, normalize, cast)


def _router_topk(logits, k, rule, normalize, cast):
    from mxq.kernels.moe_router import router_topk

    return router_topk(logits, k, rule, normalize, logits.dtype if cast else torch.float32)


@router_topk_op.register_fake
def _router_topk_fake(logits, k, rule, normalize, cast):
    t = logits.shape[0]
    return (logits.new_empty((t, k), dtype=logits.dtype if cast else torch.float32),
            logits.new_empty((t, k), dtype=torch.int64))  # fmt: skip


@torch.library.custom_op("mxq::router_group_topk", mutates_args=())
def router_group_topk_op(logits: torch.Tensor, bias: torch.Tensor, k: int, n_group: int, topk_group: int,
                         normalize: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``mxq.kernels.moe_router.router_group_topk`` as a torch custom op."""
    return _router_group_topk(logits, bias, k, n_group, topk_group, normalize, scale)


def _router_group_topk(logits, bias, k, n_group, topk_group, normalize, scale):
    from mxq.kernels.moe_router import router_group_topk

    return router_group_topk(logits, bias, k, n_group, topk_group, normalize, scale)


@router_group_topk_op.register_fake
def _router_group_topk_fake(logits, bias, k, n_group, topk_group, normalize, scale):
    t = logits.shape[0]
    return logits.new_empty((t, k), dtype=torch.float32), logits.new_empty((t, k), dtype=torch.int64)
