"""An independent bit-level reference for MX (OCP Microscaling) quantization, numpy only.

Nothing here imports torch or mxq: the element formats are rebuilt from their sign /
exponent / mantissa bit fields, rounding is a search of the sorted table of finite values,
and the shared exponents come from the integer fields of the float32 ``amax``.

Conventions (the ones ``mxq/formats.py`` documents):

* blocks are ``block_size`` consecutive elements along an axis, the last one zero-padded;
* the E8M0 scale byte is ``e + 127`` with ``e`` clamped to ``[-126, 127]``; an all-zero
  block gets ``e = -126`` (byte 1); a block holding NaN or +-Inf gets byte 0xFF and every
  element byte is the format's canonical NaN;
* elements are ``x / 2**e`` rounded to nearest, ties to even, saturated to +-max_normal,
  the sign always kept (a negative value that rounds to zero is 0x80).

Scale rules, for a block with absolute maximum ``amax > 0`` (``emax`` is the unbiased
exponent of the format's largest binade):

* FLOOR: ``floor(log2 amax) - emax``;
* RCEIL: the smallest integer ``e`` with ``amax <= max_normal * 2**e``;
* EVEN: ``floor(log2(amax rounded half-up to mbits mantissa bits)) - emax``;
* MSE: among RCEIL, RCEIL-1, RCEIL-2 (each clamped) the one whose dequantized block has the
  least sum of squared errors, ties to the earlier candidate (errors that are equal to
  within float64 rounding are settled with exact rational arithmetic).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

E8M0_BIAS = 127
E8M0_NAN = 0xFF
EXP_MIN = -126
EXP_MAX = 127
RULES = ("floor", "rceil", "even", "mse")
MSE_OFFSETS = (0, -1, -2)


# --------------------------------------------------------------------------------------
# Element formats, decoded from their bit fields
# --------------------------------------------------------------------------------------


def _decode_byte(b: int, ebits: int, mbits: int, bias: int, ieee_specials: bool) -> float:
    """One byte -> float, from its fields. ``ieee_specials``: all-ones exponent is Inf/NaN
    (E5M2); otherwise only the all-ones exponent with all-ones mantissa is NaN (E4M3 'fn')."""
    sign = -1.0 if (b >> 7) & 1 else 1.0
    exp_field = (b >> mbits) & ((1 << ebits) - 1)
    man_field = b & ((1 << mbits) - 1)
    exp_all_ones = (1 << ebits) - 1
    if ieee_specials and exp_field == exp_all_ones:
        return sign * float("inf") if man_field == 0 else float("nan")
    if not ieee_specials and exp_field == exp_all_ones and man_field == (1 << mbits) - 1:
        return float("nan")
    if exp_field == 0:  # subnormal: 0.m * 2**(1 - bias)
        return sign * float(Fraction(man_field, 1 << mbits) * Fraction(2) ** (1 - bias))
    return sign * float(
        Fraction((1 << mbits) + man_field, 1 << mbits) * Fraction(2) ** (exp_field - bias)
    )


@dataclass(frozen=True)
class RefFormat:
    name: str
    ebits: int
    mbits: int
    bias: int
    ieee_specials: bool
    nan_byte: int
    table: np.ndarray = field(repr=False)  # float64[256], value of every byte
    pos_values: np.ndarray = field(repr=False)  # sorted finite non-negative values
    pos_bytes: np.ndarray = field(repr=False)  # their byte patterns (all < 0x80)

    @property
    def max_normal(self) -> float:
        return float(self.pos_values[-1])

    @property
    def emax(self) -> int:
        """Unbiased exponent of the largest finite value (its binade)."""
        return int(np.frexp(self.max_normal)[1]) - 1

    @property
    def min_subnormal(self) -> float:
        return float(self.pos_values[1])


def _make_format(
    name: str, ebits: int, mbits: int, bias: int, ieee: bool, nan_byte: int
) -> RefFormat:
    table = np.array(
        [_decode_byte(b, ebits, mbits, bias, ieee) for b in range(256)], dtype=np.float64
    )
    pos = np.arange(128)
    finite = np.isfinite(table[:128])
    pos_bytes = pos[finite].astype(np.uint8)
    pos_values = table[:128][finite]
    order = np.argsort(pos_values, kind="stable")
    pos_values, pos_bytes = pos_values[order], pos_bytes[order]
    assert np.all(np.diff(pos_values) > 0), "positive codes must be strictly increasing"
    return RefFormat(name, ebits, mbits, bias, ieee, nan_byte, table, pos_values, pos_bytes)


E4M3 = _make_format("e4m3", 4, 3, 7, ieee=False, nan_byte=0x7F)
E5M2 = _make_format("e5m2", 5, 2, 15, ieee=True, nan_byte=0x7E)
FORMATS = {"e4m3": E4M3, "e5m2": E5M2}


def encode(values: np.ndarray, fmt: RefFormat) -> np.ndarray:
    """float64/float32 array (finite) -> uint8 codes, round to nearest even, saturating.

    The input must already be scaled; NaN is not handled (callers mask NaN blocks).
    """
    v = np.asarray(values, dtype=np.float64)
    neg = np.signbit(v)
    a = np.minimum(np.abs(v), fmt.max_normal)  # saturation
    vals = fmt.pos_values
    hi = np.searchsorted(vals, a, side="left")  # vals[hi] >= a
    hi = np.minimum(hi, len(vals) - 1)
    lo = np.maximum(hi - 1, 0)
    v_lo, v_hi = vals[lo], vals[hi]
    mid = (v_lo + v_hi) * 0.5  # exact: both have few significant bits
    b_lo, b_hi = fmt.pos_bytes[lo], fmt.pos_bytes[hi]
    # exact hits: a == v_hi -> hi (mid < a or a == v_hi == v_lo)
    take_hi = (a > mid) | (a == v_hi)
    tie = (a == mid) & (a != v_hi)
    # On a tie the pattern with the even mantissa LSB (the lowest bit of the byte) wins.
    take_hi = np.where(tie, (b_hi & 1) == 0, take_hi)
    out = np.where(take_hi, b_hi, b_lo).astype(np.uint8)
    return out | (neg.astype(np.uint8) << 7)


def decode(codes: np.ndarray, fmt: RefFormat) -> np.ndarray:
    return fmt.table[np.asarray(codes, dtype=np.uint8)]


# --------------------------------------------------------------------------------------
# Shared exponents from the integer fields of float32 amax
# --------------------------------------------------------------------------------------


def _sig_exp(amax32: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Positive finite float32 -> (sig, f) with amax = sig * 2**(f - 23), sig in [2**23, 2**24)."""
    bits = np.asarray(amax32, dtype=np.float32).view(np.uint32).astype(np.int64)
    exp_field = (bits >> 23) & 0xFF
    man = bits & 0x7FFFFF
    normal = exp_field > 0
    # Subnormal: amax = man * 2**-149; normalise man to 24 bits.
    nbits = np.frexp(np.maximum(man, 1).astype(np.float64))[1].astype(np.int64)  # bit_length
    shift = 24 - nbits
    sig = np.where(normal, man | (1 << 23), man << np.where(normal, 0, shift))
    f = np.where(normal, exp_field - 127, nbits - 1 - 149)
    return sig, f


