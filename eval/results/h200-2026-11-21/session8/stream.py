"""Session 8: how fast can a TMA loader warp stream an fp8 [N, K] weight? (consumer only waits/arrives)"""
import json, os, sys, itertools
import torch, triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
sys.path.insert(0, "eval")
from bench_gemm import _bench_graph, _copies
OUT = os.environ.get("OUT", "/tmp")

@gluon.jit
def _ld(w_desc, w_smem, ready, empty, n0, k_lo, n_iter, STAGES: gl.constexpr, NBOX: gl.constexpr, BK: gl.constexpr):
    BOXK: gl.constexpr = w_desc.block_type.shape[1]
    for i in range(n_iter):
        s = i % STAGES
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
        bar = ready.index(s)
        mbarrier.expect(bar, NBOX * w_desc.block_type.nbytes)
        for j in gl.static_range(NBOX):
            tma.async_copy_global_to_shared(w_desc, [n0, k_lo + i * BK + j * BOXK], bar, w_smem.index(s * NBOX + j))

@gluon.jit
def _cons(ready, empty, n_iter, STAGES: gl.constexpr):
    for i in range(n_iter):
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        mbarrier.arrive(empty.index(s))

@gluon.jit
def stream_kernel(w_desc, K, K_SPLIT, BN: gl.constexpr, BK: gl.constexpr, NBOX: gl.constexpr, STAGES: gl.constexpr):
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    k_lo = pid_k * K_SPLIT
    n_iter = gl.cdiv(gl.minimum(k_lo + K_SPLIT, K) - k_lo, BK)
    BOXK: gl.constexpr = BK // NBOX
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES * NBOX, BN, BOXK], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    gl.warp_specialize([(_cons, (ready, empty, n_iter, STAGES)),
                        (_ld, (w_desc, w_smem, ready, empty, pid_n * BN, k_lo, n_iter, STAGES, NBOX, BK))], [1], [24])

def run(w, bn, bk, nbox, stages, split, maxnreg):
    n, k = w.shape
    boxk = bk // nbox
    desc = TensorDescriptor(w, list(w.shape), list(w.stride()), [bn, boxk], gl.NVMMASharedLayout.get_default_for([bn, boxk], gl.float8e4nv))
    ks = triton.cdiv(triton.cdiv(k, split), bk) * bk
    grid = (triton.cdiv(n, bn), triton.cdiv(k, ks))
    stream_kernel[grid](desc, k, ks, BN=bn, BK=bk, NBOX=nbox, STAGES=stages, num_warps=4, maxnreg=maxnreg)

res = []
for (n, k) in [(57344, 8192), (4096, 4096), (8192, 28672)]:
    w0 = (torch.randn(n, k, device="cuda") * 0.1).to(torch.float8_e4m3fn)
    ws = [w0.clone() for _ in range(_copies(n * k))]
    nbytes = n * k
    src = torch.empty(n * k // 2, dtype=torch.bfloat16, device="cuda"); dst = torch.empty_like(src)
    cp = _bench_graph([lambda: dst.copy_(src)])
    row0 = dict(n=n, k=k, copy_tbps=2 * nbytes / cp / 1e6)
    print(json.dumps(row0), flush=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for bn, bk, nbox, stages, occ in itertools.product((64, 128, 256), (128, 256, 512), (1, 4), (2, 4, 8), (1, 2)):
        if bk // nbox < 32 or bn * bk * stages > 200 * 1024 or (bk // nbox) > 256:
            continue
        if occ == 2 and bn * bk * stages > 100 * 1024:
            continue
        tiles = triton.cdiv(n, bn)
        split = 1
        while tiles * split * 2 <= occ * sms and k // (split * 2) >= 4 * bk:
            split *= 2
        try:
            us = _bench_graph([lambda w=w: run(w, bn, bk, nbox, stages, split, 128 if occ == 2 else None) for w in ws])
        except Exception as ex:
            print("ERR", bn, bk, nbox, stages, str(ex)[:200]); continue
        r = dict(**row0, bn=bn, bk=bk, nbox=nbox, stages=stages, occ=occ, split=split, us=us, tbps=nbytes / us / 1e6)
        res.append(r); print(json.dumps(r), flush=True)
    del ws
    json.dump(res, open(f"{OUT}/stream.json", "w"), indent=1)
