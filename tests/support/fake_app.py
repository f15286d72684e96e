"""The app over the fake vLLM for the fast tier: one collection of small notes grouped into pages (the ``notes``
fixture, in ``tests/fast/conftest.py``), served by a real app whose vLLM is ``FakeVLLM``."""

from __future__ import annotations

import httpx

from app.serve.app import create_app
from tests.support.corpora import app_settings
from tests.support.fakes import FakeVLLM
from tests.support.servers import AppServer


def serve(notes, embedder, **generation):
    chroma, _, _ = notes
    fake = FakeVLLM()
    settings = app_settings(chroma, "http://unused/v1", collection="notes", hotness_dir=None, **generation)
    return AppServer(create_app(settings, embedder=embedder, llm=fake)), fake


def ask(server, **body) -> httpx.Response:
    return httpx.post(server.url + "/ask", json={"max_tokens": 8, **body}, timeout=30)
