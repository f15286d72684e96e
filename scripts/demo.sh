#!/usr/bin/env bash
# The main job on a fresh machine: install, start vLLM on CPU, ingest examples/docs/, serve, answer two questions.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python scripts/demo.py "$@"
