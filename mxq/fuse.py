"""Sibling projections as one MX GEMM: q/k/v of an attention block, gate/up of an MLP.

Concatenating MX weights along N is exact: the 1x32 blocks lie along K, so every output row keeps
its own fp8 codes and E8M0 scales, and one GEMM over the stacked [N_q + N_k + N_v, K] weight
computes bit for bit what the separate GEMMs compute (for W8A8 the activation is also rounded
once instead of three times: same bytes). A decode step then streams each weight once in one
launch instead of three, and quantizes X once.

``fuse_projections(model)`` is the one place this happens, for every model family whose blocks
name their projections as Llama does (``SIBLINGS``: Llama, Mistral, Qwen2, Qwen3, ...): under one
parent, MXLinear siblings with the same input width and formats become one ``FusedMXLinear``
(registered on the parent as ``mxq_fused_<names>``), and each sibling is replaced by a
``ProjectionSlice`` that returns its columns of the fused output. The model's own forward code is
unchanged: it still calls ``self.q_proj(x)``, ``self.k_proj(x)``, ``self.v_proj(x)`` with the same
``x``; the first call computes the fused product and keeps it until every sibling has taken its
slice (identity of ``x`` decides; a different input recomputes). Under ``torch.compile`` the same
code traces to one ``mxq::mx_linear`` call.

Checkpoints stay per projection: the fused module's ``state_dict`` hook writes ``q_proj.weight``,
``q_proj.weight_scale`` (and bias), ... as separate tensors, and its load pre-hook gathers them,
so ``save_pretrained`` / ``load_state_dict`` see the standard layout.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from mxq.linear import MXLinear

# Sibling groups: names under one parent module that consume the same input.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusedMXLinear(MXLinear):
    """The stacked weight of sibling ``MXLinear`` layers (``names``, in order) and their one GEMM
    (``MXLinear.forward`` over the stacked weight: [..., sum(sizes)])."""

    def __init__(self, names: tuple[str, ...], layers: list[MXLinear]):
        nn.Module.__init__(self)
        first = layers[0]
        self.names = tuple(names)
        self.sizes = tuple(m.out_features for m in layers)
        self.in_features = first.in_features
        self.out_features = sum(self.sizes)
        self.elem, self.act, self.block_size, self.kernels = first.elem, first.act, first.block_size, first.kernels
        self.weight = nn.Parameter(torch.cat([m.weight.data for m in layers]), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.cat([m.weight_scale.data for m in layers]), requires_grad=False)
        if any(m.bias is not None for m in layers):
            biases = [
                m.bias.data if m.bias is not None else torch.zeros(m.out_features, dtype=first.weight.dtype if first.bias is None else first.bias.dtype, device=m.weight.device)
                for m in layers
            ]  # fmt: skip
            self.bias = nn.Parameter(torch.cat(biases), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        self._has_bias = tuple(m.bias is not None for m in layers)
        self._x = self._y = None  # the input of the last fused call and its output, until all slices took theirs
        self._left = 0
        self._register_state_dict_hook(_split_state)
        self._join_hook = None  # on the parent (``attach``): only it sees the siblings' keys when loading

    def output_for(self, x: torch.Tensor) -> torch.Tensor:
        """The fused output for ``x``, computed once per input for all siblings."""
        if self._x is not x:
            self._x, self._y, self._left = x, self.forward(x), len(self.sizes)
        y = self._y
        self._left -= 1
        if self._left <= 0:  # every sibling has its slice: keep nothing alive
            self._x = self._y = None
        return y

    def extra_repr(self) -> str:
        return f"{'+'.join(self.names)}: in_features={self.in_features}, out_features={'+'.join(map(str, self.sizes))}"


class ProjectionSlice(nn.Module):
    """Stands where sibling ``index`` of a ``FusedMXLinear`` was: its columns of the fused output."""

    def __init__(self, fused: FusedMXLinear, index: int):
        super().__init__()
        object.__setattr__(self, "fused", fused)  # not a submodule: the parent owns it (one state_dict entry)
        self.index = index
        self.start = sum(fused.sizes[:index])
        self.stop = self.start + fused.sizes[index]
        self.in_features, self.out_features = fused.in_features, fused.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.output_for(x)[..., self.start : self.stop]

    def extra_repr(self) -> str:
        return f"{self.fused.names[self.index]} of the fused {'+'.join(self.fused.names)}, columns {self.start}:{self.stop}"


def _split_state(module: FusedMXLinear, state_dict: dict, prefix: str, local_metadata) -> None:
    """state_dict hook: the fused tensors back as the siblings' own (separate copies, no shared storage)."""
    parent = prefix[: -len(_attr(module.names)) - 1]
    for key in ("weight", "weight_scale", "bias"):
        t = state_dict.pop(prefix + key, None)
        if t is None:
            continue
        for i, (name, part) in enumerate(zip(module.names, torch.split(t, module.sizes), strict=True)):
            if key != "bias" or module._has_bias[i]:
                state_dict[f"{parent}{name}.{key}"] = part.clone()


