"""Decode attention on a 16-bit KV cache (``mxq.kernels.attention_sdpa_decode``) against float64
attention on the same inputs, on awkward shapes (the kernel in the Triton interpreter on a CPU, which
plans the splits for an H100's 132 SMs), and in a model: the grouped SDPA of a quantized model sends
one-token steps to it and gives the logits of torch's SDPA."""

from __future__ import annotations

import functools
import zlib

import pytest
import torch

pytest.importorskip("triton")

import mxq  # noqa: E402
from mxq.kernels import attention_sdpa_decode as A  # noqa: E402
from mxq.kernels.common import INTERPRET  # noqa: E402
from mxq.runtime import fuse as F  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
KERNEL = "sdpa_decode"  # named: on a CPU the interpreter runs it


def _exact(q, k, v, mask, scale, sinks=None):
    """softmax(q kᵀ scale + mask) v in float64, each query head on its kv head; [B, 1, Hq, D]. With
    sinks, exp(sink) of the query head joins the softmax's denominator (gpt-oss's eager attention)."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    if mask is not None:
        m = mask[..., : k.shape[2]]
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.double()
    if sinks is not None:
        col = sinks.double().reshape(1, -1, 1, 1).expand(s.shape[0], -1, 1, 1)
        return (torch.softmax(torch.cat([s, col], -1), -1)[..., :-1] @ v).transpose(1, 2)
    p = torch.softmax(s, -1).nan_to_num(0.0)  # a row with nothing to attend to: zeros
    return (p @ v).transpose(1, 2)


def _operands(b, hq, hkv, n, d, dtype, mask_kind, seed, bm=None):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, 1, d, generator=gen).to(dtype)
    k = torch.randn(b, hkv, n, d, generator=gen).to(dtype)
    v = torch.randn(b, hkv, n, d, generator=gen).to(dtype)
    bm = b if bm is None else bm
    if mask_kind == "bool":  # a longer mask (transformers' static-cache mask may be), a whole block hidden
        mask = torch.rand(bm, 1, 1, n + 3, generator=gen) < 0.7
        mask[..., 64:128] = False
        mask[..., 0] = True
    elif mask_kind == "add":
        keep = torch.rand(bm, 1, 1, n, generator=gen) < 0.7
        keep[..., 0] = True
        mask = torch.where(keep, 0.0, torch.finfo(dtype).min).to(dtype)
    else:
        mask = None
    return q.to(DEV), k.to(DEV), v.to(DEV), None if mask is None else mask.to(DEV)


def _tolerance(v, out_dtype):
    """Twice the worst case of the output's rounding (one ulp in the interpreter, which truncates) plus,
    on a GPU, P rounded to 16 bits before P·V: 2^-8 of the largest |v| for bf16, 2^-10 for fp16."""
    ulp = 2.0**-7 if out_dtype == torch.bfloat16 else 2.0**-9
    return ulp * float(v.abs().max())


@pytest.mark.parametrize("b,hq,hkv,n,d", [(1, 32, 4, 161, 128), (3, 12, 4, 70, 80), (2, 6, 6, 1, 64),
                                          (1, 6, 2, 1100, 128), (2, 16, 2, 600, 96), (5, 9, 3, 33, 32)])  # fmt: skip
@pytest.mark.parametrize("mask_kind", ["bool", "add", "none"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sdpa_decode_is_attention(b, hq, hkv, n, d, mask_kind, dtype):
    seed = zlib.crc32(f"{b},{hq},{hkv},{n},{d},{mask_kind},{dtype}".encode())
    q, k, v, mask = _operands(b, hq, hkv, n, d, dtype, mask_kind, seed)
    scale = 0.7 / d**0.5
    out = A.sdpa_decode(q, k, v, mask, scale, kernels=KERNEL)
    want = _exact(q, k, v, mask, scale)
    assert out.dtype == dtype and out.shape == (b, 1, hq, d)
    assert (out.double() - want).abs().max().item() <= _tolerance(v, dtype)


def test_sdpa_decode_splits_long_contexts_and_merges():
    """Few programs and a long context: the keys split over programs (an H100 plan: 1 x 2 kv heads,
    1100 keys -> 9 splits of 128), merged within the output's rounding."""
    assert A.plan_splits(1, 2, 1100, 132) == (9, 128)
    assert A.plan_splits(1, 2, 200, 132) == (1, 200)  # short: one split, one launch
    assert A.plan_splits(32, 4, 2048, 132) == (5, 448)  # ~4 programs an SM
    assert A.plan_splits(160, 4, 4096, 132) == (1, 4096)  # the batch fills the SMs: one split
    q, k, v, mask = _operands(1, 6, 2, 1100, 64, torch.bfloat16, "bool", 11)
    split = A.sdpa_decode(q, k, v, mask, 0.125, kernels=KERNEL)
    want = _exact(q, k, v, mask, 0.125)
    assert (split.double() - want).abs().max().item() <= _tolerance(v, torch.bfloat16)


