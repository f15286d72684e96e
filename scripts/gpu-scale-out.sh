#!/usr/bin/env bash
# Runs ON the GPU machine: bench.scale_out with CUDA replicas of a model of real size (dummy weights) behind
# vllm-router. One lent H200 holds two replicas with GPU_SHARE of its memory each: that checks routing, the split
# and failover with CUDA vLLM (not throughput, which needs a GPU per replica). The router's wheel travels in
# .whl-router/ (`pip download --no-deps vllm-router==0.1.17 -d .whl-router`); a vLLM serving on :8000 (an earlier
# call's) is stopped first, to free the GPU.
#   bash scripts/gpu-scale-out.sh DATASET [bench.scale_out options]   (results in $OUT or bench/results/gpu)
# Needs what gpu-e2e.sh needs (scripts/gpu-e2e-pack.sh DATASET).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu-extra.sh
TAG=${TAG:-h200}
MODEL=${MODEL:-.gpu/llama-3.1-8b-dummy}
GPU_SHARE=${GPU_SHARE:-0.42}
python3 -m pip install -q --no-index --no-deps --target /tmp/site4 .whl-router/vllm_router-*.whl
export PYTHONPATH=/tmp/site4:$PYTHONPATH
pkill -f "app\.vllm(_server|\.)" || true  # the single vLLM of gpu-vllm.sh, its front ends and engine exit on TERM
for _ in $(seq 90); do [[ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader)" ]] && break; sleep 1; done
dataset=$1
shift
python3 -m bench.scale_out --data "$DATA/$dataset" --model "$MODEL" \
  --launcher-args "--load-format dummy --block-size 16 --gpu-memory-utilization $GPU_SHARE" \
  --out "$DEST/scale-out-$dataset-$TAG.json" "$@"
