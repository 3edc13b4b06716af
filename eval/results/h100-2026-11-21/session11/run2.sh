xz -dc .ptxas/ptxas.xz > /tmp/ptxas13 && chmod +x /tmp/ptxas13
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export TRITON_PTXAS_PATH=/tmp/ptxas13
timeout 120 python3 .data/s10/smoke.py 2>&1 | tail -5 || exit 1
timeout 300 python3 -m pytest -q tests/test_attention.py -k "decode_ws or query_blocks or gpu_decode or gpu_cache" 2>&1 | tail -4
timeout 300 python3 eval/bench_attention.py --decode-only --no-sweep --out $OUT/decode_widev.json 2>&1 | grep "^|"
python3 - <<'P'
import json,os
r=json.load(open(os.environ["OUT"]+"/decode_widev.json"))
for c in r["decode_configs"]:
    if c["variant"]=="ws": print(c["context"], {k:v for k,v in c.items() if k not in ("context","variant","rel_err","us","pdl","loader_regs")}, round(c["us"],2))
P
which ncu && timeout 150 ncu --kernel-name regex:_decode_ws_kernel --launch-skip 2 --launch-count 4 --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats python3 .data/s11/prof16k.py > $OUT/ncu16k.txt 2>&1; grep -E "DRAM Throughput|Memory Throughput|Duration|Stall|L2 Hit|Mem Busy|Max Bandwidth|==PROF==|_decode_ws" $OUT/ncu16k.txt | head -60