def test_sdpa_decode_rows_with_nothing_to_attend_are_zero_and_a_mask_broadcasts():
    q, k, v, _ = _operands(3, 8, 2, 90, 32, torch.bfloat16, "none", 5)
    mask = torch.ones(3, 1, 1, 90, dtype=torch.bool, device=DEV)
    mask[1] = False  # sequence 1 sees no key
    out = A.sdpa_decode(q, k, v, mask, 0.2, kernels=KERNEL)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    ok = [0, 2]
    want = _exact(q[ok], k[ok], v[ok], mask[ok], 0.2)
    assert (out[ok].double() - want).abs().max().item() <= _tolerance(v, torch.bfloat16)
    one = torch.rand(1, 1, 1, 90, generator=torch.Generator().manual_seed(3)) < 0.5  # [1, ...]: every sequence
    one[..., 0] = True
    out1 = A.sdpa_decode(q, k, v, one.to(DEV), 0.2, kernels=KERNEL)
    assert (out1.double() - _exact(q, k, v, one.to(DEV), 0.2)).abs().max().item() <= _tolerance(v, torch.bfloat16)


def test_sdpa_decode_refuses_mismatched_operands():
    q = torch.zeros(1, 4, 1, 16)
    with pytest.raises(ValueError, match="sdpa_decode"):
        A.sdpa_decode(q, torch.zeros(1, 2, 5, 16), torch.zeros(1, 2, 6, 16))
    with pytest.raises(ValueError, match=r"sinks \(2,\) are not one logit a query head \(4,\)"):
        A.sdpa_decode(q, torch.zeros(1, 2, 5, 16), torch.zeros(1, 2, 5, 16), sinks=torch.zeros(2))


