"""The kernel core: what the kernel families (GEMM, attention, the quantizers) share, each written once.

Device facts
- ``INTERPRET`` (read once in ``toolchain``): the Triton CPU interpreter runs the kernels (tests);
  it computes bf16 dots wrongly and runs no PTX, so kernels take the dot dtype as a constexpr and
  use fp32 there. ``TL_DTYPE``: torch float dtypes -> Triton's.
- ``capability(device)``, ``sm_count(device)``: cached per device index (no sync after the first call).

The MX format as the kernels see it
- ``SCALE_BIAS``, ``SCALE_NAN`` (E8M0 bias and NaN byte, as constexprs), ``RULE_ID`` (``ScaleRule``
  -> the ``RULE`` constexpr: FLOOR 0, RCEIL 1, EVEN 2, MSE 3), ``fp8_dtype(elem)``;
- ``hw_cvt(device)``: round with the hardware fp32 -> fp8 conversion; ``pdl_ok(device)``:
  programmatic dependent launch, ``pdl_launch(consts)`` its launch option for a kernel with the
  ``PDL`` constexpr on; the A/B switches ``BIT_ROUNDING`` and ``PDL`` turn them off;
- ``mx_round_consts(elem, rule, device)``: the constexprs of ``mx_round_codes`` /
  ``mx_round_dequant`` (EMAX, MBITS, MAXN, EMIN, RULE, HW_CVT, FP8) for a launch.

Triton helpers (``@triton.jit``; the Gluon kernels call them too)
- ``e8m0_to_f32``: biased E8M0 bytes -> fp32 2**(byte - 127), byte 0 -> 2**-127, byte 255 -> NaN,
  as ``mxq.formats`` decodes them;
- the MX rounding of fp32 blocks [.., NB, 32], bit-identical to ``mxq.formats``: ``pow2_f32``,
  ``mx_fast_exponent`` (the amax rules' scale exponent from the amax bits), ``mx_scaled`` (x / 2**e,
  saturated where the rule can clip), ``round_to_elem`` (round to the element grid by fp32
  arithmetic, no fp8 conversion), ``elem_bits`` (an exact grid value -> its fp8 byte), and the two
  that kernels call: ``mx_round_codes`` (elements, exponents, non-finite mask) and
  ``mx_round_dequant`` (the rounded values);
- ``mma``: acc + a @ b for bf16-exact operands, in fp32 under the interpreter;
- ``gdc_wait``, ``gdc_launch_dependents``, ``gdc_follow`` (both, in that order): programmatic
  dependent launch (griddepcontrol);
- ``fp8_bits_asm``: PTX that moves two fp8 codes into two bf16 bit patterns (no conversion
  instruction); the caller multiplies by the power of two that the move leaves out.

The GEMM host side every MX GEMM shares: ``check_gemm_args``, ``operands_and_output``,
``tma_or_pointer``; the split of K is ``splitk``'s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mxq.formats import E4M3, E8M0_BIAS, E8M0_NAN, ElemFormat, ScaleRule
from mxq.kernels.toolchain import INTERPRET

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # older triton: pointer loads only
    TensorDescriptor = None

TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}

_CAPABILITY: dict[int, tuple[int, int]] = {}
_SM_COUNT: dict[int, int] = {}


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def capability(device: torch.device) -> tuple[int, int]:
    """CUDA compute capability of ``device``; (0, 0) for a non-CUDA device."""
    if device.type != "cuda":
        return (0, 0)
    idx = _index(device)
    if idx not in _CAPABILITY:
        _CAPABILITY[idx] = torch.cuda.get_device_capability(idx)
    return _CAPABILITY[idx]


def sm_count(device: torch.device) -> int:
    idx = _index(device)
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


# ---------------------------------------------------------------------------------------------
# The MX format as the kernels see it
# ---------------------------------------------------------------------------------------------

SCALE_BIAS = tl.constexpr(E8M0_BIAS)
SCALE_NAN = tl.constexpr(E8M0_NAN)
RULE_ID = {ScaleRule.FLOOR: 0, ScaleRule.RCEIL: 1, ScaleRule.EVEN: 2, ScaleRule.MSE: 3}

# A/B switches for tests and tools (not environment variables): round with integer ops only, and
# launch the quantizers without programmatic dependent launch.
BIT_ROUNDING = False
PDL = True


def fp8_dtype(elem: ElemFormat):
    return tl.float8e4nv if elem.mbits == 3 else tl.float8e5


def hw_cvt(device: torch.device) -> bool:
    """Round with the hardware fp32 -> fp8 conversion (cvt.rn.satfinite, sm_89+).

    Not in the interpreter (its fp32 -> fp8 cast is not RNE), nor on older GPUs (emulated), nor
    with ``BIT_ROUNDING`` (the integer route everywhere, for A/B checks).
    """
    if INTERPRET or device.type != "cuda" or BIT_ROUNDING:
        return False
    return capability(device) >= (8, 9)


def pdl_ok(device: torch.device) -> bool:
    """Programmatic dependent launch (griddepcontrol): sm_90+, not the interpreter, ``PDL`` on."""
    if INTERPRET or device.type != "cuda" or not PDL:
        return False
    return capability(device) >= (9, 0)


def pdl_launch(consts: dict) -> dict:
    """The launch option for a kernel whose ``PDL`` constexpr is on: launched behind its predecessor
    (programmatic dependent launch), which it waits for (``gdc_wait``) before reading anything."""
    return {"launch_pdl": True} if consts["PDL"] else {}


def mx_round_consts(elem: ElemFormat | None, rule: ScaleRule | None, device: torch.device) -> dict:
    """The element format's constexprs for ``mx_round_codes`` / ``mx_round_dequant`` (every kernel that rounds).

    ``elem`` None: E4M3's, for a kernel whose rounding is switched off (W8A16). ``rule`` None: no
    ``RULE`` (a kernel with its rule fixed)."""
    elem = elem or E4M3
    consts = dict(
        EMAX=elem.emax, MBITS=elem.mbits, MAXN=elem.max_normal, EMIN=1 - elem.bias,
        HW_CVT=hw_cvt(device), FP8=fp8_dtype(elem),
    )  # fmt: skip
    if rule is not None:
        consts["RULE"] = RULE_ID[rule]
    return consts


# ---------------------------------------------------------------------------------------------
# Triton helpers: E8M0 decode, MX rounding, the exact MMA, PDL
# ---------------------------------------------------------------------------------------------

@triton.jit
def e8m0_to_f32(s):
    """Biased E8M0 bytes (any integer type) -> fp32 2**(s-127); 0 -> 2**-127, 255 -> NaN."""
    si = s.to(tl.int32)
    f = (si << 23).to(tl.float32, bitcast=True)
    f = tl.where(si == 0, 5.877471754111438e-39, f)  # 2**-127, an fp32 subnormal
    return tl.where(si == 255, float("nan"), f)


_INTERP_BF16_RNE = tl.constexpr(INTERPRET)


@triton.jit
def to_out(v, OUT: tl.constexpr):
    """fp32 ``v`` in ``OUT``, rounded to nearest even as the GPU converts. Triton 3.6's interpreter
    truncates fp32 to bf16, which a chain of roundings (a gate) turns into a bias, so there bf16
    is rounded from the bits first."""
    if _INTERP_BF16_RNE and OUT == tl.bfloat16:
        b = v.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        v = b.to(tl.float32, bitcast=True)
    return v.to(OUT)


# gate kinds of ``glu`` (``GATE`` in the MoE kernels)
GATE_NONE, GATE_SILU, GATE_GPT_OSS = 0, 1, 2


@triton.jit
def glu(g, u, OUT: tl.constexpr, GATE: tl.constexpr, alpha, limit):
    """The family's gate on one tile of gate and up products (fp32), rounded to ``OUT`` after every
    step as the model's own gate on the projection's ``OUT`` output computes it: 1 SiLU(g)·u;
    2 gpt-oss's (clamp(u, ±limit) + 1)·g'·σ(α·g') with g' = min(g, limit)."""
    g = to_out(g, OUT).to(tl.float32)
    u = to_out(u, OUT).to(tl.float32)
    if GATE == 1:
        a = to_out(g / (1.0 + tl.exp(-g)), OUT).to(tl.float32)
    else:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        z = to_out(g * alpha, OUT).to(tl.float32)
        a = to_out(g * to_out(1.0 / (1.0 + tl.exp(-z)), OUT).to(tl.float32), OUT).to(tl.float32)
        u = to_out(u + 1.0, OUT).to(tl.float32)
    return to_out(a * u, OUT)


@triton.jit
def pow2_f32(e):
    """2**e as fp32 for integer e in [-126, 127], from bits."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def round_to_elem(v, e, MAXN: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr):
    """v / 2**e rounded to the element grid (RNE, saturated), as an exact fp32 value.

    v fp32 [.., nb, bs], e int32 [.., nb]. Rounds by adding and subtracting a constant whose
    ulp is the grid step of |v|'s binade (fp32 adds round to nearest even), so no fp8
    conversion instruction is involved: the Triton interpreter's fp32->fp8 cast is not RNE.
    """
    a = tl.minimum(tl.abs(v) * pow2_f32(-e)[:, :, None], MAXN)
    k = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) - 127, EMIN)
    c = (((k - MBITS + 23 + 127) << 23) | 0x400000).to(tl.float32, bitcast=True)
    r = (a + c) - c
    # The sign goes back by bits: -0 and values rounding to zero keep it, as in the spec.
    sign = v.to(tl.int32, bitcast=True) & -2147483648
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def elem_bits(r, MBITS: tl.constexpr, EMIN: tl.constexpr, BIAS: tl.constexpr):
    """Exact fp32 value on the element grid -> its fp8 byte (as int32)."""
    rb = r.to(tl.int32, bitcast=True)
    a = tl.abs(r)
    normal = (((rb >> 23) & 0xFF) - 127 + BIAS) << MBITS | ((rb >> (23 - MBITS)) & ((1 << MBITS) - 1))
    sub = (a * (2.0 ** (MBITS - EMIN))).to(tl.int32)
    byte = tl.where(a >= 2.0**EMIN, normal, sub)
    return byte | ((rb >> 24) & 0x80)


