"""Which kernel computes ``mx_linear`` for a call: the ordered registry ``LINEAR``.

Every path computes ``mx_linear_reference`` (the contract); the first path whose ``supports``
holds for the call's ``LinearProblem`` runs it (``kernels/registry.py``):

1. ``dot_scaled``  sm_100+: ``tl.dot_scaled``, the native MX MMA (``gemm_dot_scaled``).
2. ``decode_ws``   sm_90 with Gluon, W8A8, 1 <= M <= 16, K % 128 == 0: fp8 tensor cores,
                   warp-specialized (``gemm_decode_ws``).
3. ``gemv``        M <= ``gemv.GEMV_MAX_M``: the CUDA-core weight stream (``gemv``).
4. ``decode_f8``   W8A8 on sm_89+, M <= ``DECODE_F8_MAX_M``: fp8 tensor cores (``gemm_decode``).
5. ``prefill_ws``  sm_90 with Gluon, M >= ``PREFILL_WS_MIN_M``, bf16 X or W8A8, and at least one
                   256 x 128 tile per SM: the register-operand prefill GEMM (``gemm_prefill_ws``).
6. ``gemm``        everything else Triton runs: the exact emulation (``gemm``).
7. ``cpu``         a CPU tensor, where the C kernels of ``kernels/cpu.py`` build: a GEMV on the fp8
                   codes for small M, dequantize + torch matmul above (no resident dense weight).
8. ``reference``   the torch reference: no C compiler, a GPU without Triton, or ``kernels="reference"``.

On a CPU, ``kernels="auto"`` takes ``cpu``; a named Triton path runs there in the Triton
interpreter (``TRITON_INTERPRET=1``, the CPU tests). A Gluon path that fails to compile at its
first launch is turned off for the process and the call takes the next path (``gluon_api``).

Nothing here syncs the host: the choice depends on shapes, dtypes and the device's capability
(the choice is memoized per problem), so ``mx_linear`` can be captured in a CUDA graph once it
has been compiled. The measurements behind the order and the thresholds are in kernels/NOTES.md
(sections "GEMM: ..."), each with its device and date.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mxq.formats import ElemFormat, ScaleRule, as_elem_format, as_scale_rule
from mxq.kernels import cpu as cpu_path
from mxq.kernels.launch import PlanCache, on_input_device
from mxq.kernels.reference import mx_linear_reference
from mxq.kernels.registry import KernelPath, Registry, kernels_spec

try:
    from mxq.kernels import gemm as _gemm
    from mxq.kernels import gemm_decode as _decode
    from mxq.kernels import gemm_decode_ws as _decode_ws
    from mxq.kernels import gemm_dot_scaled as _dot_scaled
    from mxq.kernels import gemm_prefill_ws as _prefill_ws
    from mxq.kernels import gemv as _gemv
    from mxq.kernels import gluon_api
    from mxq.kernels import lanes as _lanes
    from mxq.kernels import launch as _launch
    from mxq.kernels import quantize as _quantize
    from mxq.kernels.common import INTERPRET, capability, sm_count
    from mxq.kernels.launch import cdiv

    HAS_TRITON = True
except ImportError:  # no triton wheel (macOS, Windows): the reference runs everywhere
    HAS_TRITON = INTERPRET = False

# Largest M whose W8A8 the dispatch sends to the fp8 tensor-core decode GEMM (decode_f8; the kernel
# itself takes up to ``gemm_decode.MAX_M``): faster than the emulation up to here, not above; M <= 2
# stays on the CUDA-core gemv, faster at M = 1 on most shapes (kernels/NOTES.md, "GEMM: W8A8 decode
# on fp8 tensor cores").
DECODE_F8_MAX_M = 16
# Smallest M for the register-operand prefill GEMM (prefill_ws): faster than the emulation from here
# on; slower at M <= 512 and where its tiles leave SMs idle, where the emulation splits K
# (kernels/NOTES.md, "GEMM: the register-operand prefill kernel").
PREFILL_WS_MIN_M = 1024


class LinearProblem(NamedTuple):
    """One ``mx_linear`` call as dispatch sees it (host facts only; hashable)."""

    m: int
    n: int
    k: int
    x_dtype: torch.dtype
    act_elem: ElemFormat | None  # None: W8A16 (X used as given)
    act_rule: ScaleRule
    block_size: int
    capability: tuple[int, int]  # (0, 0) off CUDA
    sms: int  # 0 off CUDA
    triton: bool  # Triton runs here: a CUDA device, or the interpreter on a CPU
    device: torch.device

    @classmethod
    def of(cls, m, n, k, x_dtype, act_elem, act_rule, block_size, device: torch.device, triton: bool) -> LinearProblem:
        cuda = device.type == "cuda"
        return cls(m, n, k, x_dtype, act_elem, act_rule, block_size, capability(device) if cuda else (0, 0),
                   sm_count(device) if cuda else 0, triton, device)  # fmt: skip


# --- the paths: supports(p), run(p, x2, weight, weight_scale, bias, out_dtype, x_mx=None), config(p) ---
#
# ``x_mx``: X was MX-rounded by its producer (``mx_linear``'s doc). A path that reads the codes
# (decode_ws, decode_f8) takes them; every other path takes x as given (``_x_as_given``).


def _x_as_given(p: LinearProblem, supports) -> LinearProblem:
    """The problem a path that cannot read producer codes runs when X arrives MX-rounded: W8A16 on
    the rounded values where the path takes that (the same product, X not rounded a second time),
    else ``p`` (RCEIL rounding the rounded values again gives them back)."""
    p16 = p._replace(act_elem=None)
    return p16 if supports(p16) else p


def _dot_scaled_supports(p: LinearProblem) -> bool:
    # dot_scaled cannot take fp32 X in W8A16 nor blocks other than 32
    return p.triton and p.capability[0] >= 10 and p.block_size == 32 and (p.act_elem is not None or p.x_dtype != torch.float32)


def _dot_scaled_run(p, x2, weight, weight_scale, bias, out_dtype, x_mx=None):
    if x_mx is not None:
        p = _x_as_given(p, _dot_scaled_supports)
    xq, xs = x2, None
    if p.act_elem is not None:
        xq, xs = _quantize.quantize_mx_rows(x2, p.act_elem, p.act_rule, p.block_size)
    return _dot_scaled.mx_gemm_dot_scaled(xq, xs, weight, weight_scale, bias, out_dtype=out_dtype)


def _decode_ws_supports(p: LinearProblem) -> bool:
    # ahead of gemv and decode_f8: faster than both on Hopper (kernels/NOTES.md, "GEMM: the decode
    # GEMM warp-specialized in Gluon")
    return p.triton and p.act_elem is not None and p.capability[0] == 9 and _decode_ws.takes(p.m, p.k, p.block_size)


def _decode_ws_run(p, x2, weight, weight_scale, bias, out_dtype, x_mx=None):
    return _decode_ws.mx_decode_gemm_ws(
        x2, weight, weight_scale, bias, act_elem=p.act_elem, act_rule=p.act_rule, out_dtype=out_dtype, x_mx=x_mx
    )


def _gemv_supports(p: LinearProblem) -> bool:
    return p.triton and p.m <= _gemv.GEMV_MAX_M


def _gemv_run(p, x2, weight, weight_scale, bias, out_dtype, x_mx=None):
    if x_mx is not None:
        p = _x_as_given(p, _gemv_supports)
    act_elem = p.act_elem
    if act_elem is not None and p.act_rule is ScaleRule.MSE:  # the kernel rounds amax rules only
        x2 = _quantize.fake_quantize_mx_rows(x2, act_elem, p.act_rule, p.block_size, out_dtype=torch.float32)
        act_elem = None
    return _gemv.mx_gemv(
        x2, weight, weight_scale, bias, out_dtype=out_dtype, block_size=p.block_size, act_elem=act_elem, act_rule=p.act_rule
    )


def _decode_f8_supports(p: LinearProblem) -> bool:
    return (
        p.triton and p.act_elem is not None and p.capability >= (8, 9) and p.block_size == 32
        and p.m <= DECODE_F8_MAX_M and (p.act_rule is not ScaleRule.MSE or p.k % 128 == 0)
    )  # fmt: skip


def _decode_f8_run(p, x2, weight, weight_scale, bias, out_dtype, x_mx=None):
    # reads the producer's codes (x_mx is W8A8 RCEIL, which this path takes)
    return _decode.mx_decode_gemm(x2, weight, weight_scale, bias, act_elem=p.act_elem, act_rule=p.act_rule,
                                  out_dtype=out_dtype, x_mx=x_mx)  # fmt: skip


def _prefill_ws_supports(p: LinearProblem) -> bool:
    if not (p.triton and p.capability[0] == 9 and p.m >= PREFILL_WS_MIN_M):
        return False
    cfg = _prefill_ws.PrefillRSConfig
    return (
        (p.act_elem is not None or p.x_dtype == torch.bfloat16) and _prefill_ws.takes(p.m, p.k, p.block_size)
        and cdiv(p.m, cfg.block_x) * cdiv(p.n, cfg.block_w) >= p.sms
    )  # fmt: skip


def _prefill_ws_run(p, x2, weight, weight_scale, bias, out_dtype, x_mx=None):
    if x_mx is not None:
        p = _x_as_given(p, _prefill_ws_supports)
    if p.act_elem is not None:  # X rounded to MX into bf16 (exact), then the bf16 product
        x2 = _quantize.fake_quantize_mx_rows(x2, p.act_elem, p.act_rule, p.block_size, out_dtype=torch.bfloat16)
    return _prefill_ws.mx_prefill_gemm_ws(x2, weight, weight_scale, bias, out_dtype=out_dtype, block_size=p.block_size)


def _gemm_supports(p: LinearProblem) -> bool:
    return p.triton


def _gemm_quant_inside(p: LinearProblem) -> bool:
    """W8A8 with X rounded inside the emulation kernel (small M, amax rules, where the tile rule says so)."""
    return (
        p.act_elem is not None and p.act_rule is not ScaleRule.MSE and p.m <= _gemm.GEMM_QUANT_MAX_M
        and (p.device.type != "cuda" or _gemm.pick_config(p.m, p.n, p.k, p.device).quant_x)
    )  # fmt: skip


def _gemm_run(p, x2, weight, weight_scale, bias, out_dtype, x_mx=None):
    if x_mx is not None:
        p = _x_as_given(p, _gemm_supports)
    if _gemm_quant_inside(p):
        return _gemm.mx_gemm(
            x2, weight, weight_scale, bias, out_dtype=out_dtype, block_size=p.block_size,
            act_elem=p.act_elem, act_rule=p.act_rule,
        )  # fmt: skip
    if p.act_elem is not None:
        x2 = _quantize.fake_quantize_mx_rows(x2, p.act_elem, p.act_rule, p.block_size, out_dtype=torch.bfloat16)
    return _gemm.mx_gemm(x2, weight, weight_scale, bias, out_dtype=out_dtype, block_size=p.block_size)


def _reference_run(p, x2, weight, weight_scale, bias, out_dtype, x_mx=None):
    if x_mx is not None:
        p = _x_as_given(p, _reference_only)
    y = mx_linear_reference(x2, weight, weight_scale, bias, act_elem=p.act_elem, act_rule=p.act_rule, block_size=p.block_size)
    return y.to(out_dtype)


def _reference_only(p) -> bool:
    return True


_paths = [
    KernelPath("cpu", "CPU: C GEMV on the fp8 codes, dequantize + torch matmul for large M", cpu_path.supports, cpu_path.run),
    KernelPath("reference", "torch reference (dequantize, fp32 matmul)", _reference_only, _reference_run),
]
if HAS_TRITON:
    _paths = [
        KernelPath("dot_scaled", "tl.dot_scaled, native MX MMA (sm_100+)", _dot_scaled_supports, _dot_scaled_run),
        KernelPath("decode_ws", "fp8 MMA decode, warp-specialized (Gluon, sm_90)", _decode_ws_supports, _decode_ws_run,
                   lambda p: _decode_ws.describe(_decode_ws.pick_decode_ws_config(p.m, p.n, p.k, p.device)), gluon="gemm_decode_ws"),
        KernelPath("gemv", "CUDA-core decode gemv", _gemv_supports, _gemv_run,
                   lambda p: _gemv.pick_gemv_config(p.m, p.n, p.k, p.device)),
        KernelPath("decode_f8", "fp8 MMA decode (sm_89+)", _decode_f8_supports, _decode_f8_run,
                   lambda p: _decode.pick_decode_f8_config(p.m, p.n, p.k, p.device)),
        KernelPath("prefill_ws", "register-operand prefill, warp-specialized (Gluon, sm_90)", _prefill_ws_supports,
                   _prefill_ws_run, lambda p: _prefill_ws.pick_prefill_rs_config(p.m, p.n, p.k, p.device), gluon="gemm_prefill_ws"),
        KernelPath("gemm", "exact emulation (bf16 wgmma on dequantized weights)", _gemm_supports, _gemm_run,
                   lambda p: _gemm.pick_config(p.m, p.n, p.k, p.device)),
    ] + _paths  # fmt: skip
LINEAR = Registry("linear", _paths)

CHOICES = PlanCache()  # (problem, kernels spec) -> path, bounded; cleared when a Gluon kernel is turned off


def choose(p: LinearProblem, kernels: str | None = None) -> KernelPath:
    """The path ``mx_linear`` runs ``p`` on (memoized; module doc for ``kernels``)."""
    key = (p, kernels)
    path = CHOICES.get(key)
    if path is None:
        path = CHOICES.put(key, LINEAR.choose(p, kernels))
    return path


def triton_runs(device: torch.device, spec: str) -> bool:
    """Triton runs this call: on a CUDA device; on a CPU only in the interpreter, and only for
    paths asked for by name (``spec`` other than "auto")."""
    return device.type == "cuda" or (INTERPRET and spec != "auto")


@on_input_device
def mx_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    act_elem: ElemFormat | None = None,
    act_rule: ScaleRule = ScaleRule.RCEIL,
    block_size: int = 32,
    kernels: str | None = None,
    x_mx: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Y = X · Wᵀ (+ bias) for an MX weight (fp8 [N, K], ``weight_scale`` uint8 [N, K/block_size]);
    see ``mx_linear_reference`` for the contract. ``kernels``: which paths may run it ("auto",
    "reference" or path names; default ``$MXQ_KERNELS`` or "auto").

    ``x_mx``: X is already MX-rounded (RCEIL, ``act_elem``) by its producer (``producers``): x holds
    the rounded values and ``x_mx`` = (fp8 codes [M, K], scale bytes [M, K/32]). The fp8 decode
    GEMMs read the codes; every other path takes x as it is (W8A16 on rounded values where the path takes
    that: the same product, without rounding X a second time)."""
    if weight_scale is None:
        raise ValueError("mx_linear needs weight_scale (uint8 [N, K / block_size])")
    if act_elem is not None:
        act_elem, act_rule = as_elem_format(act_elem), as_scale_rule(act_rule)
    if x_mx is not None and (act_elem is None or act_rule is not ScaleRule.RCEIL):
        raise ValueError("mx_linear: x_mx (X rounded by its producer) is for W8A8 with RCEIL activations")
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    spec = kernels_spec(kernels)
    if spec == "reference" or (not HAS_TRITON and x.device.type != "cpu"):
        if x_mx is not None:
            act_elem = None  # x holds the MX-rounded values
        y = mx_linear_reference(x2, weight, weight_scale, bias, act_elem=act_elem, act_rule=act_rule, block_size=block_size)
        return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])
    p = LinearProblem.of(x2.shape[0], weight.shape[0], k, x2.dtype, act_elem, act_rule, block_size, x2.device,
                         triton_runs(x2.device, spec))
    if p.capability[0] == 9:
        gluon_api.note_unavailable()
    path = choose(p, spec)
    y = _run(path, p, spec, x2, weight, weight_scale, bias, x.dtype, x_mx)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def linear_lane(x, weight, weight_scale, bias, *, act_elem, act_rule=ScaleRule.RCEIL, block_size=32, kernels=None,
                pre: bool = False):  # fmt: skip
    """A callable ``lane(x, x_mx)`` that computes what ``mx_linear`` computes for calls like this
    one (X of ``x``'s shape, dtype and 16-byte alignment on its device; these weight tensors; these
    options; codes from the producer or not), with the choice, the plan and the weight's
    descriptors made once (``kernels/lanes.py``); None where the call's path has no lane (only
    the Hopper decode GEMM has one), off the GPU, or without direct launches. Call it after one
    ``mx_linear`` call of the same kind, which makes the plan (and compiles the kernel)."""
    if not (HAS_TRITON and x.is_cuda and _launch.FAST) or act_elem is None:
        return None
    act_elem, act_rule = as_elem_format(act_elem), as_scale_rule(act_rule)
    spec = kernels_spec(kernels)
    k = x.shape[-1]
    p = LinearProblem.of(x.numel() // k if k else 0, weight.shape[0], k, x.dtype, act_elem, act_rule, block_size,
                         x.device, triton_runs(x.device, spec))  # fmt: skip
    if choose(p, spec).name != "decode_ws" or "gemm_decode_ws" in gluon_api.DISABLED:
        return None
    return _lanes.lane(x, weight, weight_scale, bias, act_elem, act_rule, x.dtype, block_size, pre)


