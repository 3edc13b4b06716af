"""The router's top-k in one kernel (``mxq.kernels.moe_router``, ``mxq.runtime.routing``) against
independent references: torch's softmax, sigmoid and top-k as the families write them, and each known
family's own router forward (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral, gpt-oss, DeepSeek-V3 and GLM-4-MoE
with group-limited choice; Llama 4's whole MoE block), on awkward shapes (the kernel in the Triton
interpreter on a CPU)."""

from __future__ import annotations

import copy

import pytest
import torch
from moe_models import moe_model

import mxq
from mxq.kernels.moe_router import (
    HAS_TRITON,
    router_group_topk,
    router_group_topk_reference,
    router_topk,
    router_topk_reference,
)
from mxq.runtime import fuse as F
from mxq.runtime import routing as R

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
KNOWN = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "gpt_oss", "deepseek_v3", "glm4_moe")
# DeepSeek-V3 and GLM-4-MoE with groups that limit the choice: 8 experts in 4 groups, 2 groups kept, top 3
GROUPED = dict(n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3)


def _family_model(family, seed, dtype=torch.float32):
    model = moe_model(family, seed=seed, dtype=dtype, **(GROUPED if family in ("deepseek_v3", "glm4_moe") else {}))
    gen = torch.Generator().manual_seed(seed)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # zeros as built: give the choice something to correct
            b.copy_(torch.rand(b.shape, generator=gen) * 0.2 - 0.1)
    return model


