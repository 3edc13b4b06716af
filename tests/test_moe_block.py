"""The fused experts block (``mxq.kernels.moe_block``) against independent references: the sort
against torch's stable argsort, the combine against an fp32 sum, and the whole block against
``MXExperts``' per-projection reference path, for every family the block knows (SiLU on [gate | up]
halves, gpt-oss's clamped GLU on interleaved rows with biases), W8A8 and W8A16, at decode and
prefill sizes (the interpreter on a CPU, the kernels on a GPU)."""

from __future__ import annotations

import pytest
import torch
from moe_models import FAMILIES, moe_model

import mxq
from mxq.kernels import buffers, moe_block, moe_decode
from mxq.kernels.moe_block import (
    BLOCK,
    DECODE_MAX_ROWS,
    DIRECT_MAX_TOKENS,
    GATE_GPT_OSS,
    GATE_NONE,
    GATE_SILU,
)
from mxq.runtime.experts import MXExperts

pytestmark = pytest.mark.skipif(not moe_block.HAS_TRITON, reason="needs triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _sort(ids: torch.Tensor, e: int, k_top: int):
    """The block's sort on its own: a plan's count and sort launches."""
    s = ids.numel()
    ep2 = max(16, 1 << e.bit_length())
    sub, chunk = moe_block.sort_chunks(s, ep2)
    parts = -(-s // chunk)
    pos = torch.empty(s, dtype=torch.int32, device=ids.device)
    tok = torch.empty(s, dtype=torch.int32, device=ids.device)
    ge = torch.empty(e, dtype=torch.int32, device=ids.device)
    counts = torch.empty((parts, ep2), dtype=torch.int32, device=ids.device)
    flat = ids.reshape(-1).contiguous()
    if parts > 1:
        moe_block._route_count_kernel[(parts,)](flat, counts, s, e, C=chunk, SUB=sub, EP2=ep2)
    moe_block._route_sort_kernel[(parts,)](flat, counts, pos, tok, ge, s, e, parts, k_top, C=chunk, SUB=sub, EP2=ep2,
                                           PB=8, ONE=parts == 1)  # fmt: skip
    return pos, tok, ge


@pytest.mark.parametrize("tokens,e,k_top", [(1, 4, 2), (37, 5, 3), (700, 7, 2), (300, 130, 8), (200, 256, 8)])
def test_sort_is_torchs_stable_argsort(tokens, e, k_top):
    """Rows sorted by expert, each expert's rows in token order; indices outside [0, E) sort last
    and are in no expert's group (the sort of 1400 and 2400 pairs runs in several chunks)."""
    g = torch.Generator().manual_seed(tokens)
    ids = torch.randint(-1, e + 1, (tokens, k_top), generator=g)  # -1 and E: no expert
    pos, tok, ge = _sort(ids.to(DEV), e, k_top)
    flat = ids.reshape(-1)
    bucket = torch.where((flat >= 0) & (flat < e), flat, e)
    order = torch.argsort(bucket, stable=True)
    want_pos = torch.empty_like(order)
    want_pos[order] = torch.arange(flat.numel())
    assert torch.equal(pos.cpu().long(), want_pos)
    assert torch.equal(tok.cpu().long(), order // k_top)
    assert torch.equal(ge.cpu().long(), torch.cumsum(torch.bincount(bucket, minlength=e + 1)[:e], 0))


def _experts(family: str, recipe: str, dtype=torch.float32) -> MXExperts:
    model = mxq.quantize_model(moe_model(family, seed=5, dtype=dtype).to(DEV), recipe)
    return next(m for m in model.modules() if isinstance(m, MXExperts))


def _biases_to(mod, dtype):
    for p in mod.parameters():  # the fp8 codes and uint8 scales stay
        if p.dtype in (torch.float32, torch.bfloat16):
            p.data = p.data.to(dtype)


def _call(mod, x, idx, w, kernels):
    mod.kernels = kernels
    with torch.no_grad():
        return mod(x, idx, w)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8-w8a16"])
@pytest.mark.parametrize("tokens", [1, 3, DIRECT_MAX_TOKENS + 5, DECODE_MAX_ROWS // 2 + 7])  # decode unsorted, sorted; prefill
def test_block_is_the_reference_path(family, recipe, tokens):
    """float32 activations: the two paths differ only in accumulation order (and, rarely, an MX
    rounding of the gate's output that such a difference moves across a boundary)."""
    mod = _experts(family, recipe)
    assert mod.gate_kind == (GATE_GPT_OSS if family == "gpt_oss" else GATE_SILU)
    g = torch.Generator().manual_seed(tokens)
    h, e = mod.gate_up_proj.shape[2], mod.num_experts
    x = torch.randn(tokens, h, generator=g).to(DEV)
    idx = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(tokens)]).to(DEV)
    bad = (1, 0) if tokens > 2 else (0, 1)
    idx[bad] = e if tokens > 2 else -1  # a slot routed nowhere (expert parallelism's mark): adds nothing
    w = torch.rand(tokens, 2, generator=g).to(DEV)
    got = _call(mod, x, idx, w, "moe_block")
    want = _call(mod, x, idx, w, "reference")
    assert got.shape == want.shape and got.dtype == want.dtype
    assert ((got - want).norm() / want.norm()) < 1e-3
    # the slot routed nowhere adds nothing: the same token with a zero weight there
    w2 = w.clone()
    w2[bad] = 0
    idx2 = idx.clone()
    idx2[bad] = 0
    t0 = bad[0]
    assert torch.allclose(_call(mod, x, idx2, w2, "moe_block")[t0], got[t0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_decode_variants_are_one_function(family, monkeypatch):
    """Decode's down projection per slot (the token's last program sums, by ticket) and per token,
    with X MX-rounded once ahead of gate-up or inside every program: the same output bit for bit,
    a slot routed nowhere included, and every ticket back at zero afterwards."""
    mod = _experts(family, "mxfp8")
    g = torch.Generator().manual_seed(11)
    h, e = mod.gate_up_proj.shape[2], mod.num_experts
    for tokens in (1, 3, DIRECT_MAX_TOKENS + 3):  # unsorted and sorted decode
        x = torch.randn(tokens, h, generator=g).to(DEV)
        idx = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(tokens)]).to(DEV)
        idx[tokens - 1, 1] = -1
        w = torch.rand(tokens, 2, generator=g).to(DEV)
        outs = []
        tiles = moe_block.pick_decode_configs(tokens * 2, e, 1, h, x.device, True)
        monkeypatch.setattr(moe_block, "pick_decode_configs", lambda *a, t=tiles: t)  # one tile: one summation order
        for slots, round_x in ((True, True), (False, False), (True, False)):
            monkeypatch.setattr(moe_decode, "SLOTS", slots)
            monkeypatch.setattr(moe_decode, "ROUND_X", round_x)
            moe_block.PLANS.clear()
            outs.append(_call(mod, x, idx, w, "moe_block"))
        assert torch.isfinite(outs[0]).all()
        for o in outs[1:]:
            assert torch.equal(o, outs[0]), tokens
    moe_block.PLANS.clear()
    assert buffers.COUNTERS and all(not c.any() for c in buffers.COUNTERS.values())


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_block_bf16_no_worse_than_the_reference_path(family):
    """bf16 activations: the block's distance to the float32 computation of the same quantized
    experts is within 1.5x the bf16 reference path's (the gate rounds to bf16 after every step as
    the model's gate on a bf16 projection output does; both round the down projection's input)."""
    mod = _experts(family, "mxfp8-w8a16", torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 64, generator=g).to(DEV, torch.bfloat16)
    idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(40)]).to(DEV)
    w = torch.rand(40, 2, generator=g).to(DEV, torch.bfloat16)
    for tokens in (3, 40):  # decode and prefill kernels
        a = (x[:tokens], idx[:tokens], w[:tokens])
        got, ref = _call(mod, *a, "moe_block").float(), _call(mod, *a, "reference").float()
        _biases_to(mod, torch.float32)
        exact = _call(mod, a[0].float(), a[1], a[2].float(), "reference")
        _biases_to(mod, torch.bfloat16)
        err_got, err_ref = (got - exact).norm() / exact.norm(), (ref - exact).norm() / exact.norm()
        assert err_got <= 1.5 * err_ref + 1e-3, (tokens, err_got, err_ref)


def test_block_is_chosen_only_where_it_runs():
    """auto on a CPU: the reference (no interpreter unless a path is named); an unknown gate: the
    per-projection path whatever the spec."""
    mod = _experts("qwen3_moe", "mxfp8")
    p = moe_block.BlockProblem(torch.device("cpu"), torch.float32, mod.gate_kind, 32, mod.act, "auto")
    assert BLOCK.choose(p, "auto").name == "reference"
    assert BLOCK.choose(p._replace(spec="moe_block"), "moe_block").name == ("moe_block" if moe_block.INTERPRET else "reference")
    assert BLOCK.choose(p._replace(gate=GATE_NONE, spec="moe_block"), "moe_block").name == "reference"
    assert BLOCK.choose(p._replace(device=torch.device("cuda"), spec="auto"), "auto").name == "moe_block"


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_knows_its_gate(family):
    """The seven families with transformers' default SiLU gate and gpt-oss get the fused block;
    Llama 4 is called with its tokens already routed (its experts run the per-projection path)."""
    mod = _experts(family, "mxfp8")
    want = {"gpt_oss": GATE_GPT_OSS}.get(family, GATE_SILU)
    assert mod.gate_kind == want


def captured_experts_calls(model, ids):
    """Every ``MXExperts`` call of one forward of ``model`` on ``ids``: (module, its inputs, its output)."""
    calls = []
    hooks = [m.register_forward_hook(lambda m, a, o: calls.append((m, [t.clone() for t in a], o.clone())))
             for m in model.modules() if isinstance(m, MXExperts)]  # fmt: skip
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return calls


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"])
@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp8-w8a16"])
def test_model_experts_calls_through_the_block(family, recipe):
    """In a whole model (router, shared experts, the block), every experts call's output against
    the reference path on the same inputs. Whole-model logits are not compared in W8A8: every dense
    layer rounds its input to fp8, so an ulp of accumulation order upstream (attention, on a GPU)
    flips roundings and moves a token's logits by ~1 % whatever the experts do."""
    model = mxq.quantize_model(moe_model(family, seed=1).to(DEV), recipe)
    mxq.set_kernels(model, "moe_block")
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(2)).to(DEV)
    calls = captured_experts_calls(model, ids)
    assert len(calls) >= 1
    for m, (x, idx, w), out in calls:
        m.kernels = "reference"
        with torch.no_grad():
            ref = m(x, idx, w)
        assert ((out - ref).norm() / ref.norm()) < 1e-5