def _run(path: KernelPath, p, spec, x2, weight, weight_scale, bias, out_dtype, x_mx=None):
    if path.gluon is None:
        return path.run(p, x2, weight, weight_scale, bias, out_dtype, x_mx)

    def fall_back():  # the Gluon kernel is off now: choose again (x holds the rounded values)
        CHOICES.clear()
        q = p if x_mx is None else p._replace(act_elem=None)
        return _run(choose(q, spec), q, spec, x2, weight, weight_scale, bias, out_dtype)

    return gluon_api.run_or_fall_back(path.gluon, lambda: path.run(p, x2, weight, weight_scale, bias, out_dtype, x_mx), fall_back)


def linear_path(m: int, n: int, k: int, device: torch.device, *, w8a8: bool = True, x_dtype=torch.bfloat16,
                block_size: int = 32, kernels: str | None = None) -> KernelPath:  # fmt: skip
    """The path ``mx_linear`` takes for X [m, k] (``x_dtype``) times an [n, k] MX weight on ``device``
    (E4M3 activations rounded with RCEIL when ``w8a8``): what benchmark tables print."""
    spec = kernels_spec(kernels)
    if spec == "reference" or (not HAS_TRITON and torch.device(device).type != "cpu"):
        return LINEAR["reference"]
    return choose(_problem(m, n, k, device, w8a8, x_dtype, block_size, spec), spec)


