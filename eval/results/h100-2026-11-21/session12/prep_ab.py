"""Fused K/V pre-pass vs the two kernels (graph GPU time), CPU cost per prefill call."""
import time, torch, triton
from mxq.kernels import attention as A
from mxq.kernels.attention import mx_attention_prefill
g = lambda f: (f(), torch.cuda.synchronize(), triton.testing.do_bench_cudagraph(f, rep=200, return_mode="median"))[2]
for s in (1024, 4096, 16384):
    k, v = (torch.randn(4, 32, s, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    sep = g(lambda: (A.rotate_qk_rows(k, round_to=(A.E4M3, A.ScaleRule.RCEIL), block_d=128), A._round_vt(v, A.E4M3, A.ScaleRule.RCEIL, 128)))
    fus = g(lambda: A._prep_kv(k, v, A.E4M3, A.ScaleRule.RCEIL, 128))
    mb = 4 * k.numel() * 2 / 1e6
    print(f"S={s}: separate {sep*1e3:.1f} us ({mb/sep/1e6:.2f} TB/s), fused {fus*1e3:.1f} us ({mb/fus/1e6:.2f} TB/s)", flush=True)
q, k, v = (torch.randn(1, 4, 64, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for causal in (False, True):
    for _ in range(20): mx_attention_prefill(q, k, v, causal=causal, qk_rotation=True)
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(200): mx_attention_prefill(q, k, v, causal=causal, qk_rotation=True)
    torch.cuda.synchronize(); print(f"host cost causal={causal}: {(time.perf_counter()-t)/200*1e6:.1f} us per call")
for _ in range(20): torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(200): torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
torch.cuda.synchronize(); print(f"SDPA: {(time.perf_counter()-t)/200*1e6:.1f} us per call")