def rule_exponent(amax32: np.ndarray, fmt: RefFormat, rule: str) -> np.ndarray:
    """Unclamped exponent for positive finite float32 amax (not MSE: that is RCEIL here)."""
    sig, f = _sig_exp(amax32)
    emax = fmt.emax
    if rule == "floor":
        return f - emax
    if rule in ("rceil", "mse"):
        # max_normal * 2**e = 1.m_max * 2**(emax + e): fits at e = f - emax iff
        # sig / 2**23 <= max_normal / 2**emax, checked on integers.
        max_sig = int(Fraction(fmt.max_normal) / Fraction(2) ** emax * (1 << 23))
        return f - emax + (sig > max_sig)
    if rule == "even":
        shift = 23 - fmt.mbits
        r = (sig + (1 << (shift - 1))) >> shift  # round half up to 1 + mbits bits
        return f + (r >= (1 << (fmt.mbits + 1))) - emax
    raise ValueError(rule)


@dataclass
class RefResult:
    elem: np.ndarray  # uint8 [nb, bs]
    scale: np.ndarray  # uint8 [nb]
    # MSE only (all False / empty otherwise): blocks where two candidates with different
    # exponents have float64 errors within 1e-9 relative of the least one, and for each block
    # the exponents whose errors are that close to the least one.
    ambiguous: np.ndarray  # bool [nb]
    acceptable_exps: list[tuple[int, ...]]


