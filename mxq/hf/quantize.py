"""``mxq.quantize_model``: an in-memory model to MXFP8 as a recipe says (Linear layers, routed
experts (``mxq.runtime.experts``), and with
``embeddings: mxfp8`` the input embedding and a tied head), fused and configured like a loaded
checkpoint."""

from __future__ import annotations

from torch import nn

from mxq.checkpoint.config import NativeConfig, experts_entry, native_config
from mxq.recipe import Recipe
from mxq.runtime.embedding import quantize_embedding
from mxq.runtime.experts import experts_layers, quantize_experts, select_model_layers
from mxq.runtime.fuse import fuse as fuse_model
from mxq.runtime.linear import MXLinear, linear_layers, set_kernels


def quantize_model(
    model: nn.Module, recipe: Recipe | str | None = None, *, kernels: str | None = None, fuse: bool = True
) -> nn.Module:
    """Swap the recipe's Linear layers of an in-memory model for ``MXLinear`` and its experts
    modules for ``MXExperts`` (in place; routers and shared-expert gates stay), and with
    ``embeddings: mxfp8`` its input embedding for ``MXEmbedding`` (a tied head then shares its
    tensors: ``mxq.runtime.embedding``); ``kernels`` as in ``set_kernels``; ``fuse``: the fast structure
    (``mxq.runtime.fuse``: q/k/v and gate/up as one MX GEMM each, activation quantization in its producer,
    attention without repeated K/V; same function, same ``state_dict`` layout)."""
    import warnings

    from mxq.recipe import load_recipe

    if not isinstance(recipe, Recipe):
        recipe = load_recipe(recipe)
    moe = experts_layers(model)
    if not linear_layers(model) and not moe:
        raise ValueError(f"{type(model).__name__} has no torch.nn.Linear layers or experts to quantize")
    def warn(m):
        warnings.warn(m, stacklevel=4)

    chosen, kept = select_model_layers(model, recipe, warn=warn)
    experts = [n for n in chosen if n in moe]
    chosen = [n for n in chosen if n not in moe]
    quantize_experts(model, experts, recipe.weights, recipe.activations, recipe.block_size, kernels)
    for name in chosen:
        model.set_submodule(name, MXLinear.from_linear(model.get_submodule(name), recipe.weights, recipe.activations))
    emb = quantize_embedding(model, recipe, kept, warn)
    if kernels is not None:
        set_kernels(model, kernels)
    if fuse:
        fuse_model(model)
    if hasattr(model, "config"):
        layers = {n: (recipe.weights, recipe.activations) for n in chosen}
        tied = emb.tied() if emb is not None else {}
        layers.update(emb.layers() if emb is not None else {})
        ex = {n: experts_entry(moe[n], recipe.weights, recipe.activations) for n in experts}
        model.config.quantization_config = NativeConfig(**native_config(recipe, layers, sorted(kept), tied=tied, experts=ex))
    return model
