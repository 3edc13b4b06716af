"""Routed experts in MXFP8: ``MXExperts`` and how a model's experts are found.

transformers 5 holds the routed experts of a mixture-of-experts layer as one module with 3-D
parameters, whatever the checkpoint's layout on disk: ``gate_up_proj`` [E, 2I, H] (or ``up_proj``
for experts without a gate) and ``down_proj`` [E, H, I]; gpt-oss and Llama 4 store them transposed
([E, K, N]) and gpt-oss adds biases and interleaves gate and up. ``MXExperts`` replaces such a
module and holds, for every projection, fp8 codes [E, N, K] and uint8 E8M0 scales [E, N, K/32]
(``<proj>`` and ``<proj>_scale``): blocks along K, the reduction axis, for every layout. Biases
stay in the model's dtype. The router, top-k, routing weights, shared experts and their gates stay
the model's own and in high precision: only the experts module is swapped.

``forward`` takes both calling conventions transformers uses: ``(hidden, top_k_index,
top_k_weights)`` (every family decorated with ``use_experts_implementation``) and Llama 4's
``(routed)``: hidden states already repeated per expert and scaled ([E·T, H], expert-major). Token
rows are sorted by expert and both projections run as one grouped MX GEMM each
(``mxq.kernels.moe.mx_grouped_linear``), with the family's own gate between them (its
``_apply_gate``: SiLU(gate)·up, gpt-oss's clamped GLU on interleaved columns, ...). The torch
reference of the grouped GEMM is a per-expert loop over dequantized weights: the numerics.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
from torch import nn

from mxq.compat import experts_gate
from mxq.formats import MXTensor, ScaleRule, quantize_mx
from mxq.kernels.registry import kernels_spec
from mxq.recipe import TensorSpec
from mxq.runtime.linear import TIED_TO_EMBEDDING

GATED, UNGATED = ("gate_up_proj", "down_proj"), ("up_proj", "down_proj")
SCALE_SUFFIX = "_scale"  # codes ``<proj>``, scales ``<proj>_scale`` (fused layout, in memory and on disk)
# attributes of a transformers experts module that its gate or activation reads (gpt-oss: alpha, limit)
_PLAIN_ATTRS = (int, float, bool, str, type(None))


@dataclass(frozen=True)
class ExpertsLayer:
    """One experts module as selection and the converter see it.

    ``projections``: in-memory parameter names, in order; ``shapes``: each one's per-expert
    (N, K) with K the reduction axis; ``transposed``: the model stores [E, K, N]."""

    name: str
    num_experts: int
    projections: tuple[str, ...]
    shapes: tuple[tuple[int, int], ...]
    transposed: bool
    has_bias: bool


def is_experts(module: nn.Module) -> bool:
    """A module holding routed experts as 3-D parameters (``gate_up_proj``/``up_proj`` and ``down_proj``)."""
    if isinstance(module, MXExperts):
        return True
    p = module._parameters
    down = p.get("down_proj")
    up = p.get("gate_up_proj", p.get("up_proj"))
    return down is not None and up is not None and down.dim() == 3 and up.dim() == 3


def _transposed(module: nn.Module, projections: tuple[str, ...]) -> bool:
    """[E, K, N] storage: the decorator's flag where transformers sets it, else read off the shapes
    (up [E, a, b] and down [E, c, d] chain as b == c when stored [E, N, K], a == d when transposed;
    both at once would need 2I == I)."""
    flag = getattr(module, "is_transposed", None)
    if isinstance(flag, bool):
        return flag
    up, down = (module._parameters[p].shape for p in projections)
    return up[1] == down[2] and up[2] != down[1]


def experts_layer(name: str, module: nn.Module) -> ExpertsLayer:
    """The description of the experts module ``module`` (named ``name`` in its model)."""
    if isinstance(module, MXExperts):
        return ExpertsLayer(name, module.num_experts, module.projections,
                            tuple(tuple(getattr(module, p).shape[1:]) for p in module.projections), False, module.has_bias)  # fmt: skip
    projections = GATED if "gate_up_proj" in module._parameters else UNGATED
    transposed = _transposed(module, projections)
    shapes = []
    for p in projections:
        e, a, b = module._parameters[p].shape
        shapes.append((b, a) if transposed else (a, b))
    has_bias = any(module._parameters.get(p + "_bias") is not None for p in projections)
    return ExpertsLayer(name, int(module._parameters[projections[0]].shape[0]), projections, tuple(shapes), transposed, has_bias)


def experts_layers(model: nn.Module) -> dict[str, ExpertsLayer]:
    """Every experts module of ``model`` by name."""
    return {n: experts_layer(n, m) for n, m in model.named_modules() if is_experts(m)}


def canonical(w: torch.Tensor, transposed: bool) -> torch.Tensor:
    """An experts parameter as [E, N, K] (K, the reduction axis, last)."""
    return w.transpose(1, 2) if transposed else w


def quantize_experts_weight(w: torch.Tensor, spec: TensorSpec, block_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] (or one expert's [N, K]) -> fp8 codes of the same shape and uint8 scales [..., K/bs]."""
    q = quantize_mx(w.contiguous(), -1, spec.elem, block_size, spec.scale_rule)
    return q.data, q.scales