def _sliding_add_mask(b, n, window, dtype, seed):
    """gpt-oss's additive decode mask: the last ``window`` keys of a filled prefix in view (a static
    cache's tail and the keys before the window at ``finfo.min``), the prefix length per sequence."""
    gen = torch.Generator().manual_seed(seed)
    filled = torch.randint(max(1, n // 2), n + 1, (b,), generator=gen)
    pos = torch.arange(n)
    keep = (pos[None, :] < filled[:, None]) & (pos[None, :] >= filled[:, None] - window)
    return torch.where(keep, 0.0, torch.finfo(dtype).min).to(dtype).reshape(b, 1, 1, n)


@pytest.mark.parametrize("b,hq,hkv,n,d,window", [(1, 64, 8, 300, 64, 128), (3, 12, 4, 1100, 64, 1100),
                                                 (2, 6, 2, 77, 48, 16), (4, 8, 8, 1, 64, 1)])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sdpa_decode_with_sinks_is_gpt_oss_attention(b, hq, hkv, n, d, window, dtype):
    """Attention sinks (one logit a query head in the softmax's denominator) on gpt-oss's additive
    masks, sliding window and full, one split and several (1100 keys at B=3: the H100 plan splits),
    against float64; the torch reference path computes the same function."""
    seed = zlib.crc32(f"sinks{b},{hq},{hkv},{n},{d},{window},{dtype}".encode())
    q, k, v, _ = _operands(b, hq, hkv, n, d, dtype, "none", seed)
    mask = _sliding_add_mask(b, n, window, dtype, seed).to(DEV)
    sinks = (2.0 * torch.randn(hq, generator=torch.Generator().manual_seed(seed))).to(dtype).to(DEV)
    scale = d**-0.5
    want = _exact(q, k, v, mask, scale, sinks)
    out = A.sdpa_decode(q, k, v, mask, scale, kernels=KERNEL, sinks=sinks)
    assert out.dtype == dtype and out.shape == (b, 1, hq, d)
    assert (out.double() - want).abs().max().item() <= _tolerance(v, dtype)
    ref = A.sdpa_decode(q, k, v, mask, scale, kernels="reference", sinks=sinks)
    assert (ref.double() - want).abs().max().item() <= _tolerance(v, dtype)
    assert A.plan_splits(3, 4, 1100, 132)[0] > 1  # the second shape runs the split-and-merge path


def test_keys_an_additive_mask_hides_weigh_nothing_and_rows_with_none_are_zero():
    """An additive value at or below HIDDEN hides its key as False does (fp16's finfo.min is -65504):
    the same output as the boolean mask, a row with every key hidden zeros, with sinks or without."""
    q, k, v, _ = _operands(3, 8, 2, 150, 32, torch.float16, "none", 8)
    keep = torch.rand(3, 1, 1, 150, generator=torch.Generator().manual_seed(8)) < 0.5
    keep[0] = False
    add = torch.where(keep, 0.0, torch.finfo(torch.float16).min).to(torch.float16)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(9)).to(DEV)
    for s in (None, sinks):
        by_add = A.sdpa_decode(q, k, v, add.to(DEV), 0.2, kernels=KERNEL, sinks=s)
        by_bool = A.sdpa_decode(q, k, v, keep.to(DEV), 0.2, kernels=KERNEL, sinks=s)
        assert torch.equal(by_add, by_bool)
        assert torch.equal(by_add[0], torch.zeros_like(by_add[0]))
        want = _exact(q[1:], k[1:], v[1:], keep[1:].to(DEV), 0.2, s)
        assert (by_add[1:].double() - want).abs().max().item() <= _tolerance(v, torch.float16)


def test_the_registry_takes_the_kernel_where_triton_runs():
    cuda = torch.device("cuda", 0)
    p = A.SdpaDecodeProblem(cuda, torch.bfloat16, 1, 32, 4, 128, A.MASK_BOOL, "auto")
    assert A.SDPA_DECODE.choose(p).name == "sdpa_decode"
    assert A.SDPA_DECODE.choose(p._replace(q_len=2)).name == "reference"  # a prefill chunk
    assert A.SDPA_DECODE.choose(p._replace(dtype=torch.float32)).name == "reference"
    assert A.SDPA_DECODE.choose(p._replace(spec="reference"), "reference").name == "reference"
    cpu = p._replace(device=torch.device("cpu"))
    assert A.SDPA_DECODE.choose(cpu).name == "reference"  # auto on a CPU: torch
    assert A.SDPA_DECODE.choose(cpu._replace(spec=KERNEL), KERNEL).name == ("sdpa_decode" if INTERPRET else "reference")


def test_the_op_traces_for_torch_compile():
    q, k, v, mask = _operands(2, 8, 2, 40, 32, torch.bfloat16, "bool", 9)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(2)).to(DEV)
    torch.library.opcheck(F.sdpa_decode_op, (q, k, v, mask, None, 0.25, ""))
    torch.library.opcheck(F.sdpa_decode_op, (q, k, v, None, None, 0.25, ""))
    torch.library.opcheck(F.sdpa_decode_op, (q, k, v, mask, sinks, 0.25, ""))


def _tiny_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=32, vocab_size=200, max_position_embeddings=128,
                      tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(4)
    return Qwen3ForCausalLM(cfg).eval().to(torch.bfloat16)


def _watch_decode_calls(monkeypatch) -> list:
    """Watch the eager one-token seam (``mxq.runtime.fuse._sdpa_decode``): per call (q's shape, whether sinks
    and an additive mask came with it, the error against float64 attention, the tolerance)."""
    calls = []
    real = F._sdpa_decode

    def spy(q, k, v, mask, sinks, scale, chosen):
        out = real(q, k, v, mask, sinks, scale, chosen)
        calls.append((tuple(q.shape), sinks is not None and mask is not None and mask.dtype != torch.bool,
                      (out.double() - _exact(q, k, v, mask, scale, sinks)).abs().max().item(), _tolerance(v, q.dtype)))  # fmt: skip
        return out

    monkeypatch.setattr(F, "_sdpa_decode", spy)
    return calls


def _static_steps(model, ids, kernels):
    """Prefill 9 tokens into a static cache of 24, then 3 one-token steps under ``kernels``: their logits."""
    from transformers import StaticCache

    mxq.set_kernels(model, kernels)
    cache = StaticCache(config=model.config, max_cache_len=24)
    out = []
    with torch.no_grad():
        model(ids[:, :9], past_key_values=cache, cache_position=torch.arange(9, device=DEV))
        for t in range(9, 12):
            out.append(model(ids[:, t : t + 1], past_key_values=cache, cache_position=torch.tensor([t], device=DEV)).logits.float())
    return torch.cat(out, 1)