def encode_at(blocks: np.ndarray, e: np.ndarray, fmt: RefFormat | str) -> np.ndarray:
    """Element bytes of finite float32 blocks [nb, bs] at the given exponents [nb]."""
    fmt = FORMATS[fmt] if isinstance(fmt, str) else fmt
    x64 = np.asarray(blocks, dtype=np.float32).astype(np.float64)
    return encode(x64 * np.ldexp(1.0, -np.asarray(e, dtype=np.int64))[:, None], fmt)


def _candidate(x64: np.ndarray, e: np.ndarray, fmt: RefFormat):
    """Codes, float64 dequantized values (exact, even above 2**128) and float64 SSE."""
    codes = encode(x64 * np.ldexp(1.0, -e)[:, None], fmt)
    deq = decode(codes, fmt) * np.ldexp(1.0, e)[:, None]
    return codes, deq, np.square(deq - x64).sum(axis=1)


def _exact_error(x: np.ndarray, deq: np.ndarray) -> Fraction:
    total = Fraction(0)
    for xv, dv in zip(x.tolist(), deq.tolist(), strict=True):
        d = Fraction(dv) - Fraction(xv)
        total += d * d
    return total


TIE_RTOL = 1e-9


def _mse_choice(x32: np.ndarray, clean: np.ndarray, e_rceil: np.ndarray, fmt: RefFormat):
    """Exponent per block by exact least squared error; ambiguity mask and tied exponents."""
    nb = x32.shape[0]
    rows = np.arange(nb)
    cands = np.stack([np.clip(e_rceil + off, EXP_MIN, EXP_MAX) for off in MSE_OFFSETS], axis=1)
    res = [_candidate(clean, cands[:, k], fmt) for k in range(len(MSE_OFFSETS))]
    deqs = np.stack([r[1] for r in res], axis=1)  # [nb, 3, bs]
    errs = np.stack([r[2] for r in res], axis=1)  # [nb, 3]
    best = np.zeros(nb, dtype=np.int64)
    ambiguous = np.zeros(nb, dtype=bool)
    tied: dict[int, set[int]] = {}
    for k in range(1, len(MSE_OFFSETS)):
        e_best, e_k = errs[rows, best], errs[:, k]
        # Same exponent, or the same dequantized block: exactly equal errors, the earlier wins.
        same = (cands[:, k] == cands[rows, best]) | (deqs[:, k] == deqs[rows, best]).all(axis=1)
        near = ~same & (np.abs(e_k - e_best) <= TIE_RTOL * np.maximum(e_k, e_best))
        better = ~same & ~near & (e_k < e_best)
        for i in np.nonzero(near)[0]:
            # float64 cannot tell them apart: settle with exact rational arithmetic.
            ex_best = _exact_error(clean[i], deqs[i, best[i]])
            ex_k = _exact_error(clean[i], deqs[i, k])
            better[i] = ex_k < ex_best
            ambiguous[i] = True
            tied.setdefault(int(i), set()).update({int(cands[i, best[i]]), int(cands[i, k])})
        best = np.where(better, k, best)
    return cands[rows, best], ambiguous, tied


