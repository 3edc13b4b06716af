"""kernels/dispatch.py: which path computes ``mx_linear``, and that every path computes it.

- ``test_every_path_matches_reference``: each registered LINEAR path, run directly
  (``dispatch.run_path``) over awkward shapes, X dtypes, W8A16 / W8A8 and bias, against the torch
  reference within that path's accuracy (exact up to fp32 accumulation order; the fp8 tensor-core
  decode paths up to their in-block accumulation). A combination runs wherever the path's own
  ``supports`` holds for the target: on a CPU the Triton interpreter, described as an sm_90 with
  132 SMs (it runs every plain Triton kernel; it cannot run Gluon nor ``tl.dot_scaled``); on a GPU
  the real device (the rows are then marked ``gpu``).
- the choice, by identity, for devices the tests do not have (``LinearProblem`` built by hand),
  the ``kernels`` argument, the names benchmark tables print, and the fall-back from a Gluon
  kernel that does not compile to the next path.
"""

from __future__ import annotations

import ast
import warnings

import pytest
import torch
from kernel_helpers import (
    CUDA,
    DEV,
    INTERPRET,
    activations,
    assert_gemm_close,
    chosen,
    gpu,
    mx_weight,
    path_acc,
)
from triton.compiler.errors import CompilationError
from triton.runtime.errors import PTXASError

import mxq
from mxq.formats import E4M3, E5M2, ScaleRule
from mxq.kernels import cpu as cpu_kernels
from mxq.kernels import dispatch, gluon_api
from mxq.kernels import gemm_decode_ws as WS
from mxq.kernels import gemm_prefill_ws as PWS
from mxq.kernels.launch import PlanCache
from mxq.kernels.reference import mx_linear_reference

L = dispatch.LINEAR
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
E4 = (E4M3, ScaleRule.RCEIL)

# --------------------------------------------------------------------------------------
# Every path against the reference
# --------------------------------------------------------------------------------------

# (M, N, K, X dtype, activations: None = W8A16, else (element format, scale rule), bias): every M
# with every X dtype, W8A16 and W8A8 (E4M3, RCEIL), the shapes and the bias taking turns. N is no
# multiple of 16; K a multiple of 32 with an odd number of blocks, or K = 384 (three 128-wide
# steps: the K % 128 == 0 shapes of decode_ws, decode_f8's int32 scale words and its MSE route).
_NK = [(40, 96), (33, 160), (100, 224), (33, 384), (100, 96), (40, 224), (100, 384)]
CASES = [
    (m, *_NK[i % len(_NK)], xdt, act, i % 3 != 1)
    for i, (m, xdt, act) in enumerate(
        (m, xdt, act) for m in (1, 2, 3, 8, 16, 17, 70) for xdt in (BF16, FP16, FP32) for act in (None, E4)
    )
] + [
    (3, 100, 224, FP32, (E5M2, ScaleRule.EVEN), False),  # E5M2 activations
    (2, 33, 160, BF16, (E4M3, ScaleRule.MSE), True),  # MSE: gemv and gemm round X first
    (8, 40, 384, FP16, (E4M3, ScaleRule.MSE), True),  # decode_f8 takes MSE at K % 128 == 0 only
    (16, 100, 96, BF16, (E4M3, ScaleRule.FLOOR), False),
]
# Prefill sizes on a GPU only (the interpreter would take minutes): M >= PREFILL_WS_MIN_M with
# enough [256, 128] tiles to fill an H100 / H200, where prefill_ws runs.
GPU_CASES = [
    (2050, 4100, 224, BF16, None, True),
    (1100, 8200, 160, FP32, E4, False),
]
_SHORT = {BF16: "bf16", FP16: "fp16", FP32: "fp32"}
# On a GPU every row runs on it with the real capability: a GPU test.
_ROW_MARKS = [pytest.mark.gpu] if CUDA else []


def _case_id(m, n, k, xdt, act, bias):
    a = "w8a16" if act is None else f"{act[0].name}-{act[1].value}"
    return f"{m}x{n}x{k}-{_SHORT[xdt]}-{a}" + ("-bias" if bias else "")


