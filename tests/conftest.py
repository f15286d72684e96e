"""Shared fixtures. Everything is real: on-disk Chroma or a `chroma run` server, the packaged embedder, and
(for the service tests) a vLLM CPU server with the dummy-weight test model, started once per session."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("ANONYMIZED_TELEMETRY", "False")


from app.vllm_process import LocalVLLM, free_port, wait_for_http  # noqa: E402  (after the env defaults above)


@pytest.fixture(scope="session")
def embedder():
    from app.core.embedder import Embedder
    from app.core.settings import EmbeddingSettings

    return Embedder(EmbeddingSettings())


@pytest.fixture
def settings_factory(tmp_path):
    from app.core.settings import Settings

    def make(collection: str = "test-docs", path: Path | None = None, **env) -> Settings:
        settings = Settings(_env_file=None)
        settings.chroma = settings.chroma.model_copy(update={"path": path or tmp_path / "chroma",
                                                             "collection": collection, "url": None})
        return settings

    return make


@pytest.fixture(scope="session")
def chroma_server(tmp_path_factory):
    """A real `chroma run` server on a free port."""
    port = free_port()
    data = tmp_path_factory.mktemp("chroma-server")
    chroma = Path(sys.executable).with_name("chroma")
    log = open(data / "server.log", "w")
    process = subprocess.Popen([str(chroma), "run", "--path", str(data / "db"), "--host", "127.0.0.1",
                                "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                               env=os.environ | {"ANONYMIZED_TELEMETRY": "False"})
    try:
        wait_for_http(f"http://127.0.0.1:{port}/api/v2/heartbeat", 60, process)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(20)


def run_cli(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ingest", *args], cwd=ROOT, capture_output=True, text=True,
                          env=os.environ | (env or {}), timeout=timeout)


@pytest.fixture(scope="module")
def collections(tmp_path_factory, embedder):
    """The service tests' collections in one on-disk Chroma (see ``tests.corpora``); returns its path."""
    from tests.corpora import write_service_collections

    return write_service_collections(tmp_path_factory.mktemp("service"), embedder)


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory):
    """A real vLLM CPU server (dummy-weight test model, prefix caching on), once per test session: (url, log)."""
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    with LocalVLLM(log, max_model_len=4096, startup_timeout_s=600) as url:
        yield url, log


@pytest.fixture(scope="session")
def vllm_url(vllm_server):
    return vllm_server[0]
