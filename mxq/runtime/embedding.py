"""``MXEmbedding``: the input embedding stored as MXFP8, and one copy of it for a tied output head.

The matrix [V, H] is kept exactly as an ``MXLinear`` weight with N = V, K = H: fp8 codes ``weight``
[V, H] and biased-E8M0 ``weight_scale`` [V, H/32] (1x32 blocks along H). ``forward`` gathers the
rows of codes and scales for the token ids and dequantizes them (float32 product, then the model's
dtype): bit for bit what dequantizing the whole matrix and indexing it gives, with torch ops only
(no host sync; ``torch.compile`` traces it).

Tied models (``config.tie_word_embeddings``: the output head reads the embedding matrix): when the
embedding is quantized, the head becomes an ``MXLinear`` whose ``weight`` and ``weight_scale`` ARE
the embedding's parameters, so one copy of codes and scales serves both. transformers ties
``lm_head.weight`` to the embedding itself; ``tie_head`` adds the scales to the model's tie map, so
``from_pretrained`` re-ties both after loading and ``save_pretrained`` stores the matrix once. The
head's activations follow the recipe's include/exclude for it (excluded: bf16 activations); its
weight is the embedding's whatever the recipe says, because there is only one tensor. A tied head
whose embedding stays bf16 stays bf16 too (quantizing it alone would add a second copy).

Selection: a recipe's ``embeddings: mxfp8`` quantizes the input embedding with the recipe's weight
format (``select_embedding``, shared by ``mxq.quantize_model`` and the converter). In the native
``quantization_config`` the embedding is one of the ``layers`` (activations null), and a tied head
is listed under ``tied`` ({"lm_head": {"to": "model.embed_tokens", "activations": ...}}) rather than
under ``layers``: it has no tensors of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mxq.checkpoint.config import QUANTIZABLE_DTYPES, LayerSelectionError
from mxq.formats import E4M3, ElemFormat, MXTensor, decode_e8m0, quantize_mx
from mxq.recipe import Recipe, TensorSpec
from mxq.runtime.linear import MXLinear

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class MXEmbedding(nn.Module):
    """An embedding table of ``num_embeddings`` rows stored as MX: fp8 ``weight`` [V, H] and
    uint8 E8M0 ``weight_scale`` [V, H/32]; ``forward(ids)`` returns ``dtype`` [..., H]."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        *,
        elem: ElemFormat = E4M3,
        block_size: int = 32,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        if embedding_dim % block_size:
            raise ValueError(f"MXEmbedding needs embedding_dim divisible by {block_size}, got {embedding_dim}")
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx  # kept for reference: it only affects gradients, and codes have none
        self.elem = elem
        self.block_size = block_size
        self.dtype = dtype or torch.bfloat16  # the output dtype (the model's)
        self.weight = nn.Parameter(
            torch.empty(num_embeddings, embedding_dim, dtype=elem.torch_dtype, device=device), requires_grad=False
        )
        self.weight_scale = nn.Parameter(
            torch.empty(num_embeddings, embedding_dim // block_size, dtype=torch.uint8, device=device),
            requires_grad=False,
        )

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, weights: TensorSpec, block_size: int = 32) -> MXEmbedding:
        w = emb.weight.detach()
        m = cls(emb.num_embeddings, emb.embedding_dim, emb.padding_idx, elem=weights.elem, block_size=block_size,
                dtype=w.dtype, device=w.device)  # fmt: skip
        q = quantize_mx(w, -1, weights.elem, block_size, weights.scale_rule)
        m.weight.data.copy_(q.data)
        m.weight_scale.data.copy_(q.scales)
        return m

    def mx_weight(self) -> MXTensor:
        return MXTensor(self.weight, self.weight_scale, self.weight.shape, 1, self.block_size, self.elem)

    def dequantized_weight(self) -> torch.Tensor:
        """The whole table as the layer computes with it: float32 [V, H]."""
        return self.mx_weight().dequantize(torch.float32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        # fp8 has no index kernels everywhere: gather the bytes and reinterpret them
        codes = self.weight.view(torch.uint8).index_select(0, flat).view(self.weight.dtype)
        scales = self.weight_scale.index_select(0, flat)
        vals = codes.to(torch.float32).reshape(flat.shape[0], -1, self.block_size)
        out = vals * decode_e8m0(scales).unsqueeze(-1)  # as dequantize_mx: float32 product, then the cast
        return out.reshape(*ids.shape, self.embedding_dim).to(self.dtype)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, weight={self.elem.name}, block={self.block_size}, "
            f"dtype={str(self.dtype).removeprefix('torch.')}"
        )


