# GPU call 1 (session 15): build, GPU tests of the prefill RS kernel, float64 checks, bench at M = 2048
xz -dc .ptxas/ptxas.xz > /tmp/ptxas13 && chmod +x /tmp/ptxas13
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export TRITON_PTXAS_PATH=/tmp/ptxas13
S=eval/results/h100-2026-11-21/session15
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
MXQ_LAUNCH_CHECK=1 timeout 240 python3 -m pytest -q -x tests/test_kernels.py -k "prefill_rs" > $OUT/t1.log 2>&1; tail -4 $OUT/t1.log
OUT=$OUT timeout 100 python3 $S/rs_try.py check > $OUT/check.log 2>&1; grep -c '"ok": true' $OUT/check.log; grep 'false\|error\|check_bad\|nan_col' $OUT/check.log | head
OUT=$OUT timeout 220 python3 $S/rs_try.py bench ${MS:-2048} ${VARS:-rs4,rs4if,rs4p,rs4ifp} ${MODELS:-8b,70b} > $OUT/bench.log 2>&1
python3 - <<'P'
import json, os
for r in json.load(open(os.environ["OUT"] + "/rs_bench.json")):
    xs = " ".join(f"{k[2:]}={v}" for k, v in r.items() if k.startswith("x_"))
    print(r["model"], r["layer"], r["m"], xs, r.get("best_rs"))
P
tail -3 $OUT/bench.log