@torch.library.custom_op("mxq::mx_grouped_linear", mutates_args=())
def mx_grouped_linear_op(
    x: torch.Tensor, group_end: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
    bias: torch.Tensor | None, act_elem: str, act_rule: str, block_size: int, kernels: str = "",
) -> torch.Tensor:  # fmt: skip
    """``mxq.kernels.moe.mx_grouped_linear`` as a torch custom op (``act_elem`` "" = bf16 activations)."""
    from mxq.formats import as_elem_format, as_scale_rule
    from mxq.kernels.moe import mx_grouped_linear

    return mx_grouped_linear(
        x, group_end, weight, weight_scale, bias, act_elem=as_elem_format(act_elem) if act_elem else None,
        act_rule=as_scale_rule(act_rule), block_size=block_size, kernels=kernels or None,
    )  # fmt: skip


@mx_grouped_linear_op.register_fake
def _mx_grouped_linear_fake(x, group_end, weight, weight_scale, bias, act_elem, act_rule, block_size, kernels=""):
    return x.new_empty(x.shape[0], weight.shape[1])


def _moe_experts(x, top_k_index, top_k_weights, w1, s1, b1, w2, s2, b2, gate: int, alpha: float, limit: float,
                 act_elem: str, act_rule: str, block_size: int) -> torch.Tensor:  # fmt: skip
    from mxq.formats import as_elem_format, as_scale_rule
    from mxq.kernels.moe_block import GATE_GPT_OSS, ExpertsWeights, experts_forward

    ex = ExpertsWeights(w1, s1, b1, w2, s2, b2, gate, gate == GATE_GPT_OSS, alpha, limit,
                        as_elem_format(act_elem) if act_elem else None, as_scale_rule(act_rule), block_size)  # fmt: skip
    return experts_forward(x, top_k_index, top_k_weights, ex)


@torch.library.custom_op("mxq::mx_moe_experts", mutates_args=())
def mx_moe_experts_op(
    x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, w1: torch.Tensor, s1: torch.Tensor,
    b1: torch.Tensor | None, w2: torch.Tensor, s2: torch.Tensor, b2: torch.Tensor | None, gate: int, alpha: float,
    limit: float, act_elem: str, act_rule: str, block_size: int,
) -> torch.Tensor:  # fmt: skip
    """The fused experts block (``mxq.kernels.moe_block.experts_forward``) as a torch custom op."""
    return _moe_experts(x, top_k_index, top_k_weights, w1, s1, b1, w2, s2, b2, gate, alpha, limit, act_elem,
                        act_rule, block_size)  # fmt: skip


@mx_moe_experts_op.register_fake
def _mx_moe_experts_fake(x, top_k_index, top_k_weights, w1, s1, b1, w2, s2, b2, gate, alpha, limit, act_elem, act_rule,
                         block_size):  # fmt: skip
    return x.new_empty(x.shape)


def _gate_kind(source: nn.Module, gate, projections) -> int:
    """The fused block's name for the family's gate: SiLU(gate)·up on [gate | up] halves (transformers'
    default gate with a SiLU activation), gpt-oss's clamped GLU, or 0: a gate the block does not know
    (the module then runs its per-projection path with the family's own gate)."""
    from mxq.kernels.moe_block import GATE_GPT_OSS, GATE_NONE, GATE_SILU

    if projections != GATED:
        return GATE_NONE
    name = getattr(gate, "__qualname__", "")
    if name == "GptOssExperts._apply_gate" and all(isinstance(getattr(source, a, None), float | int) for a in ("alpha", "limit")):
        return GATE_GPT_OSS
    act = source._modules.get("act_fn")
    if (gate is None or name == "_default_apply_gate") and type(act).__name__ in ("SiLUActivation", "SiLU"):
        return GATE_SILU
    return GATE_NONE


