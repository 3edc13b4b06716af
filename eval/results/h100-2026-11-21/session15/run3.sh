# GPU call 3 (session 15): interleaved A/B (ab.py) of the loop variants at M = 2048 and 8192
xz -dc .ptxas/ptxas.xz > /tmp/ptxas13 && chmod +x /tmp/ptxas13
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
export TRITON_PTXAS_PATH=/tmp/ptxas13
S=eval/results/h100-2026-11-21/session15
nvidia-smi --query-gpu=name --format=csv,noheader
OUT=$OUT timeout ${T:-400} python3 $S/ab.py ${MS:-2048} ${VARS:-rs4,rs4if,rs4ifsw,rs4ifp} ${MODELS:-8b,70b} 2>&1 | tail -30
