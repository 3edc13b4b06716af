"""The fast structure of a quantized model, set up in one place: ``fuse(model)``.

``quantize_model`` and ``from_pretrained`` call it; it changes how the model computes, never what
it computes, and never its ``state_dict``:

1. **Sibling projections** (``mxq.runtime.linear.fuse_projections``): q/k/v and gate/up each one MX GEMM.
2. **Activation quantization in its producer** (``fuse_producers``, kernels in
   ``mxq.kernels.producers``). In a Llama-family decoder layer (Llama, Mistral, Qwen2, Qwen3)
   every W8A8 input comes from an RMSNorm (``input_layernorm`` → q/k/v,
   ``post_attention_layernorm`` → gate/up) or from SiLU(gate)·up (→ down_proj). Those modules get
   a forward that computes the producer and rounds its output to MX in one kernel:
   - the RMSNorm returns the MX-rounded values (what the projections compute with anyway) and
     hands their fp8 codes and scales to the fused projection it feeds (``FusedMXLinear.give``),
     which recognises its input by identity and skips its own rounding;
   - the MLP runs fused gate/up → SiLU·up rounded to MX → down_proj on the codes.
   These modules' forwards are the only ones replaced at this step: the decoder layer still calls
   ``self.input_layernorm(h)`` and ``self.self_attn(...)``. Only modules whose arithmetic is known
   are changed (the ``NORMS`` and ``MLPS`` classes, SiLU, W8A8 with RCEIL activations: RCEIL
   rounding is idempotent, so a path that rounds X again computes the same function); others keep
   their forward.
3. **The residual add inside the norm** (``fuse_layers``, kernel ``add_rmsnorm_mx``). A decoder layer
   of ``LAYERS`` whose forward is ``KNOWN_LAYER_FORWARD`` (checked on the class's source, so a
   transformers release that changes it keeps its own) and whose post-attention norm is a fused
   producer gets a forward that computes ``residual + attn_out`` and the norm after it in one
   kernel (the sum exactly as torch adds). Its closing ``residual + mlp_out`` is computed with the
   next layer's input norm ahead, when that norm is fused too: the sum is returned as the layer's
   output and the norm's result kept on the norm, which returns it when called on that very tensor
   (identity, as ``FusedMXLinear.give``, under ``torch.compile`` too; not past a norm with hooks).
   Per decoder layer two launches fewer; the logits are bit-identical on the reference path.
4. **Attention without repeated K/V** (``GROUPED_SDPA``): transformers' SDPA attention repeats K
   and V to every query head whenever it passes a mask (always with a static cache), a copy of the
   whole cache per layer and step. This attention function folds each KV head's query heads into
   the query length instead (rows g·Sq + s), so SDPA reads K and V once; the same arithmetic.
   Used for steps of at most ``GROUPED_MAX_ROWS`` query rows per KV head (decoding); anything
   else goes to transformers' SDPA. Set when a Llama, Mistral, Qwen2 or Qwen3 model uses ``sdpa``.
   One query token on a GPU goes to ``mxq.kernels.attention_sdpa_decode`` (op ``mxq::sdpa_decode``):
   the same function in one small launch instead of cuDNN's flash kernel, masked key blocks skipped.
   gpt-oss (attention sinks, eager attention only) gets ``SINKS_ATTENTION``: its one-token steps go
   to the same kernel with the layer's sinks, 4-16x faster than its eager attention, compiled or not
   (kernels/NOTES.md); everything else runs the family's own eager attention, and its additive mask
   is made on the device (``device_eager_mask``: capturable in a CUDA graph).

5. **The router's top-k in one kernel** (``mxq.runtime.routing``, kernels in ``mxq.kernels.moe_router``): a
   known MoE router (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral, gpt-oss, DeepSeek-V3, GLM-4-MoE) keeps its
   GEMM and computes the softmax or sigmoid, the (group-limited) top-k, normalisation and cast in one
   launch instead of five or more; Llama 4's MoE block runs only the experts its router chose, not
   every expert on every token (``mxq.runtime.routing``). Grouped attention (4.) covers the attention of
   the families whose attention is Llama's.

``unfuse`` (``unfuse_layers``, ``unfuse_producers``, ``unfuse_routers``, then
``mxq.runtime.linear.unfuse_projections``) removes them. Under ``torch.compile`` the producers are the custom ops ``mxq::rmsnorm_mx``,
``mxq::add_rmsnorm_mx`` and ``mxq::silu_mul_mx`` (opaque, shape-only fakes) and the model still
compiles with ``fullgraph``.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn

from mxq.formats import ScaleRule, as_elem_format
from mxq.kernels import cpu, reference
from mxq.kernels.dispatch import HAS_TRITON
from mxq.kernels.registry import kernels_spec
from mxq.runtime.install import (
    forward_hash,
    install_forward,
    normalized_source,
    restore_forward,
    warn_unknown_forward,
)
from mxq.runtime.linear import (
    SIBLINGS,
    FusedMXLinear,
    MXLinear,
    fuse_projections,
    fused_name,
    unfuse_projections,
)
from mxq.runtime.routing import fuse_routers, unfuse_routers

# Module classes whose forward is the arithmetic the producer kernels compute (by class name, as
# transformers defines them, and by forward source, ``KNOWN_FORWARDS``; another class keeps its own).
NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
MLPS = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP")
# the sha256 (16 hex digits) of the normalized forward source (``normalized_source``) of the classes
# above, as transformers 5.17-5.24 write them: a release that changes one keeps its own forward
KNOWN_FORWARDS = {"9635bcd843f309a0": "RMSNorm", "7d2027d4464e3e71": "gated MLP"}
SILUS = ("SiLU", "SiLUActivation")  # torch.nn.SiLU, transformers.activations.SiLUActivation
QKV, GATE_UP = (fused_name(names) for names in SIBLINGS)

GROUPED_SDPA = "mxq_sdpa"
SINKS_ATTENTION = "mxq_sinks"  # gpt-oss's eager attention, one-token steps to the decode kernel
GROUPED_MAX_ROWS = 64
DECODE_KERNEL = True  # one-token steps to kernels/attention_sdpa_decode.py (False: SDPA as before, for A/B)


def fuse(model: nn.Module) -> list[str]:
    """Set up the fast structure (module doc) in place; what was fused, by module name."""
    done = fuse_projections(model)
    done += fuse_producers(model)
    done += fuse_layers(model)
    done += fuse_routers(model)
    if use_grouped_sdpa(model):
        done.append(f"attention: {model.config._attn_implementation}")
    return done


def unfuse(model: nn.Module) -> None:
    """Undo ``fuse``: the model as transformers builds it (separate projections, its modules' own
    forwards, transformers' SDPA)."""
    unfuse_layers(model)
    unfuse_producers(model)
    unfuse_routers(model)
    unfuse_projections(model)
    cfg = getattr(model, "config", None)
    if getattr(cfg, "_attn_implementation", None) in BEFORE:
        model.set_attn_implementation(BEFORE[cfg._attn_implementation])


# --- producers ----------------------------------------------------------------------------------


def unfuse_producers(model: nn.Module) -> None:
    """Every producer its module's own forward again (the instance-level forwards ``fuse_producers`` set)."""
    for m in model.modules():
        if "_mxq_feeds" in m.__dict__:
            restore_forward(m, "fuse")
            del m.__dict__["_mxq_feeds"]



def _w8a8_rceil(m: nn.Module | None) -> bool:
    act = getattr(m, "act", None)
    return isinstance(m, MXLinear) and act is not None and act.scale_rule is ScaleRule.RCEIL


def fuse_producers(model: nn.Module) -> list[str]:
    """Give each known RMSNorm and gated MLP that feeds a W8A8 projection the fused forward."""
    done = []
    for name, layer in model.named_modules():
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        for norm_name, consumer in (("input_layernorm", getattr(attn, QKV, None)),
                                    ("post_attention_layernorm", getattr(mlp, GATE_UP, None))):  # fmt: skip
            norm = getattr(layer, norm_name, None)
            if known_class(type(norm), NORMS) and isinstance(consumer, FusedMXLinear) and _w8a8_rceil(consumer):
                if _install(norm, _norm_forward, consumer):
                    done.append(f"{name}.{norm_name}")
        gate_up = getattr(mlp, GATE_UP, None)
        if known_class(type(mlp), MLPS) and isinstance(gate_up, FusedMXLinear) and _mlp_fusable(mlp, gate_up):
            if _install(mlp, _mlp_forward, gate_up):
                done.append(f"{name}.mlp")
    return done


def _mlp_fusable(mlp: nn.Module, gate_up: FusedMXLinear) -> bool:
    down = getattr(mlp, "down_proj", None)
    return (
        _w8a8_rceil(gate_up) and _w8a8_rceil(down) and down.act.elem == gate_up.act.elem
        and type(getattr(mlp, "act_fn", None)).__name__ in SILUS
    )  # fmt: skip


def _install(module: nn.Module, forward, feeds: FusedMXLinear) -> bool:
    # plain instance attributes (not submodules: the consumer is registered where it lives)
    if not install_forward(module, forward, "fuse"):
        return False
    module.__dict__["_mxq_feeds"] = feeds
    return True


def _norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    """RMSNorm whose output is MX-rounded, the codes handed to the fused projection it feeds."""
    feeds = self.__dict__["_mxq_feeds"]
    ready = getattr(self, "_mxq_ready", None)  # computed ahead with the residual add (``_add_ahead``)
    if ready is not None:
        self._mxq_ready = None
        if ready[0] is x:
            feeds.give(*ready[1:])
            return ready[1]
    if not _norm_usable(self, feeds, x):
        return type(self).forward(self, x)  # formats changed since fusing (e.g. act = None), or another dtype
    y, q, s = rmsnorm_mx(x, self.weight, self.variance_epsilon, feeds)
    feeds.give(y, q, s)
    return y


def _norm_usable(norm: nn.Module, feeds, x: torch.Tensor) -> bool:
    return _w8a8_rceil(feeds) and norm.weight.dtype == x.dtype and not x.shape[-1] % feeds.block_size


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """down_proj(SiLU(gate) · up), gate/up one GEMM, SiLU·up rounded to MX in one kernel."""
    gate_up = self.__dict__["_mxq_feeds"]
    if not _mlp_fusable(self, gate_up):
        return type(self).forward(self, x)  # formats changed since fusing
    gu = gate_up.product(x)
    y, q, s = silu_mul_mx(gu, gate_up)
    return self.down_proj(y, (q, s))


_PRODUCERS = None  # mxq.kernels.producers, imported on the first CUDA call


def _producer_impl(name: str, t: torch.Tensor, kernels: str):
    """``kernels.producers.<name>`` for a CUDA tensor, ``kernels.cpu.<name>`` for a CPU tensor where
    the CPU kernels built (unless ``kernels`` is "reference"), else its torch reference
    ``kernels.reference.<name>_reference``."""
    global _PRODUCERS
    if kernels_spec(kernels or None) != "reference":
        if HAS_TRITON and t.is_cuda:
            if _PRODUCERS is None:
                from mxq.kernels import producers as _PRODUCERS
            return getattr(_PRODUCERS, name)
        if t.device.type == "cpu" and cpu.available():
            return getattr(cpu, name)
    return getattr(reference, f"{name}_reference")


@torch.library.custom_op("mxq::rmsnorm_mx", mutates_args=())
def rmsnorm_mx_op(
    x: torch.Tensor, weight: torch.Tensor, eps: float, elem: str, block_size: int, kernels: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _producer_impl("rmsnorm_mx", x, kernels)(x, weight, eps, as_elem_format(elem), block_size)


@torch.library.custom_op("mxq::add_rmsnorm_mx", mutates_args=())
def add_rmsnorm_mx_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, elem: str, block_size: int, kernels: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _producer_impl("add_rmsnorm_mx", x, kernels)(x, residual, weight, eps, as_elem_format(elem), block_size)


@torch.library.custom_op("mxq::silu_mul_mx", mutates_args=())
def silu_mul_mx_op(
    gu: torch.Tensor, elem: str, block_size: int, kernels: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _producer_impl("silu_mul_mx", gu, kernels)(gu, as_elem_format(elem), block_size)


def _fake(v: torch.Tensor, k: int, elem: str, block_size: int):
    m = v.numel() // v.shape[-1]
    return (v.new_empty(*v.shape[:-1], k), v.new_empty((m, k), dtype=as_elem_format(elem).torch_dtype),
            v.new_empty((m, k // block_size), dtype=torch.uint8))  # fmt: skip


rmsnorm_mx_op.register_fake(lambda x, weight, eps, elem, block_size, kernels: _fake(x, x.shape[-1], elem, block_size))
add_rmsnorm_mx_op.register_fake(
    lambda x, residual, weight, eps, elem, block_size, kernels: (x.new_empty(x.shape), *_fake(x, x.shape[-1], elem, block_size))
)
silu_mul_mx_op.register_fake(lambda gu, elem, block_size, kernels: _fake(gu, gu.shape[-1] // 2, elem, block_size))


def _produce(name: str, op, feeds: MXLinear, *args):
    """Producer ``name`` on ``args`` (tensors, then eps for the norms), its output in ``feeds``'
    activation format: under ``torch.compile`` the custom op ``op`` (format by name), else the
    implementation for the first tensor's device (``_producer_impl``)."""
    if torch.compiler.is_compiling():
        return op(*args, feeds.act.elem.name, feeds.block_size, feeds.kernels or "")
    return _producer_impl(name, args[0], feeds.kernels)(*args, feeds.act.elem, feeds.block_size)


def rmsnorm_mx(x: torch.Tensor, weight: torch.Tensor, eps: float, feeds: MXLinear):
    """(MX-rounded RMSNorm output, fp8 codes [M, K], scales [M, K/32]) in ``feeds``' activation format."""
    return _produce("rmsnorm_mx", rmsnorm_mx_op, feeds, x, weight, float(eps))


def add_rmsnorm_mx(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, feeds: MXLinear):
    """(residual + x, MX-rounded RMSNorm of that, fp8 codes, scales) in ``feeds``' activation format."""
    return _produce("add_rmsnorm_mx", add_rmsnorm_mx_op, feeds, x, residual, weight, float(eps))


def silu_mul_mx(gu: torch.Tensor, feeds: MXLinear):
    """(MX-rounded SiLU(gate)·up of a fused gate/up output, fp8 codes, scales)."""
    return _produce("silu_mul_mx", silu_mul_mx_op, feeds, gu)


# --- the residual add with the norm after it ----------------------------------------------------

# Decoder layers whose forward is ``KNOWN_LAYER_FORWARD`` in the transformers releases mxq supports
# (checked on the class's source when fusing, so a release that changes it keeps its own forward).
# The releases differ in the name of the cache argument (``CACHE_ARGS``).
LAYERS = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer")
CACHE_ARGS = ("past_key_values", "cache")

KNOWN_LAYER_FORWARD = """
def forward(self, hidden_states, attention_mask=None, position_ids=None, {cache}=None, use_cache=False,
            position_embeddings=None, **kwargs):
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                      position_ids=position_ids, {cache}={cache}, use_cache=use_cache,
                                      position_embeddings=position_embeddings, **kwargs)
    hidden_states = residual + hidden_states
    residual = hidden_states
    hidden_states = self.post_attention_layernorm(hidden_states)
    hidden_states = self.mlp(hidden_states)
    hidden_states = residual + hidden_states
    return hidden_states
"""


@functools.cache
def known_class(cls: type, names: tuple[str, ...]) -> bool:
    """Whether ``cls`` is one of ``names`` (``NORMS``, ``MLPS``) with a forward of ``KNOWN_FORWARDS``;
    a class of that name with another forward is said once."""
    if cls.__name__ not in names:
        return False
    if forward_hash(cls) in KNOWN_FORWARDS:
        return True
    warn_unknown_forward(cls, "fused activation rounding")
    return False


@functools.cache
def known_layer(cls: type) -> str | None:
    """For a class of ``LAYERS`` whose forward computes ``KNOWN_LAYER_FORWARD``: the name of its
    cache argument; else None (said once for a class of ``LAYERS``)."""
    if cls.__name__ not in LAYERS:
        return None
    try:
        source = normalized_source(inspect.getsource(cls.forward))
    except (OSError, TypeError):
        source = None
    cache = next((c for c in CACHE_ARGS if source == normalized_source(KNOWN_LAYER_FORWARD.format(cache=c))), None)
    if cache is None:
        warn_unknown_forward(cls, "residual add fused with the norm")
    return cache


def fuse_layers(model: nn.Module) -> list[str]:
    """Give each known decoder layer (``known_layer``) whose post-attention norm is a fused producer
    a forward that adds the residual and normalizes in one kernel (``add_rmsnorm_mx``); where the
    next layer's input norm is one too, the layer's closing residual add is computed with that norm
    ahead and handed to it (``_add_ahead``)."""
    done = []
    for name, layers in model.named_modules():
        if not isinstance(layers, nn.ModuleList):
            continue
        for i, layer in enumerate(layers):
            cache = known_layer(type(layer))
            if cache is None or "_mxq_feeds" not in layer.post_attention_layernorm.__dict__ \
                    or not install_forward(layer, fused_layer_forward, "fuse"):  # fmt: skip
                continue
            nxt = layers[i + 1] if i + 1 < len(layers) else None
            nxt_norm = getattr(nxt, "input_layernorm", None) if nxt is not None and known_layer(type(nxt)) else None
            layer.__dict__["_mxq_next"] = nxt_norm if nxt_norm is not None and "_mxq_feeds" in nxt_norm.__dict__ else None
            if layer.__dict__["_mxq_next"] is not None:
                nxt_norm.__dict__["_mxq_ready"] = None  # a plain attribute: set and read like ``FusedMXLinear._given``
            layer.__dict__["_mxq_attn_kw"] = dict(attention_mask=None, position_ids=None, use_cache=False,
                                                  position_embeddings=None, **{cache: None})  # fmt: skip
            done.append(f"{name}.{i}: add + norm")
    return done


def unfuse_layers(model: nn.Module) -> None:
    for m in model.modules():
        if "_mxq_next" in m.__dict__:
            restore_forward(m, "fuse")
            del m.__dict__["_mxq_next"], m.__dict__["_mxq_attn_kw"]
        m.__dict__.pop("_mxq_ready", None)


def fused_layer_forward(self, hidden_states, *args, **kwargs):
    """``KNOWN_LAYER_FORWARD`` with the post-attention residual add and norm one kernel, and the
    closing residual add done with the next layer's input norm where that is fused. The
    model passes everything but the hidden states by name; a positional call runs the class's own
    forward."""
    if args:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    kw = {**self.__dict__["_mxq_attn_kw"], **kwargs}  # the layer's defaults, as it passes them on
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, **kw)
    residual, hidden_states = _add_norm(self.post_attention_layernorm, hidden_states, residual)
    hidden_states = self.mlp(hidden_states)
    nxt = self.__dict__["_mxq_next"]
    if nxt is not None:
        return _add_ahead(nxt, hidden_states, residual)
    return residual + hidden_states


def _plain(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> bool:
    """Whether ``norm`` after ``residual + x`` must run as a module call: another format or dtype
    than fused for, operands that do not add elementwise, hooks on the norm to honour, or a norm
    whose weight is not on x's device. The last is the next layer's norm on another GPU of a model
    split by ``device_map`` (or offloaded: its weight on the meta device until its hook loads it):
    the sum is returned as is, accelerate's hook moves it, and the norm computes on the moved copy."""
    feeds = norm.__dict__.get("_mxq_feeds")
    if feeds is None or not _norm_usable(norm, feeds, x) or norm._forward_hooks or norm._forward_pre_hooks:
        return True
    w = norm.weight
    return residual.shape != x.shape or residual.dtype != x.dtype or w.is_meta or w.get_device() != x.get_device()


def _add_norm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + x, norm(residual + x)), the norm's codes handed to the projection it feeds."""
    if _plain(norm, x, residual):
        h = residual + x
        return h, norm(h)
    feeds = norm.__dict__["_mxq_feeds"]
    h, y, q, s = add_rmsnorm_mx(x, residual, norm.weight, norm.variance_epsilon, feeds)
    feeds.give(y, q, s)
    return h, y


def _add_ahead(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + x, with ``norm`` of it computed in the same kernel and kept on the norm, which
    returns it when called on this very tensor (by identity, as ``FusedMXLinear.give``). A hook
    that returns a new tensor from the layer is seen (the norm computes again); one that changes
    the layer's output in place is not: ``fuse=False`` keeps transformers' forwards for that."""
    if _plain(norm, x, residual):
        return residual + x
    h, y, q, s = add_rmsnorm_mx(x, residual, norm.weight, norm.variance_epsilon, norm.__dict__["_mxq_feeds"])
    norm._mxq_ready = (h, y, q, s)
    return h


# --- attention without repeated K/V ---------------------------------------------------------------


def grouped_sdpa_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
):
    """transformers' SDPA attention, with each KV head's query heads folded into the query rows
    when a mask is given (module doc); [B, Hq, Sq, D] queries -> ([B, Sq, Hq, D], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    b, hq, sq, d = query.shape
    if sq == 1 and DECODE_KERNEL and kwargs.get("s_aux") is None:
        out = _one_token(module, query, key, value, attention_mask, dropout, scaling, None, kwargs)
        if out is not None:
            return out, None
    if (
        groups <= 1 or attention_mask is None or attention_mask.dim() != 4 or attention_mask.shape[1] != 1
        or sq * groups > GROUPED_MAX_ROWS or (dropout and module.training) or kwargs.get("output_attentions")
        or any(kwargs.get(k) is not None for k in ("position_bias", "s_aux", "softcap"))  # not plain SDPA
    ):  # fmt: skip
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)  # fmt: skip
    hkv, n = key.shape[1], key.shape[2]
    q = query.reshape(b, hkv, groups * sq, d)
    mask = attention_mask[:, :, :, :n]
    mb = mask.shape[0]
    mask = mask.expand(mb, 1, sq, n)[:, :, None].expand(mb, 1, groups, sq, n).reshape(mb, 1, groups * sq, n)
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(b, hq, sq, out.shape[-1]).transpose(1, 2).contiguous(), None


def _one_token(module, query, key, value, mask, dropout, scaling, sinks, kwargs) -> torch.Tensor | None:
    """One query token through ``mxq.kernels.attention_sdpa_decode`` where its registry chooses the
    kernel for this call (plain SDPA arguments, a [Bm, 1, 1, N] mask or none, sinks [Hq] or none),
    else None. Eager: the path chosen here runs; under ``torch.compile`` the op ``mxq::sdpa_decode``."""
    if (
        (dropout and module.training) or kwargs.get("output_attentions")
        or any(kwargs.get(k) is not None for k in ("position_bias", "softcap"))
        or (mask is not None and (mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1
                                  or mask.shape[0] not in (1, query.shape[0]) or mask.shape[3] < key.shape[2]))
        or (sinks is not None and tuple(sinks.shape) != (query.shape[1],))
    ):  # fmt: skip
        return None
    from mxq.kernels.attention_sdpa_decode import SDPA_DECODE, sdpa_decode_problem

    spec = getattr(module, "mxq_kernels", None) or ""
    p = sdpa_decode_problem(query, key, mask, spec or None)
    path = SDPA_DECODE.choose(p, p.spec)
    if path.name == "reference":
        return None
    s = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    if torch.compiler.is_compiling():
        return sdpa_decode_op(query, key, value, mask, sinks, s, spec)
    return _sdpa_decode(query, key, value, mask, sinks, s, (path, p))


def _sdpa_decode(q, k, v, mask, sinks, scale, chosen):
    """Eager: the (path, problem) ``_one_token`` chose, run (the seam the model tests watch)."""
    from mxq.kernels.attention_sdpa_decode import run_path

    path, p = chosen
    return run_path(path, p, q, k, v, mask, scale, sinks)


@torch.library.custom_op("mxq::sdpa_decode", mutates_args=())
def sdpa_decode_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   sinks: torch.Tensor | None, scale: float, kernels: str) -> torch.Tensor:  # fmt: skip
    """``mxq.kernels.attention_sdpa_decode.sdpa_decode`` as a torch custom op (opaque to ``torch.compile``)."""
    from mxq.kernels.attention_sdpa_decode import sdpa_decode

    return sdpa_decode(q, k, v, mask, scale, kernels=kernels or None, sinks=sinks)


@sdpa_decode_op.register_fake
def _sdpa_decode_fake(q, k, v, mask, sinks, scale, kernels):
    return q.new_empty((q.shape[0], 1, q.shape[1], q.shape[3]))


def sinks_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
):
    """gpt-oss's eager attention (attention sinks, an additive mask), with one query token on a GPU
    through ``mxq.kernels.attention_sdpa_decode`` (the sink a term of the softmax's denominator);
    anything else runs transformers' own ``eager_attention_forward`` of the family."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    if query.shape[2] == 1 and DECODE_KERNEL and s_aux is not None:
        out = _one_token(module, query, key, value, attention_mask, dropout, scaling, s_aux, kwargs)
        if out is not None:
            return out, None
    return eager_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                   scaling=scaling if scaling is not None else module.scaling, **kwargs)  # fmt: skip


def device_eager_mask(sdpa_mask, *args, dtype: torch.dtype = torch.float32, **kwargs):
    """transformers' ``eager_mask`` (the additive mask of eager attention: gpt-oss, models with
    attention sinks) with the same values, its 0 made on the device: the original copies it from the
    host, which a CUDA graph cannot capture and ``torch.compile`` cannot trace. ``sdpa_mask``:
    transformers' boolean mask, bound with ``functools.partial`` (no import inside a traced step)."""
    kwargs.pop("allow_is_causal_skip", None)
    mask = sdpa_mask(*args, allow_is_causal_skip=False, **kwargs)
    if mask is None:
        return None
    return torch.where(mask, torch.zeros((), dtype=dtype, device=mask.device), torch.finfo(dtype).min)


def register_grouped_sdpa() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_forward)
    AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)
    AttentionInterface.register(SINKS_ATTENTION, sinks_attention_forward)
    AttentionMaskInterface.register(SINKS_ATTENTION, functools.partial(device_eager_mask, sdpa_mask))


# model types whose attention calls the attention function as Llama's does (plain SDPA arguments)
GROUPED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
# model types whose eager attention has sinks (``sinks_attention_forward``), and the implementation each leaves
SINKS_MODEL_TYPES = ("gpt_oss",)
BEFORE = {GROUPED_SDPA: "sdpa", SINKS_ATTENTION: "eager"}


def use_grouped_sdpa(model: nn.Module) -> bool:
    """Switch a model of ``GROUPED_MODEL_TYPES`` that uses ``sdpa`` to ``GROUPED_SDPA``, or one of
    ``SINKS_MODEL_TYPES`` that uses ``eager`` to ``SINKS_ATTENTION``; whether it did."""
    cfg = getattr(model, "config", None)
    impl, kind = getattr(cfg, "_attn_implementation", None), getattr(cfg, "model_type", None)
    if impl == "sdpa" and kind in GROUPED_MODEL_TYPES:
        name = GROUPED_SDPA
    elif impl == "eager" and kind in SINKS_MODEL_TYPES:
        name = SINKS_ATTENTION
    else:
        return False
    if not hasattr(model, "set_attn_implementation"):
        return False
    register_grouped_sdpa()
    model.set_attn_implementation(name)
    return True


register_grouped_sdpa()