def quantize_blocks(blocks: np.ndarray, fmt: RefFormat | str, rule: str) -> RefResult:
    """blocks: float32 [nb, bs] (already padded) -> expected element and scale bytes."""
    fmt = FORMATS[fmt] if isinstance(fmt, str) else fmt
    x32 = np.asarray(blocks, dtype=np.float32)
    nb = x32.shape[0]
    x64 = x32.astype(np.float64)
    finite = np.isfinite(x32).all(axis=1)
    clean = np.where(np.isfinite(x64), x64, 0.0)
    amax = np.abs(clean).max(axis=1).astype(np.float32)
    nonzero = amax > 0
    safe = np.where(nonzero, amax, np.float32(1))
    e = np.where(nonzero, rule_exponent(safe, fmt, rule), EXP_MIN)
    e = np.clip(e, EXP_MIN, EXP_MAX)
    ambiguous = np.zeros(nb, dtype=bool)
    acceptable: list[tuple[int, ...]] = [(int(v),) for v in e]
    if rule == "mse":
        e, ambiguous, tied = _mse_choice(x32, clean, e, fmt)
        ambiguous &= finite
        acceptable = [tuple(sorted(tied[i])) if ambiguous[i] else (int(e[i]),) for i in range(nb)]
    codes = encode(clean * np.ldexp(1.0, -e)[:, None], fmt)
    scale = (e + E8M0_BIAS).astype(np.uint8)
    codes[~finite] = fmt.nan_byte
    scale[~finite] = E8M0_NAN
    return RefResult(codes, scale, ambiguous, acceptable)


def mse_candidate_errors(blocks: np.ndarray, fmt: RefFormat | str) -> tuple[np.ndarray, np.ndarray]:
    """float64 squared errors [nb, 3] of the MSE candidates and their exponents [nb, 3]."""
    fmt = FORMATS[fmt] if isinstance(fmt, str) else fmt
    x32 = np.asarray(blocks, dtype=np.float32)
    x64 = np.where(np.isfinite(x32), x32, 0).astype(np.float64)
    amax = np.abs(x64).max(axis=1).astype(np.float32)
    nonzero = amax > 0
    e = np.where(
        nonzero, rule_exponent(np.where(nonzero, amax, np.float32(1)), fmt, "rceil"), EXP_MIN
    )
    e = np.clip(e, EXP_MIN, EXP_MAX)
    cands = np.stack([np.clip(e + off, EXP_MIN, EXP_MAX) for off in MSE_OFFSETS], axis=1)
    errs = np.stack([_candidate(x64, cands[:, k], fmt)[2] for k in range(3)], axis=1)
    return errs, cands


# --------------------------------------------------------------------------------------
# N-d tensors
# --------------------------------------------------------------------------------------


def to_blocks(x: np.ndarray, axis: int, block_size: int) -> np.ndarray:
    """[..., n along axis, ...] -> float32 [..., nb, block_size] with the axis moved last."""
    m = np.moveaxis(np.asarray(x, dtype=np.float32), axis, -1)
    pad = (-m.shape[-1]) % block_size
    if pad:
        m = np.concatenate([m, np.zeros((*m.shape[:-1], pad), dtype=np.float32)], axis=-1)
    return m.reshape(*m.shape[:-1], -1, block_size)


def quantize(
    x: np.ndarray, fmt: RefFormat | str, rule: str, axis: int = -1, block_size: int = 32
) -> tuple[np.ndarray, np.ndarray]:
    """N-d reference: (element bytes with ``axis`` padded, scale bytes), in x's layout."""
    axis = axis % x.ndim
    blocks = to_blocks(x, axis, block_size)
    lead = blocks.shape[:-2]
    nb = blocks.shape[-2]
    res = quantize_blocks(blocks.reshape(-1, block_size), fmt, rule)
    elem = res.elem.reshape(*lead, nb * block_size)
    scale = res.scale.reshape(*lead, nb)
    return np.moveaxis(elem, -1, axis), np.moveaxis(scale, -1, axis)


def decode_e8m0(b: np.ndarray) -> np.ndarray:
    b = np.asarray(b).astype(np.int64)
    out = np.ldexp(1.0, b - E8M0_BIAS)
    return np.where(b == E8M0_NAN, np.nan, out)


def dequantize(
    elem: np.ndarray, scale: np.ndarray, fmt: RefFormat | str, shape, axis: int, block_size: int
):
    """float64 values of an MX tensor in ``shape`` (exact: no rounding anywhere)."""
    fmt = FORMATS[fmt] if isinstance(fmt, str) else fmt
    axis = axis % len(shape)
    v = np.moveaxis(decode(elem, fmt), axis, -1)
    s = np.moveaxis(decode_e8m0(scale), axis, -1)
    v = v.reshape(*v.shape[:-1], -1, block_size) * s[..., None]
    v = v.reshape(*v.shape[:-2], -1)[..., : shape[axis]]
    return np.moveaxis(v, -1, axis)
