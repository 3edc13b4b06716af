import torch, sys
from mxq.attention import MXFP8CacheLayer
from mxq.kernels import attention_decode_ws as W
from mxq.kernels.attention import mx_attention_decode, mx_attention_reference
torch.manual_seed(0)
for (b,hq,hkv,n,d) in [(2,32,8,1000,128),(2,9,3,150,64),(4,32,8,16384,128)]:
    q=torch.randn(b,hq,1,d,device="cuda").float()*2
    k=torch.randn(b,hkv,n,d,device="cuda",dtype=torch.bfloat16); v=torch.randn(b,hkv,n,d,device="cuda",dtype=torch.bfloat16)
    L=MXFP8CacheLayer(); L.update(k,v); kd,vd=L.dequantize()
    want=mx_attention_reference(q, kd, vd, qk_rotation=L.rotated, k_rotated=True)
    args=(q,L.k_data,L.k_scale,L.v_data,L.v_scale,n)
    got=W.mx_attention_decode_ws(*args, qk_rotation=L.rotated); torch.cuda.synchronize()
    tri=mx_attention_decode(*args, variant="gqa", qk_rotation=L.rotated)
    r=lambda a,b: ((a.double()-b.double()).norm()/b.double().norm()).item()
    print(b,hq,hkv,n,d, "ws", r(got,want), "triton", r(tri,want), flush=True)
