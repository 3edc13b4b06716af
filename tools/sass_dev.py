"""Read a kernel's machine code without a GPU (kernels/NOTES.md, "Attention: decode scales ahead, V in pages" and "GEMM: the wgmma register hazard and the pipelined prefill loop").

    python tools/sass_dev.py [--block-n 64] [--warps 2] [--stages 3] [--maxnreg N] [--out DIR]
    python tools/sass_dev.py --kernel gemm [--tile 256x128x64] [--warps 8] [--stages 3]
        [--loop old|zero_dot|peel] [--deq bf16|fp32] [--ptxas PATH] [--out DIR]
    python tools/sass_dev.py --kernel decode_f8 [--tile 16x128x4] [--split-k 4] [--quant-x] [--stages 2]
    python tools/sass_dev.py --kernel decode_ws [--split-k 4] [--stages 2] [--maxnreg 128] [--fuse-x]
    python tools/sass_dev.py --kernel prefill_rs [--stages 4] [--maxnreg 168]
    python tools/sass_dev.py --kernel attn_ws [--stages 4] [--head-dim 128] [--maxnreg 128]
    python tools/sass_dev.py --kernel attn_prefill [--tile 64x64] [--warps 4] [--stages 3] [--pointer-x]

Compiles a kernel for sm_90 on the CPU machine — Triton's compiler, ptxas and ``cuobjdump`` need
no GPU — and prints the registers per thread and, for the main loop (the first backward branch),
the SASS instruction count per warp per iteration with its opcode histogram. ``decode``: the
attention decode kernel (``attention_decode.decode_gqa_kernel``, B=4 Hq=32 Hkv=8 D=128 bf16, E4M3, Q/K
rotation on). ``gemm``: ``gemm.mx_gemm_kernel`` with TMA tiles as the prefill dispatch runs it,
and also the wgmma register hazards in its loop (``wgmma_register_hazards``): registers of a
wgmma's left operand written while that wgmma may still be in flight; ``prefill_rs`` likewise for
the register-operand prefill GEMM (``gemm_prefill_ws``). ``decode_f8``: the fp8
tensor-core decode GEMM (``gemm_decode.mx_decode_f8_kernel``; tile = BLOCK_M x BLOCK_N x blocks per step). ``decode_ws``: its
warp-specialized Gluon version (``gemm_decode_ws``). ``attn_ws``: the warp-specialized attention
decode kernel (``attention_decode_ws``, E4M3 cache, 4 query heads per kv head). ``attn_prefill``:
the exact prefill kernel (``attention_prefill.prefill_kernel``, K/Vᵀ by TMA, or by pointers with --pointer-x). ``--ptxas`` makes Triton use that ptxas
(default: the one mxq's launches choose, ``toolchain.configure_ptxas``: a ptxas >= 13.3 where one is installed). Integer arguments are marked
divisible by 16 the way the launcher specializes them at the benchmark shapes (without it the
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
from mxq.kernels import attention_decode, attention_prefill, toolchain
from mxq.kernels.common import RULE_ID

_PTRS = {
    "Q": "*bf16", "KD": "*fp8e4nv", "KS": "*u8", "VD": "*fp8e4nv", "VS": "*u8",
    "ML": "*fp32", "ACC": "*fp32", "MASK": "*bf16", "ROT": "*bf16", "COUNT": "*i32", "Out": "*bf16",
}  # fmt: skip
# integers that are not multiples of 16 at the benchmark shape (Hkv = 8, 4 K-scale bytes per key)
_NOT_DIV16 = {"Hkv", "stride_ksn", "stride_mb", "stride_mh", "stride_mn"}


def compile_decode(block_n=64, warps=2, stages=3, maxnreg=None, gp=4, block_d=128, fuse_merge=True):
    fn = attention_decode.decode_gqa_kernel
    names = fn.arg_names
    cons = dict(
        GROUP_C=4, GP=gp, BLOCK_N=block_n, BLOCK_D=block_d, MASK_D=False, HAS_MASK=False, MASK_BOOL=False,
        EMAX=E4M3.emax, MBITS=E4M3.mbits, MAXN=E4M3.max_normal, EMIN=1 - E4M3.bias,
        RULE=RULE_ID[ScaleRule.RCEIL], HW_CVT=True, FP8=tl.float8e4nv, INTERP=False,
        QPARTS=1, QM=16, ROT_NB=block_d // 32, stride_qd=1, FUSE_MERGE=fuse_merge, MERGE_CHUNK=16,
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


def _compile_sm90(fn, cons: dict, ptrs: dict, warps: int, stages: int, not_div16=frozenset(), source=ASTSource, **opts):
    """Compile ``fn`` for sm_90: ``cons`` constexprs, ``ptrs`` pointer/descriptor types, every other
    argument i32; integers and pointers marked divisible by 16 (as the launcher specializes them at
    the benchmark shapes) except ``not_div16``. ``source``: GluonASTSource for Gluon kernels;
    ``opts``: more compile options (maxnreg)."""
    names = fn.arg_names
    sig = {n: "constexpr" if n in cons else ptrs.get(n, "i32") for n in names}
    attrs = {
        (names.index(n),): [["tt.divisibility", 16]]
        for n in names
        if (sig[n] == "i32" and n not in not_div16) or sig[n].startswith("*")
    }
    src = source(fn, sig, constexprs={(names.index(k),): v for k, v in cons.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages, **opts))


def compile_gemm(block_m=256, block_n=128, block_k=64, warps=8, stages=3, loop="zero_dot", deq="bf16", tma_x=True, tma_w=True, split_k=1):
    """``mx_gemm_kernel`` for sm_90 as the dispatch launches it (bf16 X, E4M3 W, no bias)."""
    from mxq.kernels import gemm as G

    fn = G.mx_gemm_kernel
    cons = dict(
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BS=32, GROUP=8, DOT=tl.bfloat16, PRECISION="tf32",
        HAS_BIAS=False, SPLIT_K=split_k, EVEN_K=True, TMA_X=tma_x, TMA_W=tma_w, DEQ_BF16=deq == "bf16",
        PEEL=loop == "peel", ZERO_DOT=loop == "zero_dot", QUANT=False,
    )  # fmt: skip
    ptrs = {
        "x_ptr": f"tensordesc<bf16[{block_m}, {block_k}]>" if tma_x else "*bf16",
        "w_ptr": f"tensordesc<fp8e4nv[{block_n}, {block_k}]>" if tma_w else "*fp8e4nv",
        "s_ptr": "*u8", "b_ptr": "*u8", "y_ptr": "*bf16" if split_k == 1 else "*fp32",
    }  # fmt: skip
    return _compile_sm90(fn, cons, ptrs, warps, stages)


def compile_decode_f8(block_m=16, block_n=128, kb=4, warps=4, stages=4, split=4, tma_w=True, fused=True, qx=False):
    """``gemm_decode.mx_decode_f8_kernel`` for sm_90 as mx_decode_gemm launches it (bf16 X, E4M3 W and X)."""
    from mxq.kernels import gemm_decode as G

    fn = G.mx_decode_f8_kernel
    cons = dict(
        BLOCK_M=block_m, BLOCK_N=block_n, KB=kb, BS=32, S32=kb == 4, QX=qx, SPLIT=split, FUSED=fused, HAS_BIAS=False, EVEN_K=True,
        TMA_W=tma_w, EMAX=E4M3.emax, MBITS=E4M3.mbits, MAXN=E4M3.max_normal, EMIN=1 - E4M3.bias,
        RULE=RULE_ID[ScaleRule.RCEIL], HW_CVT=True, FP8=tl.float8e4nv,
    )  # fmt: skip
    ptrs = {
        "x_ptr": "*fp8e4nv" if qx else "*bf16", "xs_ptr": "*u8", "w_ptr": f"tensordesc<fp8e4nv[{block_n}, 32]>" if tma_w else "*fp8e4nv",
        "s_ptr": "*u8", "b_ptr": "*u8", "y_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32",
    }  # fmt: skip
    return _compile_sm90(fn, cons, ptrs, warps, stages, not_div16={"M"})


def compile_decode_ws(block_m=16, stages=2, split=4, box=128, maxnreg=128, loader_regs=24, fuse_x=False, block_n=128):
    """``gemm_decode_ws.mx_decode_ws_kernel`` (Gluon) for sm_90 as mx_decode_gemm_ws launches it
    (E4M3 W and X, bf16 out, no bias, programmatic dependent launch on); ``fuse_x``: bf16 X
    quantized in the kernel (RCEIL)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from mxq.kernels import gemm_decode_ws as W

    cons = dict(BLOCK_N=block_n, BLOCK_M=block_m, STAGES=stages, SPLIT=split, FUSED=True, HAS_BIAS=False,
                LOADER_REGS=loader_regs, BOX=box, PDL=True)  # fmt: skip
    lw = gl.NVMMASharedLayout.get_default_for([block_n, box], gl.float8e4nv)
    lx = gl.NVMMASharedLayout.get_default_for([block_m, box], gl.float8e4nv)
    w_desc = f"tensordesc<fp8e4nv[{block_n}, {box}],{lw!r}>"
    cons.update(FUSE_X=fuse_x, X_FP8=gl.float8e4nv, X_LAYOUT=lx, EMAX=8, MBITS=3, MAXN=448.0, RULE=1)
    ptrs = {
        "w_desc": w_desc, "x_desc": w_desc if fuse_x else f"tensordesc<fp8e4nv[{block_m}, {box}],{lx!r}>",
        "x_ptr": "*bf16", "s_ptr": "*i32", "xs_ptr": "*i32", "b_ptr": "*i32", "y_ptr": "*bf16", "ws_ptr": "*fp32",
        "cnt_ptr": "*i32",
    }  # fmt: skip
    # stages live in the kernel's own ring (STAGES); num_stages is unused by Gluon
    return _compile_sm90(W.mx_decode_ws_kernel, cons, ptrs, 4, 1, not_div16={"M", "stride_xsm4"},
                         source=GluonASTSource, **({"maxnreg": maxnreg} if maxnreg else {}))  # fmt: skip


