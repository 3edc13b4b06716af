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
