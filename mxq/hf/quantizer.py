"""Hugging Face integration: ``quant_method: "mxq"`` so ``from_pretrained`` builds ``MXLinear`` layers.

Importing this module (``import mxq`` does) registers the config and the quantizer with
transformers. Checkpoints written by other MXFP8 tools — compressed-tensors
``mxfp8-quantized`` and transformers' own ``quant_method: "mxfp8"`` — load through the same
quantizer: ``mxq.load`` rewrites their ``quantization_config`` into the native one in memory
(the tensors already carry the names and layout MXLinear uses; ``weight_scale_inv`` is
renamed to ``weight_scale`` while loading).

The config's schema — its fields, reading ``config.json``, telling the formats apart, rewriting
foreign configs — is ``mxq.checkpoint.config``, which needs no transformers; this module is only the glue.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from mxq.checkpoint.config import (
    QUANT_METHOD,
    NativeConfig,
    check_moe_config,
    checkpoint_format,
    foreign_to_native,
    read_config,
)
from mxq.compat import was_loaded
from mxq.runtime.linear import MXLinear, set_kernels


class MXQConfig(NativeConfig, QuantizationConfigMixin):
    """The native mxq quantization config (``mxq.checkpoint.config.NativeConfig``) as transformers sees it."""


class MXQHfQuantizer(HfQuantizer):
    """Loads pre-quantized mxq checkpoints: swaps the listed Linear layers for ``MXLinear``."""

    requires_calibration = True  # quantizing on the fly is mxq.quantize_model / mxq quantize

    def validate_environment(self, *args, **kwargs):
        return None

    def update_dtype(self, dtype):
        return dtype or torch.bfloat16

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        return False

    def _process_model_before_weight_loading(self, model, **kwargs):
        cfg: MXQConfig = self.quantization_config
        dtype = kwargs.get("dtype") or model.dtype
        _refuse_expert_parallel(model)
        checked = _validate(cfg, kwargs.get("checkpoint_files"))
        self._mxq_files = list(kwargs.get("checkpoint_files") or [])
        embeddings = []
        for name in cfg.layers:
            try:
                lin = model.get_submodule(name)
            except AttributeError:
                raise ValueError(f"quantization_config lists layer {name!r}, which {type(model).__name__} does not have") from None
            if isinstance(lin, torch.nn.Embedding):  # MXEmbedding (mxq.runtime.embedding), below
                embeddings.append(name)
                continue
            if not isinstance(lin, torch.nn.Linear):
                raise ValueError(f"quantization_config lists {name!r}, a {type(lin).__name__}, not a Linear or Embedding layer")
            w, a = cfg.layer_specs(name)
            with torch.device("meta"):
                new = MXLinear(
                    lin.in_features, lin.out_features, lin.bias is not None,
                    elem=w.elem, act=a, block_size=cfg.block_size, dtype=dtype,
                )
            model.set_submodule(name, new)
        self._mxq_declared_missing = list(getattr(model, "_keys_to_ignore_on_load_missing", None) or [])
        _prepare_experts(model, cfg, dtype)
        _quiet_per_expert_report(model, cfg)
        plan = getattr(model, "_tp_plan", None)
        if isinstance(plan, dict) and plan:  # tensor parallelism shards by the model's plan: the experts' scales too
            from mxq.runtime.tp import plan_with_scales

            model._tp_plan = plan_with_scales(plan)
        from mxq.runtime.embedding import prepare_for_loading

        prepare_for_loading(model, cfg, embeddings, dtype)  # MX embeddings and the heads tied to them
        if getattr(cfg, "scale_dtype", "u8") == "e8m0":
            _scales_as(model, torch.float8_e8m0fnu)
        if checked is not None:
            _check_shapes(model, checked)
        # the shapes config.json gives every entry: a tensor renamed or stacked on its way in (Mixtral's
        # block_sparse_moe.gate -> mlp.gate) is checked against them after loading (_check_loaded_shapes)
        self._mxq_shapes = {n: tuple(t.shape) for n, t in model.state_dict(keep_vars=True).items()}
        if cfg.attention == "mxfp8":
            import mxq.runtime.attention  # noqa: F401  (registers the "mxfp8" attention implementation)

            model.set_attn_implementation("mxfp8")
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        """The fast structure (``mxq.runtime.fuse``: q/k/v and gate/up as one MX GEMM each, activation
        quantization in its producer, attention without repeated K/V); the checkpoint layout is
        unchanged (``state_dict`` writes the projections separately)."""
        from mxq.runtime.fuse import fuse
        from mxq.runtime.tp import localize

        unwritten = _unwritten(model, getattr(self, "_mxq_declared_missing", []))
        _check_loaded_shapes(model, getattr(self, "_mxq_shapes", {}), getattr(self, "_mxq_files", []))
        _scales_as(model, torch.uint8)
        unwritten -= _per_expert_tensors(model, self.quantization_config, getattr(self, "_mxq_files", []), unwritten)
        _refuse_unwritten(model, unwritten, getattr(self, "_mxq_files", []))
        _routers_as_model(model)
        from mxq.runtime.embedding import after_loading

        after_loading(model, self.quantization_config)
        if getattr(self.quantization_config, "scale_dtype", "u8") != "u8":
            self.quantization_config.scale_dtype = "u8"  # what the model now holds, and save_pretrained writes
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            self._mxq_sharded = bool(localize(model))  # tensor-parallel loading (tp_plan=...): each MX module on its own shard
            _warn_unsharded(model, self._mxq_sharded)
        fuse(model)
        return model

    def update_weight_conversions(self, weight_conversions, *args, **kwargs):
        """Prepend the ``weight_scale_inv`` -> ``weight_scale`` renaming to what the base quantizer
        returns. The hook's signature is transformers' to choose (5.17 passes the conversions,
        5.23 also the model): whatever this release passes goes to its own base implementation
        unchanged, so no version is named here."""
        from transformers.core_model_loading import WeightRenaming

        conversions = super().update_weight_conversions(weight_conversions, *args, **kwargs)
        # transformers' own "mxfp8" checkpoints name the E8M0 scales weight_scale_inv.
        rename = WeightRenaming(source_patterns=r"^(.+)\.weight_scale_inv$", target_patterns=r"\1.weight_scale")
        return [rename, *conversions]

    def is_serializable(self, safe_serialization=None):
        if getattr(self, "_mxq_sharded", False):
            raise ValueError(
                "save_pretrained: this mxq model was loaded with tensor parallelism and each rank holds only its "
                "shards of the MX layers; save the checkpoint it was loaded from, or load it without tp_plan to save"
            )
        return True

    @property
    def is_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        # MXLinear compiles through the custom op torch.ops.mxq.mx_linear (no graph breaks, no
        # host syncs), so generate(cache_implementation="static") may compile the forward.
        return True


def _prepare_experts(model, cfg: MXQConfig, dtype) -> None:
    """Each experts module the config lists becomes an ``MXExperts`` (on the meta device, filled by
    loading). Per-expert tensors on disk reach its 3-D parameters through the family's own
    checkpoint conversion (transformers stacks ``experts.N.gate_proj.weight`` and ``up_proj`` into
    ``experts.gate_up_proj``, and the same rule carries the ``_scale`` suffix to ``gate_up_proj_scale``)."""
    from mxq.runtime.experts import MXExperts, experts_layer, is_experts

    for name in getattr(cfg, "experts", None) or {}:
        try:
            mod = model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"quantization_config experts lists {name!r}, which {type(model).__name__} does not have") from None
        if not is_experts(mod):
            raise ValueError(f"quantization_config experts lists {name!r}, a {type(mod).__name__}, not an experts module")
        info, d = experts_layer(name, mod), cfg.experts[name]
        if d["num_experts"] != info.num_experts or list(d["projections"]) != list(info.projections):
            raise ValueError(
                f"quantization_config experts[{name!r}]: {d['num_experts']} experts {d['projections']}, but config.json builds "
                f"{type(model).__name__} with {info.num_experts} {list(info.projections)}"
            )
        w, a = cfg.experts_specs(name)
        with torch.device("meta"):
            new = MXExperts(mod, elem=w.elem, act=a, block_size=cfg.block_size, dtype=dtype)
        model.set_submodule(name, new)


# The fused in-memory projections of an experts module, and the per-expert names each is found
# under on disk, in the order their rows stack: gate then up (Mixtral's w1 = gate, w3 = up, w2 =
# down), or one per-expert ``gate_up_proj`` already holding both.
_PER_EXPERT_NAMES = {
    "gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3"), ("gate_up_proj",)),
    "up_proj": (("up_proj",), ("w3",)),
    "down_proj": (("down_proj",), ("w2",)),
}
# Families whose fused gate_up holds gate and up rows alternately (gpt-oss: gate = rows 0::2): a gate
# and an up tensor stored apart interleave when stacked.
_INTERLEAVED_GATE_UP = ("GptOssExperts",)
_SCALE_NAMES = (".weight_scale", ".weight_scale_inv")


def _per_expert_tensors(model, cfg, files: list, unwritten: set[str]) -> set[str]:
    """Experts stored one expert at a time, read from the checkpoint into each ``MXExperts``: the
    codes, scales and biases transformers did not load (``unwritten``), and the scales always.

    transformers stacks per-expert tensors only under the names its family conversion knows
    (Qwen's ``experts.N.gate_proj``, Mixtral's ``block_sparse_moe.experts.N.w1``), and whether that
    rule carries a ``.weight_scale`` suffix differs between its releases (5.17 does, 5.24 does
    not). Other tools write other names (llm-compressor: ``mlp.experts.N.gate_proj`` for Mixtral,
    with biases for gpt-oss), so mxq reads every naming in ``_PER_EXPERT_NAMES`` itself, the same
    way on every release. Returns the names of the parameters written."""
    import re

    from safetensors import safe_open

    from mxq.checkpoint.files import CheckpointError

    entries = dict(getattr(cfg, "experts", None) or {})
    if not entries or not files:
        return set()
    shapes: dict[str, tuple[str, tuple]] = {}
    for f in files:
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                if ".experts." in k:
                    shapes[k] = (str(f), tuple(h.get_slice(k).get_shape()))
    handles: dict[str, object] = {}
    written: set[str] = set()

    def read(name: str, want: tuple) -> torch.Tensor:
        f, shape = shapes[name]
        if shape != tuple(want):
            hint = " (blocks must run along K, the last axis of each expert's [N, K] matrix)" if name.endswith(_SCALE_NAMES) else ""
            raise CheckpointError(f"{f}: tensor {name}: shape {list(shape)}, but the model's experts need {list(want)}{hint}")
        if f not in handles:
            handles[f] = safe_open(f, "pt")
        return handles[f].get_tensor(name)

    for name in entries:
        mod = model.get_submodule(name)
        layer, _, leaf = name.rpartition(".")
        pat = re.compile(rf"^({re.escape(layer.rpartition('.')[0])}\.[^.]+\.{re.escape(leaf)})\.0\.([^.]+)\.weight$")
        found = {m.group(2): m.group(1) for k in shapes if (m := pat.match(k))}
        if not found:
            continue  # fused on disk: loaded by name
        interleave = mod.family in _INTERLEAVED_GATE_UP
        for proj in mod.projections:
            names = next((ns for ns in _PER_EXPERT_NAMES[proj] if all(n in found for n in ns)), None)
            if names is None:
                known = " or ".join("+".join(ns) for ns in _PER_EXPERT_NAMES[proj])
                raise CheckpointError(
                    f"{name}: the checkpoint stores these experts one by one as {sorted(found)}, but not {proj} "
                    f"(read as {known})"
                )
            codes, scale = getattr(mod, proj), getattr(mod, proj + "_scale")
            bias = getattr(mod, proj + "_bias", None)
            n_part = codes.shape[1] // len(names)
            suffix = next((s for s in _SCALE_NAMES if f"{found[names[0]]}.0.{names[0]}{s}" in shapes), None)
            if suffix is None:
                raise CheckpointError(f"{name}: tensor {found[names[0]]}.0.{names[0]}.weight_scale: missing")
            targets = [(proj + "_scale", scale, suffix, codes.shape[2] // 32, torch.uint8)]
            pname = f"{name}.{proj}"
            if pname in unwritten:
                targets.append((proj, codes, ".weight", codes.shape[2], codes.dtype))
            if bias is not None and f"{pname}_bias" in unwritten:
                targets.append((proj + "_bias", bias, ".bias", None, bias.dtype))
            for attr, param, tail, k, dtype in targets:
                full = torch.empty(param.shape, dtype=dtype)
                for e in range(mod.num_experts):
                    parts = []
                    for n in names:
                        t = f"{found[n]}.{e}.{n}{tail}"
                        if t not in shapes:
                            raise CheckpointError(f"{name}: tensor {t}: missing (expert {e} of {mod.num_experts})")
                        want = (n_part,) if k is None else (n_part, k)
                        parts.append(read(t, want).view(dtype) if dtype in (torch.uint8, codes.dtype) else read(t, want).to(dtype))
                    full[e] = torch.stack(parts, 1).flatten(0, 1) if interleave and len(parts) == 2 else torch.cat(parts)
                with torch.no_grad():
                    if param.device.type == "meta":
                        _set_offloaded(mod, name, attr, full)
                    else:
                        _set_scale(param, full)
                written.add(f"{name}.{attr}")
    return written


def _quiet_per_expert_report(model, cfg) -> None:
    """transformers' load report would list experts stored one by one under names its conversion
    does not map as UNEXPECTED, and the fused parameters as MISSING, though mxq reads them itself
    (``_per_expert_tensors``, which refuses the load if any stays unwritten): the model's own
    ignore patterns take them out of the report."""
    import re

    unexpected, missing = [], []
    for name, d in (getattr(cfg, "experts", None) or {}).items():
        layer, _, leaf = name.rpartition(".")
        unexpected.append(rf"^{re.escape(layer.rpartition('.')[0])}\.[^.]+\.{re.escape(leaf)}\.\d+\.[^.]+\.(weight|weight_scale|weight_scale_inv|bias)$")
        missing.append(rf"^{re.escape(name)}\.({'|'.join(map(re.escape, d['projections']))})(_scale|_bias)?$")
    if unexpected:
        model._keys_to_ignore_on_load_unexpected = {*(model._keys_to_ignore_on_load_unexpected or ()), *unexpected}
        model._keys_to_ignore_on_load_missing = {*(model._keys_to_ignore_on_load_missing or ()), *missing}


def _refuse_expert_parallel(model) -> None:
    """transformers' expert parallelism (``DistributedConfig(enable_expert_parallel=True)``) gives
    each rank whole experts and remaps the router's choices to them; mxq's experts and fused MoE
    block run tensor parallelism only. Refused before anything loads, saying what does work."""
    dc = getattr(getattr(model, "config", None), "distributed_config", None)
    if getattr(dc, "enable_expert_parallel", False):
        raise ValueError("mxq: expert parallelism (DistributedConfig(enable_expert_parallel=True)) does not run mxq "
                         "checkpoints; load with tensor parallelism (tp_plan=\"auto\"): every expert's codes and scales "
                         "are sharded across the ranks")  # fmt: skip


def _warn_unsharded(model, sharded: bool) -> None:
    """Loaded with ``tp_plan`` over several ranks, yet no MX layer split: the family has no
    tensor-parallel plan in transformers (gpt-oss in 5.17-5.24), so every rank holds the whole
    quantized model. Said once, naming the family, instead of leaving the user to find out by memory."""
    import warnings

    from mxq.runtime.experts import MXExperts
    from mxq.runtime.linear import MXLinear

    tp = getattr(model, "_tp_size", None) or 1
    if tp > 1 and not sharded and any(isinstance(m, (MXLinear, MXExperts)) for m in model.modules()):
        kind = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        warnings.warn(f"mxq: tensor parallelism {tp}: transformers has no tensor-parallel plan for {kind}'s layers; "
                      "every rank holds the whole quantized model (only what the plan names is split)", stacklevel=2)  # fmt: skip


def _unwritten(model, declared: list[str] = ()) -> set[str]:
    """The names of the state-dict entries loading did not write: transformers marks every tensor
    it sets from the checkpoint (``mxq.compat.LOADED_MARK``); a tied entry shares its
    source's tensor; ``declared``: the model class's own patterns of keys it may miss (derived
    tensors it initializes itself). Anything else was allocated for a missing key and holds
    uninitialized memory or a random initialization."""
    import re

    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    derived = re.compile("|".join(f"(?:{p})" for p in declared)) if declared else None
    entries = model.state_dict(keep_vars=True)
    if entries and not any(was_loaded(t) for t in entries.values()):
        import warnings

        warnings.warn("mxq: this transformers release does not mark loaded tensors; the load is not verified", stacklevel=3)
        return set()
    return {n for n, t in entries.items() if n not in tied and not was_loaded(t)
            and not (derived is not None and derived.search(n)) and not (t.device.type == "meta" and _offloaded(model, n))}  # fmt: skip


def _offloaded(model, name: str) -> bool:
    """An entry accelerate offloaded (device_map with "cpu"/"disk" under hooks): the module holds a
    meta placeholder and the hook the loaded weight."""
    mod = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    hook = getattr(mod, "_hf_hook", None)
    return bool(getattr(hook, "offload", False))


def _refuse_unwritten(model, unwritten: set[str], files: list) -> None:
    """A model with any entry loading did not write is refused, naming it (``_unwritten``): it would
    run on uninitialized memory."""
    if not unwritten:
        return
    from mxq.checkpoint.files import CheckpointError

    first = sorted(unwritten)[0]
    more = f" (and {len(unwritten) - 1} more)" if len(unwritten) > 1 else ""
    where = str(Path(files[0]).parent) if files else "the checkpoint"
    raise CheckpointError(
        f"{where}: tensor {first}: not loaded: {type(model).__name__} has it, but the checkpoint holds no tensor for it "
        f"(or one of another shape){more}"
    )


def _set_offloaded(mod, name: str, attr: str, full: torch.Tensor) -> None:
    """An experts module accelerate offloaded (``device_map`` with "cpu"/"disk") holds meta
    placeholders and its hook brings the weights from a map at each call: the tensor mxq read goes
    into that map (its in-memory part, which it reads first). A hook without such a map leaves
    nowhere to put it: refused, naming it."""
    from mxq.checkpoint.files import CheckpointError

    hooks = [getattr(mod, "_hf_hook", None)]
    if hooks[0] is None:
        return  # a model built on the meta device as a whole (``check_loads``): shapes were checked, nothing to hold
    hooks += list(getattr(hooks[0], "hooks", ()) or ())
    for hook in hooks:
        wm = getattr(hook, "weights_map", None)
        store = getattr(getattr(wm, "dataset", None), "state_dict", None)
        if isinstance(store, dict):
            store[f"{wm.prefix}{attr}"] = full
            return
    raise CheckpointError(f"{name}.{attr}: on the meta device with no offloaded weights to hold it; load {name} onto a device")


def _set_scale(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the whole scale tensor ``full`` into ``param``; a tensor-parallel (DTensor) parameter
    takes this rank's shard of it, split as the plan splits the codes."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param.to_local().copy_(local.to(param.device))
    else:
        param.copy_(full.to(param.device))


def _routers_as_model(model) -> None:
    """Routers in the dtype the model was loaded in. transformers 5.17 with a quantizer leaves a
    tensor it renames while loading (Mixtral's ``block_sparse_moe.gate`` -> ``mlp.gate``) in the
    checkpoint's dtype, and the router's matmul then fails on mixed dtypes."""
    from mxq.runtime.experts import ROUTER_NAMES, is_experts

    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    want = getattr(getattr(emb, "weight", None), "dtype", None)
    if want is None or not want.is_floating_point or want.itemsize < 2:
        return
    for name, m in model.named_modules():
        if not is_experts(m):
            continue
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        for r in ROUTER_NAMES:
            router = getattr(parent, r, None)
            w = getattr(router, "weight", None)
            if isinstance(w, torch.nn.Parameter) and w.dtype.is_floating_point and w.dtype != want and w.dtype.itemsize >= 2:
                router.weight = torch.nn.Parameter(w.data.to(want), requires_grad=False)


def _validate(cfg: MXQConfig, files: list | None):
    """Refuse a checkpoint whose tensors disagree with its quantization_config, or hold fp8 NaN
    codes (``mxq.checkpoint.validate``), before any weight is loaded. Under torch.distributed the ranks share
    the reading of the data: a rank that finds a NaN code raises, and torchrun stops the others."""
    if not files:
        return None
    from pathlib import Path

    from mxq.checkpoint.validate import validate_checkpoint

    dist = torch.distributed
    # tensor-parallel loading: every rank reads the headers, each the data of its share of the layers
    share = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else None
    return validate_checkpoint(Path(files[0]).parent, {"quantization_config": cfg.to_dict()}, files, share=share)


def _check_shapes(model, checked) -> None:
    """Every checkpoint tensor the model has must have the model's shape: with a quantizer,
    transformers would set a tensor of another shape without a word."""
    from mxq.checkpoint.files import CheckpointError

    params = {n: p.shape for n, p in model.state_dict(keep_vars=True).items()}
    for name, info in checked.tensors.items():
        key = name[: -len("_inv")] if name.endswith(".weight_scale_inv") else name
        want = params.get(key)
        if want is not None and tuple(want) != tuple(info.shape):
            raise CheckpointError(
                f"{info.file}: tensor {name}: shape {list(info.shape)}, but {type(model).__name__} as config.json "
                f"describes it has {list(want)}"
            )


def _check_loaded_shapes(model, shapes: dict, files: list) -> None:
    """Every entry as loaded has the shape the model was built with. With a quantizer, transformers
    sets a tensor of another shape without a word, also one its conversion renamed or stacked, which
    ``_check_shapes`` (checkpoint names) cannot see. Tensor-parallel ranks hold shards: not checked
    here (``mxq.runtime.tp`` judges their shard rule)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return
    from mxq.checkpoint.files import CheckpointError

    where = str(Path(files[0]).parent) if files else "the checkpoint"
    for name, t in model.state_dict(keep_vars=True).items():
        want = shapes.get(name)
        if want is not None and tuple(t.shape) != want:
            raise CheckpointError(
                f"{where}: tensor {name}: loaded with shape {list(t.shape)}, but {type(model).__name__} as config.json "
                f"describes it has {list(want)}"
            )


def _scales_as(model, dtype: torch.dtype) -> None:
    """Every MX layer's ``weight_scale`` as ``dtype``, uint8 or float8_e8m0fnu: the same bits.

    transformers casts a checkpoint tensor to its parameter's dtype by value (an E8M0 scale 2**k
    would become the integer 2**k): before loading, the parameters of an E8M0 checkpoint are made
    float8_e8m0fnu so its bytes load unchanged; after loading they are viewed back as the uint8
    bytes the layers compute with."""
    other = torch.float8_e8m0fnu if dtype == torch.uint8 else torch.uint8
    for m in model.modules():
        s = m._parameters.get("weight_scale")
        if s is not None and s.dtype == other:
            m.weight_scale = torch.nn.Parameter(s.data.view(dtype), requires_grad=False)


def _register() -> None:
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(MXQConfig)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(MXQHfQuantizer)


_register()


def load(path: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
         kernels: str | None = None, fuse: bool = True):  # fmt: skip
    """Load an MXFP8 checkpoint (mxq, compressed-tensors mxfp8-quantized or transformers mxfp8);
    ``kernels`` chooses the kernels that may run it (``mxq.set_kernels``); ``fuse=False`` keeps
    the model as transformers builds it (``mxq.runtime.fuse``: q/k/v and gate/up separate, its
    own norms, MLPs and attention). Every parameter of the model is written from the checkpoint
    (or tied to one that is): anything else is refused, naming the tensor."""
    model = _from_pretrained(path, dtype)
    if not fuse:
        from mxq.runtime.fuse import unfuse

        unfuse(model)
    model = model.to(device).eval()
    return set_kernels(model, kernels) if kernels is not None else model


def check_loads(path: str | os.PathLike) -> str | None:
    """The first problem ``mxq.load`` would refuse ``path`` for, found by loading it onto the meta
    device (every check of a real load, the tensors' data read once and dropped); None if it loads.
    ``mxq inspect`` reports it, so that "ok" there means the checkpoint loads."""
    try:
        _from_pretrained(path, torch.bfloat16, device_map="meta")
    except Exception as e:  # noqa: BLE001 - whatever the load raises is the problem to report
        msg = " ".join(str(e).split())[:400]
        return msg if isinstance(e, (ValueError, OSError)) else f"{type(e).__name__}: {msg}"
    return None


def _from_pretrained(path: str | os.PathLike, dtype: torch.dtype, device_map=None):
    """``from_pretrained`` after the checks that need no model: shards inside the directory,
    headers, the config and the tensors it describes (``mxq.checkpoint.validate``); a foreign MXFP8 config is
    rewritten into the native one in memory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from mxq.checkpoint.files import CheckpointError, checkpoint_files, read_header

    config = read_config(path)
    try:
        fmt = checkpoint_format(config)
    except ValueError as e:
        raise CheckpointError(f"{os.path.join(path, 'config.json')}: {e}") from None
    try:  # before transformers builds anything from it: a negative expert count builds dense MLPs
        check_moe_config(config, os.path.join(path, "config.json"), path)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    for shard in checkpoint_files(path):  # refuses shards outside the directory before transformers reads any
        read_header(shard)  # and malformed headers, with the rules `mxq inspect` applies
    if fmt != "none":  # the config and the headers now, naming config.json; the data as the quantizer loads
        from mxq.checkpoint.validate import validate_checkpoint

        validate_checkpoint(path, config, scan=False)
    try:
        cfg = AutoConfig.from_pretrained(path, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - transformers' and huggingface_hub's many kinds: all a bad config.json
        msg = " ".join(str(e).split())[:300] or type(e).__name__
        raise CheckpointError(f"{os.path.join(path, 'config.json')}: {msg}") from None
    if fmt not in ("mxq", "none"):  # the tensors carry MXLinear's names and layout: only the config is rewritten
        from mxq.runtime.embedding import skeleton_modules

        # which layers are Linear or Embedding, and the tie, from a meta-device skeleton
        cfg.quantization_config = foreign_to_native(path, config, *skeleton_modules(cfg))
    kw = {"device_map": device_map} if device_map is not None else {}
    # a tensor of the wrong shape: mxq's checks name it (_check_loaded_shapes, or _unwritten where a
    # release re-initializes it), where transformers would raise a line that names none
    return AutoModelForCausalLM.from_pretrained(path, config=cfg, dtype=dtype, trust_remote_code=False,
                                                ignore_mismatched_sizes=True, **kw)  # fmt: skip
