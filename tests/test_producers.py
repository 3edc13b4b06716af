"""Activation quantization fused into its producer (kernels/producers.py, mxq/runtime/fuse.py), and
attention without repeated K/V.

Kernels: RMSNorm → MX and SiLU·up → MX against the torch reference (transformers' arithmetic,
then ``mxq.formats``), byte for byte in the interpreter (fp32/fp16: its bf16 cast truncates) and on
a GPU within the rounding of the reduction. Models: a tiny model of each family with the fast
structure computes the unfused model's logits exactly on the reference path, compiles to one
graph in which the producers hand their codes to the GEMMs, and unfuses. Attention: the grouped
SDPA equals transformers' SDPA on random inputs and masks.
"""

from __future__ import annotations

import copy

import pytest
import torch
from kernel_helpers import (
    CUDA,
    DEV,
    HOPPER,
    activations,
    assert_gemm_close,
    gpu,
    mx_weight,
    path_acc,
    seeded,
)
from test_fuse import FAMILIES, compiled_linear_calls  # FAMILIES: Llama, Mistral, Qwen2, Qwen3

import mxq
from mxq.formats import E4M3, E5M2, ScaleRule, fake_quantize_mx
from mxq.kernels import dispatch
from mxq.kernels import producers as P
from mxq.kernels.reference import (
    add_rmsnorm_mx_reference,
    mx_linear_reference,
    quantize_mx_rows,
    rmsnorm_mx_reference,
    silu_mul_mx_reference,
)
from mxq.runtime.fuse import GROUPED_SDPA, fuse, grouped_sdpa_forward, unfuse, use_grouped_sdpa
from mxq.runtime.linear import MXLinear

