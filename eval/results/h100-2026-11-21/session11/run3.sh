xz -dc .ptxas/ptxas.xz > /tmp/ptxas13 && chmod +x /tmp/ptxas13
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export TRITON_PTXAS_PATH=/tmp/ptxas13
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
timeout 120 python3 .data/s10/smoke.py 2>&1 | tail -5 || exit 1
timeout 200 python3 -m pytest -q tests/test_attention.py -k "gpu_decode_ws" 2>&1 | tail -2
timeout 300 python3 eval/bench_attention.py --decode-only --no-sweep --out $OUT/decode_h200.json 2>&1 | grep "^|"
python3 - <<'P'
import json,os
r=json.load(open(os.environ["OUT"]+"/decode_h200.json"))
for c in r["decode_configs"]:
    if c["variant"]=="ws": print(c["context"], {k:v for k,v in c.items() if k not in ("context","variant","rel_err","us","pdl","loader_regs")}, round(c["us"],2))
P