class MXExperts(nn.Module):
    """The routed experts of one MoE layer in MX (module doc): ``<proj>`` fp8 [E, N, K] and
    ``<proj>_scale`` uint8 [E, N, K/32] for each projection, ``<proj>_bias`` [E, N] where the
    family has biases. ``act``: the activations' MX spec (W8A8), None for W8A16."""

    takes_kernels = True  # ``mxq.set_kernels`` sets ``kernels`` (the ``GROUPED`` paths it may run)

    _hf_quantized_needs_local_tp = True  # tensor parallelism: runs on this rank's shard (``mxq.runtime.tp.localize``)

    def __init__(self, source: nn.Module, *, elem, act: TensorSpec | None, block_size: int = 32,
                 dtype: torch.dtype | None = None, kernels: str | None = None):  # fmt: skip
        super().__init__()
        info = experts_layer("", source)
        self.num_experts = info.num_experts
        self.projections = info.projections
        self.has_bias = info.has_bias
        self.elem, self.act, self.block_size, self.kernels = elem, act, block_size, kernels
        self.family = type(source).__name__
        gate = experts_gate(type(source))
        if info.projections == GATED:  # the family's gate, bound to this module (reads act_fn, alpha, limit)
            self._gate = types.MethodType(gate, self) if gate is not None else types.MethodType(silu_gate, self)
        for k, v in vars(source).items():  # plain attributes the gate reads (not parameters or modules)
            if not k.startswith("_") and isinstance(v, _PLAIN_ATTRS) and not hasattr(self, k):
                setattr(self, k, v)
        if "act_fn" in source._modules:
            self.act_fn = source._modules["act_fn"]
        self.gate_kind = _gate_kind(source, gate, info.projections)  # the fused block's gate (or none)
        device = next(iter(source.parameters())).device
        for p, (n, k) in zip(info.projections, info.shapes, strict=True):
            if k % block_size:
                raise ValueError(f"{self.family}.{p}: K={k} is not a multiple of {block_size}")
            self.register_parameter(p, nn.Parameter(torch.empty(info.num_experts, n, k, dtype=elem.torch_dtype, device=device), requires_grad=False))
            self.register_parameter(p + SCALE_SUFFIX, nn.Parameter(
                torch.empty(info.num_experts, n, k // block_size, dtype=torch.uint8, device=device), requires_grad=False))
            b = source._parameters.get(p + "_bias")
            if b is not None:
                self.register_parameter(p + "_bias", nn.Parameter(torch.empty(b.shape, dtype=dtype or b.dtype, device=device), requires_grad=False))

    @classmethod
    def from_experts(cls, source: nn.Module, weights: TensorSpec, act: TensorSpec | None, block_size: int = 32,
                     kernels: str | None = None) -> MXExperts:  # fmt: skip
        """Quantize a transformers experts module (its weights cast directly to MX)."""
        info = experts_layer("", source)
        dtype = source._parameters[info.projections[0]].dtype
        m = cls(source, elem=weights.elem, act=act, block_size=block_size, dtype=dtype, kernels=kernels)
        with torch.no_grad():
            for p in info.projections:  # one expert at a time: no float32 copy of the whole module
                w = canonical(source._parameters[p].detach(), info.transposed)
                for e in range(info.num_experts):
                    codes, scales = quantize_experts_weight(w[e], weights, block_size)
                    getattr(m, p)[e].copy_(codes)
                    getattr(m, p + SCALE_SUFFIX)[e].copy_(scales)
                b = source._parameters.get(p + "_bias")
                if b is not None:
                    getattr(m, p + "_bias").copy_(b.detach())
        return m

    def mx_weight(self, proj: str) -> MXTensor:
        w = getattr(self, proj)
        return MXTensor(w, getattr(self, proj + SCALE_SUFFIX), w.shape, 2, self.block_size, self.elem)

    def dequantized_weight(self, proj: str) -> torch.Tensor:
        """A projection as the layer computes with it: float32 [E, N, K]."""
        return self.mx_weight(proj).dequantize(torch.float32)

    def grouped(self, proj: str, x: torch.Tensor, group_end: torch.Tensor, rounded: bool = False) -> torch.Tensor:
        """One projection over rows sorted by expert (``mx_grouped_linear``; under ``torch.compile``
        the custom op ``mxq::mx_grouped_linear``, opaque to the compiler)."""
        a = None if rounded else self.act
        args = (x, group_end, getattr(self, proj), getattr(self, proj + SCALE_SUFFIX), getattr(self, proj + "_bias", None))
        if torch.compiler.is_compiling():
            return mx_grouped_linear_op(*args, a.elem.name if a is not None else "", a.scale_rule.value if a is not None else "rceil",
                                        self.block_size, self.kernels or "")  # fmt: skip
        from mxq.kernels.moe import mx_grouped_linear

        return mx_grouped_linear(
            *args, act_elem=a.elem if a is not None else None, act_rule=a.scale_rule if a is not None else ScaleRule.RCEIL,
            block_size=self.block_size, kernels=self.kernels,
        )  # fmt: skip

    def experts(self, x: torch.Tensor, group_end: torch.Tensor, rounded: bool = False) -> torch.Tensor:
        """Both projections and the gate between them for rows sorted by expert: [S, H] -> [S, H]
        (``rounded``: x already holds its MX-rounded values, W8A8's first product takes it as is)."""
        up, down = self.projections
        h = self.grouped(up, x, group_end, rounded)
        h = self._gate(h) if up == "gate_up_proj" else self.act_fn(h)
        return self.grouped(down, h.to(x.dtype), group_end)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor | None = None,
                top_k_weights: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        if top_k_index is None:  # Llama 4: every expert sees its own copy of the tokens, expert-major
            rows = hidden_states.shape[0] // self.num_experts
            ends = torch.arange(1, self.num_experts + 1, device=hidden_states.device, dtype=torch.int32) * rows
            return self.experts(hidden_states, ends)
        if self.block_runs(hidden_states):
            return self._block(hidden_states, top_k_index, top_k_weights)
        tokens, top_k = top_k_index.shape
        ids = top_k_index.reshape(-1)
        ids = torch.where((ids >= 0) & (ids < self.num_experts), ids, self.num_experts)  # outside: no expert
        order = torch.argsort(ids, stable=True)  # rows of one expert stay in token order
        token_of_row = order // top_k
        counts = torch.zeros(self.num_experts + 1, dtype=torch.int32, device=ids.device)
        counts.scatter_add_(0, ids.to(torch.int64), torch.ones_like(ids, dtype=torch.int32))
        group_end = torch.cumsum(counts[: self.num_experts], 0, dtype=torch.int32)  # ids >= E (sentinels) fall past the end
        xs, rounded = self._gather(hidden_states, token_of_row)
        y = self.experts(xs, group_end, rounded)
        w = top_k_weights.reshape(-1)[order].to(torch.float32)
        out = torch.zeros(tokens, y.shape[-1], dtype=torch.float32, device=y.device)
        out.index_add_(0, token_of_row, y.to(torch.float32) * w[:, None])
        return out.to(hidden_states.dtype)

    def block_runs(self, x: torch.Tensor) -> bool:
        """Whether the fused block (``mxq.kernels.moe_block``) runs a call on ``x``: the family's gate
        is one it knows, its path is admitted by ``kernels`` and supports the input (host facts only)."""
        from mxq.kernels.moe_block import BLOCK, BlockProblem

        if not self.gate_kind:
            return False
        spec = kernels_spec(self.kernels)
        return BLOCK.choose(BlockProblem(x.device, x.dtype, self.gate_kind, self.block_size, self.act, spec), spec).name != "reference"

    def _block(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """Routing to combine in the fused block's few launches (under ``torch.compile`` the custom op
        ``mxq::mx_moe_experts``, opaque to the compiler)."""
        up, down = self.projections
        w = (getattr(self, up), getattr(self, up + SCALE_SUFFIX), getattr(self, up + "_bias", None),
             getattr(self, down), getattr(self, down + SCALE_SUFFIX), getattr(self, down + "_bias", None))  # fmt: skip
        a = self.act
        gate = (self.gate_kind, float(getattr(self, "alpha", 0.0)), float(getattr(self, "limit", 0.0)))
        act = (a.elem.name if a is not None else "", a.scale_rule.value if a is not None else "rceil", self.block_size)
        if torch.compiler.is_compiling():
            return mx_moe_experts_op(x, top_k_index, top_k_weights, *w, *gate, *act)
        return _moe_experts(x, top_k_index, top_k_weights, *w, *gate, *act)

    def _gather(self, x: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The token rows in expert order; for a W8A8 prefill on the GPU already MX-rounded, in the
        same pass (``gather_mx_rows``: the rounding then costs nothing over the gather; kernels/NOTES.md,
        "MoE"). Decode-sized calls round inside the grouped kernel instead, and a compiled graph
        keeps the plain gather (the grouped op rounds)."""
        from mxq.kernels.moe import GROUPED_DECODE_MAX_S, gather_mx_rows

        a = self.act
        if a is None or x.device.type != "cuda" or rows.shape[0] <= GROUPED_DECODE_MAX_S or torch.compiler.is_compiling() \
                or self.kernels == "reference":  # fmt: skip
            return x[rows], False
        return gather_mx_rows(x, rows, a.elem, a.scale_rule, self.block_size), True

    def extra_repr(self) -> str:
        a = f"{self.act.elem.name}/{self.act.scale_rule.value}" if self.act else "bf16"
        shapes = ", ".join(f"{p}={list(getattr(self, p).shape)}" for p in self.projections)
        return f"{self.family}: {shapes}, weight={self.elem.name}, act={a}, bias={self.has_bias}"


def silu_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
    """act(gate)·up on [gate | up] columns: transformers' default gate (and Llama 4's)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return self.act_fn(gate) * up


def quantize_experts(model: nn.Module, names, weights: TensorSpec, act: TensorSpec | None, block_size: int = 32,
                     kernels: str | None = None) -> None:  # fmt: skip
    """Swap the named experts modules of ``model`` for ``MXExperts`` (in place)."""
    for name in names:
        model.set_submodule(name, MXExperts.from_experts(model.get_submodule(name), weights, act, block_size, kernels))


# --- what a model holds, by role: the one description selection works from --------------------

ROUTER_NAMES = ("gate", "router")  # beside an experts module: the router
SHARED_GATE_NAMES = ("shared_expert_gate",)


def structure(model: nn.Module, tied_weight: torch.Tensor | None = None) -> list:
    """Every weight-matrix layer of ``model`` as ``mxq.checkpoint.config.LinearLayer`` with its role: plain
    ``nn.Linear`` layers, experts modules, and what stays in high precision whatever the recipe
    (routers, shared-expert gates, Linear subclasses with their own forward, as Llama 4's router).
    The same function serves the in-memory path and the converter's meta-device skeleton, so the
    CLI and ``quantize_model`` select the same layers. ``tied_weight``: the input embedding's
    weight (a Linear sharing it is tied)."""
    from mxq.checkpoint.config import ROLE_EXPERTS, LinearLayer

    experts_parents = {n.rpartition(".")[0] for n, m in model.named_modules() if is_experts(m)}
    out = []
    for name, m in model.named_modules():
        parent, _, child = name.rpartition(".")
        if is_experts(m):
            info = experts_layer(name, m)
            out.append(LinearLayer(name, (info.num_experts, *info.shapes[0]), role=ROLE_EXPERTS,
                                   ks=tuple(k for _, k in info.shapes)))  # fmt: skip
        elif parent in experts_parents and child in ROUTER_NAMES and isinstance(m._parameters.get("weight"), torch.Tensor):
            out.append(LinearLayer(name, tuple(m.weight.shape), role="router"))
        elif isinstance(m, nn.Linear) and child in SHARED_GATE_NAMES:
            out.append(LinearLayer(name, tuple(m.weight.shape), role="shared_expert_gate"))
        elif isinstance(m, nn.Linear) and type(m) is not nn.Linear:
            out.append(LinearLayer(name, tuple(m.weight.shape), role="custom_linear"))
        elif type(m) is nn.Linear:
            out.append(LinearLayer(name, tuple(m.weight.shape), tied=TIED_TO_EMBEDDING if tied_weight is not None and m.weight is tied_weight else ""))
    return out


def select_model_layers(model: nn.Module, recipe, warn=None) -> tuple[list[str], dict[str, str]]:
    """``mxq.checkpoint.config.select_layers`` over an in-memory model's ``structure``: the names of the Linear
    layers and experts modules the recipe quantizes, and every kept one with its reason."""
    from mxq.checkpoint.config import select_layers

    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return select_layers(structure(model, getattr(emb, "weight", None)), recipe, warn)
