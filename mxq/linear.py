"""``MXLinear``: a Linear layer whose weight is stored as MXFP8, and the module swap that makes one.

The weight is kept as fp8 data ``weight`` [N, K] with biased-E8M0 ``weight_scale`` [N, K/32],
the names and layout MXFP8 checkpoints use. ``forward`` calls ``mxq.kernels.mx_linear``: the
Triton kernels on a GPU, the torch reference elsewhere — the same function either way. Which
kernels may run is the layer's ``kernels`` ("auto", "reference" or path names of
``mxq.kernels.dispatch.LINEAR``); ``set_kernels(model, spec)`` sets it for a whole model.

Under ``torch.compile`` the call goes through the custom op ``torch.ops.mxq.mx_linear`` (opaque to
the compiler, with a shape-only fake implementation), so a model with MXLinear layers compiles
with ``fullgraph=True`` and its decode step can be captured in a CUDA graph
(``generate(cache_implementation="static")`` on CUDA does both).
"""

from __future__ import annotations

import torch
from torch import nn

from mxq.config import LinearLayer, NativeConfig, native_config, select_layers
from mxq.formats import (
    E4M3,
    ElemFormat,
    MXTensor,
    ScaleRule,
    as_elem_format,
    as_scale_rule,
    quantize_mx,
)
from mxq.recipe import Recipe, TensorSpec

TIED_TO_EMBEDDING = "tied to the input embedding (quantizing it would add a second copy)"


@torch.library.custom_op("mxq::mx_linear", mutates_args=())
def mx_linear_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    act_elem: str,
    act_rule: str,
    block_size: int,
    kernels: str = "",
) -> torch.Tensor:
    """``mxq.kernels.mx_linear`` as a torch custom op (``act_elem`` "" = bf16 activations)."""
    from mxq.kernels import mx_linear

    return mx_linear(
        x, weight, weight_scale, bias,
        act_elem=as_elem_format(act_elem) if act_elem else None, act_rule=as_scale_rule(act_rule),
        block_size=block_size, kernels=kernels or None,
    )  # fmt: skip


@mx_linear_op.register_fake
def _mx_linear_fake(x, weight, weight_scale, bias, act_elem, act_rule, block_size, kernels=""):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


class MXLinear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        elem: ElemFormat = E4M3,
        act: TensorSpec | None = None,
        block_size: int = 32,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        kernels: str | None = None,
    ):
        super().__init__()
        if in_features % block_size:
            raise ValueError(
                f"MXLinear needs in_features divisible by {block_size}, got {in_features}"
            )
        self.in_features = in_features
        self.out_features = out_features
        self.elem = elem
        self.act = act
        self.block_size = block_size
        self.kernels = _check_kernels(kernels)  # None: $MXQ_KERNELS or "auto", read per call
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=elem.torch_dtype, device=device),
            requires_grad=False,
        )
        self.weight_scale = nn.Parameter(
            torch.empty(out_features, in_features // block_size, dtype=torch.uint8, device=device),
            requires_grad=False,
        )
        if bias:
            self.bias = nn.Parameter(
                torch.empty(out_features, dtype=dtype or torch.bfloat16, device=device)
            )
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, weights: TensorSpec, act: TensorSpec | None, block_size: int = 32,
        kernels: str | None = None,
    ) -> MXLinear:
        w = linear.weight.detach()
        m = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            elem=weights.elem,
            act=act,
            block_size=block_size,
            dtype=w.dtype,
            device=w.device,
            kernels=kernels,
        )
        q = quantize_mx(w, -1, weights.elem, block_size, weights.scale_rule)
        m.weight.data.copy_(q.data)
        m.weight_scale.data.copy_(q.scales)
        if linear.bias is not None:
            m.bias.data.copy_(linear.bias.detach())
        return m

    def mx_weight(self) -> MXTensor:
        return MXTensor(
            self.weight, self.weight_scale, self.weight.shape, 1, self.block_size, self.elem
        )

    def dequantized_weight(self) -> torch.Tensor:
        """The weight as the layer computes with it: float32 [N, K]."""
        return self.mx_weight().dequantize(torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from mxq.kernels import mx_linear

        act_elem = self.act.elem if self.act is not None else None
        act_rule = self.act.scale_rule if self.act is not None else ScaleRule.RCEIL
        if torch.compiler.is_compiling():
            return mx_linear_op(
                x, self.weight, self.weight_scale, self.bias,
                act_elem.name if act_elem is not None else "", act_rule.value, self.block_size, self.kernels or "",
            )  # fmt: skip
        return mx_linear(
            x,
            self.weight,
            self.weight_scale,
            self.bias,
            act_elem=act_elem,
            act_rule=act_rule,
            block_size=self.block_size,
            kernels=self.kernels,
        )

    def extra_repr(self) -> str:
        a = f"{self.act.elem.name}/{self.act.scale_rule.value}" if self.act else "bf16"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, weight={self.elem.name}, act={a}, block={self.block_size}"
            + (f", kernels={self.kernels}" if self.kernels else "")
        )


