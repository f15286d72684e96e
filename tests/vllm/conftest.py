"""Fixtures the vLLM tier's modules share."""

from __future__ import annotations

import pytest

from app.serve.app import create_app
from tests.support.corpora import app_settings
from tests.support.servers import AppServer


@pytest.fixture(scope="module")
def server(collections, vllm_url, embedder):
    """The service over the project's own docs (top 3), ready; one per module, so no module sees another's state."""
    settings = app_settings(collections, vllm_url, collection="project-docs", top_k=3)
    with AppServer(create_app(settings, embedder=embedder)) as running:
        running.wait_ready()
        yield running
