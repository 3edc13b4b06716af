"""The MX format: blocks of FP8 elements sharing one E8M0 power-of-two scale.

This module is the single source of truth for MX numerics in mxq. It imports only torch,
runs on any device, and is exact: element bytes and scale bytes are fully determined by
the input, the element format, the block size and the scale rule.

Definitions (OCP Microscaling Formats v1.0, with the choices the spec leaves open):

* A block is ``block_size`` consecutive elements along ``axis``. If the axis length is
  not a multiple of ``block_size`` the last block is padded with zeros; the padded
  elements are stored (so the data tensor has whole blocks) and dropped on dequantize.
* The scale is ``2**e`` stored as the E8M0 byte ``e + 127``. Byte 0xFF is NaN.
* ``e`` comes from the block's absolute maximum ``amax`` by the scale rule, then is clamped
  to ``[-126, 127]``: a finite block never gets byte 0, because Triton (up to 3.8) decodes
  E8M0 byte 0 as zero instead of 2**-127 in ``tl.dot_scaled``, which would silently zero the
  block. An all-zero block therefore gets byte 1.
* Elements are ``x / 2**e`` rounded to nearest, ties to even, saturated to ``±max_normal``
  (E4M3 has no infinities; for E5M2 saturation keeps finite inputs finite). Signs survive
  rounding to zero (-0 stays -0, a tiny negative becomes -0).
* A block holding any NaN or ±Inf gets scale byte 0xFF and every element byte is the
  format's canonical NaN: a power-of-two scale cannot be derived from an infinite amax,
  and the spec decodes every element of a NaN-scaled block as NaN anyway.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

__all__ = [
    "ElemFormat",
    "E4M3",
    "E5M2",
    "ELEM_FORMATS",
    "E8M0_BIAS",
    "E8M0_NAN",
    "ScaleRule",
    "MXTensor",
    "quantize_mx",
    "dequantize_mx",
    "fake_quantize_mx",
    "shared_exponents",
    "decode_e8m0",
    "as_elem_format",
    "as_scale_rule",
    "sqnr_db",
]

E8M0_BIAS = 127
E8M0_NAN = 0xFF
# Exponent range of a finite scale. -127 (byte 0) is legal in the spec but excluded, see above.
E8M0_MIN_EXP = -126
E8M0_MAX_EXP = 127


@dataclass(frozen=True)
class ElemFormat:
    """An FP8 element format, as data."""

    name: str
    ebits: int
    mbits: int
    bias: int
    emax: int  # unbiased exponent of the largest normal number
    max_normal: float
    min_normal: float
    min_subnormal: float
    has_inf: bool
    nan_byte: int  # the canonical NaN pattern written by quantize_mx
    torch_dtype: torch.dtype

    def __str__(self) -> str:
        return self.name

    @classmethod
    def fp8(cls, name: str, ebits: int, mbits: int, *, ieee: bool, nan_byte: int, torch_dtype: torch.dtype):
        """An OCP FP8 format from its field widths. ``ieee``: the top exponent field is Inf/NaN
        (E5M2); otherwise only S.1…1.1…1 is NaN, so the top binade stops one step short (E4M3)."""
        bias = 2 ** (ebits - 1) - 1
        emax = 2**ebits - (2 if ieee else 1) - bias  # the largest finite exponent field, unbiased
        top = 2**mbits - (1 if ieee else 2)  # the largest mantissa field there
        return cls(
            name, ebits, mbits, bias, emax, (1 + top / 2**mbits) * 2.0**emax,
            2.0 ** (1 - bias), 2.0 ** (1 - bias - mbits), ieee, nan_byte, torch_dtype,
        )  # fmt: skip


E4M3 = ElemFormat.fp8("e4m3", 4, 3, ieee=False, nan_byte=0x7F, torch_dtype=torch.float8_e4m3fn)  # max 448
E5M2 = ElemFormat.fp8("e5m2", 5, 2, ieee=True, nan_byte=0x7E, torch_dtype=torch.float8_e5m2)  # max 57344
ELEM_FORMATS: dict[str, ElemFormat] = {f.name: f for f in (E4M3, E5M2)}


class ScaleRule(str, enum.Enum):
    """How a block's shared exponent is chosen from its values."""

    FLOOR = "floor"  # OCP v1.0: floor(log2 amax) - emax; may clip the block max (up to 12.5 % for E4M3)
    RCEIL = "rceil"  # ceil(log2(amax / max_normal)): the smallest scale that never clips
    EVEN = "even"  # amax rounded to the element's mantissa width, then floor
    MSE = "mse"  # per-block search of neighbouring exponents for the least squared error

    def __str__(self) -> str:
        return self.value