def compile_prefill_rs(stages=4, maxnreg=168, loader_regs=24, block_x=256, block_w=128, block_k=64, bias=False, out="bf16"):
    """``gemm_prefill_ws.mx_prefill_rs_kernel`` (Gluon; the weight as the register operand) for
    sm_90 as mx_prefill_gemm_ws launches it with a ``PrefillRSConfig`` (bf16 X, E4M3 W)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from mxq.kernels import gemm_prefill_ws as P

    cons = dict(STAGES=stages, GROUP=8, HAS_BIAS=bias, LOADER_REGS=loader_regs, MMA_REGS=240)
    lx = gl.NVMMASharedLayout.get_default_for([block_x, block_k], gl.bfloat16)
    lw = gl.NVMMASharedLayout.get_default_for([block_w, block_k], gl.float8e4nv)
    ls = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
    ptrs = {
        "x_desc": f"tensordesc<bf16[{block_x}, {block_k}],{lx!r}>", "w_desc": f"tensordesc<fp8e4nv[{block_w}, {block_k}],{lw!r}>",
        "s_desc": f"tensordesc<u8[{block_k // 32}, {block_w}],{ls!r}>", "b_ptr": "*bf16", "y_ptr": f"*{out}",
    }  # fmt: skip
    return _compile_sm90(P.mx_prefill_rs_kernel, cons, ptrs, 4, 1, not_div16={"M"},
                         source=GluonASTSource, **({"maxnreg": maxnreg} if maxnreg else {}))  # fmt: skip


def compile_decode_attn_ws(stages=4, d=128, group=4, maxnreg=128, loader_regs=24, fused=True, wide_v=True, qk_fp8=False):
    """``attention_decode_ws.decode_ws_kernel`` (Gluon) for sm_90 as mx_attention_decode_ws launches it
    (E4M3 cache, bf16 out; ``qk_fp8``: the query as fp8 codes)."""
    import torch
    from triton.experimental.gluon._runtime import GluonASTSource

    from mxq.kernels import attention_decode_ws as W

    block_n = W.BLOCK_N
    boxes, lays = W.tma_boxes(block_n, d, torch.float8_e4m3fn, wide_v, torch.float8_e4m3fn if qk_fp8 else torch.float16)
    types = ("fp8e4nv", "u8", "fp8e4nv", "u8", "fp8e4nv" if qk_fp8 else "fp16")
    names = ("k_desc", "ks_desc", "v_desc", "vs_desc", "q_desc")
    ptrs = {n: f"tensordesc<{t}[{box[0]}, {box[1]}],{lay!r}>" for n, t, box, lay in zip(names, types, boxes, lays)}
    ptrs.update(cq_ptr="*fp32", ml_ptr="*fp32", acc_ptr="*fp32", out_ptr="*bf16", cnt_ptr="*i32", qk_scale="fp32")
    cons = dict(STAGES=stages, BLOCK_N=block_n, GROUP_C=group, LOADER_REGS=loader_regs, FUSED=fused)
    return _compile_sm90(W.decode_ws_kernel, cons, ptrs, 4, 1, not_div16={"Hkv", "L", "NSPLIT", "stride_oh"},
                         source=GluonASTSource, **({"maxnreg": maxnreg} if maxnreg else {}))  # fmt: skip


_INS = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)\s*([^;]*);")


def loops(sass: str) -> list[list[tuple[int, str, list[str]]]]:
    """Every loop (a conditional backward branch and its target), as (address, opcode, operands)."""
    seq = []
    for line in sass.splitlines():
        m = _INS.match(line)
        if m:
            seq.append((int(m.group(1), 16), m.group(3), [x.strip() for x in m.group(4).split(",")], m.group(2)))
    found = []
    for addr, op, args, pred in seq:
        target = args[-1].split()[-1] if args and args[-1] else ""
        if op == "BRA" and pred and target.startswith("0x") and int(target, 16) < addr:
            found.append([ins[:3] for ins in seq if int(target, 16) <= ins[0] <= addr])
    return found


def _main_loop(sass: str, contains: str = "") -> list[tuple[int, str, list[str]]]:
    """(address, opcode, operands) of the instructions between the first conditional backward branch
    and its target (the first whose body has an opcode starting with ``contains``, when given:
    "HGMMA" finds the MMA loop of a warp-specialized kernel)."""
    seq = []
    for line in sass.splitlines():
        m = _INS.match(line)
        if m:
            seq.append((int(m.group(1), 16), m.group(3), [x.strip() for x in m.group(4).split(",")], m.group(2)))
    for addr, op, args, pred in seq:
        target = args[-1].split()[-1] if args and args[-1] else ""
        if op == "BRA" and pred and target.startswith("0x") and int(target, 16) < addr:
            body = [ins[:3] for ins in seq if int(target, 16) <= ins[0] <= addr]
            if not contains or any(ins[1].startswith(contains) for ins in body):
                return body
    return []


def wgmma_register_hazards(sass: str, contains: str = "") -> list[tuple[str, str, str]]:
    """Writes to a register of a wgmma's left operand (4 registers, bf16 m64nNk16) while that wgmma
    may still be in flight, in the main loop run twice (the second pass sees the state the loop
    carries). HGMMAs up to one marked ``gsb0`` form a group (a ``wgmma.commit_group``);
    ``WARPGROUP.DEPBAR.LE gsb0, N`` waits until at most N groups, the newest, are in flight. PTX
    calls such a write undefined behaviour; it is the hazard ptxas < 13.3 leaves in pipelined
    register-operand loops (triton-lang/triton#9433)."""
    body = _main_loop(sass, contains)
    groups: collections.deque = collections.deque()  # committed groups: sets of A registers
    open_group: set = set()
    found = []
    for _ in range(2):
        for addr, op, args in body:
            if op.startswith("HGMMA"):
                m = re.match(r"R(\d+)$", args[1]) if len(args) > 1 else None
                if m:
                    open_group |= set(range(int(m.group(1)), int(m.group(1)) + 4))
                if "gsb0" in args:
                    groups.append(open_group)
                    open_group = set()
                continue
            if op.startswith("WARPGROUP.DEPBAR"):
                while len(groups) > int(args[-1], 16):
                    groups.popleft()
                continue
            m = re.match(r"R(\d+)$", args[0]) if args and args[0] else None
            if m and not op.startswith(("ST", "RED", "ATOM", "BAR", "BRA", "SYNCS")):
                r = int(m.group(1))
                regs = {r, r + 1} if (".64" in op or "WIDE" in op) else {r}
                if any(regs & g for g in groups) or regs & open_group:
                    found.append((hex(addr), op, args[0]))
    return found


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)

