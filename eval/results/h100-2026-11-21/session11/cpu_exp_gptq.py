"""GPTQ-style (error-feedback) rounding of K (and Q) inside MXFP8 attention, with a calibrated
query (key) covariance. CPU experiment; see the session-11 brief. Run from /work/main:

    /tmp/venv/bin/python .data/s11/exp_gptq.py [sanity|full]
"""
import sys, math, time, torch
from mxq.formats import E4M3, ScaleRule, fake_quantize_mx, shared_exponents

torch.manual_seed(0)
LOG = open(".data/s11/exp_gptq.log", "a")


def log(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    LOG.write(s + "\n"); LOG.flush()


# ----------------------------------------------------------------------------- GPTQ rounding
def block_scales(x):
    """x [N, D] float32 -> per-element scale [N, D] (2**e, RCEIL = fake_quantize_mx's default)."""
    N, D = x.shape
    e, nf = shared_exponents(x.reshape(N, D // 32, 32), E4M3, ScaleRule.RCEIL)
    assert not bool(nf.any())
    s = torch.ldexp(torch.ones_like(e, dtype=torch.float32), e)
    return s.repeat_interleave(32, -1)


def fp8_at(x, s):
    """Round x to the E4M3 grid at fixed scale s (saturating to +-448 s), exactly as _cast_elements."""
    return (x / s).clamp(-E4M3.max_normal, E4M3.max_normal).to(E4M3.torch_dtype).float() * s


def gptq_round(x, H, lam=0.01, actorder=False):
    """x [N, D] float32, H [D, D] float64 PSD. Scales fixed from the unmodified x.

    Sequential rounding with error feedback (GPTQ): minimises sum_n e_n^T H e_n greedily.
    """
    N, D = x.shape
    s = block_scales(x)
    H = H.double().clone()
    H += lam * H.diagonal().mean() * torch.eye(D, dtype=torch.float64)
    perm = torch.argsort(H.diagonal(), descending=True) if actorder else torch.arange(D)
    Hp = H[perm][:, perm]
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(Hp)), upper=True).float()
    w = x[:, perm].float().clone(); sp = s[:, perm]
    out = torch.empty_like(w)
    for i in range(D):
        qi = fp8_at(w[:, i], sp[:, i])
        out[:, i] = qi
        if i + 1 < D:
            err = (w[:, i] - qi) / U[i, i]
            w[:, i + 1:] -= err[:, None] * U[i, i + 1:][None, :]
    res = torch.empty_like(out)
    res[:, perm] = out
    return res


def quad(e, H):
    """mean_n e_n^T H e_n."""
    e = e.double()
    return ((e @ H) * e).sum(-1).mean().item()


# ----------------------------------------------------------------------------- sanity check
def sanity():
    log("=== sanity: synthetic GPTQ check ===")
    g = torch.Generator().manual_seed(0)
    D, N = 64, 4096
    for spread in (1.0, 10.0, 100.0, 1000.0):
        Qm, _ = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))
        ev = torch.logspace(0, math.log10(spread), D, dtype=torch.float64)  # eigenvalues 1..spread
        H = (Qm * ev) @ Qm.T
        x = torch.randn(N, D, generator=g) * torch.exp(torch.randn(N, 1, generator=g))  # varied token scale
        rtn = fake_quantize_mx(x, -1, E4M3, 32)
        gq = gptq_round(x, H, lam=0.01)
        gqa = gptq_round(x, H, lam=0.01, actorder=True)
        gI = gptq_round(x, torch.eye(D, dtype=torch.float64), lam=0.01)
        s = block_scales(x)
        exact_fixed = bool((fp8_at(gq, s) == gq).all()) and bool((fp8_at(gqa, s) == gqa).all())
        fq_same = (fake_quantize_mx(gq, -1, E4M3, 32) == gq).float().mean().item()
        # fraction of 32-blocks whose RCEIL scale from the GPTQ output differs from the fixed one
        s2 = block_scales(gq)
        scale_changed = (s2 != s)[:, ::32].float().mean().item()
        log(f"eig spread {spread:7.0f} (top/mean {ev.max().item()/ev.mean().item():6.2f}): "
            f"e'He RTN {quad(x-rtn,H):.4e}  GPTQ {quad(x-gq,H):.4e} (x{quad(x-gq,H)/quad(x-rtn,H):.3f})  "
            f"GPTQ-actorder {quad(x-gqa,H):.4e} (x{quad(x-gqa,H)/quad(x-rtn,H):.3f}) | "
            f"H=I equals RTN: {bool((gI==rtn).all())} | on grid at fixed scales: {exact_fixed} | "
            f"fake_quantize_mx(out)==out: {fq_same*100:.3f}% elems, blocks whose RCEIL scale moved {scale_changed*100:.3f}% | "
            f"plain MSE RTN {((x-rtn)**2).mean().item():.3e} GPTQ {((x-gq)**2).mean().item():.3e}")


