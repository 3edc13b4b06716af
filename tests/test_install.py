"""``mxq.runtime.install``: the one way mxq gives a module another forward. Under an accelerate hook the hook
keeps running around mxq's forward; a forward someone else set (a user's patch, another owner) is
left alone with a warning, and the model computes what it computed; restoring undoes only mxq's own."""

from __future__ import annotations

import copy
import types
import warnings

import pytest
import torch
from torch import nn

import mxq
from mxq.runtime import fuse as F
from mxq.runtime.install import install_forward, installed_by, restore_forward

accelerate = pytest.importorskip("accelerate")
from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module  # noqa: E402


def _doubled(self, x):
    return 2 * type(self).forward(self, x)


class _Counting(ModelHook):
    def __init__(self):
        self.calls = 0

    def pre_forward(self, module, *args, **kwargs):
        self.calls += 1
        return args, kwargs


def test_install_and_restore_on_a_plain_module():
    lin = nn.Linear(5, 3)
    x = torch.randn(2, 5)
    assert install_forward(lin, _doubled, "fuse") and installed_by(lin) == "fuse"
    torch.testing.assert_close(lin(x), 2 * nn.functional.linear(x, lin.weight, lin.bias))
    restore_forward(lin, "tp")  # not the owner: nothing happens
    assert installed_by(lin) == "fuse"
    restore_forward(lin, "fuse")
    assert "forward" not in lin.__dict__ and installed_by(lin) is None
    torch.testing.assert_close(lin(x), nn.functional.linear(x, lin.weight, lin.bias))


def test_an_accelerate_hook_keeps_running_around_mxqs_forward():
    lin = nn.Linear(5, 3)
    hook = _Counting()
    add_hook_to_module(lin, hook)
    x = torch.randn(4, 5)
    want = nn.functional.linear(x, lin.weight, lin.bias)
    assert install_forward(lin, _doubled, "fuse")
    torch.testing.assert_close(lin(x), 2 * want)
    assert hook.calls == 1  # the hook's wrapper still runs, around mxq's forward
    restore_forward(lin, "fuse")
    torch.testing.assert_close(lin(x), want)
    assert hook.calls == 2
    remove_hook_from_module(lin)
    torch.testing.assert_close(lin(x), want)


def test_a_foreign_forward_is_left_alone_with_a_warning():
    lin = nn.Linear(5, 3)
    x = torch.randn(2, 5)
    lin.forward = lambda inp: inp.sum(-1, keepdim=True)  # the user's patch
    with pytest.warns(UserWarning, match="Linear has a forward installed by another library or the user; mxq's fuse"):
        assert not install_forward(lin, _doubled, "fuse")
    torch.testing.assert_close(lin(x), x.sum(-1, keepdim=True))
    other = nn.Linear(5, 3)
    assert install_forward(other, _doubled, "tp")
    with pytest.warns(UserWarning, match="installed by mxq's tp; mxq's fuse leaves"):
        assert not install_forward(other, _doubled, "fuse")
    assert installed_by(other) == "tp"


def test_fuse_steps_aside_for_a_patched_norm():
    """A user's forward on one RMSNorm: ``fuse`` fuses every other module and leaves that norm (and the
    decoder layer whose add it would carry) as the user set it; the logits are the unfused model's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, max_position_embeddings=128)  # fmt: skip
    plain = mxq.quantize_model(LlamaForCausalLM(cfg).eval(), "mxfp8", fuse=False)
    patched = copy.deepcopy(plain)
    norm = patched.model.layers[0].input_layernorm
    norm.forward = types.MethodType(lambda self, h: type(self).forward(self, h) * 1.5, norm)  # the user's own change
    ref = copy.deepcopy(patched)
    with pytest.warns(UserWarning, match="RMSNorm has a forward installed by another library or the user"):
        done = F.fuse(patched)
    assert "model.layers.0.input_layernorm" not in done and "model.layers.1.input_layernorm" in done
    ids = torch.randint(0, plain.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(patched(ids).logits, ref(ids).logits)
        assert not torch.equal(patched(ids).logits, plain(ids).logits)
    F.unfuse(patched)
    assert "forward" in norm.__dict__  # the user's patch stays


def test_a_known_class_with_another_forward_is_said_once():
    """A class mxq fuses by name whose forward is not the known one (a new transformers release) keeps
    its own forward, and the user hears it once, with the class named."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaMLP, LlamaRMSNorm

    assert F.known_class(LlamaRMSNorm, F.NORMS) and F.known_class(LlamaMLP, F.MLPS) and F.known_layer(LlamaDecoderLayer)

    def forward(self, x, *args, **kwargs):
        return x

    for names, cls_name in ((F.NORMS, "LlamaRMSNorm"), (F.MLPS, "Qwen3MLP")):
        changed = type(cls_name, (nn.Module,), {"forward": forward})
        with pytest.warns(UserWarning, match=f"{cls_name}.forward is not the one mxq knows"):
            assert not F.known_class(changed, names)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert not F.known_class(changed, names)  # said once
    with pytest.warns(UserWarning, match="MistralDecoderLayer.forward is not the one mxq knows"):
        assert F.known_layer(type("MistralDecoderLayer", (nn.Module,), {"forward": forward})) is None
