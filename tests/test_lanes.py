"""Kernel lanes: ``MXLinear`` keeps, per input signature, the outcome of the dispatch and the plan
(``dispatch.linear_lane`` -> ``kernels/lanes.py``) and calls the compiled kernel's C launcher
directly. On CPU: when a module uses its lane and when it does not (a stand-in lane); on a Hopper
GPU: the lane's output bit for bit against ``mx_linear`` (the dispatch path the lane shortcuts),
for X quantized inside the kernel, by its producer, or by the quantizer kernel, with and without a
bias and a K split, inside a CUDA graph, and after the weight's storage changes."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEV, activations, hopper

from mxq.formats import E4M3, ScaleRule
from mxq.kernels import dispatch, mx_linear, reference
from mxq.kernels.quantize import quantize_mx_rows
from mxq.recipe import TensorSpec
from mxq.runtime.linear import MXLinear

ACT = TensorSpec(E4M3, ScaleRule.RCEIL)


def _module(n, k, bias, gen, device=DEV):
    lin = torch.nn.Linear(k, n, bias=bias, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=gen) * 0.05)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=gen))
    return MXLinear.from_linear(lin.to(device), ACT, ACT)


def test_module_uses_its_lane_only_while_it_holds(monkeypatch):
    """A lane serves the signature it was made for while the weight, scales and bias are the same
    tensors at the same addresses and the kernels spec is unchanged; anything else goes through
    ``mx_linear`` (the reference here) and makes a new lane."""
    gen = torch.Generator().manual_seed(3)
    m = _module(96, 160, True, gen, "cpu")
    made, served = [], []

    def fake_lane(x, weight, weight_scale, bias, *, act_elem, act_rule, block_size, kernels, pre):
        made.append((tuple(x.shape), pre))
        ref = lambda x, x_mx: (served.append(tuple(x.shape)), mx_linear(x, weight, weight_scale, bias, act_elem=act_elem,
                                                                          act_rule=act_rule, kernels="reference"))[1]  # noqa: E731
        return ref

    monkeypatch.setattr(dispatch, "linear_lane", fake_lane)
    x = activations(3, 160, torch.bfloat16, gen, special=False).cpu()  # the module is on the CPU on any machine
    want = m(x)
    m._lane_for(x, None, E4M3, ScaleRule.RCEIL)  # a CUDA call makes it after its first call
    assert made == [((3, 160), False)]
    assert torch.equal(m(x), want) and served == [(3, 160)]
    x3 = activations(2, 160, torch.bfloat16, gen, special=False).cpu().view(1, 2, 160)
    m(x3)  # another signature: no lane for it
    assert served == [(3, 160)]
    xq = reference.quantize_mx_rows(x, E4M3, ScaleRule.RCEIL)  # on the CPU: no Triton launch outside the interpreter
    m(x, xq)  # codes from a producer: a signature of its own
    assert served == [(3, 160)]
    m.weight.data = m.weight.data.clone()  # same Parameter, new storage
    m(x)
    assert served == [(3, 160)]
    m._lane_for(x, None, E4M3, ScaleRule.RCEIL)
    m(x)
    assert served == [(3, 160)] * 2
    m.kernels = "reference"
    m(x)
    assert served == [(3, 160)] * 2
    m.kernels = None
    monkeypatch.setenv("MXQ_KERNELS", "reference")
    m(x)
    assert served == [(3, 160)] * 2
    monkeypatch.delenv("MXQ_KERNELS")
    m(x)
    assert served == [(3, 160)] * 3
    import copy
    import io

    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    assert copy.deepcopy(m)._lanes is None and torch.load(buf, weights_only=False)._lanes is None
    monkeypatch.setattr(dispatch, "linear_lane", lambda *a, **k: None)
    m._lanes = None
    m._lane_for(x, None, E4M3, ScaleRule.RCEIL)
    assert list(m._lanes.values()) == [False]


def test_no_lane_off_the_gpu_or_for_weight_only():
    gen = torch.Generator().manual_seed(4)
    m = _module(64, 128, False, gen, "cpu")
    x = torch.randn(1, 128, dtype=torch.bfloat16)
    assert dispatch.linear_lane(x, m.weight, m.weight_scale, None, act_elem=E4M3) is None
    assert dispatch.linear_lane(x, m.weight, m.weight_scale, None, act_elem=None) is None


@hopper
@pytest.mark.parametrize("shape,n,k,bias,pre", [
    ((1, 1, 4096), 4096, 4096, False, False),  # X quantized inside, K split (o_proj of 8B)
    ((1, 4096), 6144, 4096, True, True),  # codes from the producer (qkv), bias
    ((5, 4096), 28672, 4096, False, True),  # gate_up with codes
    ((1, 14336), 4096, 14336, False, False),  # down without a producer: the quantizer kernel (slow lane)
    ((2, 8, 1152), 200, 1152, True, False),  # 16 rows, odd N
    ((3, 256), 130, 256, False, True),
])  # fmt: skip
def test_gpu_lane_matches_dispatch_bit_for_bit(shape, n, k, bias, pre):
    gen = torch.Generator().manual_seed(n + k)
    m = _module(n, k, bias, gen)
    for step in range(4):  # the first call makes the lane, the next ones use it
        x = activations(int(torch.tensor(shape[:-1]).prod()), k, torch.bfloat16, gen, special=False).view(shape).to(DEV)
        x_mx = quantize_mx_rows(x, E4M3, ScaleRule.RCEIL) if pre else None
        want = mx_linear(x, m.weight, m.weight_scale, m.bias, act_elem=E4M3, act_rule=ScaleRule.RCEIL, x_mx=x_mx)
        got = m(x, x_mx)
        assert got.shape == want.shape and torch.equal(got, want), (step, (got.float() - want.float()).abs().max())
    assert [v for v in m._lanes.values() if v], "no lane was made"
    g = torch.cuda.CUDAGraph()  # a lane inside a captured graph replays the same product
    xs = x.clone()
    xm = tuple(t.clone() for t in x_mx) if pre else None
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        out = m(xs, xm)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    m.weight.data = torch.flip(m.weight.data, [0]).contiguous()  # new storage: the lane is not used
    want = mx_linear(x, m.weight, m.weight_scale, m.bias, act_elem=E4M3, act_rule=ScaleRule.RCEIL, x_mx=x_mx)
    assert torch.equal(m(x, x_mx), want)
