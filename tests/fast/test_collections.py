"""The fast tier, several collections served by one process (``PREFIXRAG_CHROMA__COLLECTIONS``): each is a model
(``prefixrag``, ``prefixrag/<name>``) and the ``collection`` of ``/ask``, ``/v1/retrieve`` and the documents
endpoints; a question is answered from its collection alone, an upload or a deletion changes only its own, and a
key sees only its tenant's. With the service's own ranking and with a ranking worker (one pool for every
collection). Real on-disk Chroma, the real embedder and ingest; the fake vLLM at its seam."""

from __future__ import annotations

import asyncio
import collections
import json

import httpx
import pytest
from openai import OpenAI

from app.core import collections_store
from app.core.store import open_client
from app.serve.app import create_app
from ingest.pipeline import run_ingest
from tests.fast.test_documents_api import finished
from tests.support.corpora import ARTICLES, FACTS, app_settings, paragraphs
from tests.support.fakes import FakeVLLM
from tests.support.servers import AppServer
from tests.support.vllm_state import wait_until

VELMORA = b"# Velmora\n\nThe harbour of Velmora was dredged in 1911 so that steamers could dock at night.\n"
TENANTS = {"tenants": [{"name": "crew", "keys": ["key-crew"], "collections": ["facts"], "write": True},
                       {"name": "port", "keys": ["key-port"], "collections": ["harbour"], "write": True}]}


def two_collections(tmp_path, embedder, workers=0):
    """facts (four one-chunk notes) and harbour (six), in one on-disk Chroma; settings serving both."""
    roots = {"facts": tmp_path / "facts", "harbour": tmp_path / "harbour"}
    for root in roots.values():
        root.mkdir()
    for name, text in FACTS.items():
        (roots["facts"] / name).write_text(text + "\n")
    for title, texts in ARTICLES.items():
        for number, text in enumerate(texts):
            (roots["harbour"] / f"{title.lower()}-{number}.md").write_text(f"# {title}\n\n{text}\n")
    settings = app_settings(tmp_path / "chroma", "http://unused/v1", collection="facts", top_k=3,
                            hotness_dir=None)
    for name, root in roots.items():
        run_ingest([root], settings.model_copy(update={"chroma": settings.chroma.model_copy(
            update={"collection": name})}), embedder)
    settings.chroma.collections, settings.retrieval.workers = ["harbour"], workers
    return settings


def documents_of(response: httpx.Response) -> set[str]:
    assert response.status_code == 200, response.text
    body = response.json()
    return {source["document"] for source in body.get("sources", body.get("data", []))}


def models_of(url: str) -> list[str]:
    return [model["id"] for model in httpx.get(url + "/v1/models", timeout=30).json()["data"]]


