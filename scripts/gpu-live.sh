#!/usr/bin/env bash
# Runs ON the GPU machine (bench/README.md: "Live traffic first", on the H200): issue #10's benchmark,
# bench.live_traffic, unchanged — the app as users run it (`python -m app`, default settings, its embedder on the
# CPU) on the Python docs — against CUDA vLLM started by scripts/gpu-vllm.sh instead of the CPU test model.
#   bash scripts/gpu-live.sh [bench.live_traffic options]   (results in $OUT or bench/results/gpu)
# The corpus is ingested first with the encoder on the GPU (idempotent; the bench's own ingest then only checks).
# Needs what gpu-e2e.sh needs (scripts/gpu-e2e-pack.sh python-3.11-docs-html).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu-extra.sh
CHROMA=${CHROMA:-/var/tmp/bench-live}
CORPUS="$DATA/python-3.11-docs-html/files"
TAG=${TAG:-h200}
. scripts/gpu-vllm.sh
PREFIXRAG_EMBEDDING__DEVICE=cuda python3 -m ingest "$CORPUS" --chroma-path "$CHROMA" --collection live-python-3.11-docs-html
if [[ -z "${INGEST_ONLY:-}" ]]; then
  python3 -m bench.live_traffic --data "$CORPUS" --chroma "$CHROMA" --vllm-url "$URL/v1" \
    --out "$DEST/live-traffic-$TAG.json" --app-log "$DEST/live-traffic-$TAG-app.log" "$@"
fi
