#!/usr/bin/env bash
# SmolLM2-135M end to end on a GPU: quantize with every shipped recipe, then perplexity beside
# the bf16 original (Triton kernels), and the same windows through the torch reference
# (MXQ_KERNELS=reference) to show the fast path computes the same function.
#
#   bash eval/e2e_smollm2.sh GGUF_FILE TEXT_FILE OUT_DIR
#
# GGUF_FILE: the embedded default model's file (python -c "import mxq.hf.models as m; print(m.default_model_file())")
# TEXT_FILE: e.g. WikiText-2 validation (tokenized release); OUT_DIR receives JSON reports.
set -euo pipefail
G=${1:?GGUF file}; TEXT=${2:?text file}; OUT=${3:?output dir}
mkdir -p "$OUT"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
for R in mxfp8 mxfp8-w8a16 mxfp8-e5m2; do
  /usr/bin/time -f "quantize $R: %e s wall, %M KB peak RSS" \
    mxq quantize "$G" "$OUT/q-$R" --recipe "$R" --device cuda --force > "$OUT/quantize-$R.txt" 2>&1
  tail -1 "$OUT/quantize-$R.txt"
done
mxq eval ppl "$OUT/q-mxfp8" --baseline "$G" --dataset "$TEXT" --device cuda --batch-size 4 --out "$OUT/ppl-mxfp8.json"
mxq eval ppl "$OUT/q-mxfp8-w8a16" --dataset "$TEXT" --device cuda --batch-size 4 --out "$OUT/ppl-w8a16.json"
mxq eval ppl "$OUT/q-mxfp8-e5m2" --dataset "$TEXT" --device cuda --batch-size 4 --out "$OUT/ppl-e5m2.json"
mxq eval ppl "$OUT/q-mxfp8" --dataset "$TEXT" --device cuda --max-windows 24 --batch-size 4 --out "$OUT/ppl-triton24.json"
MXQ_KERNELS=reference mxq eval ppl "$OUT/q-mxfp8" --dataset "$TEXT" --device cuda --max-windows 24 --batch-size 4 --out "$OUT/ppl-ref24.json"