@pytest.mark.parametrize("workers", [0, 1])
def test_each_collection_is_a_model_and_answers_only_from_itself(tmp_path, embedder, workers):
    settings = two_collections(tmp_path, embedder, workers=workers)
    question = "When was the lighthouse at the harbour mouth lit?"
    with AppServer(create_app(settings, embedder=embedder, llm=FakeVLLM())) as server:
        server.wait_ready()
        url = server.url
        models = [model.id for model in OpenAI(base_url=url + "/v1", api_key="none").models.list().data]
        listed = httpx.get(url + "/v1/collections", timeout=30).json()["data"]
        first = documents_of(httpx.post(url + "/ask", json={"question": question}, timeout=60))
        harbour = documents_of(httpx.post(url + "/ask", json={"question": question, "collection": "harbour"},
                                          timeout=60))
        retrieved = documents_of(httpx.post(url + "/v1/retrieve", json={"question": question,
                                                                        "collection": "harbour"}, timeout=60))
        chat = OpenAI(base_url=url + "/v1", api_key="none").chat.completions.create(
            model="prefixrag/harbour", max_tokens=4, messages=[{"role": "user", "content": question}])
        unknown = httpx.post(url + "/ask", json={"question": question, "collection": "nowhere"}, timeout=30)
        no_model = httpx.post(url + "/v1/chat/completions", timeout=30, json={
            "model": "prefixrag/nowhere", "messages": [{"role": "user", "content": question}]})
        # An upload to one collection lands there alone; a deletion there leaves the other untouched.
        job = finished(server, httpx.post(url + "/v1/documents", params={"collection": "harbour"}, timeout=60,
                                          files=[("files", ("velmora.md", VELMORA))]))
        held = {name: {d["id"] for d in httpx.get(url + "/v1/documents", params={"collection": name},
                                                  timeout=30).json()["data"]} for name in ("facts", "harbour")}
        velmora = documents_of(httpx.post(url + "/ask", timeout=60, json={
            "question": "When was the harbour of Velmora dredged?", "collection": "harbour"}))
        deleted = httpx.delete(url + "/v1/documents/velmora.md", params={"collection": "harbour"}, timeout=60)
        in_facts = httpx.delete(url + "/v1/documents/velmora.md", params={"collection": "facts"}, timeout=60)
        after = documents_of(httpx.post(url + "/ask", timeout=60, json={
            "question": "When was the harbour of Velmora dredged?", "collection": "harbour"}))
    assert models == ["prefixrag", "prefixrag/harbour"]
    assert [(c["id"], c["model"], c["ready"]) for c in listed] == [
        ("facts", "prefixrag", True), ("harbour", "prefixrag/harbour", True)]
    assert first and first <= set(FACTS), first
    assert harbour and all(doc.startswith(("harbour-", "glacier-")) for doc in harbour | retrieved), harbour
    assert chat.model == "prefixrag/harbour"
    assert {source["document"] for source in chat.model_extra["sources"]} <= harbour | retrieved | {"harbour-1.md"}
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "collection_not_found"
    assert no_model.status_code == 404 and no_model.json()["error"]["code"] == "model_not_found"
    assert job["status"] == "done", job
    assert "velmora.md" in held["harbour"] and "velmora.md" not in held["facts"]
    assert "velmora.md" in velmora
    assert deleted.status_code == 200 and in_facts.status_code == 404
    assert "velmora.md" not in after


class SlowWarmups(FakeVLLM):
    """Each warm-up request takes a while; the most in flight at once is recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.running = self.most = 0

    async def complete(self, request: dict):
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            await asyncio.sleep(0.05)
            return await super().complete(request)
        finally:
            self.running -= 1


def test_pre_warm_keeps_its_bounds_for_every_collection_together(tmp_path, embedder):
    """``PREFIXRAG_WARMUP__CONCURRENCY`` bounds the warm-up requests of all the collections served, not each's."""
    settings = two_collections(tmp_path, embedder)
    settings.warmup.concurrency = 1
    llm = SlowWarmups()
    with AppServer(create_app(settings, embedder=embedder, llm=llm)) as server:
        server.wait_ready()
        wait_until(lambda: all(collection["warmup"]["state"] == "done" for collection in httpx.get(
            server.url + "/v1/collections", timeout=30).json()["data"]), 60, "both collections warmed")
    assert llm.most == 1


def test_a_key_sees_and_names_only_its_tenants_collections(tmp_path, embedder):
    settings = two_collections(tmp_path, embedder)
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(TENANTS))
    settings.service.keys_file = keys
    with AppServer(create_app(settings, embedder=embedder, llm=FakeVLLM())) as server:
        server.wait_ready()

        def call(method: str, path: str, key: str, **kwargs) -> httpx.Response:
            return httpx.request(method, server.url + path, headers={"authorization": f"Bearer {key}"},
                                 timeout=60, **kwargs)

        models = {key: [m["id"] for m in call("GET", "/v1/models", key).json()["data"]]
                  for key in ("key-crew", "key-port")}
        statuses = {
            "port asks the first": call("POST", "/ask", "key-port", json={"question": "tides?"}).status_code,
            "port asks its own": call("POST", "/ask", "key-port", json={"question": "tides?",
                                                                        "collection": "harbour"}).status_code,
            "port chats by default": call("POST", "/v1/chat/completions", "key-port", json={
                "messages": [{"role": "user", "content": "tides?"}], "max_tokens": 4}).status_code,
            "crew names harbour's model": call("POST", "/v1/chat/completions", "key-crew", json={
                "model": "prefixrag/harbour", "messages": [{"role": "user", "content": "tides?"}]}).status_code,
            "crew lists harbour": call("GET", "/v1/documents", "key-crew",
                                       params={"collection": "harbour"}).status_code,
            "crew describes harbour": call("GET", "/v1/collections/harbour", "key-crew").status_code,
        }
    assert models == {"key-crew": ["prefixrag"], "key-port": ["prefixrag/harbour"]}
    assert statuses == {"port asks the first": 404, "port asks its own": 200, "port chats by default": 404,
                        "crew names harbour's model": 404, "crew lists harbour": 404, "crew describes harbour": 404}


