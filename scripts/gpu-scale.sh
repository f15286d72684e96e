#!/usr/bin/env bash
# Runs ON the GPU machine: bench.scale with the encoder on CUDA (ingest, ranking workers, the app). No vLLM is needed:
# the app's start-up is measured against bench.instant_vllm. The distractors' sentence pool travels as a file built
# here (python -c "from bench.scale_corpus import ..." or any local bench.scale run with --pool-cache).
#   POOL=.gpu/scale-pool.json.gz bash scripts/gpu-scale.sh DATASET [bench.scale options]   (results in $OUT or bench/results/gpu)
# Needs what gpu-e2e.sh needs (scripts/gpu-e2e-pack.sh DATASET).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu-extra.sh
TAG=${TAG:-h200}
dataset=$1
shift
PREFIXRAG_EMBEDDING__DEVICE=cuda python3 -m bench.scale --data "$DATA/$dataset" --pool-cache "${POOL:-.gpu/scale-pool.json.gz}" \
  --work /var/tmp/bench-scale --out "$DEST/scale-$dataset-$TAG.json" "$@"
