"""Will an MX checkpoint shard for tensor parallelism? The rule, per quantized weight.

Tensor parallelism splits a column-parallel layer (q/k/v, gate/up: ``colwise``) along N and a
row-parallel one (o_proj, down_proj: ``rowwise``) along K, each rank holding 1/tp of it. MX blocks
run along K, 32 elements sharing one scale, so:

- a column-parallel weight [N, K] shards when tp divides N: each rank takes whole rows with their
  scales [N/tp, K/32];
- fused experts whose gate and up halves are split separately (``packed_colwise``) need tp to
  divide each half, N/2;
- a row-parallel weight shards only when each rank's slice of K holds whole blocks:
  (K / tp) % 32 == 0. Serving engines refuse a checkpoint whose per-rank K breaks a block.

Which layers are column- or row-parallel is the model family's tensor-parallel plan
(transformers' ``base_model_tp_plan``: module patterns with ``*`` for a layer index); a weight the
plan does not name is judged by its projection's name (q/k/v/gate/up/w1/w3 column, o/down/w2 row),
and anything else (embeddings, routers) is replicated or split along a dimension MX does not block.
This module needs no transformers: the caller passes the plan.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

BLOCK = 32
COLUMN_NAMES = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3", "gate_up_proj", "query_key_value")
ROW_NAMES = ("o_proj", "down_proj", "w2", "dense", "out_proj")


@dataclass(frozen=True)
class Shard:
    """One quantized weight at one TP degree: how it is split and whether that keeps MX blocks whole."""

    name: str
    style: str  # "colwise", "packed_colwise", "rowwise" or "replicated"
    shape: tuple[int, ...]
    ok: bool
    why: str = ""


def _pattern(key: str) -> re.Pattern:
    return re.compile("^" + re.escape(key).replace(r"\*", r"[^.]+") + "$")


def split_style(name: str, plan: dict[str, str] | None) -> str:
    """How tensor parallelism splits weight ``name`` (``X.weight`` of a Linear, or a fused experts
    tensor ``...experts.gate_up_proj``): the plan's style where a pattern names its module, else
    by the projection's name."""
    module = name[: -len(".weight")] if name.endswith(".weight") else name
    for key, style in (plan or {}).items():
        for prefix in ("", "model.", "model.language_model.", "language_model.model."):
            if module.startswith(prefix) and _pattern(key).match(module[len(prefix):]):
                if style in ("colwise", "packed_colwise", "rowwise", "local_colwise", "local_rowwise", "colwise_rep",
                             "rowwise_rep", "local_packed_rowwise", "packed_rowwise"):  # fmt: skip
                    return style.replace("local_", "").replace("_rep", "")
    leaf = module.rsplit(".", 1)[-1]
    if leaf in COLUMN_NAMES:
        return "packed_colwise" if leaf == "gate_up_proj" else "colwise"
    if leaf in ROW_NAMES:
        return "rowwise"
    return "replicated"


