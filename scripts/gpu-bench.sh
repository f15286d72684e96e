#!/usr/bin/env bash
# Runs ON the GPU machine (README: "On a GPU"): start vLLM through the project's own launcher with a model of real
# size (default: the Llama-3.1-8B-shape dummy folder written by `python -m app.testmodel`), check that prefix
# caching is on, then replay each dataset's prompt dumps at several concurrencies.
#   bash scripts/gpu-bench.sh DATASET...      (dumps in .gpu/dumps/DATASET, results in $OUT or bench/results/gpu)
# A server already answering on $PORT is reused (a later call on the same warm machine skips the start-up).
set -euo pipefail
cd "$(dirname "$0")/.."
[[ -f /tmp/site/env.sh ]] && . /tmp/site/env.sh
MODEL=${MODEL:-.gpu/llama-3.1-8b-dummy}
BLOCK=${BLOCK:-16}  # CUDA; the CPU backend needs 128
PORT=${PORT:-8000}
DEST=${OUT:-bench/results/gpu}
CONCURRENCY=${CONCURRENCY:-1,8,32}
MODES=${MODES:-naive,canonical,auto,naive-matched}
TAG=${TAG:-h200}            # result file suffix
VLLM_EXTRA=${VLLM_EXTRA:-}  # further vLLM flags, e.g. --skip-tokenizer-init
URL=http://127.0.0.1:$PORT
mkdir -p "$DEST"

up() { python3 -c "import sys, urllib.request; urllib.request.urlopen('$URL/health', timeout=2)" 2>/dev/null; }

if ! up; then
  echo "[gpu-bench] starting vLLM ($MODEL) $(date +%T)"
  setsid nohup python3 -m app.vllm_server --model "$MODEL" --load-format dummy --block-size "$BLOCK" \
    --max-model-len 32768 --dev-mode --port "$PORT" -- $VLLM_EXTRA > /var/tmp/vllm.log 2>&1 &
  for _ in $(seq 400); do up && break; sleep 1; done
  up || { tail -60 /var/tmp/vllm.log; exit 1; }
  echo "[gpu-bench] vLLM up $(date +%T)"
fi
head -3 /var/tmp/vllm.log 2>/dev/null || true
python3 - "$URL" <<'PY'
import sys, urllib.request
text = urllib.request.urlopen(sys.argv[1] + "/metrics").read().decode()
info = [line for line in text.splitlines() if line.startswith("vllm:cache_config_info")]
print(info[0] if info else "no vllm:cache_config_info")
assert info and 'enable_prefix_caching="True"' in info[0], "prefix caching is off"
PY
for dataset in "$@"; do
  python3 -m bench.replay --prompts ".gpu/dumps/$dataset" --vllm-url "$URL/v1" --concurrency "$CONCURRENCY" \
    --modes "$MODES" --label "$dataset, Llama-3.1-8B shape (dummy weights)" --out "$DEST/$dataset-$TAG.json"
done
