xz -dc .ptxas/ptxas.xz > /tmp/ptxas13 && chmod +x /tmp/ptxas13
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export TRITON_PTXAS_PATH=/tmp/ptxas13
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
timeout 120 python3 .data/s10/smoke.py 2>&1 | tail -5 || exit 1
timeout 300 python3 -m pytest -q tests/test_attention.py -k "decode_ws or query_blocks or gpu_decode or gpu_cache" 2>&1 | tail -4
timeout 300 python3 eval/bench_attention.py --decode-only --no-sweep --out $OUT/decode_fused.json 2>&1 | grep "^|"
python3 - <<'P'
import json,os
r=json.load(open(os.environ["OUT"]+"/decode_fused.json"))
for c in r["decode_configs"]:
    if c["variant"]=="ws": print(c["context"], c["stages"],c["programs"],c["maxnreg"],c["merge_pdl"],c["fused_merge"],round(c["us"],2))
P
timeout 200 python3 eval/bench_attention.py --prefill-only --no-tiles --out $OUT/prefill.json 2>&1 | grep -v "^<!--" | tail -20