SMALL = dict(vocab_size=97, hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=128)  # fmt: skip
# the interpreter's fp32 -> bf16 cast truncates: bf16 runs only on a GPU
KERNEL_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _assert_only_ties_differ(got, want, exact: torch.Tensor):
    """The interpreter against torch on a CPU: codes and scales equal, except where the unrounded
    value (``exact``, float64) sits at a rounding boundary. The reduction and exp of numpy and of
    torch are vectorized per CPU, so one may be an ulp from the other before rounding: an element
    may then flip to the other neighbour of a near tie, a block's scale to the other side of a
    power of two. Anything else is a defect."""
    (y, q, s), (ry, rq, rs) = got, want
    k = y.shape[-1]
    y, ry = y.double().reshape(-1, k).nan_to_num(7.0), ry.double().reshape(-1, k).nan_to_num(7.0)
    u = exact.double().reshape(-1, k)
    elem = E4M3 if q.dtype == torch.float8_e4m3fn else E5M2
    flipped = (s.reshape(-1, k // 32) != rs.reshape(-1, k // 32)).repeat_interleave(32, -1)
    amax = u.nan_to_num(0.0, 0.0, 0.0).abs().view(u.shape[0], -1, 32).amax(-1).repeat_interleave(32, -1)
    at_power = (torch.log2(amax / elem.max_normal) - torch.log2(amax / elem.max_normal).round()).abs() < 1e-2
    assert bool(at_power[flipped].all()), "a block scale differs away from a power-of-two boundary"
    moved = (y != ry) & ~flipped
    tie = (u - (y + ry) / 2).abs() <= (y - ry).abs() / 16
    assert bool(tie[moved].all()), f"{int((moved & ~tie).sum())} rounded values differ away from a tie"
    codes = q.view(torch.uint8).reshape(-1, k) != rq.view(torch.uint8).reshape(-1, k)
    assert torch.equal(codes & ~flipped, moved), "codes and rounded values disagree"


def _assert_producer_close(got, want, dtype, exact: torch.Tensor):
    """Rounded values, codes and scales equal the reference's (on a CPU up to the near ties of
    ``_assert_only_ties_differ``); on a GPU the reduction and exp may move a value by an ulp before
    rounding, so there a few elements may sit one fp8 step away."""
    (y, q, s), (ry, rq, rs) = got, want
    assert y.shape == ry.shape and y.dtype == ry.dtype == dtype and q.dtype == rq.dtype and s.shape == rs.shape
    if not CUDA:
        _assert_only_ties_differ(got, want, exact)
        return
    diff = (q.view(torch.uint8).int() - rq.view(torch.uint8).int()).abs()
    assert (diff > 1).sum() == 0 and (diff > 0).float().mean() < 1e-3, diff.float().mean()
    assert (s.int() - rs.int()).abs().max() <= 1 and (s != rs).float().mean() < 1e-3
    # the rounded values are the codes' values (checked against the format's own rounding)
    assert torch.equal(y.float().view(-1, y.shape[-1]).nan_to_num(7.0),
                       fake_quantize_mx(y.float().view(-1, y.shape[-1]), -1, E4M3 if q.dtype == torch.float8_e4m3fn else E5M2, 32,
                                        ScaleRule.RCEIL).nan_to_num(7.0))  # fmt: skip


def _rmsnorm64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.double()
    return w.double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("elem", [E4M3, E5M2])
def test_rmsnorm_mx_matches_reference(dtype, elem):
    gen = seeded(str(dtype), elem.name)
    for shape in [(5, 160), (1, 4096), (2, 3, 96)] if CUDA else [(5, 160), (1, 1024), (2, 3, 96)]:
        k = shape[-1]
        x = activations(int(torch.tensor(shape[:-1]).prod()), k, dtype, gen, special=True, decades=(-2, 2)).view(shape)
        w = (torch.rand(k, generator=gen) + 0.5).to(dtype).to(DEV)
        got = P.rmsnorm_mx(x, w, 1e-5, elem)
        want = rmsnorm_mx_reference(x, w, 1e-5, elem)
        _assert_producer_close(got, want, dtype, _rmsnorm64(x, w, 1e-5))
        assert got[1].shape == (x.numel() // k, k) and got[2].shape == (x.numel() // k, k // 32)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("elem", [E4M3, E5M2])
def test_silu_mul_mx_matches_reference(dtype, elem):
    gen = seeded(str(dtype), elem.name, "silu")
    for shape in [(7, 2 * 160), (1, 2 * 1056), (2, 2, 2 * 96)]:
        k2 = shape[-1]
        gu = activations(int(torch.tensor(shape[:-1]).prod()), k2, dtype, gen, special=True, decades=(-2, 1)).view(shape)
        got = P.silu_mul_mx(gu, elem)
        want = silu_mul_mx_reference(gu, elem)
        g, u = gu.double().chunk(2, dim=-1)
        _assert_producer_close(got, want, dtype, torch.nn.functional.silu(g) * u)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_add_rmsnorm_mx_matches_reference(dtype):
    """The residual add and the norm in one kernel: the sum equals torch's ``residual + x`` exactly,
    the rest what RMSNorm → MX of that sum gives; rows that are not contiguous in memory included."""
    gen = seeded(str(dtype), "add")
    for shape in [(6, 224), (1, 4096 if CUDA else 1024), (3, 1, 96)]:
        k, m = shape[-1], int(torch.tensor(shape[:-1]).prod())
        x = activations(m, k, dtype, gen, special=True, decades=(-2, 2)).view(shape)
        r = activations(m, k, dtype, gen, special=False, decades=(-1, 2)).view(shape)
        w = (torch.rand(k, generator=gen) + 0.5).to(dtype).to(DEV)
        for e in (E4M3, E5M2):
            h, *got = P.add_rmsnorm_mx(x, r, w, 1e-6, e)
            rh, *want = add_rmsnorm_mx_reference(x, r, w, 1e-6, e)
            assert h.shape == x.shape and torch.equal(h.nan_to_num(7.0), rh.nan_to_num(7.0))
            _assert_producer_close(tuple(got), tuple(want), dtype, _rmsnorm64(rh, w, 1e-6))
    wide = activations(5, 2 * 160, dtype, gen, special=False)
    x, r = wide[:, :160], wide[:, 160:]  # rows 320 apart: read as rows, not as the storage
    w = (torch.rand(160, generator=gen) + 0.5).to(dtype).to(DEV)
    _assert_producer_close(P.rmsnorm_mx(x, w, 1e-6, E4M3), rmsnorm_mx_reference(x, w, 1e-6, E4M3), dtype,
                           _rmsnorm64(x, w, 1e-6))
    h, *got = P.add_rmsnorm_mx(x, r, w, 1e-6, E4M3)
    assert torch.equal(h, r + x)
    _assert_producer_close(tuple(got), rmsnorm_mx_reference(r + x, w, 1e-6, E4M3), dtype, _rmsnorm64(r + x, w, 1e-6))
    w2 = torch.stack([w, -w], 1)[:, 0]  # the same weight, every other element of its storage
    h2, *got2 = P.add_rmsnorm_mx(x, r, w2, 1e-6, E4M3)
    assert torch.equal(h2, h) and all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got2, got))


def test_producer_kernels_refuse_bad_input():
    x = torch.randn(2, 100, device=DEV)
    with pytest.raises(ValueError, match="divisible by the MX block 32"):
        P.rmsnorm_mx(x, torch.ones(100, device=DEV), 1e-6, E4M3)
    with pytest.raises(ValueError, match="weight of shape"):
        P.rmsnorm_mx(torch.randn(2, 96, device=DEV), torch.ones(96, device=DEV, dtype=torch.float16), 1e-6, E4M3)
    with pytest.raises(ValueError, match="even last axis"):
        P.silu_mul_mx(torch.randn(2, 97, device=DEV), E4M3)
    with pytest.raises(ValueError, match="residual like x"):
        P.add_rmsnorm_mx(torch.randn(2, 96, device=DEV), torch.randn(1, 96, device=DEV), torch.ones(96, device=DEV), 1e-6, E4M3)


@pytest.mark.parametrize("path", ["gemv", "gemm", "reference"] + (["decode_ws"] if HOPPER else []))
def test_mx_linear_takes_producer_codes(path):
    """X rounded by its producer (values + codes) gives what W8A8 on the unrounded X gives."""
    gen = torch.Generator().manual_seed(11)
    n, k = 72, 256
    wq, ws, w64 = mx_weight(n, k, E4M3, gen)
    for m in (1, 3):
        x = activations(m, k, torch.float32, gen, special=False)
        # the producer here: the format's own rounding of x (a producer's output is exactly that)
        q, s = quantize_mx_rows(x, E4M3)
        xr = fake_quantize_mx(x, -1, E4M3, 32, ScaleRule.RCEIL)
        want = dispatch.mx_linear(x, wq, ws, act_elem=E4M3, kernels=path)
        got = dispatch.mx_linear(xr, wq, ws, act_elem=E4M3, kernels=path, x_mx=(q, s))
        ref = mx_linear_reference(x, wq, ws, act_elem=E4M3)
        # against the float64 product, within the path's accumulation (fp8 tensor cores: coarser)
        assert_gemm_close(got, x, w64, None, E4M3, acc_rel=path_acc(path), ref=ref)
        if path != "decode_ws":  # the same product; the interpreter's float32 dot may sum in another order
            assert torch.allclose(got, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())
    with pytest.raises(ValueError, match="RCEIL"):
        dispatch.mx_linear(xr, wq, ws, act_elem=E4M3, act_rule=ScaleRule.FLOOR, x_mx=(q, s))


def _model(family: str, dtype=torch.float32, recipe="mxfp8", fused=False):
    torch.manual_seed(sum(map(ord, family)))
    cfg_cls, model_cls = FAMILIES[family]
    m = model_cls(cfg_cls(**SMALL, attn_implementation="sdpa")).to(dtype).eval()
    return mxq.quantize_model(m, recipe, fuse=fused)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_structure_computes_the_unfused_model(family, dtype):
    plain = _model(family, dtype)
    fast = copy.deepcopy(plain)
    done = fuse(fast)
    layers = SMALL["num_hidden_layers"]
    assert sum(d.endswith(("input_layernorm", "post_attention_layernorm")) for d in done) == 2 * layers
    assert sum(d.endswith(".mlp") for d in done) == layers and f"attention: {GROUPED_SDPA}" in done
    assert sum(d.endswith("add + norm") for d in done) == layers
    assert fast.config._attn_implementation == GROUPED_SDPA
    assert fast.state_dict().keys() == plain.state_dict().keys()
    ids = torch.randint(0, SMALL["vocab_size"], (2, 19))
    with torch.no_grad():
        want, got = plain(ids).logits, fast(ids).logits
    assert torch.equal(got, want)
    kw = dict(max_new_tokens=9, min_new_tokens=9, do_sample=False, pad_token_id=0)
    with torch.no_grad():  # decoding: the grouped attention over a static cache (masked), and the dynamic cache
        for cache in ("static", "dynamic"):
            assert torch.equal(fast.generate(ids, cache_implementation=cache, **kw),
                               plain.generate(ids, cache_implementation=cache, **kw))  # fmt: skip
    unfuse(fast)
    assert not any("_mxq_feeds" in m.__dict__ or "_mxq_next" in m.__dict__ for m in fast.modules())
    assert fast.config._attn_implementation == "sdpa"
    with torch.no_grad():
        assert torch.equal(fast(ids).logits, want)


def _count_producers(monkeypatch):
    from mxq.runtime import fuse as F

    calls, impl = [], F._producer_impl
    monkeypatch.setattr(F, "_producer_impl", lambda name, t, kernels: calls.append(name) or impl(name, t, kernels))
    return calls


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_layer_adds_the_residual_inside_the_norms(family, monkeypatch):
    """With the layers fused, every residual add but the last layer's closing one happens inside a
    norm kernel: per forward one plain RMSNorm (the first layer's input), 2L - 1 add + norm; the
    logits equal the unfused model's exactly (reference path), and again after unfusing."""
    plain = _model(family, torch.bfloat16)
    fast = copy.deepcopy(plain)
    fuse(fast)
    layers = SMALL["num_hidden_layers"]
    calls = _count_producers(monkeypatch)
    ids = torch.randint(0, SMALL["vocab_size"], (3, 13))
    with torch.no_grad():
        got = fast(ids).logits
        assert torch.equal(got, plain(ids).logits)
    assert calls.count("rmsnorm_mx") == 1 and calls.count("add_rmsnorm_mx") == 2 * layers - 1
    assert calls.count("silu_mul_mx") == layers
    assert all(getattr(m, "_mxq_ready", None) is None for m in fast.modules())  # every hand-over taken


def test_layer_fusion_respects_hooks_and_positional_calls(monkeypatch):
    """A hook that replaces a layer's output breaks the hand-over (the next norm recomputes from the
    new tensor); a hook on a norm makes it a module call again; a positional call runs the class's
    forward. Each computes what the unfused model with the same hook computes."""
    plain = _model("llama", torch.float32)
    fast = copy.deepcopy(plain)
    fuse(fast)
    seen = []
    for m in (plain, fast):
        m.model.layers[0].register_forward_hook(lambda mod, a, out: out * 1.5)
        m.model.layers[1].post_attention_layernorm.register_forward_hook(lambda mod, a, out: seen.append(1))
    calls = _count_producers(monkeypatch)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 9))
    with torch.no_grad():
        assert torch.equal(fast(ids).logits, plain(ids).logits)
    assert len(seen) == 2  # the hooked norm ran in both models
    # layer 0's input norm; layer 1's, recomputed from the hook's tensor; layer 1's hooked norm as a module
    assert calls.count("rmsnorm_mx") == 3 and calls.count("add_rmsnorm_mx") == 2
    layer, x = fast.model.layers[1], torch.randn(2, 9, SMALL["hidden_size"])
    emb = fast.model.rotary_emb(x, torch.arange(9)[None].expand(2, 9))
    with torch.no_grad():  # positional arguments: the class's own forward
        want = type(layer).forward(layer, x, None, None, None, False, emb)
        assert torch.equal(layer(x, None, None, None, False, emb), want)