def compile_prefill_attn(block_m=64, block_n=64, warps=4, stages=3, d=128, tma=True, exact=True, causal=False):
    """``attention_prefill.prefill_kernel`` for sm_90 as ``mx_attention_prefill`` launches it (bf16 Q,
    E4M3 RCEIL, Q/K rotation on, no mask): K and Vᵀ by TMA descriptors or pointer loads."""
    fn = attention_prefill.prefill_kernel
    cons = dict(
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=d, CAUSAL=causal, HAS_MASK=False, MASK_BOOL=False,
        PV_SPLIT=exact, EMAX=E4M3.emax, MBITS=E4M3.mbits, MAXN=E4M3.max_normal, EMIN=1 - E4M3.bias,
        RULE=RULE_ID[ScaleRule.RCEIL], HW_CVT=True, FP8=tl.float8e4nv, INTERP=False, QPARTS=1, TMA=tma,
        stride_qd=1,
    )  # fmt: skip
    ptrs = {
        "Q": "*bf16", "Out": "*bf16", "M": "*bf16", "ROT": "*bf16", "qk_scale": "fp32",
        "K": f"tensordesc<bf16[{block_n}, {d}]>" if tma else "*bf16",
        "VT": f"tensordesc<bf16[{d}, {block_n}]>" if tma else "*bf16",
    }  # fmt: skip
    return _compile_sm90(fn, cons, ptrs, warps, stages, not_div16={"Hq", "GROUP", "Sq", "Sk", "D"})