def check_shard(name: str, shape: tuple[int, ...], style: str, tp: int) -> Shard:
    """The rule of the module docstring for one weight ([N, K] or fused [E, N, K])."""
    if len(shape) < 2 or tp == 1 or style == "replicated":
        return Shard(name, style, tuple(shape), True)
    n, k = shape[-2], shape[-1]
    if style in ("colwise", "packed_colwise"):
        parts = 2 if style == "packed_colwise" else 1
        if n % (parts * tp):
            what = f"N={n}" if parts == 1 else f"each half of N={n} ({n // 2})"
            return Shard(name, style, tuple(shape), False, f"{what} does not split into {tp} equal parts")
        return Shard(name, style, tuple(shape), True)
    if k % tp:
        return Shard(name, style, tuple(shape), False, f"K={k} does not split into {tp} equal parts")
    if (k // tp) % BLOCK:
        return Shard(name, style, tuple(shape), False,
                     f"K={k} gives {k // tp} per rank, not a multiple of the {BLOCK}-element MX block")  # fmt: skip
    return Shard(name, style, tuple(shape), True)


def shard_report(weights: dict[str, tuple[int, ...]], plan: dict[str, str] | None, tp: int) -> list[Shard]:
    """Every quantized weight (name -> shape: the fp8 tensors of a checkpoint) at TP degree ``tp``."""
    return [check_shard(n, tuple(s), split_style(n, plan), tp) for n, s in sorted(weights.items())]


def failures(weights: dict[str, tuple[int, ...]], plan: dict[str, str] | None, tps=(2, 4, 8)) -> dict[int, list[Shard]]:
    """The weights that do not shard, for each TP degree in ``tps`` (only degrees with any)."""
    out = {}
    for tp in tps:
        bad = [s for s in shard_report(weights, plan, tp) if not s.ok]
        if bad:
            out[tp] = bad
    return out


# --- running a checkpoint sharded ------------------------------------------------------------------
#
# ``from_pretrained(path, tp_plan="auto")`` (under ``torchrun``) is transformers' own tensor
# parallelism: it builds the model, makes every parameter the family's plan names a DTensor
# placeholder, and each rank reads only its shard. MX scales shard with their codes: a Linear's
# ``weight_scale`` belongs to the module the plan names (split along N with the rows, along K in
# whole 32-blocks), and a fused experts tensor's ``<proj>_scale`` gets its projection's style
# (``plan_with_scales``). After loading, ``localize`` gives each MX module of a column- or
# row-parallel layer its shard as plain tensors and its own forward: column-parallel layers need no
# communication (input replicated, output this rank's columns), so q/k/v and gate/up still fuse into
# one GEMM each; row-parallel layers and experts add one all-reduce of their output (the bias after
# it). transformers' DTensor path would give the same function with more host work per call.

# styles ``localize`` runs itself: no communication, or an all-reduce of the output
LOCAL_STYLES = ("colwise", "packed_colwise")
REDUCED_STYLES = ("rowwise", "moe_tp_experts")
EXPERT_PROJECTIONS = ("gate_up_proj", "up_proj", "down_proj")


def plan_with_scales(plan: dict[str, str] | None) -> dict[str, str] | None:
    """``plan`` plus ``<key>_scale`` for each fused experts tensor it names (``...experts.gate_up_proj``
    -> ``...experts.gate_up_proj_scale``, same style). A Linear's scale needs nothing: the plan
    names its module, and every parameter of that module follows it."""
    if not plan:
        return plan
    out = dict(plan)
    for key, style in plan.items():
        parent, _, leaf = key.rpartition(".")
        if leaf in EXPERT_PROJECTIONS and parent.endswith("experts"):
            out.setdefault(key + "_scale", style)
    return out


def plan_style(name: str, plan: dict[str, str] | None) -> str | None:
    """The style ``plan`` gives module ``name`` (layer indices matched by ``*``), or None."""
    generic = re.sub(r"\.\d+(?=\.|$)", ".*", name)
    return (plan or {}).get(generic)


def localize(model) -> list[str]:
    """After tensor-parallel loading: each MX module of a column-parallel, row-parallel or experts
    layer holds its shard as plain tensors and runs its own forward (section comment). Modules of
    other styles keep transformers' hooks. Returns the names of the modules changed."""
    from torch import nn
    from torch.distributed.tensor import DTensor

    from mxq.runtime.experts import MXExperts
    from mxq.runtime.linear import MXLinear

    plan = getattr(model, "tp_plan", None) or {}
    done = []
    for name, m in model.named_modules():
        if not isinstance(m, (MXLinear, MXExperts)):
            continue
        shards = {k: p for k, p in m._parameters.items() if isinstance(p, DTensor)}
        style = plan_style(name, plan)
        if not shards or style not in LOCAL_STYLES + REDUCED_STYLES:
            continue
        first = next(iter(shards.values()))
        group, tp = first.device_mesh.get_group(), first.device_mesh.size()
        for k, p in shards.items():
            if p.dim() >= 2 and "scale" not in k and not (s := check_shard(f"{name}.{k}", tuple(p.shape), _shard_style(style, k), tp)).ok:
                raise ValueError(f"tensor parallelism {tp}: {s.name}: {s.why} (`mxq inspect CHECKPOINT --tp {tp}` lists every layer)")
        for k, p in shards.items():
            m._parameters[k] = nn.Parameter(p.to_local(), requires_grad=False)
        m.__dict__.pop("forward", None)  # transformers' hook: the module's own forward again
        if isinstance(m, MXLinear):
            m.out_features, m.in_features = m.weight.shape
        if style in REDUCED_STYLES:
            _reduce_output(m, group)
        done.append(name)
    return done


def _shard_style(module_style: str, param: str) -> str:
    """How ``param`` of a module of ``module_style`` is split (an experts module's projections
    carry their own: gate/up column-wise in two halves, down row-wise)."""
    if module_style != "moe_tp_experts":
        return module_style
    proj = param.removesuffix("_scale")
    return {"gate_up_proj": "packed_colwise", "up_proj": "colwise", "down_proj": "rowwise"}.get(proj, "replicated")


def _reduce_output(m, group) -> None:
    """The module's forward followed by an all-reduce over ``group``. A Linear's bias is added after
    the reduction; an experts module's down-projection bias (weighted per token inside its
    forward) is kept on rank 0 only, so the sum holds it once."""
    import torch.distributed as dist

    from mxq.runtime.install import install_forward
    from mxq.runtime.linear import MXLinear

    bias = None
    if isinstance(m, MXLinear) and m.bias is not None:
        bias, m.bias = m.bias, None
    elif not isinstance(m, MXLinear) and dist.get_rank(group) != 0:
        for p in m.projections[1:]:
            b = m._parameters.get(p + "_bias")
            if b is not None:
                b.data.zero_()
    m.__dict__["_mxq_tp"] = (group, bias)

    def forward(self, *args, **kwargs):
        y = type(self).forward(self, *args, **kwargs)
        grp, b = self.__dict__["_mxq_tp"]
        dist.all_reduce(y, group=grp)
        return y if b is None else y + b

    if not install_forward(m, forward, "tp"):
        raise RuntimeError(f"tensor parallelism: {type(m).__name__} has a forward mxq did not install; its shard "
                           "cannot be reduced (the warning above names who installed it)")