def _rows():
    for name in L.names():
        for case in CASES:
            yield pytest.param(name, *case, id=f"{name}-{_case_id(*case)}", marks=_ROW_MARKS)
        for case in GPU_CASES:
            yield pytest.param(name, *case, id=f"{name}-{_case_id(*case)}", marks=[gpu, pytest.mark.gpu])


def target_problem(m, n, k, xdt, act_elem, act_rule, device: torch.device) -> dispatch.LinearProblem:
    """The problem as the device that runs the paths sees it: a GPU's real capability and SM
    count; for the interpreter an sm_90 with 132 SMs (it runs every plain Triton kernel)."""
    if device.type == "cuda":
        return dispatch.LinearProblem.of(m, n, k, xdt, act_elem, act_rule, 32, device, triton=True)
    return dispatch.LinearProblem(m, n, k, xdt, act_elem, act_rule, 32, (9, 0), 132, True, device)


@pytest.mark.parametrize("name,m,n,k,xdt,act,has_bias", list(_rows()))
def test_every_path_matches_reference(name, m, n, k, xdt, act, has_bias):
    path = L[name]
    if INTERPRET and path.gluon is not None:
        pytest.skip(f"{name}: Gluon kernels do not run in the Triton interpreter (tests/test_sass_dev.py compiles them)")
    if INTERPRET and name == "dot_scaled":
        pytest.skip("dot_scaled: the Triton interpreter does not run tl.dot_scaled")
    act_elem, act_rule = act if act is not None else (None, ScaleRule.RCEIL)
    p = target_problem(m, n, k, xdt, act_elem, act_rule, torch.device(DEV))
    if not path.supports(p):
        where = "the interpreter (as sm_90)" if INTERPRET else f"sm_{p.capability[0]}{p.capability[1]}"
        pytest.skip(f"{name} does not take this problem on {where}")
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w, ws, w64 = mx_weight(n, k, E5M2 if (m + n) % 2 else E4M3, gen)
    x = activations(m, k, xdt, gen, special=False, decades=(-2, 1))
    bias = torch.randn(n, generator=gen).to(xdt).to(DEV) if has_bias else None
    y = dispatch.run_path(name, x, w, ws, bias, act_elem=act_elem, act_rule=act_rule)
    ref = mx_linear_reference(x, w, ws, bias, act_elem=act_elem, act_rule=act_rule)
    assert y.dtype == xdt and y.shape == (m, n)
    assert_gemm_close(y, x, w64, bias, act_elem, act_rule, acc_rel=path_acc(name), ref=ref)


def test_run_path_keeps_leading_dims_floor_and_mse():
    """3-D X through the named paths (and mx_linear asked for one by name), FLOOR and MSE rounding of
    E5M2 activations."""
    gen = torch.Generator().manual_seed(5)
    n, k = 48, 128
    w, ws, w64 = mx_weight(n, k, E4M3, gen)
    x = activations(6, k, torch.float32, gen, special=False).reshape(2, 3, k)
    for rule in (ScaleRule.FLOOR, ScaleRule.MSE):
        for name in ("decode_f8", "gemm"):
            y = dispatch.run_path(name, x, w, ws, None, act_elem=E5M2, act_rule=rule)
            assert y.shape == (2, 3, n)
            assert_gemm_close(y, x, w64, None, E5M2, rule, acc_rel=path_acc(name))
    y = dispatch.mx_linear(x, w, ws, None, act_elem="e5m2", act_rule="floor", kernels="gemm")
    assert y.shape == (2, 3, n)
    assert_gemm_close(y, x, w64, None, E5M2, ScaleRule.FLOOR)