def as_elem_format(name: str | ElemFormat) -> ElemFormat:
    if isinstance(name, ElemFormat):
        return name
    key = str(name).lower().replace("fp8_", "").replace("float8_", "")
    key = {"e4m3fn": "e4m3"}.get(key, key)
    try:
        return ELEM_FORMATS[key]
    except KeyError:
        raise ValueError(f"unknown element format {name!r}; expected one of {sorted(ELEM_FORMATS)}") from None


def as_scale_rule(name: str | ScaleRule) -> ScaleRule:
    if isinstance(name, ScaleRule):
        return name
    try:
        return ScaleRule(str(name).lower())
    except ValueError:
        raise ValueError(
            f"unknown scale rule {name!r}; expected one of {[r.value for r in ScaleRule]}"
        ) from None


# MSE candidates, as offsets from the RCEIL exponent. A larger exponent than RCEIL is never
# better: RCEIL already avoids clipping and a coarser grid is a subset of the finer one.
MSE_OFFSETS = (0, -1, -2)


@dataclass
class MXTensor:
    """An MX-quantized tensor.

    ``data`` has the input's layout with ``axis`` padded to whole blocks; ``scales`` has the
    same layout with ``axis`` of length ``ceil(shape[axis] / block_size)``.
    """

    data: torch.Tensor  # float8_e4m3fn or float8_e5m2
    scales: torch.Tensor  # uint8, biased E8M0
    shape: torch.Size
    axis: int
    block_size: int
    elem: ElemFormat

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_mx(self, dtype)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scales.numel()


def decode_e8m0(scales: torch.Tensor) -> torch.Tensor:
    """Biased E8M0 bytes -> float32 powers of two (byte 0 -> 2**-127, 0xFF -> NaN)."""
    b = scales.to(torch.int32)
    # Bytes 1..254 are exactly the fp32 bit patterns with that biased exponent and a zero mantissa.
    out = (b << 23).view(torch.float32)
    out = torch.where(b == 0, torch.full_like(out, 2.0**-127), out)
    return torch.where(b == E8M0_NAN, torch.full_like(out, float("nan")), out)


def exp2_f32(e: torch.Tensor) -> torch.Tensor:
    """2**e as float32 for integer e in [-126, 127], built from bits (exact on every backend)."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def _exp2_f64(e: torch.Tensor) -> torch.Tensor:
    """2**e as float64 for integer e in [-1022, 1023], built from bits."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def _rule_exponent(amax: torch.Tensor, elem: ElemFormat, rule: ScaleRule) -> torch.Tensor:
    """Unclamped shared exponent per block for the amax-based rules, from the float32 bit fields.

    amax: float32, >= 0, finite. Integer arithmetic on the exponent and mantissa fields is exact
    on every device (CUDA's float64 ldexp/pow are not). A subnormal amax (< 2**-126) always lands
    below the clamp, so it is treated as exponent -127 with its raw mantissa.
    """
    bits = amax.view(torch.int32)
    f = ((bits >> 23) & 0xFF) - 127  # floor(log2 amax) for normal amax
    mant = bits & 0x7FFFFF  # amax = (1 + mant / 2**23) * 2**f
    if rule is ScaleRule.FLOOR:
        return f - elem.emax
    if rule is ScaleRule.RCEIL or rule is ScaleRule.MSE:
        # amax fits under max_normal * 2**(f - emax) unless its mantissa exceeds max_normal's (1.75).
        max_mant = int((elem.max_normal / 2.0**elem.emax - 1.0) * 2**23)
        return f - elem.emax + (mant > max_mant).to(f.dtype)
    if rule is ScaleRule.EVEN:
        # Round the mantissa half-up to mbits; a carry out of the mantissa moves to the next binade.
        shift = 23 - elem.mbits
        rounded = (mant + (1 << (shift - 1))) >> shift
        return f + (rounded >> elem.mbits) - elem.emax
    raise AssertionError(rule)