def test_layer_fusion_only_for_known_forwards():
    """Only a decoder layer whose forward is the known one (either release's cache argument name)
    gets the fused forward; a subclass that changes it keeps its own."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from mxq.runtime.fuse import KNOWN_LAYER_FORWARD, known_layer

    assert known_layer(LlamaDecoderLayer) in ("past_key_values", "cache")
    ns = {}
    exec(KNOWN_LAYER_FORWARD.format(cache="cache"), ns)  # the release that renamed the argument
    assert known_layer(type("LlamaDecoderLayer", (LlamaDecoderLayer,), {"forward": ns["forward"]})) is None  # no source file
    changed = type("LlamaDecoderLayer", (LlamaDecoderLayer,), {"forward": lambda self, hidden_states, **kw: hidden_states})
    m = _model("llama")
    m.model.layers[0].__class__ = changed
    done = fuse(m)
    assert not any(d.startswith("model.layers.0:") for d in done) and "model.layers.1: add + norm" in done
    assert m.model.layers[0].__dict__.get("forward") is None


def test_producers_only_where_the_arithmetic_is_known():
    """W8A16 has no activation rounding to fuse; a FLOOR activation rule is not idempotent; a
    norm of an unknown class keeps its forward."""
    m = _model("llama", recipe="mxfp8-w8a16", fused=True)
    assert not any("_mxq_feeds" in x.__dict__ for x in m.modules())
    m = _model("llama")
    for mod in m.modules():
        if getattr(mod, "act", None) is not None:
            mod.act = type(mod.act)(mod.act.elem, ScaleRule.FLOOR)
    assert not [d for d in fuse(m) if not d.startswith("attention")][2 * SMALL["num_hidden_layers"]:]
    assert not any("_mxq_feeds" in x.__dict__ for x in m.modules())
    m = _model("qwen2")
    m.model.layers[0].input_layernorm.__class__ = type("OtherRMSNorm", (type(m.model.layers[0].input_layernorm),), {})
    done = fuse(m)
    assert "model.layers.0.input_layernorm" not in done and "model.layers.1.input_layernorm" in done


def test_producers_follow_formats_changed_after_fusing():
    """Setting the layers' activations to None after fusing (W8A8 -> W8A16, as eval/check_paths does)
    turns the producers off: the model computes the W8A16 model."""
    fast = _model("llama", fused=True)
    plain = _model("llama", recipe="mxfp8-w8a16")
    for m in fast.modules():
        if isinstance(m, MXLinear):  # fused ones included
            m.act = None
    ids = torch.randint(0, SMALL["vocab_size"], (2, 7))
    with torch.no_grad():
        assert torch.equal(fast(ids).logits, plain(ids).logits)


def test_compiled_producers_hand_codes_to_the_gemms(monkeypatch):
    """Under dynamo (fullgraph) each norm and SiLU·up is one producer op and every q/k/v, gate/up
    and down GEMM receives its codes; the logits equal the eager model's."""
    m = _model("qwen3", fused=True)
    ids = torch.randint(0, SMALL["vocab_size"], (1, 9))
    with torch.no_grad():
        want = m(ids).logits
    producers = _count_producers(monkeypatch)
    got, calls = compiled_linear_calls(m, ids, monkeypatch)
    assert torch.equal(got, want)
    layers, h = SMALL["num_hidden_layers"], SMALL["hidden_size"]
    # the residual adds inside the norms under dynamo too (two compiled calls counted)
    assert producers.count("add_rmsnorm_mx") == 2 * (2 * layers - 1) and producers.count("rmsnorm_mx") == 2
    assert not any(getattr(x, "_mxq_ready", None) is not None for x in m.modules())
    with_codes = [n for n, given in calls if given]
    assert len(calls) == 4 * layers and len(with_codes) == 3 * layers  # all but o_proj
    assert with_codes.count(h) == layers  # down_proj


