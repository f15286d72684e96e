#!/usr/bin/env bash
# The whole test suite from a fresh machine: set up .venv, install the browser for the page test, run pytest.
# Every service the tests need (vLLM CPU server, `chroma run`, the app) is started by the tests themselves.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Debian packages the tests drive: chromium (the page test), docker-compose (validates docker/compose.yaml).
missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
if ((${#missing[@]})); then
  echo "[test] installing Debian packages: ${missing[*]}" >&2
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null) \
    || echo "[test] ${missing[*]} could not be installed; the tests that need them will fail" >&2
fi
# A lint or type finding fails the run before the slow tests start.
.venv/bin/ruff check app ingest bench tests scripts
.venv/bin/mypy  # app/, ingest/ and bench/, configured in pyproject.toml
.venv/bin/lint-imports --no-cache  # the kernel contracts in pyproject.toml: app and ingest share app.core only
exec .venv/bin/python -m pytest -q -ra "$@"
