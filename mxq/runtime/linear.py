"""``MXLinear``: a Linear layer whose weight is stored as MXFP8, and the module swap that makes one.

The weight is kept as fp8 data ``weight`` [N, K] with biased-E8M0 ``weight_scale`` [N, K/32],
the names and layout MXFP8 checkpoints use. ``forward`` calls ``mxq.kernels.mx_linear``: the
Triton kernels on a GPU, the torch reference elsewhere — the same function either way. Which
kernels may run is the layer's ``kernels`` ("auto", "reference" or path names of
``mxq.kernels.dispatch.LINEAR``); ``set_kernels(model, spec)`` sets it for a whole model.
``fuse_projections`` (the last section) runs q/k/v and gate/up as one MX GEMM each.

Under ``torch.compile`` the call goes through the custom op ``torch.ops.mxq.mx_linear`` (opaque to
the compiler, with a shape-only fake implementation), so a model with MXLinear layers compiles
with ``fullgraph=True`` and its decode step can be captured in a CUDA graph
(``generate(cache_implementation="static")`` on CUDA does both).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from mxq import settings
from mxq.formats import (
    E4M3,
    ElemFormat,
    MXTensor,
    ScaleRule,
    as_elem_format,
    as_scale_rule,
    quantize_mx,
)
from mxq.recipe import TensorSpec

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
    x_codes: torch.Tensor | None = None,
    x_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """``mxq.kernels.mx_linear`` as a torch custom op (``act_elem`` "" = bf16 activations;
    ``x_codes``/``x_scales``: X quantized by its producer, ``mx_linear``'s ``x_mx``)."""
    from mxq.kernels import mx_linear

    return mx_linear(
        x, weight, weight_scale, bias,
        act_elem=as_elem_format(act_elem) if act_elem else None, act_rule=as_scale_rule(act_rule),
        block_size=block_size, kernels=kernels or None, x_mx=(x_codes, x_scales) if x_codes is not None else None,
    )  # fmt: skip


@mx_linear_op.register_fake
def _mx_linear_fake(x, weight, weight_scale, bias, act_elem, act_rule, block_size, kernels="", x_codes=None, x_scales=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


class MXLinear(nn.Module):
    # tensor parallelism (transformers' tp_plan): the forward runs on this rank's shard as plain
    # tensors (``mxq.runtime.tp.localize``)
    _hf_quantized_needs_local_tp = True

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

    # eager calls of one input signature, made short (``_lane_for``): key -> lane, or False for none
    _lanes: dict | None = None

    def forward(self, x: torch.Tensor, x_mx: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Y = X · Wᵀ (+ bias). ``x_mx``: X was MX-rounded by its producer (``mxq.runtime.fuse``): x holds
        the rounded values, ``x_mx`` their fp8 codes and scale bytes."""
        lanes, lane = self._lanes, None
        if lanes is not None and not torch.compiler.is_compiling():  # made for CUDA calls only (``_lane_for``)
            lane = lanes.get(_lane_key(x, x_mx))
            if lane and lane.owner == (self.kernels, settings.kernels()) and lane.holds(self._parameters):
                return lane.run(x, x_mx)
        from mxq.kernels import mx_linear

        act_elem = self.act.elem if self.act is not None else None
        act_rule = self.act.scale_rule if self.act is not None else ScaleRule.RCEIL
        if torch.compiler.is_compiling():
            return mx_linear_op(
                x, self.weight, self.weight_scale, self.bias,
                act_elem.name if act_elem is not None else "", act_rule.value, self.block_size, self.kernels or "",
                *(x_mx if x_mx is not None else (None, None)),
            )  # fmt: skip
        y = mx_linear(
            x,
            self.weight,
            self.weight_scale,
            self.bias,
            act_elem=act_elem,
            act_rule=act_rule,
            block_size=self.block_size,
            kernels=self.kernels,
            x_mx=x_mx,
        )
        if x.is_cuda and LANES and lane is not False:  # False: this signature has no lane
            self._lane_for(x, x_mx, act_elem, act_rule)
        return y

    def __getstate__(self):
        """Pickling and ``copy.deepcopy`` leave the lanes behind (compiled kernels, launchers)."""
        state = dict(super().__getstate__())
        state.pop("_lanes", None)
        return state

    def _lane_for(self, x, x_mx, act_elem, act_rule) -> None:
        """After an eager call through ``mx_linear``: keep a lane for calls of this input signature
        (``mxq.kernels.dispatch.linear_lane``), or that there is none. A lane is used while the
        module's weight, scales and bias are the same tensors at the same addresses and its
        ``kernels`` and $MXQ_KERNELS are what they were; at most ``LANES_PER_MODULE`` signatures."""
        from mxq.kernels import dispatch

        if self._lanes is None or len(self._lanes) >= LANES_PER_MODULE:
            self._lanes = {}
        lane = dispatch.linear_lane(
            x, self.weight, self.weight_scale, self.bias, act_elem=act_elem, act_rule=act_rule,
            block_size=self.block_size, kernels=self.kernels, pre=x_mx is not None,
        )  # fmt: skip
        self._lanes[_lane_key(x, x_mx)] = _Lane(lane, self._parameters, (self.kernels, settings.kernels())) if lane else False

    def extra_repr(self) -> str:
        a = f"{self.act.elem.name}/{self.act.scale_rule.value}" if self.act else "bf16"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, weight={self.elem.name}, act={a}, block={self.block_size}"
            + (f", kernels={self.kernels}" if self.kernels else "")
        )


# Lanes (``MXLinear._lane_for``): on unless ``MXQ_DEBUG=no-lanes`` (A/B timings, debugging)
LANES = not settings.debug("no-lanes")
LANES_PER_MODULE = 16


class _Lane:
    """A kernel lane (``dispatch.linear_lane``) with what it was made for: the module's parameter
    tensors and their addresses (``param.data = ...`` keeps the object, not the address), and the
    kernels spec."""

    __slots__ = ("run", "params", "ptrs", "owner")

    def __init__(self, run, params: dict, owner: tuple):
        self.run, self.owner = run, owner
        self.params = (params["weight"], params["weight_scale"], params.get("bias"))
        self.ptrs = tuple(t.data_ptr() if t is not None else 0 for t in self.params)

    def holds(self, params: dict) -> bool:
        w, s, b = self.params
        return (
            params["weight"] is w and params["weight_scale"] is s and params.get("bias") is b
            and w.data_ptr() == self.ptrs[0] and s.data_ptr() == self.ptrs[1] and (b is None or b.data_ptr() == self.ptrs[2])
        )  # fmt: skip


def _lane_key(x: torch.Tensor, x_mx) -> tuple:
    """The input signature a lane serves: shape, dtype, 16-byte alignment, device, codes or not."""
    return x.shape, x.dtype, x.data_ptr() & 15, x.get_device(), x_mx is None


def _check_kernels(kernels: str | None) -> str | None:
    if kernels is None:
        return None
    from mxq.kernels import check_kernels

    return check_kernels(kernels)


def set_kernels(model: nn.Module, kernels: str | None) -> nn.Module:
    """Which kernels run ``model``'s MX layers: "auto", "reference" (the torch reference, for A/B
    checks) or path names (``mxq.kernels.dispatch.LINEAR``, the attention registries); None
    restores the default ($MXQ_KERNELS, else "auto"). MX layers (``MXLinear``, and modules whose
    class sets ``takes_kernels``: ``mxq.runtime.experts.MXExperts``) keep it as ``kernels``; attention
    modules (the ones transformers hands to MX attention, ``mxq.runtime.attention``) as ``mxq_kernels``.
    Returns the model."""
    spec = _check_kernels(kernels)
    for m in model.modules():
        if isinstance(m, MXLinear) or getattr(type(m), "takes_kernels", False):
            m.kernels = spec
        elif type(m).__name__.endswith("Attention"):
            m.mxq_kernels = spec
    return model


def linear_layers(model: nn.Module) -> dict[str, nn.Linear]:
    return {n: m for n, m in model.named_modules() if type(m) is nn.Linear}


# --- Sibling projections as one MX GEMM: q/k/v of an attention block, gate/up of an MLP ----------
#
# Concatenating MX weights along N is exact: the 1x32 blocks lie along K, so every output row keeps
# its own fp8 codes and E8M0 scales, and one GEMM over the stacked [N_q + N_k + N_v, K] weight
# computes bit for bit what the separate GEMMs compute (for W8A8 the activation is also rounded
# once instead of three times: same bytes). A decode step then streams each weight once in one
# launch instead of three, and quantizes X once.
#
# ``fuse_projections(model)`` is the one place this happens, for every model family whose blocks
# name their projections as Llama does (``SIBLINGS``: Llama, Mistral, Qwen2, Qwen3, ...): under one
# parent, MXLinear siblings with the same input width and formats become one ``FusedMXLinear``
# (registered on the parent as ``mxq_fused_<names>``), and each sibling is replaced by a
# ``ProjectionSlice`` that returns its columns of the fused output. The model's own forward code is
# unchanged: it still calls ``self.q_proj(x)``, ``self.k_proj(x)``, ``self.v_proj(x)`` with the same
# ``x``; the first call computes the fused product and keeps it until every sibling has taken its
# slice (identity of ``x`` decides; a different input recomputes). Under ``torch.compile`` the same
# code traces to one ``mxq::mx_linear`` call.
#
# Checkpoints stay per projection: the fused module's ``state_dict`` hook writes ``q_proj.weight``,
# ``q_proj.weight_scale`` (and bias), ... as separate tensors, and its load pre-hook gathers them,
# so ``save_pretrained`` / ``load_state_dict`` see the standard layout.

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
        some = next((m.bias for m in layers if m.bias is not None), None)
        if some is not None:  # siblings without a bias add zeros to theirs
            biases = [m.bias.data if m.bias is not None else some.new_zeros(m.out_features) for m in layers]
            self.bias = nn.Parameter(torch.cat(biases), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        self._has_bias = tuple(m.bias is not None for m in layers)
        self._x = self._y = None  # the input of the last fused call and its output, until all slices took theirs
        self._left = 0
        self._given = None  # (x, codes, scales) from the producer of the next input (``give``)
        self._register_state_dict_hook(_split_state)
        self._join_hook = None  # on the parent (``attach``): only it sees the siblings' keys when loading

    def give(self, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
        """The producer of this layer's next input has MX-rounded it (``mxq.runtime.fuse``): ``x`` holds
        the rounded values; the GEMM takes the codes and scales instead of rounding x again."""
        self._given = (x, codes, scales)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """The whole fused output [..., sum(sizes)] for ``x`` (the quantized X given for it, if any)."""
        given, self._given = self._given, None
        return self.forward(x, given[1:] if given is not None and given[0] is x else None)

    def output_for(self, x: torch.Tensor) -> torch.Tensor:
        """The fused output for ``x``, computed once per input for all siblings."""
        if self._x is not x:
            self._x, self._y, self._left = x, self.product(x), len(self.sizes)
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

    # the layer as a reader of MXLinear sees it: its rows of the fused tensors (views)
    weight = property(lambda self: self.fused.weight[self.start : self.stop])
    weight_scale = property(lambda self: self.fused.weight_scale[self.start : self.stop])
    bias = property(lambda self: None if not self.fused._has_bias[self.index] else self.fused.bias[self.start : self.stop])
    elem = property(lambda self: self.fused.elem)
    act = property(lambda self: self.fused.act)
    block_size = property(lambda self: self.fused.block_size)

    def mx_weight(self) -> MXTensor:
        return MXTensor(self.weight, self.weight_scale, self.weight.shape, 1, self.block_size, self.elem)

    def dequantized_weight(self) -> torch.Tensor:
        """The weight as the layer computes with it: float32 [N, K]."""
        return self.mx_weight().dequantize(torch.float32)

    def extra_repr(self) -> str:
        return f"{self.fused.names[self.index]} of the fused {'+'.join(self.fused.names)}, columns {self.start}:{self.stop}"


def _split_state(module: FusedMXLinear, state_dict: dict, prefix: str, local_metadata) -> None:
    """state_dict hook: the fused tensors back as the siblings' own (separate copies, no shared storage)."""
    parent = prefix[: -len(fused_name(module.names)) - 1]
    for key in ("weight", "weight_scale", "bias"):
        t = state_dict.pop(prefix + key, None)
        if t is None:
            continue
        for i, (name, part) in enumerate(zip(module.names, torch.split(t, module.sizes), strict=True)):
            if key != "bias" or module._has_bias[i]:
                state_dict[f"{parent}{name}.{key}"] = part.clone()


def _join_state(module: FusedMXLinear, state_dict: dict, parent: str, *args) -> None:
    """load_state_dict pre-hook of the parent: the siblings' tensors gathered into the fused ones."""
    prefix = parent + fused_name(module.names) + "."
    for key in ("weight", "weight_scale", "bias"):
        parts = [state_dict.pop(f"{parent}{name}.{key}", None) for name in module.names]
        if all(p is None for p in parts):
            continue
        if key == "bias":
            parts = [p if p is not None else torch.zeros(n, dtype=module.bias.dtype) for p, n in zip(parts, module.sizes, strict=True)]
        if any(p is None for p in parts):
            continue  # incomplete: load_state_dict reports the missing keys
        state_dict[prefix + key] = torch.cat(parts)


def fused_name(names: tuple[str, ...]) -> str:
    """The attribute a fused sibling group is registered under on its parent (``mxq_fused_<names>``)."""
    return "mxq_fused_" + "_".join(names)


def _fusable(layers: list) -> bool:
    first = layers[0]
    return all(
        type(m) is MXLinear and m.in_features == first.in_features and m.elem == first.elem and m.act == first.act
        and m.block_size == first.block_size and m.kernels == first.kernels and m.weight.device == first.weight.device
        and type(m.weight.data).__name__ != "DTensor" and _class_forward(m)
        for m in layers
    )  # fmt: skip


def _class_forward(m: MXLinear) -> bool:
    """Whether ``m`` computes its class's forward on what it is called with, which the fused group
    then computes instead: no forward of its own (tensor parallelism installs one), or only the
    one accelerate's ``dispatch_model`` puts on every module with parameters (``from_pretrained``
    with a ``device_map`` of several devices does so before mxq fuses), a hook that moves the
    inputs to the device the weights are resident on. The block holding the siblings has such a
    hook for that device, so their input is there already and the fused group needs none."""
    if "forward" not in m.__dict__:
        return True
    hook, inner = m.__dict__.get("_hf_hook"), m.__dict__.get("_old_forward")
    return (
        type(hook).__name__ == "AlignDevicesHook" and not hook.offload and not hook.io_same_device
        and hook.execution_device is not None and torch.device(hook.execution_device) == m.weight.device
        and getattr(inner, "__func__", None) is type(m).forward
    )  # fmt: skip


def mx_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The model's MX projections by their checkpoint names: each ``MXLinear`` and each
    ``ProjectionSlice`` of a fused group (with ``weight``, ``weight_scale``, ``dequantized_weight()``
    as MXLinear has them), not the fused modules themselves."""
    return {
        n: m for n, m in model.named_modules()
        if isinstance(m, ProjectionSlice) or (isinstance(m, MXLinear) and not isinstance(m, FusedMXLinear))
    }  # fmt: skip


def fuse_projections(model: nn.Module) -> list[str]:
    """Fuse every sibling group of ``MXLinear`` layers (``SIBLINGS``) in place; the fused groups' names."""
    done = []
    for parent_name, parent in list(model.named_modules()):
        for names in SIBLINGS:
            layers = [getattr(parent, n, None) for n in names]
            if any(m is None for m in layers) or not _fusable(layers):
                continue
            fused = FusedMXLinear(names, layers)
            parent.add_module(fused_name(names), fused)
            fused._join_hook = parent._register_load_state_dict_pre_hook(functools.partial(_join_state, fused))
            for i, n in enumerate(names):
                setattr(parent, n, ProjectionSlice(fused, i))
            done.append(f"{parent_name}.{'+'.join(names)}" if parent_name else "+".join(names))
    return done


def unfuse_projections(model: nn.Module) -> None:
    """Undo ``fuse_projections``: every sibling an ``MXLinear`` with its own weight again. The
    producers ``mxq.runtime.fuse`` installs read the fused modules: ``mxq.runtime.fuse.unfuse`` removes them first."""
    for parent in list(model.modules()):
        for names in SIBLINGS:
            fused = getattr(parent, fused_name(names), None)
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
            delattr(parent, fused_name(names))
