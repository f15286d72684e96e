#!/usr/bin/env bash
# Runs ON the GPU machine: bench.throughput (the app as users run it, naive RAG and vLLM alone replaying the app's
# requests, closed loops over HTTP) against CUDA vLLM started by scripts/gpu-vllm.sh; PROFILE=1 samples the app with
# py-spy during each prefixrag arm.
#   bash scripts/gpu-throughput.sh DATASET [bench.throughput options]   (results in $OUT or bench/results/gpu)
# Needs what gpu-e2e.sh needs (scripts/gpu-e2e-pack.sh DATASET).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu-extra.sh
TAG=${TAG:-h200}
. scripts/gpu-vllm.sh
dataset=$1
shift
if [[ -n "${PROFILE:-}" ]]; then  # py-spy (carried as a wheel in .whl/) samples the app in each prefixrag arm
  python3 -m pip install -q --no-index --no-deps --target /tmp/site3 .whl/py_spy-*.whl
  export PATH=/tmp/site3/bin:$PATH
  set -- --profile "$DEST/profile-$dataset-$TAG" "$@"
fi
python3 -m bench.throughput --data "$DATA/$dataset" --chroma "/var/tmp/bench-throughput" --vllm-url "$URL/v1" \
  --out "$DEST/throughput-$dataset-$TAG.json" --app-log "/var/tmp/throughput-$dataset-$TAG-app.log" \
  --warmup-s 15 "$@"