def test_mx_linear_on_cpu():
    """On a CPU ``kernels="reference"`` runs the torch reference (same bits); "auto" (the default)
    the ``cpu`` path where its C kernels build (tests/test_cpu_path.py), the reference otherwise."""
    gen = torch.Generator().manual_seed(9)
    w, ws, _ = mx_weight(40, 64, E4M3, gen)
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    b = torch.randn(40, generator=gen).to(torch.bfloat16)
    w, ws = w.cpu(), ws.cpu()
    auto = L["cpu"] if cpu_kernels.available() else L["reference"]
    for act in (None, E4M3):
        ref = mx_linear_reference(x, w, ws, b, act_elem=act)
        torch.testing.assert_close(dispatch.mx_linear(x, w, ws, b, act_elem=act), ref, rtol=2**-7, atol=1e-5)
        assert torch.equal(dispatch.mx_linear(x, w, ws, b, act_elem=act, kernels="reference"), ref)
    assert dispatch.linear_path(3, 40, 64, torch.device("cpu")) is auto
    assert dispatch.path_name(3, 40, 64, torch.device("cpu")) == auto.name
    assert dispatch.linear_path(3, 40, 64, torch.device("cpu"), kernels="reference") is L["reference"]


def test_mx_linear_errors_are_clear():
    w = torch.zeros(8, 64, dtype=torch.float8_e4m3fn)
    s = torch.full((8, 2), 127, dtype=torch.uint8)
    with pytest.raises(ValueError, match="mx_linear needs weight_scale"):
        dispatch.mx_linear(torch.zeros(2, 64), w, None)
    with pytest.raises(ValueError, match=r"kernels='gemv,fastest': unknown kernel path fastest"):
        dispatch.mx_linear(torch.zeros(2, 64), w, s, kernels="gemv,fastest")
    with pytest.raises(KeyError):
        dispatch.run_path("fastest", torch.zeros(2, 64), w, s)


# --------------------------------------------------------------------------------------
# The choice, by identity, for simulated devices
# --------------------------------------------------------------------------------------


def sim(m, n, k, *, act=E4M3, rule=ScaleRule.RCEIL, x_dtype=BF16, cap=(9, 0), sms=132, block_size=32):
    """The problem of a call on a device these tests need not have (default: sm_90, 132 SMs, W8A8
    with E4M3 RCEIL activations, bf16 X)."""
    return dispatch.LinearProblem(m, n, k, x_dtype, act, rule, block_size, cap, sms, True, torch.device("cpu"))


def test_choice_on_sm90():
    """Hopper: the warp-specialized decode GEMM for W8A8 at M <= 16 with K % 128 == 0, the gemv
    for M <= 2 otherwise, fp8 tensor cores (decode_f8) for W8A8 up to M = 16, the register-operand
    prefill where its tiles fill the SMs, the emulation for the rest. Where Gluon does not import
    with the API the kernels use, its paths are never chosen: the next one is."""
    ws_ok, pre_ok = gluon_api.usable("gemm_decode_ws"), gluon_api.usable("gemm_prefill_ws")
    ch = dispatch.choose
    assert ch(sim(1, 4096, 4096)) is (L["decode_ws"] if ws_ok else L["gemv"])
    assert ch(sim(16, 4096, 4096)) is (L["decode_ws"] if ws_ok else L["decode_f8"])
    assert ch(sim(8, 4096, 4096, rule=ScaleRule.MSE)) is (L["decode_ws"] if ws_ok else L["decode_f8"])
    assert ch(sim(1, 4096, 4096, act=None)) is L["gemv"]
    assert ch(sim(2, 4096, 96, act=None, x_dtype=FP32)) is L["gemv"]
    assert ch(sim(1, 4096, 96)) is L["gemv"]  # K % 128 != 0: no decode_ws
    assert ch(sim(8, 4096, 96)) is L["decode_f8"]
    assert ch(sim(8, 4096, 96, rule=ScaleRule.MSE)) is L["gemm"]  # MSE on decode_f8 needs K % 128 == 0
    assert ch(sim(3, 4096, 4096, act=None)) is L["gemm"]
    assert ch(sim(17, 4096, 4096)) is L["gemm"]
    assert ch(sim(256, 4096, 4096)) is L["gemm"] and ch(sim(256, 4096, 4096, act=None)) is L["gemm"]
    assert ch(sim(4096, 4096, 4096, act=None)) is (L["prefill_ws"] if pre_ok else L["gemm"])
    assert ch(sim(4096, 4096, 4096)) is (L["prefill_ws"] if pre_ok else L["gemm"])
    assert ch(sim(4096, 4096, 4096, act=None, x_dtype=FP16)) is L["gemm"]  # W8A16 takes bf16 X only