def test_a_served_collection_that_is_missing_is_refused_alone(tmp_path, embedder):
    settings = two_collections(tmp_path, embedder)
    settings.chroma.collections = ["harbour", "absent"]
    with AppServer(create_app(settings, embedder=embedder, llm=FakeVLLM())) as server:
        server.wait_ready()
        described = httpx.get(server.url + "/v1/collections/absent", timeout=30).json()
        absent = httpx.post(server.url + "/ask", json={"question": "tides?", "collection": "absent"}, timeout=30)
        harbour = httpx.post(server.url + "/ask", json={"question": "tides?", "collection": "harbour"}, timeout=30)
    assert (described["ready"], described["model"]) == (False, "prefixrag/absent")
    assert "does not exist" in described["problem"]
    assert absent.status_code == 503 and absent.json()["error"]["code"] == "collection_unavailable", absent.text
    assert harbour.status_code == 200


@pytest.mark.parametrize("workers", [0, 1])
def test_a_collection_made_over_http_is_served_at_once_and_after_a_restart_until_deleted(tmp_path, embedder,
                                                                                         workers):
    settings = two_collections(tmp_path, embedder, workers)
    made = {"id": "logbook"}
    with AppServer(create_app(settings, embedder=embedder, llm=FakeVLLM())) as server:
        server.wait_ready()
        url = server.url
        created = httpx.post(url + "/v1/collections", json=made, timeout=60)
        again = httpx.post(url + "/v1/collections", json=made, timeout=60)
        bad = httpx.post(url + "/v1/collections", json={"id": "-no"}, timeout=60)
        empty = httpx.post(url + "/ask", json={"question": "tides?", "collection": "logbook"}, timeout=60)
        job = finished(server, httpx.post(url + "/v1/documents", params={"collection": "logbook"}, timeout=60,
                                          files=[("files", ("velmora.md", VELMORA))]))
    with AppServer(create_app(settings, embedder=embedder, llm=FakeVLLM())) as server:  # a restart
        server.wait_ready()
        url = server.url
        models = models_of(url)
        cited = documents_of(httpx.post(url + "/ask", timeout=60, json={
            "question": "When was the harbour of Velmora dredged?", "collection": "logbook"}))
        configured = httpx.delete(url + "/v1/collections/harbour", timeout=60)
        deleted = httpx.delete(url + "/v1/collections/logbook", timeout=60)
        gone = httpx.post(url + "/ask", json={"question": "tides?", "collection": "logbook"}, timeout=30)
        after = models_of(url)
        remade = httpx.post(url + "/v1/collections", json=made, timeout=60)  # the name again: nothing of before
        fresh = documents_of(httpx.post(url + "/ask", timeout=60, json={
            "question": "When was the harbour of Velmora dredged?", "collection": "logbook"}))
        httpx.delete(url + "/v1/collections/logbook", timeout=60)
    with AppServer(create_app(settings, embedder=embedder, llm=FakeVLLM())) as server:  # and another
        server.wait_ready()
        still = models_of(server.url)
    assert created.status_code == 201, created.text
    assert (created.json()["model"], created.json()["ready"], created.json()["chunks"]) == ("prefixrag/logbook",
                                                                                          True, 0)
    assert again.status_code == 409 and again.json()["error"]["code"] == "collection_exists"
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_collection_name"
    assert empty.status_code == 200 and empty.json()["sources"] == []
    assert job["status"] == "done", job
    assert models == ["prefixrag", "prefixrag/harbour", "prefixrag/logbook"] and "velmora.md" in cited
    assert configured.status_code == 409 and configured.json()["error"]["code"] == "collection_configured"
    assert deleted.status_code == 200 and deleted.json() == {"id": "logbook", "object": "collection.deleted",
                                                              "deleted": True}
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "collection_not_found"
    assert after == still == ["prefixrag", "prefixrag/harbour"]
    assert remade.status_code == 201 and fresh == set()
    assert not (tmp_path / "chroma" / "prefixrag-lexical" / "logbook").exists()