def test_a_quantized_models_decode_steps_take_the_kernel(monkeypatch):
    """Prefill 9 tokens into a static cache, then 3 one-token steps: with the kernel named, every
    step's attention goes to it (2 layers x 3 steps) and equals attention on its inputs within the
    output's rounding. The logits follow torch's SDPA: a bf16 ulp of the attention output (0.4 %)
    carried through the model moves them ~1 % (measured 0.95 %, W8A16: no activation rounding to
    amplify it); 5 % catches a wrong head or key while leaving that rounding room."""

    model = mxq.quantize_model(_tiny_qwen3().to(DEV), "mxfp8-w8a16")
    assert model.config._attn_implementation == F.GROUPED_SDPA
    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(1)).to(DEV)
    calls = _watch_decode_calls(monkeypatch)

    def steps(kernels):  # the linear layers on torch: the interpreter is slow
        return _static_steps(model, ids, f"{kernels},reference")

    with monkeypatch.context() as m:  # what ran before the kernel: the grouped SDPA
        m.setattr(F, "DECODE_KERNEL", False)
        want = steps(KERNEL)
    assert calls == []
    got = steps(KERNEL)
    assert len(calls) == 6 and all(shape == (2, 8, 1, 32) and err <= tol for shape, _, err, tol in calls)
    assert ((got - want).norm() / want.norm()).item() < 5e-2
    mxq.set_kernels(model, None)


@pytest.mark.parametrize("sinks", [False, True])
def test_the_compiled_one_token_step_draws_no_warning(sinks):
    """Under ``torch.compile`` the one-token attention's kernel choice is traced (the grouped SDPA, and
    gpt-oss's attention with sinks): it gives the eager result and no warning reaches the user (an
    ``lru_cache`` in the kernel-spec check once made Dynamo warn)."""
    import warnings

    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal, module.scaling = 4, True, 0.1
    q, k, v, mask = _operands(1, 8, 2, 20, 32, torch.bfloat16, "add" if sinks else "bool", 2)
    if sinks:
        module.mxq_kernels = KERNEL  # the interpreter on a CPU; auto on a GPU
        aux = torch.randn(8, generator=torch.Generator().manual_seed(4)).to(DEV)
        fn = functools.partial(F.sinks_attention_forward, module, s_aux=aux, scaling=0.1)
    else:
        fn = functools.partial(F.grouped_sdpa_forward, module, scaling=0.1)
    eager = fn(q, k, v, mask)[0]
    if sinks:
        assert (eager.double() - _exact(q, k, v, mask, 0.1, aux)).abs().max().item() <= _tolerance(v, q.dtype)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = torch.compile(lambda *a: fn(*a)[0], fullgraph=True, backend="eager")(q, k, v, mask)
    assert [str(w.message)[:80] for w in caught if "Dynamo" in str(w.message)] == []
    assert torch.equal(got, eager)


@pytest.mark.parametrize("window", [64, 5])
def test_a_quantized_gpt_oss_decodes_through_the_kernel_with_its_sinks(monkeypatch, window):
    """gpt-oss (attention sinks, eager additive masks, sliding and full layers) under mxq: its
    attention is ``SINKS_ATTENTION``; prefill 9 tokens into a static cache, then 3 one-token steps:
    every one-token attention goes to the kernel with the layer's sinks (2 layers x 3 steps), each
    within the output's rounding of float64 attention on its inputs, and the logits follow
    transformers' own eager attention (the same 5 % room as the Qwen3 test; a 5-key window hides keys
    of the sliding layer). Every token takes all 4 experts: with top-2 of 4, a bf16 ulp of attention
    flipped one token's expert choice on an H100 and moved its logits 28 %."""
    from moe_models import moe_model

    model = mxq.quantize_model(moe_model("gpt_oss", seed=2, dtype=torch.bfloat16, sliding_window=window,
                                         num_experts_per_tok=4).to(DEV),
                               "mxfp8-w8a16")  # fmt: skip
    assert model.config._attn_implementation == F.SINKS_ATTENTION
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3)).to(DEV)
    calls = _watch_decode_calls(monkeypatch)

    def steps():  # the experts on torch: the interpreter is slow
        return _static_steps(model, ids, f"{KERNEL},reference")

    with monkeypatch.context() as m:  # transformers' eager attention of the family
        m.setattr(F, "DECODE_KERNEL", False)
        want = steps()
    assert calls == []
    got = steps()
    assert len(calls) == 6 and all(sunk and err <= tol for _, sunk, err, tol in calls)
    assert ((got - want).norm() / want.norm()).item() < 5e-2
    mxq.set_kernels(model, None)
    F.unfuse(model)
    assert model.config._attn_implementation == "eager"