@triton.jit
def mx_fast_exponent(xf, EMAX: tl.constexpr, MBITS: tl.constexpr, RULE: tl.constexpr):
    """(exponent int32 [.., NB], non-finite mask [.., NB]) for the amax rules (not MSE).

    The block amax is an integer max over |bits| (NaN and Inf sort above every finite value,
    so one max also finds the non-finite blocks): two integer ops per element instead of the
    finite mask, select and float max of the quantizer's MSE route (``quantize``).
    """
    ab = xf.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    imax = tl.max(ab, axis=2)
    nonfinite = imax >= 0x7F800000
    f = (imax >> 23) - 127
    mant = imax & 0x7FFFFF
    if RULE == 0:  # FLOOR
        e = f - EMAX
    elif RULE == 2:  # EVEN
        e = f - EMAX + (mant >= (0x800000 - (1 << (22 - MBITS)))).to(tl.int32)
    else:  # RCEIL
        e = f - EMAX + (mant > 0x600000).to(tl.int32)
    e = tl.where(imax > 0, e, -126)
    e = tl.minimum(tl.maximum(e, -126), 127)
    return e, nonfinite


@triton.jit
def mx_scaled(xf, e, MAXN: tl.constexpr, RULE: tl.constexpr):
    """x / 2**e (exact: a power of two), saturated to +-MAXN where the rule can clip."""
    s = xf * pow2_f32(-e)[:, :, None]
    if RULE != 1:  # FLOOR and EVEN may put the block max above max_normal; RCEIL never does
        s = tl.minimum(tl.maximum(s, -MAXN), MAXN)
    return s


