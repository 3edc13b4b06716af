# GPU call 4 (session 15): defaults = one step in flight + split warpgroups; GPU tests, model shapes, bench_gemm
xz -dc .ptxas/ptxas.xz > /tmp/ptxas13 && chmod +x /tmp/ptxas13
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export TRITON_PTXAS_PATH=/tmp/ptxas13
nvidia-smi --query-gpu=name --format=csv,noheader
MXQ_LAUNCH_CHECK=1 timeout 200 python3 -m pytest -q -x tests/test_kernels.py -k "prefill_rs" > $OUT/t4.log 2>&1; tail -2 $OUT/t4.log
MXQ_LAUNCH_CHECK=1 timeout 150 python3 -m pytest -q -x tests/test_e2e.py -k "model_shapes" > $OUT/t4e.log 2>&1; tail -2 $OUT/t4e.log
timeout 220 python3 -m mxq.eval.bench_gemm --models 8b,70b --ms 1024,2048,8192 --no-quantize --out $OUT/bench_gemm.json > $OUT/bench_gemm.log 2>&1
python3 - <<'P'
import json, os
d = json.load(open(os.environ["OUT"] + "/bench_gemm.json"))
print(list(d)[:10] if isinstance(d, dict) else type(d))
P
grep "^| " $OUT/bench_gemm.log | cut -d'|' -f2-13 | head -30
