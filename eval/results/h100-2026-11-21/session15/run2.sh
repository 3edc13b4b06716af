# GPU call 2 (session 15): inflight default; GPU tests, variants around it, dispatched bench_gemm
xz -dc .ptxas/ptxas.xz > /tmp/ptxas13 && chmod +x /tmp/ptxas13
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export TRITON_PTXAS_PATH=/tmp/ptxas13
S=eval/results/h100-2026-11-21/session15
nvidia-smi --query-gpu=name --format=csv,noheader
MXQ_LAUNCH_CHECK=1 timeout 200 python3 -m pytest -q -x tests/test_kernels.py -k "prefill_rs" > $OUT/t2.log 2>&1; tail -2 $OUT/t2.log
OUT=$OUT timeout 150 python3 $S/rs_try.py bench 2048 rs4,rs4if,rs5if,rs3if,rs4ifsw 8b,70b > $OUT/bench2.log 2>&1
python3 - <<'P'
import json, os
for r in json.load(open(os.environ["OUT"] + "/rs_bench.json")):
    print(r["model"], r["layer"], r["m"], " ".join(f"{k[2:]}={v}" for k, v in r.items() if k.startswith("x_")), r.get("best_rs"))
P
timeout 200 python3 -m mxq.eval.bench_gemm --models 8b,70b --ms 1024,2048,8192 --no-quantize --out $OUT/bench_gemm.json > $OUT/bench_gemm.log 2>&1; tail -40 $OUT/bench_gemm.log
