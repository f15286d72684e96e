#!/usr/bin/env bash
# Runs ON the GPU machine: the service's edge under load against CUDA vLLM started by scripts/gpu-vllm.sh, over
# SQuAD v1.1's passages: bench.retry_storm (256 clients asking again at once after each 429, 16 obeying
# Retry-After, admission fixed at 64 so that there is a storm to refuse, 256-token answers, the encoder on the CPU)
# then bench.refusal_cost (what one refusal costs the serving loop on this host's cores).
#   bash scripts/gpu-edge.sh [bench.retry_storm options]   (results in $OUT or bench/results/gpu)
# Needs what gpu-e2e.sh needs (scripts/gpu-e2e-pack.sh squad-v1.1 ...).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu-extra.sh
TAG=${TAG:-h200}
. scripts/gpu-vllm.sh
python3 -m bench.retry_storm --data "$DATA/squad-v1.1" --chroma /var/tmp/bench-throughput --vllm-url "$URL/v1" \
  --storm 256 --obeying 16 --max-tokens 256 --duration-s 45 --app-env PREFIXRAG_EMBEDDING__DEVICE=cpu \
  --app-env PREFIXRAG_TRAFFIC__MAX_IN_FLIGHT=64 --out "$DEST/retry-storm-$TAG.json" "$@"
python3 -m bench.refusal_cost --data "$DATA/squad-v1.1" --chroma /var/tmp/bench-throughput --vllm-url "$URL/v1" \
  --out "$DEST/refusal-cost-$TAG.json"
