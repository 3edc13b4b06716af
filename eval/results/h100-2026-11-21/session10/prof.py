import cProfile, pstats, torch, time
from mxq.attention import MXFP8CacheLayer
from mxq.kernels.attention import mx_attention_decode
b,hq,hkv,n,d=4,32,8,4096,128
q=torch.randn(b,hq,1,d,device="cuda",dtype=torch.bfloat16)
k=torch.randn(b,hkv,n,d,device="cuda",dtype=torch.bfloat16); v=torch.randn_like(k)
L=MXFP8CacheLayer(); L.update(k,v)
args=(q,L.k_data,L.k_scale,L.v_data,L.v_scale,n)
for var in (None, "gqa"):
    f=lambda: mx_attention_decode(*args, variant=var, qk_rotation=L.rotated, counters=L.decode_counters())
    for _ in range(20): f()
    torch.cuda.synchronize(); t=time.perf_counter()
    for _ in range(200): f()
    torch.cuda.synchronize(); print(var, "eager us/call", (time.perf_counter()-t)/200*1e6)
    pr=cProfile.Profile(); pr.enable()
    for _ in range(200): f()
    torch.cuda.synchronize(); pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(14)