def test_one_run_signature_and_one_decode_f8_threshold():
    """Every LINEAR path's ``run`` takes the same arguments, producer codes (``x_mx``) included, so
    ``mx_linear`` calls any path the same way; the dispatch's decode_f8 threshold is the one in
    dispatch and stays within what the kernel takes."""
    import inspect

    from mxq.kernels import gemm_decode

    sigs = {p.name: tuple(inspect.signature(p.run).parameters) for p in L}
    assert len(set(sigs.values())) == 1, sigs
    assert sigs["reference"] == ("p", "x2", "weight", "weight_scale", "bias", "out_dtype", "x_mx")
    assert all(inspect.signature(p.run).parameters["x_mx"].default is None for p in L)
    assert dispatch.DECODE_F8_MAX_M <= gemm_decode.MAX_M and not hasattr(gemm_decode, "DECODE_F8_MAX_M")
    assert dispatch.choose(sim(dispatch.DECODE_F8_MAX_M, 4096, 96)) is L["decode_f8"]
    assert dispatch.choose(sim(dispatch.DECODE_F8_MAX_M + 1, 4096, 96)) is L["gemm"]


def test_choice_prefill_ws_rule():
    """M >= PREFILL_WS_MIN_M, block 32, at least one [256, 128] tile per SM: the register-operand
    kernel; fewer tiles (8B o_proj at M = 1024 on 132 SMs), smaller M, other blocks, other devices,
    or a ``kernels`` spec without it: not."""
    pre_ok = gluon_api.usable("gemm_prefill_ws")
    takes = L["prefill_ws"].supports
    m0 = dispatch.PREFILL_WS_MIN_M
    assert takes(sim(2048, 4096, 4096, act=None)) == pre_ok  # 8 x 32 = 256 tiles
    assert takes(sim(1024, 6144, 4096, act=None)) == pre_ok  # 4 x 48 = 192
    assert not takes(sim(1024, 4096, 4096, act=None))  # 4 x 32 = 128 < 132
    assert takes(sim(1024, 4096, 4096, act=None, sms=114)) == pre_ok
    assert not takes(sim(m0 - 1, 57344, 8192, act=None))
    assert not takes(sim(4096, 4096, 4096, act=None, cap=(10, 0)))
    assert not takes(sim(4096, 4096, 4096, act=None, cap=(8, 9)))
    assert not takes(sim(4096, 4096, 4096, act=None, block_size=16))
    assert dispatch.choose(sim(4096, 4096, 4096), "decode_ws,gemv,decode_f8,gemm") is L["gemm"]


def test_choice_on_other_devices():
    ch = dispatch.choose
    sm100 = dict(cap=(10, 0), sms=148)
    assert ch(sim(1, 4096, 4096, **sm100)) is L["dot_scaled"]
    assert ch(sim(4096, 4096, 4096, act=None, **sm100)) is L["dot_scaled"]
    assert ch(sim(1, 4096, 4096, act=None, x_dtype=FP32, **sm100)) is L["gemv"]  # dot_scaled: no fp32 W8A16
    assert ch(sim(256, 4096, 4096, act=None, x_dtype=FP32, **sm100)) is L["gemm"]
    assert ch(sim(8, 4096, 4096, block_size=64, **sm100)) is L["gemm"]  # dot_scaled and decode_f8: block 32 only
    sm89 = dict(cap=(8, 9), sms=128)
    assert ch(sim(1, 4096, 4096, **sm89)) is L["gemv"] and ch(sim(8, 4096, 4096, **sm89)) is L["decode_f8"]
    assert ch(sim(8, 4096, 4096, cap=(8, 0), sms=108)) is L["gemm"]  # no fp8 MMA
    cpu = torch.device("cpu")
    no_triton = dispatch.LinearProblem.of(8, 4096, 4096, BF16, E4M3, ScaleRule.RCEIL, 32, cpu, triton=False)
    cpu_path = L["cpu"] if cpu_kernels.available() else L["reference"]
    assert no_triton.capability == (0, 0) and ch(no_triton) is cpu_path
    assert dispatch.linear_path(1, 4096, 4096, cpu) is cpu_path  # CPU, "auto": the C kernels
    assert ch(no_triton, "reference") is L["reference"]


