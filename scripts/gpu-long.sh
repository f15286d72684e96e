#!/usr/bin/env bash
# Runs ON the GPU machine: bench.long_context (a dataset bound into books of UNIT tokens; naive top-k, naive filling
# a book's budget, prefixrag with book-sized units) against CUDA vLLM started by scripts/gpu-vllm.sh with a window
# of twice a book (MAX_MODEL_LEN; the model folder must allow it: python -m app.testmodel --max-model-len).
#   UNIT=32768 bash scripts/gpu-long.sh DATASET [bench.long_context options]   (results in $OUT or bench/results/gpu)
# PROFILE=1 samples vLLM's API server and engine core with py-spy for the whole run (raw stacks beside the JSON).
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
name=long-context-$dataset-$((UNIT / 1024))k-$TAG
spies=()
if [[ -n "${PROFILE:-}" ]]; then  # py-spy (carried as a wheel in .whl/) samples vLLM's API server and engine core
  python3 -m pip install -q --no-index --no-deps --target /tmp/site3 .whl/py_spy-*.whl
  for part in "api-server:app[.]vllm[.](entry|launcher) " "engine-core:VLLM::EngineCore"; do
    /tmp/site3/bin/py-spy record --nonblocking -r 100 -f raw -o "$DEST/profile-$name-${part%%:*}.txt" \
      -p "$(pgrep -f "${part#*:}" | head -1)" > /dev/null 2>&1 &
    spies+=($!)
  done
fi
python3 -m bench.long_context --data "$DATA/$dataset" --unit-tokens "$UNIT" --vllm-url "$URL/v1" \
  --chroma-path "/var/tmp/bench-long/$dataset" --out "$DEST/$name.json" "$@"
if ((${#spies[@]})); then kill -INT "${spies[@]}" 2>/dev/null || true; wait "${spies[@]}" || true; fi
