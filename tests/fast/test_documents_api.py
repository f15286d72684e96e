"""The fast tier, documents over HTTP: uploads ingested by ``python -m ingest`` in a child process as jobs (a bad
file reported, the rest ingested; two at once both land), the documents listed, one deleted and never cited
again, bad uploads refused before anything is stored. Real on-disk Chroma, the real embedder and ingest; the
fake vLLM at its seam."""

from __future__ import annotations

import contextlib
import hashlib
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from app.core import lexical, withdrawals
from app.core.store import open_collection, write_lock
from app.serve.app import create_app
from ingest.pipeline import run_ingest
from tests.support.corpora import app_settings, write_notes
from tests.support.fake_app import ask
from tests.support.fakes import FakeVLLM
from tests.support.servers import AppServer

HARBOUR = "The harbour of Velmora was dredged in 1911 so that steamers of the Aurel line could dock at night."
HARBOUR_MD = f"# Velmora\n\n{HARBOUR}\n".encode()
AGAIN_MD = b"# Again\n\nA second upload.\n"
GLACIER = "The Oskar glacier lost forty metres of ice in the summer of 2003, the survey of Brennholt recorded."


def upload(server, *files: tuple[str, bytes]) -> httpx.Response:
    return httpx.post(server.url + "/v1/documents", files=[("files", file) for file in files], timeout=60)


def finished(server, response: httpx.Response) -> dict:
    assert response.status_code == 202, response.text
    location = response.headers["location"]
    deadline = time.monotonic() + 180
    while (job := httpx.get(server.url + location, timeout=10).json())["status"] in ("queued", "running"):
        assert time.monotonic() < deadline, job
        time.sleep(0.2)
    return job