def test_kernels_argument_restricts_the_choice(monkeypatch):
    ch = dispatch.choose
    assert ch(sim(1, 4096, 4096), "gemv,gemm") is L["gemv"]
    assert ch(sim(8, 4096, 96), "gemv,gemm") is L["gemm"]
    assert ch(sim(8, 4096, 96), " GEMM , gemv ") is L["gemm"]
    assert ch(sim(8, 4096, 96), "decode_f8") is L["decode_f8"]
    assert ch(sim(1, 4096, 4096, act=None), "decode_f8") is L["reference"]  # the reference stays last
    for p in (sim(1, 4096, 4096), sim(4096, 4096, 4096), sim(1, 4096, 4096, cap=(10, 0))):
        assert ch(p, "reference") is L["reference"] and ch(p, "gemm") is L["gemm"]
    for bad in ("gemv,fastest", "fastest"):
        with pytest.raises(ValueError, match="unknown kernel path fastest"):
            ch(sim(1, 64, 64), bad)
        with pytest.raises(ValueError, match="unknown kernel path fastest"):
            dispatch.linear_path(1, 64, 64, torch.device("cpu"), kernels=bad)
        with pytest.raises(ValueError, match="unknown kernel path fastest"):
            dispatch.path_name(1, 64, 64, torch.device("cpu"), kernels=bad)
    dev = torch.device(DEV)
    monkeypatch.setenv("MXQ_KERNELS", "gemm")  # the default spec
    assert dispatch.linear_path(1, 64, 64, dev) is L["gemm"]
    assert dispatch.linear_path(1, 64, 64, dev, kernels="auto") is not L["gemm"]  # an argument wins
    monkeypatch.setenv("MXQ_KERNELS", "gemv,turbo")
    with pytest.raises(ValueError, match=r"MXQ_KERNELS='gemv,turbo': unknown kernel path turbo"):
        dispatch.linear_path(1, 64, 64, dev)


def test_kernels_on_model_layers():
    """``MXLinear(kernels=)`` and ``mxq.set_kernels``: checked when set, passed to each call."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 40))
    mxq.quantize_model(model, "mxfp8", kernels="reference")
    layers = [m for m in model.modules() if isinstance(m, mxq.MXLinear)]
    assert len(layers) == 1 and all(m.kernels == "reference" for m in layers)
    x = torch.randn(3, 64)
    y_ref = model(x)
    mxq.set_kernels(model, " GEMM ")
    assert all(m.kernels == "gemm" for m in layers) and "kernels=gemm" in repr(layers[0])
    torch.testing.assert_close(model(x), y_ref, rtol=1e-4, atol=1e-4)  # the emulation, interpreted
    with pytest.raises(ValueError, match="unknown kernel path fastest"):
        mxq.set_kernels(model, "fastest")
    with pytest.raises(ValueError, match="unknown kernel path fastest"):
        mxq.MXLinear(64, 8, kernels="fastest")
    mxq.set_kernels(model, None)
    assert all(m.kernels is None for m in layers)
    torch.testing.assert_close(model(x), y_ref, rtol=1e-4, atol=1e-4)  # CPU, auto: the cpu path (fp32 sums)


def test_path_name_is_the_chosen_paths_name():
    """What benchmark tables print starts with the name of the path dispatch takes (then its tiles),
    on this machine's device (the interpreter on a CPU: Triton paths only when asked for by name)."""
    dev = torch.device(DEV)
    for m, w8a8 in ((1, True), (2, False), (8, True), (300, False)):
        for spec in (None, "reference", "gemv", "gemm", "gemv,gemm", "decode_f8"):
            path = dispatch.linear_path(m, 100, 256, dev, w8a8=w8a8, kernels=spec)
            name = dispatch.path_name(m, 100, 256, dev, w8a8=w8a8, kernels=spec)
            assert name.split()[0] == path.name and (name == path.name) == (path.config is None), (m, spec, name)
    assert dispatch.linear_path(1, 100, 256, dev, kernels="gemv,gemm") is L["gemv"]
    assert dispatch.linear_path(8, 100, 256, dev, kernels="gemv,gemm") is L["gemm"]
    assert dispatch.linear_path(8, 100, 256, dev, kernels="reference") is L["reference"]
    f8 = dispatch.linear_path(8, 100, 256, dev, kernels="decode_f8")
    assert f8 is (L["decode_f8"] if CUDA and torch.cuda.get_device_capability() >= (8, 9) else L["reference"])
    if not CUDA:
        auto = L["cpu"] if cpu_kernels.available() else L["reference"]
        assert dispatch.linear_path(1, 100, 256, dev) is auto  # "auto" off CUDA


