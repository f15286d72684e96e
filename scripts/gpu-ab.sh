#!/usr/bin/env bash
# bench.throughput for two versions of the app on one warm vLLM, their runs alternating: on a lent machine the host
# drifts between runs more than most changes move the figures, so each version's runs interleave with the other's.
#   Here:   bash scripts/gpu-ab.sh pack COMMIT
#           writes .gpu/base (BASE_DIR): COMMIT's app, bench, ingest and prompts (no results) and its id, which the
#           runs record as their commit; carry it with the run (scripts/gpu-e2e-pack.sh DATASET for the rest).
#   There:  ROUNDS=4 TAG=h100-s64 bash scripts/gpu-ab.sh run DATASET [bench.throughput options]
#           "head" (this tree) then "base", ROUNDS times; HEAD_ENV / BASE_ENV: app settings for one side only
#           (e.g. BASE_ENV=PREFIXRAG_EMBEDDING__DEVICE=cpu, base packed from the same commit as head). Naive's
#           encoder runs on the CPU (beside vLLM and the app's encoders an 80 GB card has no room for a fourth).
set -euo pipefail
cd "$(dirname "$0")/.."
BASE_DIR=${BASE_DIR:-.gpu/base}
case ${1:-} in
pack)
  commit=$(git rev-parse --short=7 "${2:?pack COMMIT}")
  rm -rf "$BASE_DIR" && mkdir -p "$BASE_DIR"
  git archive "$commit" app bench ingest prompts pyproject.toml | tar x -C "$BASE_DIR"
  rm -rf "$BASE_DIR/bench/results"
  echo "$commit" > "$BASE_DIR/COMMIT"
  echo "$BASE_DIR: $commit"
  ;;
run)
  dataset=${2:?run DATASET}
  shift 2
  . scripts/gpu-extra.sh
  . scripts/gpu-vllm.sh
  TAG=${TAG:-ab}
  export PREFIXRAG_EMBEDDING__DEVICE=cpu  # naive's encoder; the app's own is set by --app-env below
  here=$PWD
  absolute() { [[ $1 == /* ]] && echo "$1" || echo "$here/$1"; }  # base runs from its own folder
  tokenizer=$(absolute "$MODEL") dest=$(absolute "$DEST")
  for round in $(seq "${ROUNDS:-3}"); do
    for side in head base; do
      folder=$here extra=${HEAD_ENV:-}
      if [[ $side == base ]]; then folder=$(absolute "$BASE_DIR") extra=${BASE_ENV:-}; fi
      (cd "$folder" && python3 -m bench.throughput --data "$DATA/$dataset" --chroma /var/tmp/bench-throughput \
        --vllm-url "$URL/v1" --arms prefixrag,naive --warmup-s 15 --app-env PREFIXRAG_EMBEDDING__DEVICE=auto \
        --app-env "PREFIXRAG_VLLM__TOKENIZER=$tokenizer" ${extra:+--app-env "$extra"} \
        --app-log "/var/tmp/ab-$side-$round.log" --out "$dest/throughput-$dataset-$TAG-$side-$round.json" "$@")
      echo "[gpu-ab] $side $round done $(date +%T)"
    done
  done
  ;;
*)
  sed -n '2,10p' "$0"
  exit 2
  ;;
esac