def sha(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest()


def sync(server, files: dict[str, str], prefix: str = "") -> dict:
    response = httpx.post(server.url + "/v1/documents/sync", json={"files": files, "prefix": prefix}, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def cited(server, question: str) -> set[str]:
    answer = ask(server, question=question, top_k=3)
    assert answer.status_code == 200, answer.text
    return {source["document"] for source in answer.json()["sources"]}


def test_uploaded_documents_are_answered_from_when_done_and_never_cited_once_deleted(tmp_path, embedder):
    settings = app_settings(tmp_path / "chroma", "http://unused/v1", collection="uploads", hotness_dir=None)
    write_notes(tmp_path / "docs")
    run_ingest([tmp_path / "docs"], settings, embedder)
    with AppServer(create_app(settings, embedder=embedder, llm=FakeVLLM())) as server:
        server.wait_ready()
        first = finished(server, upload(server, ("ports/harbour.md", HARBOUR_MD),
                                        ("broken.pdf", b"%PDF-1.4 not really a pdf")))
        with ThreadPoolExecutor(2) as pool:  # two uploads at once: one job after the other, both land
            both = list(pool.map(lambda f: finished(server, upload(server, f)),
                                 [("glacier.txt", GLACIER.encode()), ("again.md", AGAIN_MD)]))
        before = cited(server, "When was the harbour of Velmora dredged?")  # its ranking now remembered
        listed = {d["id"]: d for d in httpx.get(server.url + "/v1/documents", timeout=30).json()["data"]}
        folder = sync(server, {"ports/harbour.md": sha(HARBOUR_MD), "ports/quay.md": sha(b"# Quay\n")}, "ports/")
        everything = sync(server, {"glacier.txt": sha(b"Changed."), "again.md": sha(AGAIN_MD)})
        resynced = finished(server, upload(server, ("glacier.txt", b"Changed."), ("again.md", AGAIN_MD)))
        deleted = httpx.delete(server.url + "/v1/documents/ports/harbour.md", timeout=60)
        after = cited(server, "When was the harbour of Velmora dredged?")
        gone = httpx.delete(server.url + "/v1/documents/ports/harbour.md", timeout=60)
        remaining = {d["id"] for d in httpx.get(server.url + "/v1/documents", timeout=30).json()["data"]}
        saved, deadline = lexical.index_dir(settings.chroma), time.monotonic() + 60
        while any(i.startswith("ports/harbour.md::") for i in lexical.load(saved).ids):  # saved again, after
            assert time.monotonic() < deadline, "BM25 was not saved again after the deletion"
            time.sleep(0.1)
    assert first["status"] == "done" and first["files"] == ["ports/harbour.md", "broken.pdf"]
    assert [f["path"] for f in first["report"]["failed"]] == ["broken.pdf"]  # reported, the other ingested
    assert "ports/harbour.md" in before
    assert [job["status"] for job in both] == ["done", "done"]
    assert listed["ports/harbour.md"]["complete"] and listed["ports/harbour.md"]["chunks"] >= 1
    assert {"glacier.txt", "again.md", "para-000"} <= set(listed)
    assert (folder["add"], folder["update"], folder["unchanged"], folder["delete"]) == (
        ["ports/quay.md"], [], ["ports/harbour.md"], [])  # compared under its prefix only
    assert (everything["update"], everything["unchanged"]) == (["glacier.txt"], ["again.md"])
    assert {"para-000", "ports/harbour.md"} <= set(everything["delete"])  # held, not listed
    report = resynced["report"]  # only the changed file is embedded again
    assert (report["files_updated"], report["files_unchanged"], report["chunks_embedded"]) == (1, 1, 1)
    assert deleted.status_code == 200 and deleted.json()["chunks"] == listed["ports/harbour.md"]["chunks"]
    assert "ports/harbour.md" not in after and "ports/harbour.md" not in remaining
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "document_not_found"


def test_a_bad_upload_is_refused_before_anything_is_stored(tmp_path, embedder):
    settings = app_settings(tmp_path / "chroma", "http://unused/v1", collection="uploads", hotness_dir=None)
    settings.service.max_upload_bytes = 4096
    write_notes(tmp_path / "docs")
    run_ingest([tmp_path / "docs"], settings, embedder)
    with AppServer(create_app(settings, embedder=embedder, llm=FakeVLLM())) as server:
        server.wait_ready()
        refused = [upload(server, ("tool.exe", b"MZ"), ("fine.md", b"# Fine\n")),
                   upload(server, ("../escape.md", b"# Out\n")),
                   upload(server, ("big.md", b"# Big\n" + b"word " * 2000)),
                   httpx.get(server.url + "/v1/jobs/nope", timeout=10)]
        listed = {d["id"] for d in httpx.get(server.url + "/v1/documents", timeout=30).json()["data"]}
    assert [r.status_code for r in refused] == [415, 400, 413, 404]
    assert ".md" in refused[0].json()["error"]["message"] and refused[0].json()["error"]["param"] == "files"
    assert not {"fine.md", "escape.md", "big.md"} & listed


def test_the_collection_is_described_and_its_description_follows_a_deletion(tmp_path, embedder):
    settings = app_settings(tmp_path / "chroma", "http://unused/v1", collection="described", hotness_dir=None)
    notes = write_notes(tmp_path / "docs")
    run_ingest([tmp_path / "docs"], settings, embedder)
    with AppServer(create_app(settings, embedder=embedder, llm=FakeVLLM())) as server:
        server.wait_ready()
        listed = httpx.get(server.url + "/v1/collections", timeout=30).json()["data"]
        before = httpx.get(server.url + "/v1/collections/described", timeout=30).json()
        assert httpx.delete(server.url + "/v1/documents/para-001", timeout=60).status_code == 200
        after = httpx.get(server.url + "/v1/collections/described", timeout=30).json()
        deadline = time.monotonic() + 60  # the stamp moves once the rows are deleted, just after the DELETE
        while (moved := httpx.get(server.url + "/v1/collections/described", timeout=30).json())[
                "generation"] == before["generation"]:
            assert time.monotonic() < deadline, "the generation did not move after the deletion"
            time.sleep(0.1)
        other = httpx.get(server.url + "/v1/collections/elsewhere", timeout=30)
    assert [c["id"] for c in listed] == ["described"] and listed[0]["documents"] == before["documents"]
    assert before["object"] == "collection" and before["documents"] == len(notes) and before["ready"]
    assert before["chunks"] >= len(notes) and before["strategy"] == settings.context.strategy
    assert before["warmup"]["state"] and before["problem"] is None
    assert after["documents"] == len(notes) - 1 and after["chunks"] < before["chunks"]
    assert (moved["documents"], moved["chunks"]) == (after["documents"], after["chunks"])
    assert moved["generation"] != before["generation"]  # what a client watches to know the collection changed
    assert other.status_code == 404 and other.json()["error"]["code"] == "collection_not_found"


def test_a_deletion_answered_before_a_stop_is_never_cited_and_its_rows_go_at_the_next_start(tmp_path, embedder):
    settings = app_settings(tmp_path / "chroma", "http://unused/v1", collection="withdrawn", hotness_dir=None)
    settings.ingest.lock_timeout_s = 120
    write_notes(tmp_path / "docs")
    (tmp_path / "docs" / "harbour.md").write_bytes(HARBOUR_MD)
    run_ingest([tmp_path / "docs"], settings, embedder)
    stored = open_collection(settings.chroma, embedder, create=False)
    ids = stored.get(where={"doc_id": "harbour.md"}, include=[])["ids"]
    withdrawals.record(settings.chroma, "harbour.md", ids)  # what a DELETE leaves until the rows are deleted
    with contextlib.ExitStack() as writer:
        writer.enter_context(write_lock(settings.chroma, 10))  # a writer holds the lock: the rows stay meanwhile
        with AppServer(create_app(settings, embedder=embedder, llm=FakeVLLM())) as server:
            server.wait_ready()
            meanwhile = cited(server, "When was the harbour of Velmora dredged?")
            listed = {d["id"] for d in httpx.get(server.url + "/v1/documents", timeout=30).json()["data"]}
            rows_meanwhile = len(stored.get(ids=ids, include=[])["ids"])
            writer.close()
            deadline = time.monotonic() + 60
            while withdrawals.pending(settings.chroma):
                assert time.monotonic() < deadline, "the withdrawn rows were not deleted"
                time.sleep(0.1)
            after = cited(server, "When was the harbour of Velmora dredged?")
            again = httpx.delete(server.url + "/v1/documents/harbour.md", timeout=60)
    assert rows_meanwhile == len(ids) > 0  # still stored, never cited
    assert "harbour.md" not in meanwhile | listed | after and "para-000" in listed
    assert again.status_code == 404
    reread = open_collection(settings.chroma, embedder, create=False)
    assert reread.get(ids=ids, include=[])["ids"] == []
