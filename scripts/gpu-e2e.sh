#!/usr/bin/env bash
# Runs ON the GPU machine (bench/README.md: "On a GPU"): the whole benchmark pipeline of bench.prefix_cache
# (ingest into on-disk Chroma, the real embedder, BM25, the service graph, pre-warm, retrieval per question)
# against CUDA vLLM started by scripts/gpu-vllm.sh (the project's own launcher, a model of real size with dummy
# weights).
#   bash scripts/gpu-e2e.sh DATASET...   (datasets under $DATA, results in $OUT or bench/results/gpu)
# Needs vLLM installed from ../shared/gpu (/tmp/site) and the service's own dependencies the image lacks, installed
# from the bundle `scripts/gpu-e2e-pack.sh` makes (scripts/gpu-extra.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu-extra.sh
CONCURRENCY=${CONCURRENCY:-4}
TAG=${TAG:-h200-e2e}
. scripts/gpu-vllm.sh
for dataset in "$@"; do
  python3 -m bench.prefix_cache --data "$DATA/$dataset" --questions 300 --concurrency "$CONCURRENCY" --top-k 5 \
    --seed 0 --max-tokens 16 --modes naive,prefixrag --vllm-url "$URL/v1" --out "$DEST/$dataset-c$CONCURRENCY-$TAG.json"
done