@triton.jit
def mx_round_codes(
    xf,  # fp32 [BM, NB, BS]
    EMAX: tl.constexpr, MBITS: tl.constexpr, MAXN: tl.constexpr, EMIN: tl.constexpr,
    RULE: tl.constexpr, HW_CVT: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    """xf's MX rounding as (elements r [BM, NB, BS] fp32, exactly on the element grid; scale
    exponents e [BM, NB] int32; non-finite block mask [BM, NB]): the value is r·2**e. Not for MSE.

    HW_CVT rounds with the hardware fp32 -> fp8 conversion (round to nearest even, sm_89+);
    otherwise (interpreter) with the add/subtract trick of ``round_to_elem``.
    """
    e, nonfinite = mx_fast_exponent(xf, EMAX, MBITS, RULE)
    if HW_CVT:
        r = mx_scaled(xf, e, MAXN, RULE).to(FP8, fp_downcast_rounding="rtne").to(tl.float32)
    else:
        r = round_to_elem(xf, e, MAXN, MBITS, EMIN)
    return r, e, nonfinite


@triton.jit
def mx_round_dequant(
    xf,  # fp32 [BM, NB, BS]
    EMAX: tl.constexpr, MBITS: tl.constexpr, MAXN: tl.constexpr, EMIN: tl.constexpr,
    RULE: tl.constexpr, HW_CVT: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    """The MX-rounded values of xf (fp32, exact; NaN for a non-finite block). Not for MSE."""
    r, e, nonfinite = mx_round_codes(xf, EMAX, MBITS, MAXN, EMIN, RULE, HW_CVT, FP8)
    d = r * pow2_f32(e)[:, :, None]
    return tl.where(nonfinite[:, :, None], float("nan"), d)


@triton.jit
def mma(a, b, acc, INTERP: tl.constexpr):
    """acc + a @ b for bf16-exact operands. The interpreter's bf16 dot is wrong (Triton 3.6) and
    its fp32 dot defaults to tf32, so there the same exact values go through an ieee fp32 dot."""
    if INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def masked_max(s, ok, mv, m_i, AXIS: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr):
    """An online-softmax step's scores and maxima (base-2 scores): the user's mask ``mv`` applied
    (bool: drops keys; additive: added, times log2 e), keys outside ``ok`` at -inf. Returns (scores,
    the new running max along ``AXIS``, the max to subtract: 0 where no key has been seen yet)."""
    if HAS_MASK:
        if MASK_BOOL:
            ok = ok & (mv != 0)
        else:
            s = s + mv.to(tl.float32) * 1.4426950408889634
    s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, AXIS))
    return s, m_new, tl.where(m_new == float("-inf"), 0.0, m_new)