def _join_state(module: FusedMXLinear, state_dict: dict, parent: str, *args) -> None:
    """load_state_dict pre-hook of the parent: the siblings' tensors gathered into the fused ones."""
    prefix = parent + _attr(module.names) + "."
    for key in ("weight", "weight_scale", "bias"):
        parts = [state_dict.pop(f"{parent}{name}.{key}", None) for name in module.names]
        if all(p is None for p in parts):
            continue
        if key == "bias":
            parts = [p if p is not None else torch.zeros(n, dtype=module.bias.dtype) for p, n in zip(parts, module.sizes, strict=True)]
        if any(p is None for p in parts):
            continue  # incomplete: load_state_dict reports the missing keys
        state_dict[prefix + key] = torch.cat(parts)


def _attr(names: tuple[str, ...]) -> str:
    return "mxq_fused_" + "_".join(names)


def _fusable(layers: list) -> bool:
    first = layers[0]
    return all(
        type(m) is MXLinear and m.in_features == first.in_features and m.elem == first.elem and m.act == first.act
        and m.block_size == first.block_size and m.kernels == first.kernels and m.weight.device == first.weight.device
        for m in layers
    )  # fmt: skip


def fuse_projections(model: nn.Module) -> list[str]:
    """Fuse every sibling group of ``MXLinear`` layers (``SIBLINGS``) in place; the fused groups' names."""
    done = []
    for parent_name, parent in list(model.named_modules()):
        for names in SIBLINGS:
            layers = [getattr(parent, n, None) for n in names]
            if any(m is None for m in layers) or not _fusable(layers):
                continue
            fused = FusedMXLinear(names, layers)
            parent.add_module(_attr(names), fused)
            fused._join_hook = parent._register_load_state_dict_pre_hook(functools.partial(_join_state, fused))
            for i, n in enumerate(names):
                setattr(parent, n, ProjectionSlice(fused, i))
            done.append(f"{parent_name}.{'+'.join(names)}" if parent_name else "+".join(names))
    return done


def unfuse_projections(model: nn.Module) -> None:
    """Undo ``fuse_projections``: every sibling an ``MXLinear`` with its own weight again."""
    for parent in list(model.modules()):
        for names in SIBLINGS:
            fused = getattr(parent, _attr(names), None)
            if not isinstance(fused, FusedMXLinear):
                continue
            for i, (name, w, s) in enumerate(zip(names, torch.split(fused.weight.data, fused.sizes),
                                                 torch.split(fused.weight_scale.data, fused.sizes), strict=True)):  # fmt: skip
                m = MXLinear(fused.in_features, fused.sizes[i], fused._has_bias[i], elem=fused.elem, act=fused.act,
                             block_size=fused.block_size, dtype=fused.bias.dtype if fused.bias is not None else None,
                             device=w.device, kernels=fused.kernels)  # fmt: skip
                m.weight.data = w.clone()
                m.weight_scale.data = s.clone()
                if fused._has_bias[i]:
                    m.bias.data = torch.split(fused.bias.data, fused.sizes)[i].clone()
                setattr(parent, name, m)
            fused._join_hook.remove()
            delattr(parent, _attr(names))


__all__ = ["SIBLINGS", "FusedMXLinear", "ProjectionSlice", "fuse_projections", "unfuse_projections"]
