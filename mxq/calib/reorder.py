"""Channel permutations of the reduction axis K, folded into the producer of each activation.

MX blocks run along K (1x32 tiles of the activation X[M, K], 32x1 tiles of the weight seen as
K×N). Reordering K so that channels of similar magnitude share a block is free only where the
permutation can be folded into the tensor that *produces* the activation; then the written
checkpoint is a standard one and the forward pass needs no gather. Three places qualify in a
Llama/Qwen-style decoder (see docs/ARCHITECTURE.md, "Tiles, and which axis is which"):

* ``mlp``: the input of ``down_proj`` is ``act(gate(x)) * up(x)``, elementwise in the intermediate
  dimension, so permuting the rows of ``gate_proj`` and ``up_proj`` (and their biases) permutes
  it; ``down_proj`` columns take the same permutation.
* ``v``: the input of ``o_proj`` is the concatenation of the heads' ``softmax(QKᵀ)·V``. RoPE does not
  touch V, so permuting ``v_proj`` rows within each KV head permutes that head's output; with
  GQA every query head sharing the KV head (query head q uses KV head ``q // (n_heads/n_kv)``)
  carries the same permutation into its slice of ``o_proj`` columns.
* ``residual``: one permutation of the hidden dimension everywhere: embedding columns, every
  RMSNorm weight (RMSNorm is elementwise and its mean of squares is order-free), the columns of
  every projection reading the stream (q/k/v, gate/up, lm_head) and the rows of every
  projection writing it (o_proj, down_proj). With tied embeddings ``lm_head`` *is* the embedding
  matrix; permuting its columns once permutes both uses consistently.

Everything here is a pure function of (tensor name, tensor, permutations, geometry), so the
same code permutes an in-memory model and the streaming converter's tensors one at a time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

__all__ = ["Geometry", "Permutations", "ReorderError", "permute_tensor", "permute_state_dict", "permute_model"]


class ReorderError(ValueError):
    """A permutation that cannot be folded; the message names the tensor or key."""


@dataclass(frozen=True)
class Geometry:
    """The dimensions the permutations act on, from a transformers config."""

    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config) -> Geometry:
        c = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = int(c.num_attention_heads)
        return cls(
            num_hidden_layers=int(c.num_hidden_layers),
            hidden_size=int(c.hidden_size),
            intermediate_size=int(c.intermediate_size),
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(c, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(c, "head_dim", None) or c.hidden_size // heads),
        )

    @property
    def n_rep(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Permutations:
    """Permutations to fold. ``perm[i]`` is the original channel placed at position i."""

    mlp: dict[int, list[int]] = field(default_factory=dict)  # layer -> permutation of intermediate
    v: dict[int, list[list[int]]] = field(default_factory=dict)  # layer -> per KV head, of head_dim
    residual: list[int] | None = None  # permutation of hidden_size, or none

    def is_empty(self) -> bool:
        return not self.mlp and not self.v and self.residual is None

    def to_dict(self) -> dict:
        return {
            "mlp": {str(i): list(p) for i, p in sorted(self.mlp.items())},
            "v": {str(i): [list(h) for h in p] for i, p in sorted(self.v.items())},
            "residual": list(self.residual) if self.residual is not None else None,
        }

    def summary(self) -> dict:
        return {"mlp_layers": sorted(self.mlp), "v_layers": sorted(self.v), "residual": self.residual is not None}

    def validate(self, geom: Geometry, where: str = "permutations") -> None:
        for i, p in self.mlp.items():
            _check_layer(i, geom, f"{where}.mlp.{i}")
            _check_perm(p, geom.intermediate_size, f"{where}.mlp.{i}")
        for i, heads in self.v.items():
            _check_layer(i, geom, f"{where}.v.{i}")
            if not isinstance(heads, list) or len(heads) != geom.num_key_value_heads:
                raise ReorderError(f"{where}.v.{i}: expected one permutation per KV head ({geom.num_key_value_heads})")
            for h, p in enumerate(heads):
                _check_perm(p, geom.head_dim, f"{where}.v.{i}[{h}]")
        if self.residual is not None:
            _check_perm(self.residual, geom.hidden_size, f"{where}.residual")

    # index tensors, as gathers on the permuted axis
    def v_rows(self, layer: int, geom: Geometry) -> torch.Tensor:
        d = geom.head_dim
        return torch.cat([h * d + torch.as_tensor(p) for h, p in enumerate(self.v[layer])])

    def o_cols(self, layer: int, geom: Geometry) -> torch.Tensor:
        d = geom.head_dim
        heads = self.v[layer]
        return torch.cat([q * d + torch.as_tensor(heads[q // geom.n_rep]) for q in range(geom.num_attention_heads)])


def _check_layer(i, geom: Geometry, where: str) -> None:
    if not isinstance(i, int) or not 0 <= i < geom.num_hidden_layers:
        raise ReorderError(f"{where}: layer index out of range 0..{geom.num_hidden_layers - 1}")


def _check_perm(p, n: int, where: str) -> None:
    if not isinstance(p, list) or len(p) != n or not all(isinstance(v, int) for v in p) or sorted(p) != list(range(n)):
        raise ReorderError(f"{where}: not a permutation of 0..{n - 1}")


# Tensor names of Llama/Qwen2/Qwen3/Mistral-style decoders (the HF state-dict layout).
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_RESIDUAL_IN = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                "mlp.gate_proj.weight", "mlp.up_proj.weight"}  # columns read the residual stream
_RESIDUAL_OUT = {"self_attn.o_proj.weight", "self_attn.o_proj.bias",
                 "mlp.down_proj.weight", "mlp.down_proj.bias"}  # rows write it
_NORMS = {"input_layernorm.weight", "post_attention_layernorm.weight"}
# Tensors the residual permutation leaves alone (they act on head_dim or on projection outputs).
_RESIDUAL_FREE = {"self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias",
                  "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                  "mlp.gate_proj.bias", "mlp.up_proj.bias"}


def permute_tensor(name: str, t: torch.Tensor, perms: Permutations, geom: Geometry) -> torch.Tensor:
    """``t`` (the tensor called ``name`` in the HF state dict) with every applicable permutation folded in."""
    if perms.is_empty():
        return t
    r = torch.as_tensor(perms.residual) if perms.residual is not None else None
    m = _LAYER.match(name)
    if m is None:
        if r is None:
            return t
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return t[:, r]
        if name == "model.norm.weight":
            return t[r]
        if name == "lm_head.bias":
            return t
        raise ReorderError(f"tensor {name}: the residual permutation cannot be folded into it (unknown role)")
    layer, rest = int(m.group(1)), m.group(2)
    if layer in perms.mlp:
        p = torch.as_tensor(perms.mlp[layer])
        if rest in ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.gate_proj.bias", "mlp.up_proj.bias"):
            t = t[p]
        elif rest == "mlp.down_proj.weight":
            t = t[:, p]
    if layer in perms.v:
        if rest in ("self_attn.v_proj.weight", "self_attn.v_proj.bias"):
            t = t[perms.v_rows(layer, geom)]
        elif rest == "self_attn.o_proj.weight":
            t = t[:, perms.o_cols(layer, geom)]
    if r is not None:
        if rest in _RESIDUAL_IN:
            t = t[:, r]
        elif rest in _RESIDUAL_OUT or rest in _NORMS:
            t = t[r]
        elif rest not in _RESIDUAL_FREE:
            raise ReorderError(f"tensor {name}: the residual permutation cannot be folded into it (unknown role)")
    return t.contiguous()


def permute_state_dict(sd: dict[str, torch.Tensor], perms: Permutations, geom: Geometry) -> dict[str, torch.Tensor]:
    return {k: permute_tensor(k, v, perms, geom) for k, v in sd.items()}


@torch.no_grad()
def permute_model(model: torch.nn.Module, perms: Permutations) -> torch.nn.Module:
    """Fold ``perms`` into an in-memory HF model (in place). Tied parameters are permuted once."""
    geom = Geometry.from_config(model.config)
    perms.validate(geom)
    for name, p in model.named_parameters():  # deduplicated: a tied lm_head appears as the embedding
        p.data = permute_tensor(name, p.data, perms, geom)
    return model
