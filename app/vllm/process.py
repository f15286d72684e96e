"""Servers as child processes of ours (the cluster launcher, benchmarks, tests): each in its own process group
(stopping it stops its workers too), its output in a log, awaited until it serves."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]  # the project root: children run from there


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_http(url: str, timeout: float, process: subprocess.Popen[bytes] | None = None) -> None:
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


class Child:
    """``Child(name, argv, log_path, env).start()``; ``wait_for(url)``; ``stop()`` (SIGTERM, then SIGKILL) or
    ``kill()`` (SIGKILL at once: a crash, for failure tests)."""

    def __init__(self, name: str, argv: list[str], log_path: Path | None, env: dict[str, str] | None = None) -> None:
        """``log_path`` None: the child writes to our own terminal."""
        self.name, self.argv, self.log_path, self.env = name, argv, log_path, env or {}
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> Child:
        env = os.environ | {"PYTHONUNBUFFERED": "1"} | self.env
        if self.log_path is None:
            self.process = subprocess.Popen(self.argv, cwd=ROOT, env=env, start_new_session=True)
            return self
        with open(self.log_path, "a") as log:
            self.process = subprocess.Popen(self.argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)
        return self

    def wait_for(self, url: str, timeout: float) -> None:
        try:
            wait_for_http(url, timeout, self.process)
        except Exception:
            if self.log_path is not None:
                print(f"--- {self.name} ({self.log_path}) ---\n{self.log_path.read_text()[-5000:]}", file=sys.stderr)
            self.stop()
            raise

    @property
    def pid(self) -> int:
        assert self.process is not None, "not started"
        return self.process.pid

    def wait(self) -> int:
        """Until it exits (Ctrl-C here: it is stopped, draining as on SIGTERM, and the interrupt goes on)."""
        assert self.process is not None, "not started"
        try:
            return self.process.wait()
        except KeyboardInterrupt:
            self.stop()
            raise

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout: float = 60) -> None:
        if self.process is None or not self.running:
            return
        self._signal(self.process, signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        if self.process is not None and self.running:
            self._signal(self.process, signal.SIGKILL)
            self.process.wait(30)

    @staticmethod
    def _signal(process: subprocess.Popen[bytes], sig: int) -> None:
        try:
            os.killpg(process.pid, sig)  # its own process group: the server and every worker it started
        except ProcessLookupError:
            pass


def app_child(log_path: Path | None, env: dict[str, str], port: int | None = None) -> Child:
    """The query service (``python -m app``) as a child, configured by ``env`` (``PREFIXRAG_*``); ``port`` sets
    PREFIXRAG_SERVICE__PORT. Not started yet."""
    env = env | ({"PREFIXRAG_SERVICE__PORT": str(port)} if port is not None else {})
    return Child("app", [sys.executable, "-m", "app"], log_path, env)


def chroma_child(path: Path, port: int, log_path: Path) -> Child:
    """A Chroma server (``chroma run``, telemetry off) on ``port`` storing into ``path``. Not started yet."""
    argv = [str(Path(sys.executable).with_name("chroma")), "run", "--path", str(path), "--host", "127.0.0.1",
            "--port", str(port)]
    return Child("chroma", argv, log_path, {"ANONYMIZED_TELEMETRY": "False"})


def vllm_argv(port: int, *flags: str) -> list[str]:
    """The project's launcher (``python -m app.vllm_server``) on ``port``, with further launcher flags."""
    return [sys.executable, "-m", "app.vllm_server", "--port", str(port), *flags]


class LocalVLLM:
    """``with LocalVLLM(log_path, max_model_len) as url:`` the CPU test model (dev mode: its prefix cache can
    be reset) on a free port (or ``port``); ``url`` ends in ``/v1``."""

    def __init__(self, log_path: Path, max_model_len: int = 4096, startup_timeout_s: float = 900,
                 port: int | None = None, env: dict[str, str] | None = None) -> None:
        self.port = port or free_port()
        self.startup_timeout_s = startup_timeout_s
        argv = vllm_argv(self.port, "--test-model", "--dev-mode", "--max-model-len", str(max_model_len))
        self.child = Child("vLLM", argv, log_path, env)

    def __enter__(self) -> str:
        self.child.start().wait_for(f"http://127.0.0.1:{self.port}/v1/models", self.startup_timeout_s)
        return f"http://127.0.0.1:{self.port}/v1"

    def __exit__(self, *exc: object) -> None:
        self.child.stop()