def test_loaded_checkpoint_has_the_fast_structure(tmp_path):
    m = _model("mistral", dtype=torch.bfloat16, fused=True)
    m.save_pretrained(tmp_path / "ckpt")
    model, plain = mxq.load(tmp_path / "ckpt"), mxq.load(tmp_path / "ckpt", fuse=False)
    assert sum("_mxq_feeds" in x.__dict__ for x in model.modules()) == 3 * SMALL["num_hidden_layers"]
    assert not any("_mxq_feeds" in x.__dict__ for x in plain.modules()) and plain.config._attn_implementation == "sdpa"
    ids = torch.randint(0, SMALL["vocab_size"], (1, 11))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, plain(ids).logits)


def test_grouped_sdpa_only_for_known_families_and_plain_arguments():
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    m = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=50, attn_implementation="sdpa"))
    assert not use_grouped_sdpa(m) and m.config._attn_implementation == "sdpa"
    gen = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(1, 4, 1, 16, generator=gen), torch.randn(1, 2, 9, 16, generator=gen), torch.randn(1, 2, 9, 16, generator=gen)
    mask = torch.ones(1, 1, 1, 9, dtype=torch.bool)
    bias = torch.randn(1, 4, 1, 9, generator=gen)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    want, _ = sdpa_attention_forward(module, q, k, v, mask, position_bias=bias)
    got, _ = grouped_sdpa_forward(module, q, k, v, mask, position_bias=bias)  # falls back: the bias is not plain SDPA
    assert torch.equal(got, want)


