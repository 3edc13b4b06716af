import json, os, sys, torch
sys.path.insert(0, "eval")
from bench_attention import _bench, ROT
from mxq.attention import MXFP8CacheLayer
from mxq.kernels import attention_decode_ws as W
b, hq, hkv, d = 4, 32, 8, 128
res = []
for n in (4096, 8192, 16384, 32768):
    q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16); v = torch.randn_like(k)
    L = MXFP8CacheLayer(); L.update(k, v)
    args = (q, L.k_data, L.k_scale, L.v_data, L.v_scale, n)
    sd = _bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True), graph=True) * 1e3
    row = {"context": n, "sdpa_us": sd}
    for progs, regs in ((264, 128), (396, 80), (330, 80)):
        for wide in (True, False):
            cfg = W.DecodeAttnWSConfig(programs=progs, maxnreg=regs, wide_v=wide)
            us = _bench(lambda: W.mx_attention_decode_ws(*args, qk_rotation=L.rotated, config=cfg), graph=True) * 1e3
            row[f"{progs}/{regs}/{'wide' if wide else 'page'}"] = us
    res.append(row)
    print(n, f"sdpa {sd:.1f}", " ".join(f"{k_}={v_:.1f}({sd / v_:.2f}x)" for k_, v_ in row.items() if "/" in k_), flush=True)
json.dump({"device": torch.cuda.get_device_name(), "rows": res}, open(os.environ["OUT"] + "/ws_ab.json", "w"), indent=1)