# ----------------------------------------------------------------------------- model experiment
def full():
    import mxq
    from mxq.models import load_model
    from mxq.eval.perplexity import make_windows
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    SEQ = 2048
    import os
    EVAL = [int(x) for x in os.environ.get("EVAL", "0,1").split(",")]; CAL = [10, 11]
    model, tok = load_model(None, dtype=torch.float32)
    texts = open(".data/valid.txt").read()
    win = make_windows(tok, texts, SEQ, max_windows=max(EVAL + CAL) + 1)
    log(f"windows total {win.n_windows_total}; eval {EVAL}, calibration {CAL}")
    D = model.config.head_dim if hasattr(model.config, "head_dim") else model.config.hidden_size // model.config.num_attention_heads
    NL = model.config.num_hidden_layers

    def hadamard(n):
        h = torch.ones(1, 1)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        return h
    g = torch.Generator().manual_seed(1234)
    signs = (torch.randint(0, 2, (D,), generator=g) * 2 - 1).float()
    R = (signs[:, None] * hadamard(D)) / math.sqrt(D)  # same R as exp_sink.py

    HQ = {"cal": {}, "oracle": {}}  # [layer] -> [hkv, D, D] float64 E[q q^T] (rotated, post-RoPE)
    HK = {"cal": {}, "oracle": {}}  # [layer] -> [hkv, D, D] float64 E[k k^T]
    CNT = {"cal": {}, "oracle": {}}
    DEFAULT = {"q": None, "k": None, "v": False, "rot": None, "collect": None,
               "kH": "cal", "qH": "cal", "lam": 0.01, "actorder": False, "proxy": False}
    MODE = dict(DEFAULT)
    PROXY = {}  # layer -> [sum RTN e'He, sum used e'He, n] under oracle H

    def attn(module, q, k, v, mask, dropout=0.0, scaling=None, is_causal=None, **kw):
        b, hq, sq, d = q.shape; hkv = k.shape[1]; gsz = hq // hkv
        L = module.layer_idx
        qf, kf, vf = q.float(), k.float(), v.float()
        if MODE["rot"] is not None:
            qf = qf @ MODE["rot"]; kf = kf @ MODE["rot"]
        if MODE["collect"] is not None:
            c = MODE["collect"]
            qg = qf.reshape(b, hkv, gsz, sq, d).transpose(1, 0).reshape(hkv, -1, d).double()
            kg = kf.transpose(1, 0).reshape(hkv, -1, d).double()
            HQ[c][L] = HQ[c].get(L, 0) + qg.transpose(1, 2) @ qg
            HK[c][L] = HK[c].get(L, 0) + kg.transpose(1, 2) @ kg
            cq, ck = CNT[c].get(L, (0, 0)); CNT[c][L] = (cq + qg.shape[1], ck + kg.shape[1])
        q_in, k_in = qf, kf
        if MODE["q"] == "rtn":
            qf = fake_quantize_mx(qf, -1, E4M3, 32)
        elif MODE["q"] == "gptq":
            out = torch.empty_like(qf)
            for j in range(hkv):
                Hs = HK[MODE["qH"]][L][j]
                x = qf[:, j * gsz:(j + 1) * gsz].reshape(-1, d)
                out[:, j * gsz:(j + 1) * gsz] = gptq_round(x, Hs, MODE["lam"], MODE["actorder"]).reshape(b, gsz, sq, d)
            qf = out
        if MODE["k"] == "rtn":
            kf = fake_quantize_mx(kf, -1, E4M3, 32)
        elif MODE["k"] == "gptq":
            out = torch.empty_like(kf)
            for j in range(hkv):
                x = kf[:, j].reshape(-1, d)
                out[:, j] = gptq_round(x, HQ[MODE["kH"]][L][j], MODE["lam"], MODE["actorder"]).reshape(b, sq, d)
            kf = out
        if MODE["proxy"] and MODE["k"] is not None and L in HQ["oracle"]:
            rt = fake_quantize_mx(k_in, -1, E4M3, 32)
            p = PROXY.setdefault(L, [0.0, 0.0, 0])
            for j in range(hkv):
                Ho = HQ["oracle"][L][j] / CNT["oracle"][L][0]
                p[0] += quad((k_in[:, j] - rt[:, j]).reshape(-1, d), Ho)
                p[1] += quad((k_in[:, j] - kf[:, j]).reshape(-1, d), Ho)
            p[2] += hkv
        if MODE["v"]:
            vf = fake_quantize_mx(vf, -2, E4M3, 32)
        kf = kf.repeat_interleave(gsz, 1); vf = vf.repeat_interleave(gsz, 1)
        s = (qf @ kf.transpose(-1, -2)) * scaling
        allowed = torch.ones(sq, k.shape[2], dtype=torch.bool).tril()
        s = s.masked_fill(~allowed, float("-inf"))
        o = torch.softmax(s, -1) @ vf
        return o.transpose(1, 2).to(q.dtype).contiguous(), None

    AttentionInterface.register("exp", attn); AttentionMaskInterface.register("exp", sdpa_mask)
    model.config._attn_implementation = "exp"
    for l in model.model.layers:
        l.self_attn.config._attn_implementation = "exp"

    def run(idx):
        lps = []; nll = 0.0; n = 0
        with torch.no_grad():
            for i in idx:
                ids = win.input_ids[i:i + 1]
                lp = torch.log_softmax(model(ids).logits.float(), -1)[0, :-1]
                tgt = ids[0, 1:]
                nll += -lp.gather(1, tgt[:, None]).sum().item(); n += tgt.numel()
                lps.append(lp)
        return math.exp(nll / n), lps

    # calibration pass (exact attention, rotated q/k collected)
    t = time.time()
    MODE.update(DEFAULT); MODE.update(rot=R, collect="cal")
    ppl_cal, _ = run(CAL)
    log(f"calibration pass on windows {CAL}: ppl {ppl_cal:.4f}  {time.time()-t:.0f}s")

    results = []
    base = None
    variants = [
        ("exact (+oracle H)", dict(rot=R, collect="oracle")),
        ("qkv+had RTN", dict(q="rtn", k="rtn", v=True, rot=R)),
        ("k RTN", dict(k="rtn", rot=R, proxy=True)),
        ("k GPTQ cal", dict(k="gptq", rot=R, proxy=True)),
        ("k GPTQ oracle", dict(k="gptq", kH="oracle", rot=R, proxy=True)),
        ("q RTN", dict(q="rtn", rot=R)),
        ("q GPTQ cal", dict(q="gptq", rot=R)),
        ("qkv K:GPTQcal", dict(q="rtn", k="gptq", v=True, rot=R)),
        ("qkv K,Q:GPTQcal", dict(q="gptq", k="gptq", v=True, rot=R)),
        ("qkv K,Q:GPTQorc", dict(q="gptq", k="gptq", kH="oracle", qH="oracle", v=True, rot=R)),
        ("qkv K:GPTQcal l=.001", dict(q="rtn", k="gptq", v=True, rot=R, lam=0.001)),
        ("qkv K:GPTQcal l=.1", dict(q="rtn", k="gptq", v=True, rot=R, lam=0.1)),
        ("qkv K:GPTQcal actord", dict(q="rtn", k="gptq", v=True, rot=R, actorder=True)),
        ("qkv K:GPTQcal actord l=.1", dict(q="rtn", k="gptq", v=True, rot=R, actorder=True, lam=0.1)),
        ("qv RTN (K exact)", dict(q="rtn", v=True, rot=R)),
        ("qkv K,Q:GPTQcal l=.001", dict(q="gptq", k="gptq", v=True, rot=R, lam=0.001)),
        ("k GPTQ cal l=.001", dict(k="gptq", rot=R, proxy=True, lam=0.001)),
        ("k GPTQ cal l=.1", dict(k="gptq", rot=R, proxy=True, lam=0.1)),
        ("k GPTQ cal actord", dict(k="gptq", rot=R, proxy=True, actorder=True)),
        ("qkv K,Q:GPTQcal actord", dict(q="gptq", k="gptq", v=True, rot=R, actorder=True)),
        ("v RTN", dict(v=True, rot=R)),
        ("qv Q:GPTQcal (K exact)", dict(q="gptq", v=True, rot=R)),
    ]
    only = sys.argv[2].split(",") if len(sys.argv) > 2 else None
    for vi, (name, cfg) in enumerate(variants):
        if only is not None and vi != 0 and str(vi) not in only:
            continue
        t = time.time()
        MODE.update(DEFAULT); MODE.update(cfg); PROXY.clear()
        ppl, lps = run(EVAL)
        if base is None:
            base = (ppl, lps); kl = 0.0
            if EVAL == [0, 1]:
                spectrum_report(HQ, HK, CNT, NL)
        else:
            kl = sum((bb.exp() * (bb - a)).sum().item() for a, bb in zip(lps, base[1])) / sum(a.shape[0] for a in lps)
        line = f"{name:28s} ppl {ppl:.4f} ({(ppl/base[0]-1)*100:+.3f} %)  KL {kl:.3e}  {time.time()-t:.0f}s"
        if PROXY:
            r = sum(p[0] for p in PROXY.values()); u = sum(p[1] for p in PROXY.values())
            per = [PROXY[L][1] / PROXY[L][0] for L in sorted(PROXY)]
            line += f"  | proxy e'H_orc e (sum over layers) used/RTN {u/r:.3f}; per layer min {min(per):.3f} med {sorted(per)[len(per)//2]:.3f} max {max(per):.3f}"
        results.append(line)
        log(line)
    log("\n=== results (eval windows %s, %d tokens each) ===" % (EVAL, SEQ))
    for r in results:
        log(r)