@triton.jit
def gdc_wait():
    """Wait for the kernel this one was launched behind (programmatic dependent launch, e.g. the
    X quantizer) to finish and its writes to be visible; a no-op without PDL."""
    tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def gdc_launch_dependents():
    """Let the kernel launched behind this one with programmatic dependent launch start now."""
    tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def gdc_follow():
    """First thing in a kernel of the decode chain (kernels/NOTES.md, "GEMM: decode fixed cost"): let
    the kernel launched behind this one start now (it waits for this one before reading what this
    writes), then wait for the kernel this one was launched behind to finish."""
    gdc_launch_dependents()
    gdc_wait()


def fp8_bits_asm(shift: int, mask: int) -> str:
    """PTX: two fp8 codes (bits 0-15 of $1, element 0 in the low byte) -> two bf16 patterns in $0.
    Each byte moves to the top of its 16-bit half (PRMT), the sign stays, the other 7 bits shift
    right by ``shift`` into bf16's exponent and mantissa fields (``mask``). E4M3: shift 4, mask
    0x07F007F0, a bf16 worth the fp8 value times 2**-120; E5M2: 3, 0x0FE00FE0, times 2**-112."""
    return f"""{{
    .reg .b32 t, u;
    prmt.b32 t, $1, 0, 0x1404;
    shr.b32 u, t, {shift};
    and.b32 u, u, {mask:#010x};
    and.b32 t, t, 0x80008000;
    or.b32 $0, t, u;
    }}"""


# ---------------------------------------------------------------------------------------------
# The GEMM host side
# ---------------------------------------------------------------------------------------------

def check_gemm_args(x, weight, weight_scale, bias, block_size):
    """(M, K) of an MX GEMM call Y = X·dequant(W)ᵀ; a ValueError/TypeError naming what is wrong."""
    if x.dim() != 2:
        raise ValueError(f"mx_gemm takes X as [M, K], got shape {tuple(x.shape)}")
    if x.dtype not in TL_DTYPE:
        raise TypeError(f"X must be bfloat16, float16 or float32, got {x.dtype}")
    if weight.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"MX weight must be float8_e4m3fn or float8_e5m2, got {weight.dtype}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight must be [N, K={x.shape[1]}], got {tuple(weight.shape)}")
    m, k = x.shape
    n = weight.shape[0]
    if k % block_size:
        raise ValueError(f"K={k} must be a multiple of block_size={block_size}")
    if weight_scale.dtype != torch.uint8 or tuple(weight_scale.shape) != (n, k // block_size):
        raise ValueError(
            f"weight_scale must be uint8 [{n}, {k // block_size}], got {weight_scale.dtype} {tuple(weight_scale.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    return m, k


def operands_and_output(x, weight, weight_scale, bias, out_dtype, n):
    """Unit-stride operands and the [M, N] output; ``done`` when M, N or K is 0 (the output is
    then final: empty, or the bias / zeros)."""
    x, weight, weight_scale = (t if t.stride(1) == 1 else t.contiguous() for t in (x, weight, weight_scale))
    m, k = x.shape
    y = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m and n and not k:
        y.zero_() if bias is None else y.copy_(bias.to(y.dtype).expand(m, n))
    return x, weight, weight_scale, y, not (m and n and k)


def tma_or_pointer(t: torch.Tensor, block: list[int], wanted: bool):
    """(used, kernel argument): a host TMA descriptor of ``t`` where asked for and possible
    (16-byte aligned base and row stride, not the interpreter), else ``t`` for pointer loads."""
    ok = (
        wanted and TensorDescriptor is not None and not INTERPRET
        and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
    )  # fmt: skip
    return ok, (TensorDescriptor.from_tensor(t, block) if ok else t)
