"""CPU cost per mx_attention_prefill call (tiny shape, GPU work negligible), with a cProfile."""
import cProfile, pstats, time, torch
from mxq.kernels.attention import mx_attention_prefill
q, k, v = (torch.randn(1, 4, 64, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for causal in (False, True):
    for _ in range(20): mx_attention_prefill(q, k, v, causal=causal, qk_rotation=True)
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(200): mx_attention_prefill(q, k, v, causal=causal, qk_rotation=True)
    torch.cuda.synchronize(); print(f"causal={causal}: {(time.perf_counter()-t)/200*1e6:.1f} us per call (CPU-bound)")
for _ in range(20): torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(200): torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
torch.cuda.synchronize(); print(f"SDPA: {(time.perf_counter()-t)/200*1e6:.1f} us per call")
pr = cProfile.Profile(); pr.enable()
for _ in range(200): mx_attention_prefill(q, k, v, causal=True, qk_rotation=True)
torch.cuda.synchronize(); pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(25)
