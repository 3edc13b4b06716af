"""The CPU path of ``mx_linear``: a small C library built once per machine and loaded with ctypes.

The torch reference (``reference.mx_linear_reference``) dequantizes the whole weight to float32 on
every call, which makes an MXFP8 model's decode step on a CPU several times slower than the same
model in bf16. This path computes the same function without a full-precision copy of the weight:

- **Activations** (W8A8): X is rounded to MX along K by ``mxq_quant_rows``, the bit-level
  transcription of ``formats.quantize_mx`` (FLOOR, RCEIL and EVEN rules; MSE goes through the
  torch reference): the same rounded values and the same bytes (tested).
- **Small M** (M <= ``GEMV_MAX_M``, decoding): a GEMV streams the 1-byte codes and the scales
  and keeps nothing. With AVX512-BF16 and X exact in bf16 (bf16 X, or MX-rounded X: always, but
  for blocks below 2**-117) the codes become bf16 through tables (``mxq_gemv_vbmi``: two byte
  tables, ``vpermt2b``, 64 codes per step, M <= ``VBMI_MAX_M``; ``mxq_gemv_bf16``: a 16-bit
  table, 32 codes per step), each 32-block's products are summed by ``vdpbf16ps`` in float32 and
  multiplied by the block's power-of-two scale, the blocks summed in float32. Otherwise
  (``mxq_gemv``) the codes become float32 through fp16 bits (``vcvtph2ps``), or a 256-entry table
  without AVX-512. Tiny GEMVs run on the calling thread (``GEMV_PARALLEL_MIN``).
- **Large M** (prefill): the weight is dequantized into a temporary (freed after the call) and
  multiplied by torch: bf16 x bf16 with float32 accumulation (oneDNN, AMX where the CPU has it)
  when every operand is exact in bf16 and there is no bias (the reference adds it in float32
  before the cast), else float32 x float32 as the reference does.

Numerics: dequantized weights (E4M3/E5M2 code times a power of two) and MX-rounded activations are
exact in float32 and bf16, and every product of two of them is exact in float32, so the paths and
the reference differ only in the order of the float32 sums: |y - exact| <= 2 K 2**-24 sum|x w|
before the cast to the output dtype (``vdpbf16ps`` also flushes products below 2**-126 to zero:
at most K 2**-126 more). tests/test_cpu_path.py asserts that bound, and bit-equal rounded
activations.

Build: ``library()`` compiles ``SOURCE`` (``kernels/cpu_source.py``) with ``$CC`` (else cc, gcc
or clang) at -O3 -march=native -fopenmp into ``cpu/`` of mxq's cache folder (``mxq.settings``: ``$MXQ_CACHE``,
default ~/.cache/mxq; with ``MXQ_CACHE=off``, a temporary folder of the process), named
by a hash of the source, the compiler and the CPU's flags: once per machine (about 2 s on the
2-core CPU; later processes only load it). OpenMP is the runtime torch already loaded
(libgomp.so.1), with torch's thread count (a compiler without OpenMP, like Apple's clang: one
thread). Without a compiler, or if the build fails, one warning is issued and the registry moves
on to the reference: the same numbers, slower. ``MXQ_CPU_KERNELS=0`` turns the path off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from mxq import settings
from mxq.formats import ScaleRule, fake_quantize_mx
from mxq.kernels.cpu_source import SOURCE
from mxq.kernels.reference import mx_linear_reference

# Largest M the GEMV takes; above it the dequantize + torch matmul (measured: BENCHMARKS.md, "CPU").
GEMV_MAX_M = 16
# Smallest M * N * K a GEMV spreads over torch's threads (every SmolLM2 projection at decode; 2 threads
# on the idle 2-core CPU: 32 tok/s against 23 with decode GEMVs on one thread). A parallel region
# waits for every thread of the team, which costs milliseconds whenever another process holds a core:
# on a loaded machine one thread is faster (BENCHMARKS.md, "CPU").
GEMV_PARALLEL_MIN = 1 << 18
# Largest M for the byte-table (AVX512-VBMI) GEMV; above it the 16-bit-table one (measured: BENCHMARKS.md, "CPU").
VBMI_MAX_M = 2
# Smallest activation scale exponent the bf16 product takes (below it an MX value may be a bf16 subnormal).
BF16_MIN_EXP = -117

FMT = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1}
RULES = {ScaleRule.FLOOR: 0, ScaleRule.RCEIL: 1, ScaleRule.EVEN: 2}
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-fno-fast-math"]


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return shutil.which(cc)
    return None


def cpu_flags() -> str:
    """The processor's feature flags as /proc/cpuinfo lists them (the platform's name elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def native_bf16_matmul(flags: str | None = None) -> bool:
    """Whether this CPU has bf16 matrix instructions: AMX-BF16 or AVX512-BF16 on x86, BF16 on Arm. Without
    them torch computes a bf16 matmul by converting to float32 on the way, slower than float32 itself
    (README, "Two commands", has the measurement)."""
    have = set((cpu_flags() if flags is None else flags).split())
    return bool(have & {"amx_bf16", "avx512_bf16", "bf16"})


