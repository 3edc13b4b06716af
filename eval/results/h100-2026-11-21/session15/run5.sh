# GPU call 5 (session 15): PDL between the X quantizer and the prefill GEMM; GPU tests, interleaved W8A8 A/B
xz -dc .ptxas/ptxas.xz > /tmp/ptxas13 && chmod +x /tmp/ptxas13
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export TRITON_PTXAS_PATH=/tmp/ptxas13
S=eval/results/h100-2026-11-21/session15
nvidia-smi --query-gpu=name --format=csv,noheader
MXQ_LAUNCH_CHECK=1 timeout 200 python3 -m pytest -q -x tests/test_kernels.py -k "prefill_rs or pdl" > $OUT/t5.log 2>&1; tail -2 $OUT/t5.log
MXQ_LAUNCH_CHECK=1 timeout 100 python3 -m pytest -q -x tests/test_e2e.py -k "model_shapes and bfloat16" > $OUT/t5e.log 2>&1; tail -2 $OUT/t5e.log
OUT=$OUT timeout 150 python3 $S/ab.py 2048 rs4if,w8a8,w8a8nopdl 8b,70b 2>&1 | tail -9; cp $OUT/ab.json $OUT/ab_pdl2048.json
OUT=$OUT timeout 100 python3 $S/ab.py 8192 w8a8,w8a8nopdl 8b 2>&1 | tail -5