@pytest.mark.parametrize("groups,sq,b", [(1, 1, 2), (2, 1, 3), (4, 3, 1), (3, 1, 2), (8, 16, 1)])
def test_grouped_sdpa_equals_transformers_sdpa(groups, sq, b):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    gen = torch.Generator().manual_seed(groups * 100 + sq)
    hkv, n, d = 2, 37, 32
    q = torch.randn(b, hkv * groups, sq, d, generator=gen)
    k, v = torch.randn(b, hkv, n, d, generator=gen), torch.randn(b, hkv, n, d, generator=gen)
    mask = torch.rand(b, 1, sq, n, generator=gen) > 0.3
    mask[..., 0] = True
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = groups, True
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=d**-0.5)
    got, _ = grouped_sdpa_forward(module, q, k, v, mask, scaling=d**-0.5)
    assert got.shape == want.shape == (b, sq, hkv * groups, d)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_gpu_fast_structure_matches_reference_path(family):
    """On the GPU the fast structure (producer kernels, decode GEMM on their codes) computes what
    the unfused model on the torch reference computes: bf16 logits within W8A8's step noise."""
    plain = _model(family, torch.bfloat16).cuda()
    fast = copy.deepcopy(plain)
    fuse(fast)
    mxq.set_kernels(plain, "reference")
    for m in (1, 8, 300):
        ids = torch.randint(0, SMALL["vocab_size"], (1, m), device="cuda")
        with torch.no_grad():
            a, r = fast(ids).logits.float(), plain(ids).logits.float()
        assert ((a - r).norm() / r.norm()).item() < 0.03