def cast_elements(blocks: torch.Tensor, e: torch.Tensor, elem: ElemFormat) -> torch.Tensor:
    """blocks: float32 [..., nb, bs]; e: int [..., nb] in the clamped range -> fp8 [..., nb, bs]."""
    scaled = blocks * exp2_f32(-e).unsqueeze(-1)  # exact: a power of two within fp32 range
    scaled = scaled.clamp(-elem.max_normal, elem.max_normal)
    return scaled.to(elem.torch_dtype)  # round to nearest even


def _to_blocks(x: torch.Tensor, axis: int, block_size: int) -> tuple[torch.Tensor, int]:
    """Move ``axis`` last, pad it with zeros to whole blocks, split it into [nb, block_size]."""
    moved = x.movedim(axis, -1)
    n = moved.shape[-1]
    pad = (-n) % block_size
    if pad:
        moved = torch.nn.functional.pad(moved, (0, pad))
    return moved.reshape(*moved.shape[:-1], -1, block_size), pad


def shared_exponents(
    blocks: torch.Tensor, elem: ElemFormat, rule: ScaleRule
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block shared exponent (clamped, int32) and a mask of non-finite blocks.

    ``blocks``: float32 [..., nb, block_size].
    """
    amax = blocks.abs().amax(dim=-1)  # NaN and Inf propagate into amax
    finite = torch.isfinite(amax)
    safe = torch.where(finite & (amax > 0), amax, torch.ones_like(amax))
    e = _rule_exponent(safe, elem, rule).to(torch.int64)
    # Zero blocks sit at the bottom of the range: any scale decodes them to zero.
    e = torch.where(amax > 0, e, torch.full_like(e, E8M0_MIN_EXP))
    e = e.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)
    if rule is ScaleRule.MSE:
        e = _mse_search(blocks, e, elem)
    return e.to(torch.int32), ~finite


def _mse_search(blocks: torch.Tensor, e_rceil: torch.Tensor, elem: ElemFormat) -> torch.Tensor:
    """Among RCEIL and the next smaller exponents, pick the one with least squared error.

    Ties go to the earlier candidate in MSE_OFFSETS (RCEIL first).
    """
    clean = torch.nan_to_num(blocks, nan=0.0, posinf=0.0, neginf=0.0)
    best_e = e_rceil
    best_err = None
    for off in MSE_OFFSETS:
        e = (e_rceil + off).clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)
        # float64: a block near the float32 maximum dequantizes past it (2**128) and must not become inf.
        q = cast_elements(clean, e, elem).to(torch.float64) * _exp2_f64(e).unsqueeze(-1)
        err = (q - clean.to(torch.float64)).square().sum(dim=-1)
        if best_err is None:
            best_err = err
        else:
            better = err < best_err
            best_e = torch.where(better, e, best_e)
            best_err = torch.where(better, err, best_err)
    return best_e


def _quantize_blocks(blocks: torch.Tensor, elem: ElemFormat, rule: ScaleRule):
    """float32 blocks [..., nb, bs] -> (fp8 elements, exponents, mask of non-finite blocks or None)."""
    e, nonfinite = shared_exponents(blocks, elem, rule)
    if bool(nonfinite.any()):
        blocks = torch.nan_to_num(blocks, nan=0.0, posinf=0.0, neginf=0.0)
    else:
        nonfinite = None
    return cast_elements(blocks, e, elem), e, nonfinite


def _check_input(x: torch.Tensor, block_size: int) -> None:
    if not x.is_floating_point():
        raise TypeError(f"quantize_mx needs a floating-point tensor, got {x.dtype}")
    if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float64):
        raise TypeError(f"quantize_mx takes float32, bfloat16 or float16 input, got {x.dtype}")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if x.dim() == 0:
        raise ValueError("quantize_mx needs at least one dimension")


def _quantize_along(x, axis, elem, block_size, scale_rule):
    """Validate, block ``x`` along ``axis`` and quantize: (elem, axis, fp8 [..., nb, bs], e, nonfinite)."""
    elem = as_elem_format(elem)
    rule = as_scale_rule(scale_rule)
    _check_input(x, block_size)
    axis = axis % x.dim()
    blocks, _ = _to_blocks(x.to(torch.float32), axis, block_size)
    return (elem, axis, *_quantize_blocks(blocks, elem, rule))


def quantize_mx(
    x: torch.Tensor,
    axis: int = -1,
    elem: ElemFormat | str = E4M3,
    block_size: int = 32,
    scale_rule: ScaleRule | str = ScaleRule.RCEIL,
) -> MXTensor:
    """Quantize ``x`` to MX with blocks of ``block_size`` consecutive elements along ``axis``.

    ``axis=-1`` on a [N, K] matrix gives 1x32 tiles; ``axis=0`` gives 32x1 tiles.
    """
    elem, axis, data, e, nonfinite = _quantize_along(x, axis, elem, block_size, scale_rule)
    scales = (e + E8M0_BIAS).to(torch.uint8)
    if nonfinite is not None:
        scales = torch.where(nonfinite, torch.full_like(scales, E8M0_NAN), scales)
        data_u8 = data.view(torch.uint8)
        data_u8 = torch.where(nonfinite.unsqueeze(-1), torch.full_like(data_u8, elem.nan_byte), data_u8)
        data = data_u8.view(elem.torch_dtype)

    data = data.reshape(*data.shape[:-2], -1).movedim(-1, axis)
    scales = scales.movedim(-1, axis)
    return MXTensor(data.contiguous(), scales.contiguous(), x.shape, axis, block_size, elem)


def dequantize_mx(t: MXTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MXTensor -> dense tensor of the original shape (computed in float32, then cast)."""
    vals = t.data.movedim(t.axis, -1).to(torch.float32)
    vals = vals.reshape(*vals.shape[:-1], -1, t.block_size)
    scale = decode_e8m0(t.scales.movedim(t.axis, -1)).unsqueeze(-1)
    out = (vals * scale).reshape(*vals.shape[:-2], -1)
    out = out[..., : t.shape[t.axis]].movedim(-1, t.axis)
    return out.to(dtype).contiguous()


def fake_quantize_mx(
    x: torch.Tensor,
    axis: int = -1,
    elem: ElemFormat | str = E4M3,
    block_size: int = 32,
    scale_rule: ScaleRule | str = ScaleRule.RCEIL,
) -> torch.Tensor:
    """The MX-rounded values of ``x`` in ``x.dtype``: equal to dequantize_mx(quantize_mx(x)).

    Computed without materialising the fp8/E8M0 layout (a test holds the two equal), because
    this is what the reference linear layer runs on every activation.
    """
    _, axis, data, e, nonfinite = _quantize_along(x, axis, elem, block_size, scale_rule)
    vals = data.to(torch.float32) * exp2_f32(e).unsqueeze(-1)
    if nonfinite is not None:
        vals = vals.masked_fill(nonfinite.unsqueeze(-1), float("nan"))
    vals = vals.reshape(*vals.shape[:-2], -1)[..., : x.shape[axis]].movedim(-1, axis)
    return vals.to(x.dtype).contiguous()


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB (inf when exact).

    Sums in float32 (torch reduces pairwise: ~1e-6 relative, ample for a dB figure); a float64
    sum of a float32 tensor costs a conversion pass, which was a quarter of the converter's time.
    """
    ref = ref.float()
    d = ref - approx.float()
    noise = float(torch.dot(d.reshape(-1), d.reshape(-1)))
    signal = float(torch.dot(ref.reshape(-1), ref.reshape(-1)))
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)
