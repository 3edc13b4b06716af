"""Host (CPU) cost of eager mxq calls on the device machine: per-call times and cProfiles."""
import cProfile, io, json, os, pstats, sys, time
import torch, torch.nn.functional as F
from mxq.formats import E4M3, ScaleRule
from mxq.kernels import mx_linear
from mxq.kernels.quantize import quantize_mx_rows
from mxq.kernels import attention as KA

OUT = os.environ.get("OUT", "/tmp")
dev = torch.device("cuda")
res = {}

def per_call(fn, n=300, warm=30):
    for _ in range(warm): fn()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): fn()
    torch.cuda.synchronize(); return (time.perf_counter() - t) / n * 1e6

def prof(fn, n=200, top=30, key="tottime"):
    pr = cProfile.Profile(); pr.enable()
    for _ in range(n): fn()
    torch.cuda.synchronize(); pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats(key).print_stats(top); return s.getvalue()

# micro: tiny shapes, GPU work negligible
torch.manual_seed(0)
N = K = 512
w = torch.randn(N, K, device=dev).to(torch.float8_e4m3fn)
ws = torch.randint(120, 130, (N, K // 32), device=dev, dtype=torch.uint8)
wb = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
for m in (1, 16):
    x = torch.randn(m, K, device=dev, dtype=torch.bfloat16)
    res[f"F.linear bf16 M={m}"] = per_call(lambda: F.linear(x, wb))
    res[f"mx_linear W8A8 M={m}"] = per_call(lambda: mx_linear(x, w, ws, act_elem=E4M3))
    res[f"mx_linear W8A16 M={m}"] = per_call(lambda: mx_linear(x, w, ws))
    res[f"quantize_mx_rows M={m}"] = per_call(lambda: quantize_mx_rows(x, E4M3, ScaleRule.RCEIL, 32))
    res[f"torch.empty+copy M={m}"] = per_call(lambda: torch.empty_like(x).copy_(x))
for k, v in res.items(): print(f"{k:32s} {v:8.1f} us", flush=True)
x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
p1 = prof(lambda: mx_linear(x, w, ws, act_elem=E4M3)); print(p1)
p2 = prof(lambda: mx_linear(x, w, ws)); print(p2, flush=True)
q, k, v = (torch.randn(1, 4, 64, 128, device=dev, dtype=torch.bfloat16) for _ in range(3))
res["mx_attention_prefill tiny"] = per_call(lambda: KA.mx_attention_prefill(q, k, v, causal=True, qk_rotation=True), n=100)
res["SDPA tiny"] = per_call(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), n=100)
p3 = prof(lambda: KA.mx_attention_prefill(q, k, v, causal=True, qk_rotation=True), n=100); print(p3, flush=True)
print(json.dumps(res, indent=1), flush=True)

# HF eager decode: Llama-3-8B dims, 4 layers
from transformers import LlamaConfig, LlamaForCausalLM
import mxq, mxq.attention as MA
from mxq.decode import StaticGreedyDecoder
cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=4, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=32000, max_position_embeddings=8192, tie_word_embeddings=False)
torch.set_default_dtype(torch.bfloat16)
with torch.device(dev): model = LlamaForCausalLM(cfg).eval()
torch.set_default_dtype(torch.float32)
ids = torch.randint(0, 32000, (1, 128), device=dev)
def eager_steps(model, n=64):
    dec = StaticGreedyDecoder(model, 1, 128 + n + 8, cuda_graph=False)
    dec.prefill(ids); dec.step(); torch.cuda.synchronize()
    dec.prefill(ids); torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): dec.step()
    torch.cuda.synchronize(); return (time.perf_counter() - t) / n * 1e3, dec
def gen_ms(model, cache_fn=None, n=32):
    kw = {}
    def g(nn):
        if cache_fn: kw["past_key_values"] = cache_fn()
        torch.cuda.synchronize(); t = time.perf_counter()
        with torch.inference_mode(): model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=nn, min_new_tokens=nn, do_sample=False, pad_token_id=0, **kw)
        torch.cuda.synchronize(); return time.perf_counter() - t
    g(4); return (g(1 + n) - g(1)) / n * 1e3
hf = {}
hf["bf16 static eager ms/step"], _ = eager_steps(model)
hf["bf16 generate ms/step"] = gen_ms(model)
mxq.quantize_model(model, "mxfp8")
hf["mxfp8 static eager ms/step"], dec = eager_steps(model)
hf["mxfp8 generate ms/step"] = gen_ms(model)
print(json.dumps(hf, indent=1), flush=True)
with torch.inference_mode():
    dec.prefill(ids)
    p4 = prof(lambda: dec.step(), n=20, top=45); print(p4)
    p4c = prof(lambda: dec.step(), n=20, top=45, key="cumtime"); print(p4c, flush=True)
model.config._attn_implementation = MA.ATTN_IMPLEMENTATION
model.set_attn_implementation(MA.ATTN_IMPLEMENTATION) if hasattr(model, "set_attn_implementation") else None
hf["mxfp8-attn generate MXFP8Cache ms/step"] = gen_ms(model, cache_fn=lambda: MA.MXFP8Cache())
print(json.dumps(hf, indent=1), flush=True)
def gen_prof():
    with torch.inference_mode(): model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=MA.MXFP8Cache(), max_new_tokens=17, min_new_tokens=17, do_sample=False, pad_token_id=0)
p5 = prof(gen_prof, n=2, top=45); print(p5, flush=True)
json.dump(dict(micro=res, hf=hf, prof=dict(w8a8=p1, w8a16=p2, attn_prefill=p3, step_tot=p4, step_cum=p4c, gen_attn=p5),
               device=torch.cuda.get_device_name()), open(f"{OUT}/host_prof.json", "w"), indent=1)
