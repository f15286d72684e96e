#!/usr/bin/env bash
# Runs ON the GPU machine (bench/README.md: "On a GPU"): start vLLM (scripts/gpu-vllm.sh), then replay each
# dataset's prompt dumps at several concurrencies.
#   bash scripts/gpu-bench.sh DATASET...      (dumps in .gpu/dumps/DATASET, results in $OUT or bench/results/gpu)
set -euo pipefail
cd "$(dirname "$0")/.."
[[ -f /tmp/site/env.sh ]] && . /tmp/site/env.sh
DEST=${OUT:-bench/results/gpu}
CONCURRENCY=${CONCURRENCY:-1,8,32}
MODES=${MODES:-naive,canonical,auto,naive-matched}
TAG=${TAG:-h200}            # result file suffix
mkdir -p "$DEST"
. scripts/gpu-vllm.sh
for dataset in "$@"; do
  python3 -m bench.replay --prompts ".gpu/dumps/$dataset" --vllm-url "$URL/v1" --concurrency "$CONCURRENCY" \
    --modes "$MODES" --label "$dataset, Llama-3.1-8B shape (dummy weights)" --out "$DEST/$dataset-$TAG.json"
done