def test_describe_of_simulated_choices(monkeypatch):
    """The config a table prints for the sm_90 paths (their tile rules need the SM count only)."""
    monkeypatch.setattr(WS, "sm_count", lambda device: 132)
    for p in (sim(1, 4096, 4096), sim(8, 4096, 96), sim(4096, 4096, 4096), sim(256, 4096, 4096), sim(1, 4096, 4096, act=None)):
        path = dispatch.choose(p)
        assert path.describe(p).startswith(path.name + " ") or path.describe(p) == path.name
    assert L["decode_ws"].describe(sim(1, 4096, 4096)) == "decode_ws " + WS.describe(WS.rule_decode_ws_config(1, 4096, 4096, None))
    assert L["prefill_ws"].describe(sim(4096, 4096, 4096)) == f"prefill_ws {PWS.PrefillRSConfig()}"


# --------------------------------------------------------------------------------------
# A Gluon kernel that does not compile: the next path, one warning
# --------------------------------------------------------------------------------------


def as_sm90(monkeypatch, sms=132):
    """``mx_linear`` as on an sm_90 GPU with ``sms`` SMs, with fresh Gluon state and no remembered
    choices: CPU tensors run the Triton paths in the interpreter (on a GPU, on it)."""
    monkeypatch.setattr(gluon_api, "DISABLED", {})
    monkeypatch.setattr(gluon_api, "WARNED", set())
    monkeypatch.setattr(gluon_api, "PROBLEM", None)  # as if the API probe had passed
    monkeypatch.setattr(dispatch, "CHOICES", PlanCache())
    of = dispatch.LinearProblem.of
    monkeypatch.setattr(dispatch.LinearProblem, "of", classmethod(
        lambda cls, *a, **kw: of(*a, **kw)._replace(capability=(9, 0), sms=sms, triton=True)))  # fmt: skip


def _compile_error(kind: str) -> Exception:
    if kind == "ptxas":
        return PTXASError("ptxas fatal: unknown instruction 'wgmma.fence.sync.aligned'")
    return CompilationError(None, ast.parse("x").body[0], "unsupported layout in gl.warp_specialize")


def _mxq_warnings(seen) -> list[str]:
    return [str(w.message) for w in seen if str(w.message).startswith("mxq:")]


