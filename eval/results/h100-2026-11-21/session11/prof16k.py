import sys, torch
from mxq.attention import MXFP8CacheLayer
from mxq.kernels import attention_decode_ws as W
b, hq, hkv, n, d = 4, 32, 8, 16384, 128
q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
k = torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16); v = torch.randn_like(k)
L = MXFP8CacheLayer(); L.update(k, v)
args = (q, L.k_data, L.k_scale, L.v_data, L.v_scale, n)
for wide in (True, False):
    cfg = W.DecodeAttnWSConfig(wide_v=wide)
    for _ in range(3):
        W.mx_attention_decode_ws(*args, qk_rotation=L.rotated, config=cfg)
torch.cuda.synchronize()