def cache_dir() -> Path:
    return settings.cpu_build_dir()


def build(cc: str) -> Path:
    """Compile ``SOURCE`` (or find it compiled): the shared library's path. Raises on failure."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256("\n".join([SOURCE, cc, version, " ".join(FLAGS), cpu_flags(), platform.machine()]).encode())
    out = cache_dir() / f"mxq_cpu_{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / "mxq_cpu.c"
        src.write_text(SOURCE)
        lib = Path(tmp) / out.name
        for flags in (FLAGS, [f for f in FLAGS if f != "-fopenmp"]):  # a compiler without OpenMP: one thread
            r = subprocess.run([cc, *flags, str(src), "-o", str(lib), "-lm"], capture_output=True, text=True, timeout=300)
            if r.returncode == 0:
                break
        else:
            raise RuntimeError(f"{cc} failed: {r.stderr.strip()[-2000:]}")
        os.replace(lib, out)  # atomic: a process building beside this one gets a whole file
    return out


_P, _I64, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (with one warning) where they cannot be built or loaded."""
    if not settings.cpu_kernels():
        return None
    cc = _compiler()
    if cc is None:
        warnings.warn("mxq: no C compiler found ($CC, cc, gcc, clang): MX layers on the CPU run the torch reference "
                      "(same results, slower)", RuntimeWarning, stacklevel=2)  # fmt: skip
        return None
    try:
        lib = ctypes.CDLL(str(build(cc)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        warnings.warn(f"mxq: the CPU kernels did not build ({first}): MX layers on the CPU run the torch reference "
                      "(same results, slower)", RuntimeWarning, stacklevel=2)  # fmt: skip
        return None
    lib.mxq_quant_rows.argtypes = [_P, _I, _I64, _I64, _I64, _I, _I, _P, _P, _P, _P, _I]
    lib.mxq_quant_rows.restype = _I
    lib.mxq_dequant.argtypes = [_P, _P, _I64, _I64, _I64, _I, _P, _P, _I]
    lib.mxq_dequant.restype = None
    lib.mxq_gemv.argtypes = [_P, _I64, _I64, _P, _P, _I64, _I64, _I, _P, _P, _I]
    lib.mxq_gemv.restype = None
    lib.mxq_gemv_bf16.argtypes = [_P, _I64, _I64, _P, _P, _I64, _I, _P, _P, _I]
    lib.mxq_gemv_bf16.restype = _I
    lib.mxq_gemv_vbmi.argtypes = lib.mxq_gemv_bf16.argtypes
    lib.mxq_gemv_vbmi.restype = _I
    return lib


def available() -> bool:
    return library() is not None


def _ptr(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


def _rows_in(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """X as the C code reads it: contiguous bf16 (flag 1) or float32 (flag 0)."""
    if x.dtype == torch.bfloat16:
        return x.contiguous(), 1
    return x.to(torch.float32).contiguous(), 0


def quantize_rows(x: torch.Tensor, elem, rule: ScaleRule, block_size: int = 32, out_dtype: torch.dtype = torch.float32,
                  codes: bool = False):  # fmt: skip
    """Rows of X [M, K] rounded to MX along K (``formats.fake_quantize_mx``; FLOOR, RCEIL, EVEN):
    (values in ``out_dtype`` (float32 or bfloat16, rounded to nearest even as torch casts), fp8
    codes [M, K] and scale bytes [M, K/bs] (``formats.quantize_mx``'s bytes, None unless
    ``codes``), the smallest scale byte of a finite block (255 if none))."""
    xin, in16 = _rows_in(x)
    m, k = xin.shape
    out = torch.empty((m, k), dtype=out_dtype)
    c = torch.empty((m, k), dtype=elem.torch_dtype) if codes else None
    s = torch.empty((m, k // block_size), dtype=torch.uint8) if codes else None
    f32 = out_dtype == torch.float32
    smin = library().mxq_quant_rows(xin.data_ptr(), in16, m, k, block_size, FMT[elem.torch_dtype], RULES[rule],
                                    out.data_ptr() if f32 else None, None if f32 else out.data_ptr(), _ptr(c), _ptr(s),
                                    torch.get_num_threads())  # fmt: skip
    return out, c, s, smin


def dequantize(weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype, block_size: int = 32) -> torch.Tensor:
    """The MX weight [N, K] as a dense ``dtype`` tensor (float32 or bfloat16; exact either way)."""
    n, k = weight.shape
    out = torch.empty((n, k), dtype=dtype)
    f32 = dtype == torch.float32
    library().mxq_dequant(weight.data_ptr(), weight_scale.data_ptr(), n, k, block_size, FMT[weight.dtype],
                          out.data_ptr() if f32 else None, None if f32 else out.data_ptr(), torch.get_num_threads())  # fmt: skip
    return out


def gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
         block_size: int = 32, exact_bf16: bool = False) -> torch.Tensor:  # fmt: skip
    """float32 Y [M, N] = X [M, K] · Wᵀ (+ bias), float32 accumulation. ``exact_bf16``: X is bf16
    (contiguous) and the bf16 dot-product kernel may run (AVX512-BF16, blocks of 32); otherwise X
    is read as float32."""
    lib = library()
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=torch.float32)
    b = bias.to(torch.float32).contiguous() if bias is not None else None
    nt = torch.get_num_threads() if m * n * k >= GEMV_PARALLEL_MIN else 1
    fmt = FMT[weight.dtype]
    if exact_bf16 and block_size == 32:
        kernel = lib.mxq_gemv_vbmi if m <= VBMI_MAX_M else lib.mxq_gemv_bf16
        if kernel(x.data_ptr(), m, k, weight.data_ptr(), weight_scale.data_ptr(), n, fmt, _ptr(b), y.data_ptr(), nt):
            return y
        if lib.mxq_gemv_bf16(x.data_ptr(), m, k, weight.data_ptr(), weight_scale.data_ptr(), n, fmt, _ptr(b), y.data_ptr(), nt):
            return y
    xf = x.to(torch.float32).contiguous()
    lib.mxq_gemv(xf.data_ptr(), m, k, weight.data_ptr(), weight_scale.data_ptr(), n, block_size, fmt, _ptr(b), y.data_ptr(), nt)
    return y


def supports(p) -> bool:
    """A ``dispatch.LinearProblem`` this path runs: on the CPU, where the library built."""
    return (
        p.device.type == "cpu" and p.k % p.block_size == 0 and p.block_size <= 256
        and p.x_dtype in (torch.float32, torch.bfloat16, torch.float16) and available()
    )  # fmt: skip


def run(p, x2, weight, weight_scale, bias, out_dtype, x_mx=None):
    """``mx_linear`` on the CPU (module doc). ``x_mx``: x holds MX-rounded values, taken as given."""
    act = p.act_elem if x_mx is None else None
    if weight.dtype not in FMT or not weight.is_contiguous() or not weight_scale.is_contiguous():
        y = mx_linear_reference(x2, weight, weight_scale, bias, act_elem=act, act_rule=p.act_rule, block_size=p.block_size)
        return y.to(out_dtype)
    bs = p.block_size
    small = p.m <= GEMV_MAX_M
    # X exact in bf16: bf16 input, or MX-rounded with every block exponent >= -117 (smallest value >= 2**-126)
    if act is None:
        x, exact16 = x2, x2.dtype == torch.bfloat16
        if not exact16 and x_mx is not None and x_mx[1].numel():  # MX-rounded by its producer: as rounded here
            exact16 = int(x_mx[1].min()) - 127 >= BF16_MIN_EXP
    elif act_rule_in_c(p.act_rule):
        x, _, _, smin = quantize_rows(x2, act, p.act_rule, bs, torch.bfloat16 if small else torch.float32)
        exact16 = smin - 127 >= BF16_MIN_EXP
        if small and not exact16:
            x, *_ = quantize_rows(x2, act, p.act_rule, bs)
    else:  # MSE: the reference's rounding
        x = fake_quantize_mx(x2.to(torch.float32), -1, act, bs, p.act_rule)
        exact16 = False
    if small:
        x = x.to(torch.bfloat16 if exact16 else torch.float32).contiguous()
        return gemv(x, weight, weight_scale, bias, bs, exact16).to(out_dtype)
    if exact16 and bias is None and out_dtype == torch.bfloat16:  # bf16 x bf16, float32 accumulation
        return (x.to(torch.bfloat16) @ dequantize(weight, weight_scale, torch.bfloat16, bs).t()).to(out_dtype)
    y = x.to(torch.float32) @ dequantize(weight, weight_scale, torch.float32, bs).t()
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(out_dtype)


def act_rule_in_c(rule: ScaleRule) -> bool:
    return rule in RULES


# --- producers (``mxq.runtime.fuse``): their output MX-rounded in one C pass -----------------------------


def _mx_rounded(v: torch.Tensor, elem, block_size: int):
    """``reference._mx_rounded``: (v MX-rounded with RCEIL in v's dtype, fp8 codes [M, K], scale bytes [M, K/bs])."""
    k = v.shape[-1]
    out_dtype = torch.bfloat16 if v.dtype == torch.bfloat16 else torch.float32
    vals, c, s, _ = quantize_rows(v.reshape(-1, k), elem, ScaleRule.RCEIL, block_size, out_dtype, codes=True)
    return vals.to(v.dtype).reshape(v.shape), c, s


def rmsnorm_mx(x: torch.Tensor, weight: torch.Tensor, eps: float, elem, block_size: int = 32):
    """``reference.rmsnorm_mx_reference`` with the rounding in C (same values and bytes)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return _mx_rounded(weight * h.to(x.dtype), elem, block_size)


def add_rmsnorm_mx(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, elem, block_size: int = 32):
    """``reference.add_rmsnorm_mx_reference`` with the rounding in C (same values and bytes)."""
    h = residual + x
    return (h, *rmsnorm_mx(h, weight, eps, elem, block_size))


def silu_mul_mx(gu: torch.Tensor, elem, block_size: int = 32):
    """``reference.silu_mul_mx_reference`` with the rounding in C (same values and bytes)."""
    g, u = gu.chunk(2, dim=-1)
    return _mx_rounded(torch.nn.functional.silu(g) * u, elem, block_size)