def test_block_compiles_as_one_custom_op():
    """Under torch.compile the block is the custom op ``mxq::mx_moe_experts``: the MoE layer traces
    with fullgraph (no graph break, no host sync) and computes what the eager block computes."""
    model = mxq.quantize_model(moe_model("qwen3_moe", seed=3).to(DEV))
    mxq.set_kernels(model, "moe_block")
    block = model.model.layers[1].mlp
    x = torch.randn(1, 9, 64, generator=torch.Generator().manual_seed(4)).to(DEV)
    with torch.no_grad():
        want = block(x)
        got = torch.compile(block, fullgraph=True, backend="eager")(x)
    assert torch.equal(got, want)


def test_strided_weights_are_read_as_the_contiguous_ones():
    """Weights that are strided views (a shard of another tensor) give the contiguous weights' result."""
    mod = _experts("qwen3_moe", "mxfp8")
    ex = moe_block.ExpertsWeights(mod.gate_up_proj, mod.gate_up_proj_scale, None, mod.down_proj, mod.down_proj_scale, None,
                                  GATE_SILU, False, 0.0, 0.0, mod.act.elem, mod.act.scale_rule, 32)  # fmt: skip
    wide = torch.cat([mod.down_proj.view(torch.uint8), mod.down_proj.view(torch.uint8)], dim=2)
    strided = moe_block.ExpertsWeights(**{**ex.__dict__, "w2": wide[:, :, :64].view(mod.down_proj.dtype)})
    assert not strided.w2.is_contiguous()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 64, generator=g).to(DEV)
    idx = torch.tensor([[0, 1], [2, 3], [1, 2]]).to(DEV)
    w = torch.rand(3, 2, generator=g).to(DEV)
    assert torch.equal(moe_block.experts_forward(x, idx, w, strided), moe_block.experts_forward(x, idx, w, ex))
