import cProfile, io, pstats, time, statistics, torch, json, os
from transformers import LlamaConfig, LlamaForCausalLM
import mxq
from mxq.kernels import launch as L
from mxq.decode import StaticGreedyDecoder
dev = torch.device("cuda")
cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=8, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=32000, max_position_embeddings=8192, tie_word_embeddings=False)
torch.set_default_dtype(torch.bfloat16)
with torch.device(dev): model = LlamaForCausalLM(cfg).eval()
torch.set_default_dtype(torch.float32)
mxq.quantize_model(model, "mxfp8")
ids = torch.randint(0, 32000, (1, 512), device=dev)
res = {}
with torch.inference_mode():
    for fast in (True, False, True, False):
        L.FAST = fast
        model(ids, use_cache=False); torch.cuda.synchronize()
        ts = []
        for _ in range(10):
            t = time.perf_counter(); model(ids, use_cache=False); torch.cuda.synchronize(); ts.append(time.perf_counter() - t)
        res.setdefault(f"prefill512 ms FAST={fast}", []).append(round(statistics.median(ts) * 1e3, 2))
print(json.dumps(res), flush=True)
L.FAST = True
dec = StaticGreedyDecoder(model, 1, 300, cuda_graph=False)
p = ids[:, :128]
dec.prefill(p); dec.step(); torch.cuda.synchronize(); dec.prefill(p); torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(32): dec.step()
torch.cuda.synchronize(); res["eager step ms"] = round((time.perf_counter() - t) / 32 * 1e3, 2); print(res, flush=True)
pr = cProfile.Profile(); pr.enable()
for _ in range(10): dec.step()
torch.cuda.synchronize(); pr.disable()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25); print(s.getvalue()[:7000])
json.dump(res, open(os.environ.get("OUT", "/tmp") + "/ab8b.json", "w"))