def _check_kernels(kernels: str | None) -> str | None:
    if kernels is None:
        return None
    from mxq.kernels import check_kernels

    return check_kernels(kernels)


def set_kernels(model: nn.Module, kernels: str | None) -> nn.Module:
    """Which kernels run ``model``'s MX layers: "auto", "reference" (the torch reference, for A/B
    checks) or path names (``mxq.kernels.dispatch.LINEAR``, the attention registries); None
    restores the default ($MXQ_KERNELS, else "auto"). Also read by MX attention (``mxq.attention``)
    through each module's ``mxq_kernels``. Returns the model."""
    spec = _check_kernels(kernels)
    for m in model.modules():
        if isinstance(m, MXLinear):
            m.kernels = spec
        else:
            m.mxq_kernels = spec
    return model


def linear_layers(model: nn.Module) -> dict[str, nn.Linear]:
    return {n: m for n, m in model.named_modules() if type(m) is nn.Linear}


def model_layers(model: nn.Module) -> list[LinearLayer]:
    """The model's Linear layers as ``mxq.config.select_layers`` sees them."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    emb_weight = getattr(emb, "weight", None)
    return [
        LinearLayer(
            name,
            tuple(lin.weight.shape),
            tied=TIED_TO_EMBEDDING if emb_weight is not None and lin.weight is emb_weight else "",
        )
        for name, lin in linear_layers(model).items()
    ]


def select_model_layers(model: nn.Module, recipe: Recipe, warn=None) -> tuple[list[str], dict[str, str]]:
    """``mxq.config.select_layers`` over an in-memory model's Linear layers."""
    return select_layers(model_layers(model), recipe, warn)


def quantize_model(model: nn.Module, recipe: Recipe | str | None = None, *, kernels: str | None = None) -> nn.Module:
    """Swap the recipe's Linear layers of an in-memory model for ``MXLinear`` (in place);
    ``kernels`` as in ``set_kernels``."""
    import warnings

    from mxq.recipe import load_recipe

    if not isinstance(recipe, Recipe):
        recipe = load_recipe(recipe)
    if not linear_layers(model):
        raise ValueError(f"{type(model).__name__} has no torch.nn.Linear layers to quantize")
    chosen, kept = select_model_layers(model, recipe, warn=lambda m: warnings.warn(m, stacklevel=4))
    for name in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(
            parent,
            child,
            MXLinear.from_linear(getattr(parent, child), recipe.weights, recipe.activations),
        )
    if kernels is not None:
        set_kernels(model, kernels)
    if hasattr(model, "config"):
        layers = {n: (recipe.weights, recipe.activations) for n in chosen}
        model.config.quantization_config = NativeConfig(**native_config(recipe, layers, sorted(kept)))
    return model
