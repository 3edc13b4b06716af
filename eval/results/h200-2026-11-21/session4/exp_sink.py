import os, sys, math, time, torch
import mxq
from mxq.models import load_model
from mxq.formats import E4M3, fake_quantize_mx
from mxq.eval.perplexity import make_windows
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
torch.manual_seed(0)
NW = int(sys.argv[1]) if len(sys.argv) > 1 else 2
SEQ = int(sys.argv[2]) if len(sys.argv) > 2 else 2048
model, tok = load_model(None, dtype=torch.float32)
texts = open(os.environ.get("VALID", "../shared/data/wikitext-2/valid.txt")).read()
win = make_windows(tok, texts, SEQ, max_windows=NW)
D = model.config.head_dim if hasattr(model.config, "head_dim") else model.config.hidden_size // model.config.num_attention_heads
def hadamard(n):
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h
g = torch.Generator().manual_seed(1234)
signs = (torch.randint(0, 2, (D,), generator=g) * 2 - 1).float()
R = (signs[:, None] * hadamard(D)) / math.sqrt(D)
H32 = torch.block_diag(*[hadamard(32) / math.sqrt(32)] * (D // 32))
print("R orth err", (R @ R.T - torch.eye(D)).abs().max().item())
MODE = {"q": False, "k": False, "v": False, "rot": None, "kmean": False, "sink": 0}
def attn(module, q, k, v, mask, dropout=0.0, scaling=None, is_causal=None, **kw):
    b, hq, sq, d = q.shape; hkv = k.shape[1]
    qf, kf, vf = q.float(), k.float(), v.float()
    if MODE["kmean"]:
        kf = kf - kf.mean(2, keepdim=True)
    if MODE["rot"] is not None:
        qf = qf @ MODE["rot"]; kf = kf @ MODE["rot"]
    if MODE["q"]: qf = fake_quantize_mx(qf, -1, E4M3, 32)
    k0, v0 = kf.clone(), vf.clone()
    if MODE["k"]: kf = fake_quantize_mx(kf, -1, E4M3, 32)
    if MODE["v"]: vf = fake_quantize_mx(vf, -2, E4M3, 32)
    S0 = MODE["sink"]
    if S0:
        kf[:, :, :S0] = k0[:, :, :S0]; vf[:, :, :S0] = v0[:, :, :S0]
    kf = kf.repeat_interleave(hq // hkv, 1); vf = vf.repeat_interleave(hq // hkv, 1)
    s = (qf @ kf.transpose(-1, -2)) * scaling
    allowed = torch.ones(sq, k.shape[2], dtype=torch.bool).tril()
    s = s.masked_fill(~allowed, float("-inf"))
    o = torch.softmax(s, -1) @ vf
    return o.transpose(1, 2).to(q.dtype).contiguous(), None
AttentionInterface.register("exp", attn); AttentionMaskInterface.register("exp", sdpa_mask)
model.config._attn_implementation = "exp"
for l in model.model.layers: l.self_attn.config._attn_implementation = "exp"
def run():
    lps = []; nll = 0.0; n = 0
    with torch.no_grad():
        for i in range(win.input_ids.shape[0]):
            ids = win.input_ids[i:i+1]
            lp = torch.log_softmax(model(ids).logits.float(), -1)[0, :-1]
            tgt = ids[0, 1:]
            nll += -lp.gather(1, tgt[:, None]).sum().item(); n += tgt.numel()
            lps.append(lp)
    return math.exp(nll / n), lps
Qo, _ = torch.linalg.qr(torch.randn(D, D, generator=torch.Generator().manual_seed(7)))
g2 = torch.Generator().manual_seed(99)
R2 = ((torch.randint(0, 2, (D,), generator=g2) * 2 - 1).float()[:, None] * hadamard(D)) / math.sqrt(D)
variants = [
  ("exact", {}),
  ("qkv+had", dict(q=True, k=True, v=True, rot=R)),
  ("qkv+had+sink1", dict(q=True, k=True, v=True, rot=R, sink=1)),
  ("qkv+had+sink4", dict(q=True, k=True, v=True, rot=R, sink=4)),
  ("qkv+had+sink32", dict(q=True, k=True, v=True, rot=R, sink=32)),
  ("kv+had", dict(k=True, v=True, rot=R)),
  ("kv+had+sink32", dict(k=True, v=True, rot=R, sink=32)),
]
base = None
for name, cfg in variants:
    t = time.time()
    MODE.update({"q": False, "k": False, "v": False, "rot": None, "kmean": False, "sink": 0}); MODE.update(cfg)
    ppl, lps = run()
    if base is None: base = (ppl, lps); kl = 0.0
    else:
        kl = sum((b.exp() * (b - a)).sum().item() for a, b in zip(lps, base[1])) / sum(a.shape[0] for a in lps)
    print(f"{name:16s} ppl {ppl:.4f} ({(ppl/base[0]-1)*100:+.3f} %)  KL {kl:.3e}  {time.time()-t:.0f}s", flush=True)
