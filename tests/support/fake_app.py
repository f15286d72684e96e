"""The app over the fake vLLM for the fast tier: one collection of small notes grouped into pages (the ``notes``
fixture, in ``tests/fast/conftest.py``), served by a real app whose vLLM is ``FakeVLLM``."""

from __future__ import annotations

from concurrent.futures import Future

import httpx

from app.serve.app import create_app
from tests.support.corpora import app_settings
from tests.support.fakes import FakeVLLM
from tests.support.servers import AppServer
from tests.support.vllm_state import wait_until


def serve(notes, embedder, **generation):
    chroma, _, _ = notes
    fake = FakeVLLM()
    settings = app_settings(chroma, "http://unused/v1", collection="notes", hotness_dir=None, **generation)
    return AppServer(create_app(settings, embedder=embedder, llm=fake)), fake


def ask(server, **body) -> httpx.Response:
    return httpx.post(server.url + "/ask", json={"max_tokens": 8, **body}, timeout=30)


def place_taken(server) -> None:
    """Until a request holds a place of admission (or is queued for one)."""
    wait_until(lambda: server.app.state.services.traffic.present > 0, 10, "a place of admission taken")


def hold_the_place(server, pool) -> Future[httpx.Response]:
    """A question, asked on ``pool``, that takes a place (a ``GatedVLLM`` then holds it until its gate is set)."""
    held = pool.submit(ask, server, question="What?")
    place_taken(server)
    return held
