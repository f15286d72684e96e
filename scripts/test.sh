#!/usr/bin/env bash
# The whole test suite from a fresh machine: set up .venv, install the browser for the page test, run pytest.
# Every service the tests need (vLLM CPU server, `chroma run`, the app) is started by the tests themselves.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if ! command -v chromium >/dev/null 2>&1; then
  echo "[test] installing Debian chromium for the page test" >&2
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "[test] chromium could not be installed; the browser test will fail" >&2
fi
exec .venv/bin/python -m pytest -q -ra "$@"
