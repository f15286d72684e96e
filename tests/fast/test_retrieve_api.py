"""The fast tier, ``POST /v1/retrieve``: the ranking ``/ask`` uses, each hit with its whole text and the stable
unit it belongs to, over a real on-disk Chroma with the real embedder; it needs no vLLM (tested with none
listening), checks its input as ``/ask`` does, and refuses at once beyond its own bound."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from app.serve.app import create_app
from tests.support.corpora import app_settings
from tests.support.fake_app import ask, serve
from tests.support.servers import AppServer


def retrieve(server, **body) -> httpx.Response:
    return httpx.post(server.url + "/v1/retrieve", json=body, timeout=30)


def test_retrieve_ranks_as_ask_does_and_names_the_unit_each_hit_is_shown_in(notes, embedder):
    _, texts, index = notes
    member = next(m for members in index.pages.values() if len(members) >= 3 for m in members)
    question = texts[member][:300]
    server, _ = serve(notes, embedder, strategy="document", top_k=5)
    with server:
        server.wait_ready()
        found = retrieve(server, question=question)
        answered = ask(server, question=question).json()
        scoped = retrieve(server, question=question, top_k=2, filters={"source_prefix": "notes"}).json()["data"]
    assert found.status_code == 200, found.text
    hits = found.json()["data"]
    assert [hit["rank"] for hit in hits] == [1, 2, 3, 4, 5] and hits[0]["document"] == member
    assert [hit["score"] for hit in hits] == sorted((hit["score"] for hit in hits), reverse=True)
    assert all(hit["text"] and hit["text"] in texts[hit["document"]] for hit in hits)
    assert all(hit["id"] == f"{hit['document']}::{hit['chunk_index']}" for hit in hits)
    assert [hit["unit"] for hit in hits] == [index.page_of(hit["document"]) for hit in hits]  # small notes: pages
    # /ask shows the same ranking: its sources are those hits, the best first.
    assert answered["sources"][0]["chunk_id"] == hits[0]["chunk_id"]
    assert {s["chunk_id"] for s in answered["sources"]} <= {hit["chunk_id"] for hit in hits}
    # Filtered to a source, a prompt shows a hit's own document, never a page that may hold other sources.
    assert len(scoped) == 2 and all(hit["unit"] == hit["document"] for hit in scoped)


def test_retrieve_needs_no_vllm_checks_its_input_and_refuses_beyond_its_bound(notes, embedder):
    chroma, texts, _ = notes
    settings = app_settings(chroma, "http://127.0.0.1:9/v1", collection="notes", hotness_dir=None)  # nobody there
    settings.traffic.max_retrievals = 1
    with AppServer(create_app(settings, embedder=embedder)) as server:
        assert httpx.get(server.url + "/readyz", timeout=10).status_code == 503  # vLLM is down
        ranked = retrieve(server, question=texts["para-001"][:200], top_k=3)
        bad = [retrieve(server, question=" "), retrieve(server, question="What?", top_k=0),
               retrieve(server, question="What?", stream=True), retrieve(server, question="What?", top_k="3")]
        service, release = server.app.state.services.service, threading.Event()
        ranks = service.pipeline.retrieve

        async def held(lookup):
            while not release.is_set():
                await asyncio.sleep(0.01)
            return await ranks(lookup)

        service.pipeline.retrieve = held
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(retrieve, server, question="What is held?")
            while service._retrievals == 0:
                time.sleep(0.01)
            refused = retrieve(server, question="And now?")
            release.set()
            admitted = first.result()
    assert ranked.status_code == 200, ranked.text
    assert [hit["document"] for hit in ranked.json()["data"]][0] == "para-001"
    assert [r.status_code for r in bad] == [400] * 4
    assert [r.json()["error"]["param"] for r in bad[:2]] == ["question", "top_k"]
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1", refused.text
    assert refused.json()["error"]["code"] == "overloaded" and admitted.status_code == 200
