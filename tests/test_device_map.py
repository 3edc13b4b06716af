"""A quantized model dispatched by accelerate (``from_pretrained(..., device_map=...)``): the hooks
that move each block's inputs to its device must not change what the model computes.

On the CPU every block maps to the CPU with the hooks forced on (``dispatch_model(...,
force_hooks=True)``, what ``from_pretrained`` calls when its map names several devices), and the
hooks' inputs are copied (``moving``) as a move between two GPUs copies them: new tensors with the
same values, so nothing mxq hands from one module to the next by identity (the producers' codes,
the residual sum computed ahead with the next layer's norm) crosses a hook. Same arithmetic, so
the logits equal the un-hooked model's bit for bit and ``generate()`` picks the same tokens; dense
(Llama, Qwen3) and mixture-of-experts (Qwen3-MoE, Mixtral) checkpoints from the converter.

On two GPUs (``gpu``): a model of kernel-sized widths split between cuda:0 and cuda:1 computes
what it computes on one GPU (the same kernels on the same kind of device), and
``StaticGreedyDecoder`` refuses the split model with its one graph, or decodes it eagerly.
"""

from __future__ import annotations

import pytest
import torch
from moe_models import moe_model
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

import mxq
from mxq.convert.converter import quantize_checkpoint
from mxq.runtime.decode import StaticGreedyDecoder
from mxq.runtime.fuse import QKV, fused_layer_forward, unfuse
from mxq.runtime.linear import FusedMXLinear

accelerate = pytest.importorskip("accelerate")
from accelerate import dispatch_model  # noqa: E402
from accelerate.hooks import AlignDevicesHook  # noqa: E402

DENSE = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=128, tie_word_embeddings=False)  # fmt: skip
FAMILIES = ["llama", "qwen3", "qwen3_moe", "mixtral"]
GREEDY = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)


def _bf16_model(family: str, seed: int = 0):
    if family in DENSE:
        torch.manual_seed(seed)
        cfg_cls, model_cls = DENSE[family]
        return model_cls(cfg_cls(**SMALL)).eval()
    return moe_model(family, seed=seed)


def _checkpoint(tmp_path, family: str):
    """``family``'s tiny random model in bf16, converted to MXFP8 as ``mxq quantize`` does."""
    src, out = tmp_path / "bf16", tmp_path / "mxfp8"
    _bf16_model(family).to(torch.bfloat16).save_pretrained(src)
    quantize_checkpoint(str(src), out, "mxfp8", progress=False, warn=lambda m: None)
    return out


def _device_map(model, device) -> dict:
    """Every block on ``device``, named as accelerate's ``device_map="auto"`` names them (the
    embedding, each decoder layer, the final norm, the rotary embedding, the head)."""
    blocks = {}
    for name, child in model.model.named_children():
        if isinstance(child, torch.nn.ModuleList):
            blocks.update({f"model.{name}.{i}": device for i in range(len(child))})
        else:
            blocks[f"model.{name}"] = device
    blocks["lm_head"] = device
    return blocks


