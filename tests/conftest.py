"""Shared fixtures. Everything is real: on-disk Chroma or a `chroma run` server, the packaged embedder, and
(for the service tests) a vLLM CPU server with the dummy-weight test model, started once per session."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.vllm.process import LocalVLLM, chroma_child, free_port
from tests.support.env import ROOT  # noqa: F401  (sets the environment every test process needs)


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
    server = chroma_child(data / "db", port, data / "server.log").start()
    try:
        server.wait_for(f"http://127.0.0.1:{port}/api/v2/heartbeat", 60)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop(20)


@pytest.fixture(scope="module")
def collections(tmp_path_factory, embedder):
    """The service tests' collections in one on-disk Chroma (see ``tests.support.corpora``); returns its path."""
    from tests.support.corpora import write_service_collections

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


@pytest.fixture(scope="module")
def articles_db(tmp_path_factory, embedder):
    """Two "articles" of eight paragraphs (records sharing a title are one parent document), unpaged: the
    strategy tests are about whole articles as units."""
    from app.core.settings import Settings
    from ingest.pipeline import run_ingest
    from tests.support.corpora import ARTICLES

    base = tmp_path_factory.mktemp("strategies")
    records = [{"id": f"{t}#{i}", "title": t, "text": text} for t, texts in ARTICLES.items()
               for i, text in enumerate(texts)]
    (base / "articles.jsonl").write_text("\n".join(map(json.dumps, records)) + "\n")
    settings = Settings(_env_file=None)
    settings.chroma.path, settings.chroma.collection = base / "chroma", "articles"
    settings.pages.tokens = 0
    run_ingest([base / "articles.jsonl"], settings, embedder)
    return base / "chroma"


TIERS = {"fast": set(), "vllm": {"vllm"}, "cluster": {"vllm", "cluster"}}  # folder -> the marks its tests carry


def pytest_collection_modifyitems(items):
    """A test's folder is its tier: ``fast/`` needs no vLLM, ``vllm/`` starts the real vLLM CPU server,
    ``cluster/`` two replicas behind vllm-router. A test whose marks disagree with its folder fails collection."""
    for item in items:
        tier = Path(item.path).parent.name
        if tier in TIERS:
            marks = {mark.name for mark in item.iter_markers()} & {"vllm", "cluster"}
            if marks != TIERS[tier]:
                raise pytest.UsageError(f"{item.nodeid}: marked {sorted(marks)}, but {tier}/ holds tests marked "
                                        f"{sorted(TIERS[tier])}")