# --- which embedding a recipe quantizes ----------------------------------------------------------

@dataclass(frozen=True)
class EmbeddingLayer:
    """The input embedding as selection sees it: ``shape`` [V, H], ``dtype`` (safetensors name, or
    None in memory), ``head``: the output head that reads the same matrix ("" when untied)."""

    name: str
    shape: tuple[int, ...] = ()
    dtype: str | None = None
    head: str = ""


@dataclass(frozen=True)
class EmbeddingChoice:
    """What the recipe does with the embedding: ``spec`` (None: stays as it is, with ``kept``
    saying why when the recipe asked for it) and, for a tied head, its activation spec."""

    name: str
    spec: TensorSpec | None = None
    kept: str = ""
    head: str = ""
    head_act: TensorSpec | None = None

    def layers(self) -> dict[str, tuple[TensorSpec, TensorSpec | None]]:
        """The embedding as a quantized layer of the native config (no activations), or nothing."""
        return {self.name: (self.spec, None)} if self.spec is not None else {}

    def tied(self) -> dict[str, tuple[str, TensorSpec | None]]:
        """The native config's ``tied``: head -> (embedding, head activations)."""
        return {self.head: (self.name, self.head_act)} if self.spec is not None and self.head else {}


def select_embedding(layer: EmbeddingLayer, recipe: Recipe, warn=None) -> EmbeddingChoice:
    """Rules: quantized when the recipe says ``embeddings: mxfp8``, H is a multiple of the block
    size (else kept, with a warning) and the weight is F32/F16/BF16 (else ``LayerSelectionError``).
    A tied head shares it, with the recipe's activations when the recipe selects the head."""
    if recipe.embeddings is None:
        return EmbeddingChoice(layer.name)
    shape = layer.shape
    if len(shape) != 2 or shape[-1] % recipe.block_size:
        kept = f"H={shape[-1] if shape else '?'} is not a multiple of {recipe.block_size}"
        if warn:
            warn(f"keeping {layer.name} in its original dtype: {kept}")
        return EmbeddingChoice(layer.name, kept=kept)
    if layer.dtype is not None and layer.dtype not in QUANTIZABLE_DTYPES:
        raise LayerSelectionError(
            f"tensor {layer.name}.weight: unsupported dtype {layer.dtype} (mxq quantizes F32, F16 and BF16 weights)"
        )
    head_act = recipe.activations if layer.head and recipe.selects(layer.head) else None
    return EmbeddingChoice(layer.name, recipe.weights, head=layer.head, head_act=head_act)


# --- models: the embedding, its tied head, the swap ----------------------------------------------

def input_embedding(model: nn.Module) -> tuple[str, nn.Module] | None:
    """(name, module) of the model's input embedding, or None."""
    get = getattr(model, "get_input_embeddings", None)
    try:
        emb = get() if get is not None else None
    except (NotImplementedError, AttributeError):
        return None
    if emb is None:
        return None
    return next(((n, m) for n, m in model.named_modules() if m is emb), None)


def tied_head(model: nn.Module, emb_name: str) -> str:
    """The name of the Linear layer whose weight is tied to the embedding ``emb_name`` ("" when none).
    A model in memory: the layer holding the same Parameter object. A skeleton on the meta device
    (the converter's, or ``from_pretrained``'s before loading): transformers' tie map
    (``all_tied_weights_keys``, from the config's ``tie_word_embeddings``), which loading applies."""
    emb = model.get_submodule(emb_name)
    w = getattr(emb, "weight", None)
    if w is not None and w.device.type != "meta":
        for n, m in model.named_modules():
            if m is not emb and isinstance(m, nn.Linear) and m.weight is w:
                return n
        return ""
    src = emb_name + ".weight"
    for target, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        if source == src and target.endswith(".weight"):
            return target[: -len(".weight")]
    return ""


def embedding_layer(model: nn.Module) -> EmbeddingLayer | None:
    """The model's nn.Embedding (in memory, or a meta-device skeleton) as ``select_embedding`` sees
    it, with its tied head (None: no plain nn.Embedding)."""
    found = input_embedding(model)
    if found is None or type(found[1]) is not nn.Embedding:
        return None
    name, emb = found
    return EmbeddingLayer(name, tuple(emb.weight.shape), head=tied_head(model, name))


