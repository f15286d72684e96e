"""Where the project is, the environment every test process starts with, and ingest's CLI as users run it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("ANONYMIZED_TELEMETRY", "False")


def run_cli(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m ingest ARGS`` from the project root."""
    return subprocess.run([sys.executable, "-m", "ingest", *args], cwd=ROOT, capture_output=True, text=True,
                          env=os.environ | (env or {}), timeout=timeout)