def _distinct_logits(t: int, e: int, dtype, gen) -> torch.Tensor:
    """Logits without ties (multiples of 1/16, exact in bf16) so that the choice is unique."""
    rows = [(torch.randperm(e, generator=gen) - e // 2).float() / 16 for _ in range(t)]
    return torch.stack(rows).to(dtype)


@pytest.mark.parametrize("t,e,k", [(1, 60, 4), (7, 128, 8), (37, 8, 2), (5, 33, 1), (3, 256, 8)])
@pytest.mark.parametrize("rule", [("softmax", True), ("softmax", False), ("topk_softmax", False), ("topk_sigmoid", False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_topk_is_the_reference(t, e, k, rule, dtype):
    gen = torch.Generator().manual_seed(t * 1000 + e)
    logits = _distinct_logits(t, e, dtype, gen).to(DEV)
    for out in (dtype, torch.float32):
        w, i = router_topk(logits, k, *rule, out)
        w_ref, i_ref = router_topk_reference(logits, k, *rule, out)
        assert w.dtype == w_ref.dtype == out and i.dtype == torch.int64 and w.shape == i.shape == (t, k)
        assert torch.equal(i, i_ref)
        # float32 arithmetic in another order: a few float32 ulps, at most one ulp of a bf16 output
        tol = 2**-7 if out == torch.bfloat16 else 1e-5
        torch.testing.assert_close(w.float(), w_ref.float(), rtol=tol, atol=1e-7)


def test_router_topk_ties_go_to_the_lower_index():
    logits = torch.zeros(3, 12, device=DEV)
    logits[1, 7] = logits[1, 9] = 1.0
    w, i = router_topk(logits, 3, "softmax", True, torch.float32)
    assert i.tolist() == [[0, 1, 2], [7, 9, 0], [0, 1, 2]]
    torch.testing.assert_close(w[0], torch.full((3,), 1 / 3, device=DEV))


def test_router_topk_refuses_k_beyond_the_experts_and_unknown_rules():
    with pytest.raises(ValueError, match="k=9 for 8 experts"):
        router_topk(torch.zeros(2, 8), 9, "softmax", True, torch.float32)
    with pytest.raises(ValueError, match="rule 'sparsemax' is none of"):
        router_topk(torch.zeros(2, 8), 2, "sparsemax", True, torch.float32)
    with pytest.raises(ValueError, match="12 experts in 5 groups"):
        router_group_topk(torch.zeros(2, 12), torch.zeros(12), 2, 5, 1, True, 1.0)
    with pytest.raises(ValueError, match="k=9 for 2 groups of 4 experts"):
        router_group_topk(torch.zeros(2, 16), torch.zeros(16), 9, 4, 2, True, 1.0)


@pytest.mark.parametrize("t,e,groups,kept,k", [(1, 256, 8, 4, 8), (7, 64, 4, 2, 6), (5, 48, 3, 2, 5), (9, 160, 1, 1, 8),
                                               (3, 20, 5, 3, 4), (4, 6, 3, 1, 2)])  # fmt: skip
@pytest.mark.parametrize("normalize", [True, False])
def test_router_group_topk_is_the_reference(t, e, groups, kept, k, normalize):
    """DeepSeek-V3's rule: the same experts in the same order (the biased scores have no ties here),
    weights within float32 rounding; where groups are left out, the choice is not the plain top k."""
    gen = torch.Generator().manual_seed(t * 1000 + e + groups)
    logits = torch.randn(t, e, generator=gen).to(DEV)
    bias = (torch.rand(e, generator=gen) * 0.2 - 0.1).to(DEV)
    w, i = router_group_topk(logits, bias, k, groups, kept, normalize, 2.5)
    w_ref, i_ref = router_group_topk_reference(logits, bias, k, groups, kept, normalize, 2.5)
    assert w.dtype == torch.float32 and i.dtype == torch.int64 and w.shape == i.shape == (t, k)
    assert torch.equal(i, i_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-7)
    if kept < groups and t > 1:
        plain = (logits.sigmoid() + bias).topk(k, dim=-1).indices
        assert not torch.equal(plain, i)


def _router(model):
    return next(m for m in model.modules() if type(m).__name__ in R.ROUTERS)


@pytest.mark.parametrize("family", KNOWN)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_known_router_is_its_familys_forward(family, dtype):
    """The rule ``known_router`` gives the family's class, through the one-kernel forward, against the
    module's own forward: the same logits and experts, the weights within rounding (DeepSeek-V3's
    forward lists its k experts in no particular order: compared as sets)."""
    router = _router(_family_model(family, seed=3, dtype=dtype).to(DEV))
    rule = R.known_router(type(router))
    assert rule is not None, type(router).__name__
    gen = torch.Generator().manual_seed(7)
    for tokens in (1, 13):
        h = torch.randn(tokens, router.weight.shape[1], generator=gen).to(DEV, dtype)
        want = type(router).forward(router, h)
        got = R.fused_router_forward(router, h, rule)
        assert len(got) == len(want) == 3
        assert torch.equal(got[0], want[0])  # the same GEMM
        assert got[1].dtype == want[1].dtype and got[2].dtype == want[2].dtype
        (gi, go), (wi, wo) = got[2].sort(-1), want[2].sort(-1)
        gw, ww = got[1].gather(-1, go), want[1].gather(-1, wo)
        # the same experts; where bf16 logits tie, the same logits (torch breaks ties its own way)
        assert torch.equal(want[0].gather(-1, gi), want[0].gather(-1, wi))
        ties = (want[0].unsqueeze(-1) == want[0].unsqueeze(-2)).sum((-1, -2)) > want[0].shape[-1]
        assert torch.equal(gi[~ties], wi[~ties]) and (~ties).any()
        tol = 2**-7 if got[1].dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(gw[~ties].float(), ww[~ties].float(), rtol=tol, atol=1e-7)


def test_any_router_class_with_a_known_forward_gets_its_rule():
    """DeepSeek-V3's router forward is shared verbatim by other families' classes: the rule follows the
    source, not the name (and a class that is no router is left alone)."""
    ds = type(_router(_family_model("deepseek_v3", seed=1)))
    twin = type("SomeOtherTopkRouter", (torch.nn.Module,), {"forward": ds.forward})
    assert R.known_router(twin) == R.known_router(ds) and R.known_router(twin).kind == "group_sigmoid"
    assert R.known_router(type("SomeOtherGate", (torch.nn.Module,), {"forward": ds.forward})) is None


@pytest.mark.parametrize("k", [1, 2])
def test_llama4_runs_only_the_chosen_experts(k):
    """Llama 4's MoE block with MX experts: the fused forward computes transformers' function (every
    expert on every token, scaled by dense sigmoid scores) on T·k rows instead of E·T."""
    plain = mxq.quantize_model(moe_model("llama4_text", seed=4, num_experts_per_tok=k).to(DEV), fuse=False)
    fast = copy.deepcopy(plain)
    assert sum(d.endswith("(router, chosen experts only)") for d in F.fuse(fast)) == plain.config.num_hidden_layers
    rows = []
    hook = fast.model.layers[0].feed_forward.experts.register_forward_hook(lambda m, a, out: rows.append(a[0].shape[0]))
    ids = torch.randint(0, plain.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(5)).to(DEV)
    with torch.no_grad():
        a, b = fast(ids).logits, plain(ids).logits
    hook.remove()
    assert rows == [2 * 11 * k]  # E = 4 experts: the block ran 88 rows
    # the same function; rows of another count through the expert GEMMs may round in another order
    assert ((a - b).norm() / b.norm()) < 1e-5
    with torch.no_grad():
        kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(fast.generate(ids, **kw), plain.generate(ids, **kw))
    F.unfuse(fast)
    assert "forward" not in fast.model.layers[0].feed_forward.__dict__


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_fuse_installs_the_routers_and_unfuse_removes_them(family):
    """On a CPU the fused router runs the module's own forward, so the model is the same function
    bit for bit; the grouped attention is on where the family's attention is Llama's, gpt-oss's attention
    with sinks (its own eager attention but for one-token steps on a GPU) on gpt-oss."""
    plain = mxq.quantize_model(moe_model(family, seed=2), fuse=False)
    fast = copy.deepcopy(plain)
    done = F.fuse(fast)
    routers = [d for d in done if d.endswith("(router)")]
    assert len(routers) == plain.config.num_hidden_layers, done
    assert f"attention: {F.SINKS_ATTENTION if family == 'gpt_oss' else F.GROUPED_SDPA}" in done
    ids = torch.randint(0, plain.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(fast(ids).logits, plain(ids).logits)
    F.unfuse(fast)
    assert not any("_mxq_router" in m.__dict__ or "forward" in m.__dict__ for m in fast.modules() if type(m).__name__ in R.ROUTERS)


def test_a_changed_router_forward_keeps_its_own_with_a_warning():
    def forward(self, hidden_states):
        return torch.topk(hidden_states, 2, dim=-1)

    changed = type("Qwen3MoeTopKRouter", (torch.nn.Module,), {"forward": forward})
    with pytest.warns(UserWarning, match="Qwen3MoeTopKRouter.forward is not the one mxq knows"):
        assert R.known_router(changed) is None
    assert R.known_router(type("SomethingElse", (torch.nn.Module,), {"forward": forward})) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("family", KNOWN)
def test_fused_routers_on_a_gpu_give_the_models_tokens(family):
    plain = mxq.quantize_model(moe_model(family, seed=2).cuda(), fuse=False)  # float32: no ties among logits
    fast = copy.deepcopy(plain)
    assert any(d.endswith("(router)") for d in F.fuse(fast))
    ids = torch.randint(0, plain.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4)).cuda()
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        a, b = fast(ids).logits.float(), plain(ids).logits.float()
        assert ((a - b).norm() / b.norm()) < 1e-3
        assert torch.equal(fast.generate(ids, **kw), plain.generate(ids, **kw))


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_fused_router_compiles_as_one_custom_op(family):
    """Under torch.compile the fused forward calls ``mxq::router_topk``: it traces with fullgraph and
    gives what the eager forward gives (which calls the kernel without the op's dispatch)."""
    router = _router(_family_model(family, seed=5).to(DEV))
    rule = R.known_router(type(router))
    h = torch.randn(6, router.weight.shape[1], generator=torch.Generator().manual_seed(2)).to(DEV)
    with torch.no_grad():
        want = R.fused_router_forward(router, h, rule)
        got = torch.compile(lambda x: R.fused_router_forward(router, x, rule), fullgraph=True, backend="eager")(h)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