def share_with_head(model: nn.Module, emb_name: str, head_name: str, act: TensorSpec | None,
                    kernels: str | None = None):  # fmt: skip
    """Make ``head_name`` an ``MXLinear`` whose weight and scales are the ``MXEmbedding`` at
    ``emb_name`` (the same Parameter objects), and register the scales in the model's tie map."""
    emb = model.get_submodule(emb_name)
    old = model.get_submodule(head_name)
    bias = getattr(old, "bias", None)
    with torch.device("meta"):
        head = MXLinear(emb.embedding_dim, emb.num_embeddings, bias is not None, elem=emb.elem, act=act,
                        block_size=emb.block_size, dtype=emb.dtype, kernels=kernels)  # fmt: skip
    head.weight = emb.weight
    head.weight_scale = emb.weight_scale
    if bias is not None:
        head.bias = bias
    model.set_submodule(head_name, head)
    _tie_scales(model, emb_name, head_name)
    return head


def _tie_scales(model: nn.Module, emb_name: str, head_name: str) -> None:
    """Add ``head.weight_scale -> embedding.weight_scale`` to transformers' tie maps: ``tie_weights``
    (after loading) then shares the scales as it shares the weight, and ``save_pretrained`` writes
    them once."""
    key, src = f"{head_name}.weight_scale", f"{emb_name}.weight_scale"
    keys = dict(getattr(model, "_tied_weights_keys", None) or {})
    if keys.get(key) != src:
        keys[key] = src
        model._tied_weights_keys = keys  # on the instance: the class's map stays as it is
    expanded = getattr(model, "all_tied_weights_keys", None)
    if isinstance(expanded, dict):
        expanded[key] = src


def swap_embedding(model: nn.Module, name: str, spec: TensorSpec, block_size: int = 32, *,
                   dtype: torch.dtype | None = None, meta: bool = False) -> MXEmbedding:  # fmt: skip
    """Replace the nn.Embedding ``name`` with an ``MXEmbedding``: quantized from its weight, or
    (``meta``) an empty one on the meta device for ``from_pretrained`` to fill."""
    emb = model.get_submodule(name)
    if meta:
        with torch.device("meta"):
            new = MXEmbedding(emb.num_embeddings, emb.embedding_dim, emb.padding_idx, elem=spec.elem,
                              block_size=block_size, dtype=dtype)  # fmt: skip
    else:
        new = MXEmbedding.from_embedding(emb, spec, block_size)
    model.set_submodule(name, new)
    keep_compute_dtype(model)
    return new


def quantize_embedding(model: nn.Module, recipe: Recipe, kept: dict[str, str], warn=None,
                       kernels: str | None = None) -> EmbeddingChoice | None:  # fmt: skip
    """``mxq.quantize_model``'s part for the embedding: select, swap, share with a tied head (whose
    "tied" entry leaves ``kept``). None when the model has no plain nn.Embedding."""
    layer = embedding_layer(model)
    if layer is None:
        if recipe.embeddings is not None and warn:
            warn(f"{type(model).__name__} has no torch.nn.Embedding input embedding; recipe {recipe.name!r} quantizes none")
        return None
    choice = select_embedding(layer, recipe, warn)
    if choice.kept:
        kept[choice.name] = choice.kept
    if choice.spec is None:
        return choice
    swap_embedding(model, choice.name, choice.spec, recipe.block_size)
    if choice.head:
        share_with_head(model, choice.name, choice.head, choice.head_act, kernels)
        kept.pop(choice.head, None)
    return choice


# --- from_pretrained (mxq.hf.quantizer's quantizer) -------------------------------------------------------

