"""Read a kernel's machine code without a GPU (kernels/NOTES.md, attention session 4).

    python -m mxq.kernels.sass_dev [--block-n 64] [--warps 2] [--stages 3] [--maxnreg N] [--out DIR]

Compiles the decode kernel (``attention._decode_gqa_kernel``, B=4 Hq=32 Hkv=8 D=128 bf16, E4M3,
Q/K rotation on) for sm_90 on the CPU machine — Triton's compiler and ``cuobjdump`` need no
GPU — and prints the registers per thread and, for the main loop (the first backward branch),
the SASS instruction count per warp per tile with its opcode histogram. Integer arguments are
marked divisible by 16 the way the launcher specializes them at that shape (without it the
compiler cannot prove 16-byte alignment and the code differs from what runs). DIR gets the
TTGIR, PTX and SASS for reading.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from mxq.formats import E4M3, ScaleRule
from mxq.kernels import attention as A
from mxq.kernels.quantize import _RULE_ID

_PTRS = {
    "Q": "*bf16", "KD": "*fp8e4nv", "KS": "*u8", "VD": "*fp8e4nv", "VS": "*u8",
    "ML": "*fp32", "ACC": "*fp32", "MASK": "*bf16", "ROT": "*bf16",
}  # fmt: skip
# integers that are not multiples of 16 at the benchmark shape (Hkv = 8, 4 K-scale bytes per key)
_NOT_DIV16 = {"Hkv", "stride_ksn", "stride_mb", "stride_mh", "stride_mn"}


def compile_decode(block_n=64, warps=2, stages=3, maxnreg=None, gp=4, block_d=128):
    fn = A._decode_gqa_kernel
    names = fn.arg_names
    cons = dict(
        GROUP_C=4, GP=gp, BLOCK_N=block_n, BLOCK_D=block_d, MASK_D=False, HAS_MASK=False, MASK_BOOL=False,
        EMAX=E4M3.emax, MBITS=E4M3.mbits, MAXN=E4M3.max_normal, EMIN=1 - E4M3.bias,
        RULE=_RULE_ID[ScaleRule.RCEIL], HW_CVT=True, FP8=tl.float8e4nv, INTERP=False,
        QPARTS=1, QM=16, ROT_NB=block_d // 32, stride_qd=1,
    )  # fmt: skip
    sig = {n: "constexpr" if n in cons else _PTRS.get(n, "fp32" if n == "qk_scale" else "i32") for n in names}
    attrs = {
        (names.index(n),): [["tt.divisibility", 16]]
        for n in names
        if sig[n] not in ("constexpr", "fp32") and n not in _NOT_DIV16
    }
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in cons.items() if k in names}, attrs=attrs)
    opts = dict(num_warps=warps, num_stages=stages, **({"maxnreg": maxnreg} if maxnreg else {}))
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def main_loop_histogram(sass: str) -> tuple[int, collections.Counter]:
    """Instruction count and opcode histogram between the first backward branch and its target."""
    lines = sass.splitlines()
    ins = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)")
    for line in lines:
        m = re.match(r"\s*/\*([0-9a-f]+)\*/\s+@!?P\d BRA 0x([0-9a-f]+)", line)
        if m and int(m.group(2), 16) < int(m.group(1), 16):
            lo, hi = int(m.group(2), 16), int(m.group(1), 16)
            ops = collections.Counter()
            for other in lines:
                mm = ins.match(other)
                if mm and lo <= int(mm.group(1), 16) <= hi:
                    ops[mm.group(3).split(".")[0]] += 1
            return sum(ops.values()), ops
    return 0, collections.Counter()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--block-n", type=int, default=64)
    ap.add_argument("--warps", type=int, default=2)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--maxnreg", type=int, default=None)
    ap.add_argument("--out", default=None, help="folder for k.ttgir, k.ptx, k.sass")
    args = ap.parse_args()
    k = compile_decode(args.block_n, args.warps, args.stages, args.maxnreg)
    out = args.out or tempfile.mkdtemp(prefix="mxq_sass_")
    os.makedirs(out, exist_ok=True)
    for ext in ("ttgir", "ptx"):
        with open(os.path.join(out, f"k.{ext}"), "w") as f:
            f.write(k.asm[ext])
    cubin = os.path.join(out, "k.cubin")
    with open(cubin, "wb") as f:
        f.write(k.asm["cubin"])
    sass = subprocess.run([_tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True, check=True).stdout
    with open(os.path.join(out, "k.sass"), "w") as f:
        f.write(sass)
    res = subprocess.run([_tool("cuobjdump"), "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
    regs = re.findall(r"REG:(\d+)", res)
    n, ops = main_loop_histogram(sass)
    print(f"registers/thread {regs[0] if regs else '?'}, shared {k.metadata.shared} B, files in {out}")
    print(f"main loop: {n} instructions per warp per {args.block_n}-key tile")
    for op, c in ops.most_common(20):
        print(f"  {op:10s} {c}")


if __name__ == "__main__":
    main()