@pytest.mark.parametrize(
    "gluon_path,module,fn,m,n,k,act,sms,next_path",
    [
        ("decode_ws", WS, "mx_decode_gemm_ws", 1, 40, 256, E4M3, 132, "gemv"),
        ("decode_ws", WS, "mx_decode_gemm_ws", 5, 40, 128, E4M3, 132, "decode_f8"),
        ("prefill_ws", PWS, "mx_prefill_gemm_ws", 1024, 8, 32, None, 1, "gemm"),
    ],
    ids=["decode_ws-gemv", "decode_ws-decode_f8", "prefill_ws-gemm"],
)
@pytest.mark.parametrize("error", ["ptxas", "compile"])
def test_gluon_compile_failure_falls_back_to_the_next_path(monkeypatch, gluon_path, module, fn, m, n, k, act, sms, next_path, error):
    """The Gluon kernel fails to compile at its first launch: one warning naming it and the reason,
    the same call answered by the next path in dispatch order (the reference's function), the
    choice moved for good (no second attempt, no second warning)."""
    as_sm90(monkeypatch, sms)
    tries = []

    def broken(*args, **kwargs):
        tries.append(1)
        raise _compile_error(error)

    monkeypatch.setattr(module, fn, broken)
    gen = torch.Generator().manual_seed(m + n + k)
    w, ws, w64 = mx_weight(n, k, E4M3, gen)
    x = activations(m, k, BF16, gen, special=False, decades=(-2, 1))
    bias = torch.randn(n, generator=gen).to(BF16).to(DEV)
    assert chosen(x, w, act) is L[gluon_path]
    kernel = L[gluon_path].gluon
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        y = dispatch.mx_linear(x, w, ws, bias, act_elem=act)
    msgs = _mxq_warnings(seen)
    assert len(msgs) == 1 and f"{kernel} does not compile" in msgs[0]
    assert ("PTXASError" if error == "ptxas" else "CompilationError") in msgs[0] and "next kernel" in msgs[0]
    assert kernel in gluon_api.DISABLED and chosen(x, w, act) is L[next_path]
    ref = mx_linear_reference(x, w, ws, bias, act_elem=act)
    assert_gemm_close(y, x, w64, bias, act, acc_rel=path_acc(next_path), ref=ref)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        y2 = dispatch.mx_linear(x, w, ws, bias, act_elem=act)
    assert not _mxq_warnings(seen) and len(tries) == 1 and torch.equal(y2, y)


# --------------------------------------------------------------------------------------
# GPU: model shapes through the dispatched path, other X dtypes, graph capture
# --------------------------------------------------------------------------------------


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 16, 17, 64, 100, 256, 2048])
@pytest.mark.parametrize("n,k", [(4096, 4096), (1000, 14336), (6144, 1056)])
def test_gpu_mx_linear(m, n, k):
    gen = torch.Generator().manual_seed(m + n)
    w, ws, w64 = mx_weight(n, k, E4M3, gen)
    x = (torch.randn(m, k, generator=gen)).to(torch.bfloat16).cuda()
    bias = torch.randn(n, generator=gen).to(torch.bfloat16).cuda()
    for act in (None, E4M3):
        y = dispatch.mx_linear(x, w, ws, bias, act_elem=act)
        assert_gemm_close(y, x, w64, bias, act, acc_rel=path_acc(chosen(x, w, act).name))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("xdtype", [torch.float16, torch.float32])
def test_gpu_mx_linear_other_dtypes(xdtype):
    gen = torch.Generator().manual_seed(2)
    w, ws, w64 = mx_weight(1000, 1024, E5M2, gen)
    x = torch.randn(300, 1024, generator=gen).to(xdtype).cuda()
    for act in (None, E4M3):
        y = dispatch.mx_linear(x, w, ws, None, act_elem=act)
        assert_gemm_close(y, x, w64, None, act, acc_rel=path_acc(chosen(x, w, act).name))


@gpu
@pytest.mark.gpu
def test_gpu_cuda_graph_capture():
    gen = torch.Generator().manual_seed(6)
    w, ws, _ = mx_weight(4096, 4096, E4M3, gen)
    for m in (1, 4, 300):
        x = torch.randn(m, 4096, generator=gen).to(torch.bfloat16).cuda()
        y0 = dispatch.mx_linear(x, w, ws, None, act_elem=E4M3)  # compile outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = dispatch.mx_linear(x, w, ws, None, act_elem=E4M3)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, y0), chosen(x, w, E4M3).name


@gpu
@pytest.mark.gpu
def test_gpu_reference_kernels_match_the_torch_reference():
    """``kernels="reference"`` on a GPU is the torch reference, whatever the shape."""
    gen = torch.Generator().manual_seed(7)
    w, ws, _ = mx_weight(1000, 1024, E4M3, gen)
    for m in (1, 300):
        x = torch.randn(m, 1024, generator=gen).to(torch.bfloat16).cuda()
        y = dispatch.mx_linear(x, w, ws, None, act_elem=E4M3, kernels="reference")
        assert torch.equal(y, mx_linear_reference(x, w, ws, None, act_elem=E4M3))
        assert chosen(x, w, E4M3, kernels="reference") is L["reference"]