def prepare_for_loading(model: nn.Module, cfg, names: list[str], dtype: torch.dtype) -> None:
    """Before the weights load: the quantization_config's embeddings ``names`` become empty
    ``MXEmbedding`` modules and its ``tied`` heads ``MXLinear`` modules sharing their tensors; the
    ties must be the model's own (config.json ``tie_word_embeddings``)."""
    cls = type(model).__name__
    tied = cfg.tied_layers()
    for name in names:
        w, a = cfg.layer_specs(name)
        if a is not None:
            raise ValueError(f"quantization_config layers[{name!r}].activations: {name} is an embedding (no activations to quantize); expected null")
        swap_embedding(model, name, w, cfg.block_size, dtype=dtype, meta=True)
    for target, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        head, emb = target.removesuffix(".weight"), source.removesuffix(".weight")
        if emb in names and head not in tied:
            raise ValueError(
                f"quantization_config quantizes {emb!r}, which {cls} ties to {head!r} (tie_word_embeddings), "
                f"but does not list {head!r} under tied"
            )
        if head in cfg.layers and emb not in names and source.endswith(".weight"):
            raise ValueError(
                f"quantization_config lists {head!r}, which {cls} ties to the unquantized {emb!r} "
                "(tie_word_embeddings): a tied head is quantized only with its embedding"
            )
    for head, (emb, act) in tied.items():
        if emb not in names:
            raise ValueError(f"quantization_config tied[{head!r}]: {emb!r} is not an embedding layer of {cls}")
        if tied_head(model, emb) != head:
            raise ValueError(
                f"quantization_config ties {head!r} to {emb!r}, but {cls} does not tie them "
                "(config.json tie_word_embeddings is false)"
            )
        share_with_head(model, emb, head, act)


def after_loading(model: nn.Module, cfg) -> None:
    """After the weights load (and any change of the scales' dtype): every tied head holds its
    embedding's Parameter objects again."""
    for head, (emb, _) in cfg.tied_layers().items():
        e, h = model.get_submodule(emb), model.get_submodule(head)
        h.weight, h.weight_scale = e.weight, e.weight_scale


def skeleton_modules(config) -> tuple[dict[str, str], dict[str, str], dict[str, tuple[int, tuple[str, ...]]]]:
    """The Linear and Embedding layers of the model ``config`` describes (name -> "Linear" or
    "Embedding"; other modules holding a weight matrix, such as routers, by their class name; built on
    the meta device), its ties (head -> input embedding) and its experts
    modules (name -> (number of experts, projections), ``mxq.runtime.experts``)."""
    from transformers import AutoModelForCausalLM

    from mxq.runtime.experts import experts_layers

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    experts = {n: (e.num_experts, e.projections) for n, e in experts_layers(model).items()}
    kinds = {
        n: "Embedding" if isinstance(m, nn.Embedding) else "Linear" if isinstance(m, nn.Linear) else type(m).__name__
        for n, m in model.named_modules()
        if isinstance(m, (nn.Linear, nn.Embedding)) or getattr(m._parameters.get("weight"), "ndim", 0) == 2
    }  # fmt: skip  (other modules with a weight matrix, routers: by class name, never a quantization target)
    found = input_embedding(model)
    head = tied_head(model, found[0]) if found is not None else ""
    return kinds, ({head: found[0]} if head else {}), experts


# --- the model's dtype ---------------------------------------------------------------------------
#
# transformers' ``model.dtype`` is the dtype of the first floating-point parameter. With the
# embedding quantized that is the fp8 code table, and generate() would build attention masks (and
# user code would cast inputs) in fp8. ``keep_compute_dtype`` gives the model a subclass of its own
# class (same name, module and behaviour) whose ``dtype`` skips fp8 parameters.

_DTYPE_CLASSES: dict[type, type] = {}


def _compute_dtype(self) -> torch.dtype:
    first = None
    for p in self.parameters():
        if p.is_floating_point():
            if p.dtype not in FP8_DTYPES:
                return p.dtype
            first = first or p.dtype
    if first is None:
        raise StopIteration  # as transformers' property does for a model without floating-point parameters
    return first


def keep_compute_dtype(model: nn.Module) -> nn.Module:
    cls = type(model)
    if getattr(cls, "_mxq_compute_dtype", False) or not isinstance(getattr(cls, "dtype", None), property):
        return model
    sub = _DTYPE_CLASSES.get(cls)
    if sub is None:
        attrs = {"dtype": property(_compute_dtype), "_mxq_compute_dtype": True,
                 "__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__}  # fmt: skip
        sub = _DTYPE_CLASSES[cls] = type(cls.__name__, (cls,), attrs)
    model.__class__ = sub
    return model


__all__ = [
    "MXEmbedding",
    "EmbeddingLayer",
    "EmbeddingChoice",
    "select_embedding",
    "quantize_embedding",
    "share_with_head",
    "swap_embedding",
    "keep_compute_dtype",
    "tied_head",
]