@pytest.mark.chroma_server
def test_collections_made_uploaded_to_and_deleted_on_a_chroma_server_follow_on_every_replica(tmp_path, embedder,
                                                                                            chroma_server):
    """Two service replicas on one Chroma server: what one makes, fills and deletes over HTTP, the other serves
    and stops serving at its next polls, without a restart."""
    settings = app_settings(tmp_path / "unused", "http://unused/v1", collection="served-first", top_k=3,
                            hotness_dir=None)
    settings.chroma.url, settings.chroma.lexical_dir = chroma_server, tmp_path / "lexical"
    settings.chroma.poll_s = 0.2
    (tmp_path / "first").mkdir()
    (tmp_path / "first" / "tides.md").write_text(FACTS["tides.md"] + "\n")
    run_ingest([tmp_path / "first"], settings, embedder)
    velmora = {"question": "When was the harbour of Velmora dredged?", "collection": "server-logbook"}
    with AppServer(create_app(settings, embedder=embedder, llm=FakeVLLM())) as server, \
            AppServer(create_app(settings.model_copy(deep=True), embedder=embedder, llm=FakeVLLM())) as other:
        server.wait_ready()
        other.wait_ready()
        url = server.url
        created = httpx.post(url + "/v1/collections", json={"id": "server-logbook"}, timeout=60)
        job = finished(server, httpx.post(url + "/v1/documents", params={"collection": "server-logbook"},
                                          timeout=60, files=[("files", ("velmora.md", VELMORA))]))
        cited = documents_of(httpx.post(url + "/ask", timeout=60, json=velmora))
        wait_until(lambda: "prefixrag/server-logbook" in models_of(other.url), 30, "the other replica serves it")
        wait_until(lambda: "velmora.md" in documents_of(httpx.post(other.url + "/ask", timeout=60, json=velmora)),
                   30, "the other replica answers from its upload")
        recorded = collections_store.recorded(settings.chroma)
        deleted = httpx.delete(url + "/v1/collections/server-logbook", timeout=60)
        wait_until(lambda: models_of(other.url) == ["prefixrag"], 30, "the other replica no longer serves it")
        gone = httpx.post(other.url + "/ask", json=velmora, timeout=30)
    names = {collection.name for collection in open_client(settings.chroma).list_collections()}
    assert created.status_code == 201 and job["status"] == "done", (created.text, job)
    assert "velmora.md" in cited and recorded == ["server-logbook"]
    assert deleted.status_code == 200 and "server-logbook" not in names and "served-first" in names
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "collection_not_found"


def test_questions_asked_while_an_upload_fills_a_collection_made_empty_are_answered(tmp_path, embedder):
    """With a ranking worker, whose store handle was opened on the empty collection: every question asked while the
    upload's chunks are written gets an answer (with what is searchable so far), and the upload's text once done."""
    settings = two_collections(tmp_path, embedder, workers=1)
    notes = [("velmora.md", VELMORA)] + [(f"note-{n:03d}.md", f"# Note {n}\n\n{text}\n".encode())
                                         for n, text in enumerate(paragraphs() * 3)]
    statuses: collections.Counter[int] = collections.Counter()
    with AppServer(create_app(settings, embedder=embedder, llm=FakeVLLM())) as server:
        server.wait_ready()
        url, question = server.url, {"question": "When was the harbour of Velmora dredged?", "collection": "logbook"}
        assert httpx.post(url + "/v1/collections", json={"id": "logbook"}, timeout=60).status_code == 201
        assert httpx.post(url + "/ask", json=question, timeout=60).status_code == 200  # the worker opens it empty
        accepted = httpx.post(url + "/v1/documents", params={"collection": "logbook"}, timeout=60, files=[
            ("files", note) for note in notes])
        location = url + accepted.headers["location"]
        while httpx.get(location, timeout=10).json()["status"] in ("queued", "running"):
            statuses[httpx.post(url + "/ask", json=question, timeout=60).status_code] += 1
        job = finished(server, accepted)
        cited = documents_of(httpx.post(url + "/ask", json=question, timeout=60))
    assert job["status"] == "done", job
    assert set(statuses) == {200}, statuses
    assert "velmora.md" in cited
