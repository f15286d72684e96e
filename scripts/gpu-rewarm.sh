#!/usr/bin/env bash
# Runs ON the GPU machine: bench.rewarm (after an ingest under steady traffic, how soon pre-warm has the changed
# corpus warm again, and what that costs users' TTFT) against CUDA vLLM started by scripts/gpu-vllm.sh, over the
# FastAPI docs.
#   bash scripts/gpu-rewarm.sh [bench.rewarm options]   (results in $OUT or bench/results/gpu)
# Needs the extras bundle with the FastAPI docs (scripts/gpu-e2e-pack.sh squad-v1.1 fastapi-docs-md).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu-extra.sh
TAG=${TAG:-h200}
. scripts/gpu-vllm.sh
python3 -m bench.rewarm --data "$DATA/fastapi-docs-md/files" --vllm-url "$URL/v1" --out "$DEST/rewarm-$TAG.json" \
  --app-log "$DEST/rewarm-$TAG-app.log" "$@"
