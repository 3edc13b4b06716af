"""Eager host cost: per-call times (tiny shapes) + HF eager decode step (Llama-3-8B dims, 4 layers)."""
import json, os, sys, time, torch, torch.nn.functional as F
from mxq.formats import E4M3
from mxq.kernels import mx_linear
dev = torch.device("cuda"); OUT = os.environ.get("OUT", "/tmp"); tag = sys.argv[1]
def per_call(fn, n=500, warm=30):
    for _ in range(warm): fn()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): fn()
    torch.cuda.synchronize(); return round((time.perf_counter() - t) / n * 1e6, 1)
res = {}
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
from mxq.kernels import attention as KA
q, k, v = (torch.randn(1, 4, 64, 128, device=dev, dtype=torch.bfloat16) for _ in range(3))
res["mx_attention_prefill tiny"] = per_call(lambda: KA.mx_attention_prefill(q, k, v, causal=True, qk_rotation=True), n=200)
res["SDPA tiny"] = per_call(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), n=200)
print(json.dumps(res, indent=1), flush=True)
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
    torch.cuda.synchronize(); return round((time.perf_counter() - t) / n * 1e3, 2)
def gen_ms(model, cache_fn=None, n=32):
    kw = {}
    def g(nn):
        if cache_fn: kw["past_key_values"] = cache_fn()
        torch.cuda.synchronize(); t = time.perf_counter()
        with torch.inference_mode(): model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=nn, min_new_tokens=nn, do_sample=False, pad_token_id=0, **kw)
        torch.cuda.synchronize(); return time.perf_counter() - t
    g(1 + n); g(4); return round((g(1 + n) - g(1)) / n * 1e3, 2)
hf = {}
if tag == "base":
    hf["bf16 static eager ms/step"] = eager_steps(model)
    hf["bf16 generate ms/step"] = gen_ms(model)
mxq.quantize_model(model, "mxfp8")
hf["mxfp8 static eager ms/step"] = eager_steps(model)
hf["mxfp8 generate ms/step"] = gen_ms(model)
model.set_attn_implementation(MA.ATTN_IMPLEMENTATION)
hf["mxfp8-attn generate MXFP8Cache ms/step"] = gen_ms(model, cache_fn=lambda: MA.MXFP8Cache())
print(json.dumps(hf, indent=1), flush=True)
json.dump(dict(micro=res, hf=hf, env={k: os.environ.get(k) for k in ("MXQ_FAST_LAUNCH", "MXQ_LAUNCH_CHECK")}), open(f"{OUT}/eager_{tag}.json", "w"), indent=1)
