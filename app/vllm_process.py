"""A vLLM server as a child process of ours (benchmarks, tests): started through ``app.vllm_server`` with the
project's flags, awaited until it serves, and stopped with its whole process group."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_http(url: str, timeout: float, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"process for {url} exited with {process.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not up after {timeout}s")


class LocalVLLM:
    """``with LocalVLLM(log_path, max_model_len) as url:`` the CPU test model (dev mode: its prefix cache can
    be reset) on a free port; ``url`` ends in ``/v1``."""

    def __init__(self, log_path: Path, max_model_len: int = 4096, startup_timeout_s: float = 900) -> None:
        self.log_path, self.max_model_len, self.startup_timeout_s = log_path, max_model_len, startup_timeout_s
        self.port = free_port()
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> str:
        log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "app.vllm_server", "--test-model", "--dev-mode", "--port", str(self.port),
             "--max-model-len", str(self.max_model_len)],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=os.environ | {"PYTHONUNBUFFERED": "1"},
            start_new_session=True)  # its own process group: stopping it stops vLLM's workers too
        try:
            wait_for_http(f"http://127.0.0.1:{self.port}/v1/models", self.startup_timeout_s, self.process)
        except Exception:
            print(self.log_path.read_text()[-5000:], file=sys.stderr)
            self.__exit__()
            raise
        return f"http://127.0.0.1:{self.port}/v1"

    def __exit__(self, *exc) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