def _problem(m, n, k, device, w8a8, x_dtype, block_size, spec) -> LinearProblem:
    act = as_elem_format("e4m3") if w8a8 else None
    return LinearProblem.of(m, n, k, x_dtype, act, ScaleRule.RCEIL, block_size, device, triton_runs(device, spec))


def path_name(m: int, n: int, k: int, device: torch.device, w8a8: bool = True, kernels: str | None = None) -> str:
    """``linear_path``'s name and, where the path has a tile rule, its config."""
    spec = kernels_spec(kernels)
    path = linear_path(m, n, k, device, w8a8=w8a8, kernels=spec)
    if path.config is None or not HAS_TRITON:
        return path.name
    return path.describe(_problem(m, n, k, device, w8a8, torch.bfloat16, 32, spec))


def run_path(
    name: str,
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    **options,
) -> torch.Tensor:
    """The registered path ``name`` run on this call directly, whatever dispatch would choose
    (tests run every path against the reference; benchmarks time one). No Gluon fall-back.
    ``options``: ``mx_linear_reference``'s keywords (``act_elem``, ``act_rule``, ``block_size``)."""
    path = LINEAR[name]
    x2, p = _call_problem(x, weight, name, **options)
    y = path.run(p, x2, weight, weight_scale, bias, x.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _call_problem(x, weight, spec: str, act_elem=None, act_rule=ScaleRule.RCEIL, block_size: int = 32):
    """X as rows [M, K] and the ``LinearProblem`` of a call with these activation options."""
    if act_elem is not None:
        act_elem, act_rule = as_elem_format(act_elem), as_scale_rule(act_rule)
    x2 = x.reshape(-1, x.shape[-1])
    return x2, LinearProblem.of(x2.shape[0], weight.shape[0], x2.shape[1], x2.dtype, act_elem, act_rule, block_size,
                                x2.device, triton_runs(x2.device, spec))  # fmt: skip
