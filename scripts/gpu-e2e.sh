#!/usr/bin/env bash
# Runs ON the GPU machine (bench/README.md: "On a GPU"): the whole benchmark pipeline of bench.prefix_cache
# (ingest into on-disk Chroma, the real embedder, BM25, the service graph, pre-warm, retrieval per question)
# against CUDA vLLM started by scripts/gpu-vllm.sh (the project's own launcher, a model of real size with dummy
# weights).
#   bash scripts/gpu-e2e.sh DATASET...   (datasets under $DATA, results in $OUT or bench/results/gpu)
# Needs vLLM installed from ../shared/gpu (/tmp/site) and the service's own dependencies the image lacks, installed
# from the bundle `scripts/gpu-e2e-pack.sh` makes (EXTRA: the staged folder holding its parts).
set -euo pipefail
cd "$(dirname "$0")/.."
. /tmp/site/env.sh
EXTRA=${EXTRA:-/var/tmp/stage-extra}
DATA=${DATA:-/var/tmp/extra/data}
if [[ ! -d /tmp/site2 ]]; then
  (cd "$EXTRA" && cat $(ls xpack.part.* | sort) > xpack.tar && sha256sum -c xpack.sha \
    && rm -rf /var/tmp/extra && mkdir -p /var/tmp/extra && tar xf xpack.tar -C /var/tmp/extra)
  python3 -m pip install -q --no-index --no-deps --target /tmp/site2 /var/tmp/extra/wheels/*.whl
fi
export PYTHONPATH=/tmp/site2${PYTHONPATH:+:$PYTHONPATH}
DEST=${OUT:-bench/results/gpu}
CONCURRENCY=${CONCURRENCY:-4}
TAG=${TAG:-h200-e2e}
mkdir -p "$DEST"
. scripts/gpu-vllm.sh
for dataset in "$@"; do
  python3 -m bench.prefix_cache --data "$DATA/$dataset" --questions 300 --concurrency "$CONCURRENCY" --top-k 5 \
    --seed 0 --max-tokens 16 --modes naive,prefixrag --vllm-url "$URL/v1" --out "$DEST/$dataset-c$CONCURRENCY-$TAG.json"
done