def spectrum_report(HQ, HK, CNT, NL):
    log("=== eigen-spread of calibrated H (rotated, post-RoPE): top/mean eig, eff.rank=(sum ev)^2/sum ev^2, "
        "cond (top/bottom); cal-vs-oracle rel. Frobenius diff ===")
    for L in range(NL):
        parts = []
        for nm, Hd in (("Hq", HQ), ("Hk", HK)):
            Hc = Hd["cal"][L] / (CNT["cal"][L][0] if nm == "Hq" else CNT["cal"][L][1])
            Ho = Hd["oracle"][L] / (CNT["oracle"][L][0] if nm == "Hq" else CNT["oracle"][L][1])
            st = []
            for j in range(Hc.shape[0]):
                ev = torch.linalg.eigvalsh(Hc[j]).clamp_min(0)
                diff = ((Hc[j] - Ho[j]).norm() / Ho[j].norm()).item()
                st.append(f"{(ev.max()/ev.mean()).item():5.1f}/{(ev.sum()**2/(ev**2).sum()).item():4.1f}/{(ev.max()/ev.min().clamp_min(1e-30)).item():.0e}/{diff:.2f}")
            parts.append(nm + " " + " ".join(st))
        log(f"L{L:02d} " + " | ".join(parts))


if __name__ == "__main__":
    torch.set_num_threads(2)
    what = sys.argv[1] if len(sys.argv) > 1 else "full"
    if what in ("sanity", "all"):
        sanity()
    if what in ("full", "all"):
        full()
