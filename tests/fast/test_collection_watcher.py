"""The fast tier, an ingest run beside the service (``app.runtime.collection``): while the run writes, the service
reads rows afresh but keeps its store handles and BM25 (none rebuilt from half-written rows); it reloads once, at
the run's end; a run killed mid-way is reloaded as ended. In-process ranking and a worker process alike. Real
on-disk Chroma, the real embedder; no vLLM (nothing here generates)."""

from __future__ import annotations

import asyncio

import pytest

from app.core.store import forget_clients, mark_changed, open_collection, write_lock
from app.runtime.retrieval_pool import RetrievalPool
from app.runtime.services import build_services
from ingest.pipeline import run_ingest
from tests.support.corpora import app_settings
from tests.support.env import ROOT

QUESTION = "What is vLLM?"


@pytest.mark.parametrize("workers", [0, 1])
def test_while_a_run_writes_rows_are_read_afresh_and_the_service_reloads_once_at_its_end(tmp_path, embedder,
                                                                                           workers):
    settings = app_settings(tmp_path / "chroma", "http://unused/v1", collection="docs")
    settings.retrieval.workers = workers
    run_ingest([ROOT / "examples" / "docs"], settings, embedder)

    async def scenario() -> list[str]:
        services = await build_services(settings, embedder=embedder)
        watcher, index, ranker = services.watcher, services.index, services.clients.ranker
        assert isinstance(ranker, RetrievalPool) == bool(workers)
        seen: list[str] = []
        watcher.subscribe(lambda rewarm: asyncio.sleep(0, seen.append("reloaded")))
        watcher.subscribe_writing(lambda: seen.append("writing"))
        try:
            await watcher.check_now()  # the first look: handles and indexes loaded
            handle, bm25 = index.collection, index.lexical_index(wait=True)
            top = (await ranker.rank(QUESTION, 3)).chunks[0].id
            forget_clients()  # the writer's own handle, as another process has: the service's still holds the row
            writer = open_collection(settings.chroma, embedder, create=False)
            with write_lock(settings.chroma, 10):
                mark_changed(writer, writing=True)
                writer.delete(ids=[top])
                await watcher.check_now()
                assert seen == ["writing"]
                assert index.collection is handle and index.lexical_index() is bm25  # kept, not rebuilt
                assert top not in {c.id for c in (await ranker.rank(QUESTION, 3)).chunks}  # its row read afresh
                mark_changed(writer, run_ended=True)
            await watcher.check_now()
            assert seen == ["writing", "reloaded"]
            with write_lock(settings.chroma, 10):  # a run killed after its first write: its stamp, lock released
                mark_changed(writer, writing=True)
            await watcher.check_now()
            await watcher.check_now()
            return seen
        finally:
            await services.aclose()

    assert asyncio.run(scenario()) == ["writing", "reloaded", "reloaded"]