def main_loop_histogram(sass: str, contains: str = "") -> tuple[int, collections.Counter]:
    """Instruction count and opcode histogram between the first backward branch and its target."""
    ops = collections.Counter(op.split(".")[0] for _, op, _ in _main_loop(sass, contains))
    return sum(ops.values()), ops


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", choices=("decode", "gemm", "decode_f8", "decode_ws", "prefill_rs", "attn_ws", "attn_prefill"), default="decode")
    ap.add_argument("--block-n", type=int, default=None, help="decode: keys per tile (64); decode_ws: weight rows per tile (128)")
    ap.add_argument("--head-dim", type=int, default=128, help="attn_ws: head_dim (64 or 128)")
    ap.add_argument("--tile", default="256x128x64", help="gemm: BLOCK_M x BLOCK_N x BLOCK_K")
    ap.add_argument("--loop", choices=("old", "zero_dot", "peel"), default="zero_dot", help="gemm: accumulator start")
    ap.add_argument("--deq", choices=("bf16", "fp32"), default="bf16", help="gemm: scale multiply in bf16 or fp32")
    ap.add_argument("--split-k", type=int, default=1, help="gemm: K splits (fp32 partials out)")
    ap.add_argument("--quant-x", action="store_true", help="decode_f8: X quantized first (fp8 tiles loaded as they are)")
    ap.add_argument("--pointer-x", action="store_true", help="gemm: activation tiles by pointer loads, not TMA (decode tiles)")
    ap.add_argument("--warps", type=int, default=None, help="default 2 (decode), 8 (gemm)")
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--maxnreg", type=int, default=None)
    ap.add_argument("--merge", choices=("fused", "kernel"), default="fused", help="decode: split merge in the kernel or not")
    ap.add_argument("--fuse-x", action="store_true", help="decode_ws: bf16 X quantized inside the kernel")
    ap.add_argument("--block-m", type=int, default=16, help="decode_ws: activation rows per tile (8 or 16)")
    ap.add_argument("--qk-fp8", action="store_true", help="attn_ws: Q·Kᵀ as fp8 wgmmas on the codes (DecodeAttnWSConfig.qk_fp8)")
    ap.add_argument("--ptxas", default=None, help="assemble with this ptxas instead of Triton's")
    ap.add_argument("--out", default=None, help="folder for k.ttgir, k.ptx, k.sass")
    args = ap.parse_args()
    if args.ptxas:  # before Triton compiles anything: the PTX version it emits follows its ptxas
        os.environ["TRITON_PTXAS_PATH"] = args.ptxas
    else:  # the ptxas mxq's own launches would choose
        toolchain.configure_ptxas()
    out = args.out or tempfile.mkdtemp(prefix="mxq_sass_")
    os.makedirs(out, exist_ok=True)
    if args.kernel == "decode":
        k = compile_decode(args.block_n or 64, args.warps or 2, args.stages, args.maxnreg, fuse_merge=args.merge == "fused")
        unit = f"{args.block_n}-key tile"
    elif args.kernel == "decode_ws":
        k = compile_decode_ws(block_m=args.block_m, stages=args.stages, split=args.split_k, maxnreg=args.maxnreg, fuse_x=args.fuse_x,
                              block_n=args.block_n or 128)
        unit = "128-wide K step (the first backward branch may be the loader warp's loop)"
    elif args.kernel == "attn_ws":
        k = compile_decode_attn_ws(stages=args.stages if args.stages != 3 else 4, d=args.head_dim, maxnreg=args.maxnreg or 128,
                                   qk_fp8=args.qk_fp8)  # fmt: skip
        unit = "64-key tile (the first backward branch may be the loader warp's loop)"
    elif args.kernel == "attn_prefill":
        bm, bn = (int(v) for v in args.tile.split("x")[:2]) if args.tile != "256x128x64" else (64, 64)
        k = compile_prefill_attn(bm, bn, args.warps or 4, args.stages, args.head_dim, tma=not args.pointer_x)
        unit = f"{bn}-key tile"
    elif args.kernel == "prefill_rs":
        k = compile_prefill_rs(stages=args.stages, maxnreg=args.maxnreg or 168)
        unit = "64-wide K step (the MMA warps' loop)"
    elif args.kernel == "decode_f8":
        bm, bn, kb = (int(v) for v in args.tile.split("x"))
        k = compile_decode_f8(bm, bn, kb, args.warps or 4, args.stages, args.split_k, not args.pointer_x, qx=args.quant_x)
        unit = f"{kb * 32}-wide K step"
    else:
        bm, bn, bk = (int(v) for v in args.tile.split("x"))
        k = compile_gemm(bm, bn, bk, args.warps or 8, args.stages, args.loop, args.deq, not args.pointer_x, True, args.split_k)
        unit = f"{bk}-wide K step"
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
    loop = "HGMMA" if args.kernel == "prefill_rs" else ""
    n, ops = main_loop_histogram(sass, loop)
    print(f"registers/thread {regs[0] if regs else '?'}, shared {k.metadata.shared} B, files in {out}")
    print(f"main loop: {n} instructions per warp per {unit}")
    for op, c in ops.most_common(20):
        print(f"  {op:10s} {c}")
    if args.kernel in ("gemm", "prefill_rs"):
        hz = wgmma_register_hazards(sass, loop)
        print(f"wgmma register hazards: {len(hz)}" + (f" (first: {hz[0]})" if hz else ""))


if __name__ == "__main__":
    main()