def _copies(obj):
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, (tuple, list)):
        return type(obj)(_copies(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _copies(v) for k, v in obj.items()}
    return obj


@pytest.fixture
def moving(monkeypatch):
    """accelerate's hooks hand each block copies of its inputs (as moving them to another GPU
    does; on the CPU ``.to("cpu")`` returns the same tensor); the number of hooked calls."""
    calls = []
    pre = AlignDevicesHook.pre_forward

    def pre_forward(self, module, *args, **kwargs):
        args, kwargs = pre(self, module, *args, **kwargs)
        calls.append(type(module).__name__)
        return _copies(args), _copies(kwargs)

    monkeypatch.setattr(AlignDevicesHook, "pre_forward", pre_forward)
    return calls


def _loaded_dispatched(path, tmp_path, plain):
    """``path`` loaded as ``from_pretrained`` loads it over several devices: a map that is not one
    device (here the last layer offloaded to disk, the rest on the CPU) makes transformers dispatch
    the model, hooks on every module with parameters, before mxq fuses it."""
    device_map = _device_map(plain, "cpu")
    device_map[f"model.layers.{len(plain.model.layers) - 1}"] = "disk"
    return AutoModelForCausalLM.from_pretrained(
        path, device_map=device_map, offload_folder=str(tmp_path / "offload")
    ).eval()


def _dispatched_after(path, plain):
    """``path`` loaded on the CPU (fused), then dispatched with the hooks forced on."""
    device_map = _device_map(plain, "cpu")
    model = AutoModelForCausalLM.from_pretrained(path, device_map=device_map).eval()
    return dispatch_model(model, device_map, force_hooks=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_dispatched_checkpoint_computes_the_plain_one(tmp_path, family, moving):
    out = _checkpoint(tmp_path, family)
    plain = AutoModelForCausalLM.from_pretrained(out).eval()
    torch.manual_seed(1)
    ids = torch.randint(0, plain.config.vocab_size, (2, 11))
    with torch.no_grad():
        want = plain(ids).logits
        want_tokens = plain.generate(ids, **GREEDY)
    for hooked in (_loaded_dispatched(out, tmp_path, plain), _dispatched_after(out, plain)):
        layers = hooked.model.layers
        assert all(isinstance(layer._hf_hook, AlignDevicesHook) for layer in layers)
        # the resident layers have the fast structure, inside the hooks (the offloaded one cannot)
        assert isinstance(getattr(layers[0].self_attn, QKV), FusedMXLinear)
        if family in DENSE:
            assert all(layer._old_forward.__func__ is fused_layer_forward for layer in layers[:-1])
        with torch.no_grad():
            del moving[:]
            assert torch.equal(hooked(ids).logits, want)
            assert moving.count(type(layers[0]).__name__) == len(layers)  # each layer got copies
            assert torch.equal(hooked.generate(ids, **GREEDY), want_tokens)


def test_quantizing_a_dispatched_model_keeps_its_hooks(moving):
    """A bf16 model dispatched first and quantized after: fusing puts its forwards inside the
    hooks (which keep moving the inputs), and unfusing takes them out again, hooks kept."""
    bf16 = _bf16_model("llama", seed=2)
    plain = mxq.quantize_model(_bf16_model("llama", seed=2), "mxfp8")
    hooked = dispatch_model(bf16, _device_map(bf16, "cpu"), force_hooks=True)
    mxq.quantize_model(hooked, "mxfp8")
    layer = hooked.model.layers[0]
    assert (
        isinstance(layer._hf_hook, AlignDevicesHook)
        and layer._old_forward.__func__ is fused_layer_forward
    )
    assert isinstance(getattr(layer.self_attn, QKV), FusedMXLinear)  # hooked siblings fused too
    assert (
        "forward" in layer.__dict__ and layer.forward.func.__name__ == "new_forward"
    )  # the hook's wrapper
    ids = torch.randint(0, SMALL["vocab_size"], (1, 9))
    with torch.no_grad():
        want = plain(ids).logits
        del moving[:]
        assert torch.equal(hooked(ids).logits, want) and len(moving) >= SMALL["num_hidden_layers"]
        assert torch.equal(hooked.generate(ids, **GREEDY), plain.generate(ids, **GREEDY))
        unfuse(hooked)
        assert (
            layer._old_forward.__func__ is type(layer).forward
            and layer.forward.func.__name__ == "new_forward"
        )
        del moving[:]
        assert torch.equal(hooked(ids).logits, want) and len(moving) >= SMALL["num_hidden_layers"]


def test_next_layer_elsewhere_gets_the_sum_not_its_norm(moving):
    """A layer hands its closing residual sum to the next layer's norm (computed ahead, in one
    kernel) only where that norm's weight is on the sum's device. Here the last layer is
    offloaded after fusing (its weights on the meta device until its hook loads them, as a layer
    on another GPU has them elsewhere): the sum goes as it is and the norm computes after the hook."""
    from accelerate.hooks import attach_align_device_hook
    from accelerate.utils import named_module_tensors

    plain = mxq.quantize_model(_bf16_model("llama", seed=4), "mxfp8")
    hooked = mxq.quantize_model(_bf16_model("llama", seed=4), "mxfp8")
    last = hooked.model.layers[-1]
    weights = {n: t.detach().clone() for n, t in named_module_tensors(last, recurse=True)}
    attach_align_device_hook(last, execution_device="cpu", offload=True, weights_map=weights)
    assert (
        hooked.model.layers[-2].__dict__["_mxq_next"] is last.input_layernorm
        and last.input_layernorm.weight.is_meta
    )
    ids = torch.randint(0, SMALL["vocab_size"], (2, 9))
    with torch.no_grad():
        assert torch.equal(hooked(ids).logits, plain(ids).logits)
        assert torch.equal(hooked.generate(ids, **GREEDY), plain.generate(ids, **GREEDY))


def test_static_decoder_on_a_dispatched_model(tmp_path, moving):
    """Without a graph the decoder runs a dispatched model's steps eagerly: ``generate()``'s tokens.
    Its graph needs one device: a model with parameters on two is refused in one line."""
    out = _checkpoint(tmp_path, "llama")
    plain = AutoModelForCausalLM.from_pretrained(out).eval()
    hooked = _loaded_dispatched(out, tmp_path, plain)
    ids = torch.randint(0, SMALL["vocab_size"], (1, 6))
    dec = StaticGreedyDecoder(hooked, batch_size=1, max_len=32)
    with torch.no_grad():
        assert torch.equal(dec.generate(ids, 8), plain.generate(ids, **GREEDY))
    with pytest.raises(
        ValueError,
        match=r"^StaticGreedyDecoder: the model's parameters are on cpu and meta \(device_map\)",
    ):
        StaticGreedyDecoder(hooked, batch_size=1, max_len=32, cuda_graph=True)


# --- two GPUs ------------------------------------------------------------------------------------

TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2
two_gpus = pytest.mark.skipif(not TWO_GPUS, reason="needs two CUDA devices")

# widths the Hopper kernels take (K % 128, heads of 64, 8 experts)
GPU_DENSE = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, max_position_embeddings=256, tie_word_embeddings=False)  # fmt: skip
GPU_MOE = dict(GPU_DENSE, moe_intermediate_size=256, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
               mlp_only_layers=[])  # fmt: skip


def _gpu_checkpoint(tmp_path, family: str):
    torch.manual_seed(5)
    model = (
        LlamaForCausalLM(LlamaConfig(**GPU_DENSE))
        if family == "llama"
        else Qwen3MoeForCausalLM(Qwen3MoeConfig(**GPU_MOE))
    )
    with torch.no_grad():
        for p in model.parameters():  # weights and routers spread as trained ones are
            if p.dim() >= 2:
                p.normal_(0, 0.05)
    src, out = tmp_path / "bf16", tmp_path / "mxfp8"
    model.to(torch.bfloat16).save_pretrained(src)
    quantize_checkpoint(str(src), out, "mxfp8", progress=False, warn=lambda m: None)
    return out


def _split(model) -> dict:
    """The embedding on cuda:0, the first half of the layers on cuda:1, the second on cuda:0, the
    head on cuda:1: the hidden states cross between the devices both ways, and the first layer's
    cache is not where the embedding is (as ``device_map="auto"`` with a small GPU 0 places them)."""
    blocks = _device_map(model, 1)
    half = model.config.num_hidden_layers // 2
    blocks.update(
        {"model.embed_tokens": 0, **{f"model.layers.{i}": 0 for i in range(half, 2 * half)}}
    )
    return blocks


@two_gpus
@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_gpu_split_over_two_devices_computes_the_one_device_model(tmp_path, family):
    out = _gpu_checkpoint(tmp_path, family)
    one = AutoModelForCausalLM.from_pretrained(out, device_map={"": 0}).eval()
    split = AutoModelForCausalLM.from_pretrained(out, device_map=_split(one)).eval()
    assert {p.device.index for p in split.parameters()} == {0, 1}
    torch.cuda.set_device(0)  # as a script's default: the second half's tensors are not on it
    torch.manual_seed(3)
    for b, t in ((1, 1), (2, 17), (1, 300)):  # decode-sized (the lanes, the producers), prefill
        ids = torch.randint(0, GPU_DENSE["vocab_size"], (b, t), device="cuda:0")
        with torch.no_grad():
            want, got = one(ids).logits.float(), split(ids).logits.float()
        assert got.device == want.device and not got.isnan().any()
        # the same kernels on the same kind of GPU: equal up to accumulation order
        assert ((got - want).norm() / want.norm()).item() < 1e-3
    ids = torch.randint(0, GPU_DENSE["vocab_size"], (2, 7), device="cuda:0")
    with torch.no_grad():
        assert torch.equal(split.generate(ids, **GREEDY), one.generate(ids, **GREEDY))


@two_gpus
@pytest.mark.gpu
def test_gpu_static_decoder_refuses_a_split_model_or_decodes_it_eagerly(tmp_path):
    out = _gpu_checkpoint(tmp_path, "llama")
    one = AutoModelForCausalLM.from_pretrained(out, device_map={"": 0}).eval()
    split = AutoModelForCausalLM.from_pretrained(out, device_map=_split(one)).eval()
    with pytest.raises(
        ValueError, match=r"^StaticGreedyDecoder: the model's parameters are on cuda:0 and cuda:1"
    ):
        StaticGreedyDecoder(split, batch_size=1, max_len=64)
    ids = torch.randint(0, GPU_DENSE["vocab_size"], (1, 5), device="cuda:0")
    want = StaticGreedyDecoder(one, batch_size=1, max_len=64).generate(ids, 16)
    got = StaticGreedyDecoder(split, batch_size=1, max_len=64, cuda_graph=False).generate(ids, 16)
    assert torch.equal(got, want)
