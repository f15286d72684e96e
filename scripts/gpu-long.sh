#!/usr/bin/env bash
# Runs ON the GPU machine: bench.long_context (a dataset bound into books of UNIT tokens; naive top-k, naive filling
# a book's budget, prefixrag with book-sized units) against CUDA vLLM started by scripts/gpu-vllm.sh with a window
# of twice a book (MAX_MODEL_LEN; the model folder must allow it: python -m app.testmodel --max-model-len).
#   UNIT=32768 bash scripts/gpu-long.sh DATASET [bench.long_context options]   (results in $OUT or bench/results/gpu)
# Needs what gpu-e2e.sh needs (scripts/gpu-e2e-pack.sh DATASET).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu-extra.sh
TAG=${TAG:-h200}
UNIT=${UNIT:-32768}
export MAX_MODEL_LEN=${MAX_MODEL_LEN:-$((2 * UNIT))}
. scripts/gpu-vllm.sh
dataset=$1
shift
python3 -m bench.long_context --data "$DATA/$dataset" --unit-tokens "$UNIT" --vllm-url "$URL/v1" \
  --chroma-path "/var/tmp/bench-long/$dataset" --out "$DEST/long-context-$dataset-$((UNIT / 1024))k-$TAG.json" "$@"
