"""Ranking in worker processes (``PREFIXRAG_RETRIEVAL__WORKERS``) over a real collection, with the real encoder: the
workers rank as the serving process does, a burst of questions is answered in batches, a worker killed under
load is started again, a burst is spread over the free workers before any is batched, and closing the pool ends
every worker."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor

from app.core.errors import StoreUnavailable
from app.core.metrics import ServiceMetrics
from app.rag.retriever import Retriever
from app.runtime.retrieval_pool import RetrievalPool, WorkerConfig
from tests.support.corpora import app_settings

QUESTIONS = ["How is the prefix cache measured?", "What does the service log?", "How do I start vLLM?",
             "Which counters does vLLM export?", "What does ingest do with a bad file?", "How is a chunk sized?"]


def ids(ranking) -> list[str]:
    return [chunk.id for chunk in ranking.chunks]


def test_workers_rank_as_the_serving_process_does_and_one_killed_is_started_again(collections, embedder):
    settings = app_settings(collections, "http://unused/v1", collection="project-docs")
    here = Retriever.over(embedder, settings.chroma, ThreadPoolExecutor(2), settings.retrieval)
    here.index.lexical_index(wait=True)
    expected = {question: ids(here.rank_sync(question, 5)) for question in QUESTIONS}
    here.index.close()

    async def scenario() -> None:
        pool = RetrievalPool(WorkerConfig(settings.chroma, settings.embedding, settings.retrieval,
                                          settings.pages), workers=2)
        try:
            await pool.prime()
            assert pool.primed()
            burst = await asyncio.gather(*(pool.rank(q, 5) for q in QUESTIONS * 4))  # more than two at a time
            assert [ids(ranking) for ranking in burst] == [expected[q] for q in QUESTIONS * 4]
            assert all(ranking.complete for ranking in burst)
            killed = pool._channels[0].process
            os.kill(killed.pid, signal.SIGKILL)
            await asyncio.to_thread(killed.join, 10)
            outcomes = await asyncio.gather(*(pool.rank(q, 5) for q in QUESTIONS), return_exceptions=True)
            assert all(isinstance(o, StoreUnavailable) or ids(o) == expected[q]
                       for o, q in zip(outcomes, QUESTIONS, strict=True)), outcomes
            for _ in range(600):  # the slot's new worker, primed, answers again
                if pool._channels[0].process is not killed and pool.primed():
                    break
                await asyncio.gather(pool.rank(QUESTIONS[0], 5), return_exceptions=True)
                await asyncio.sleep(0.1)
            assert pool._channels[0].process.pid != killed.pid
            again = await asyncio.gather(*(pool.rank(q, 5) for q in QUESTIONS))
            assert [ids(ranking) for ranking in again] == [expected[q] for q in QUESTIONS]
        finally:
            processes = [channel.process for channel in pool._channels]
            await pool.aclose()
        assert not any(process.is_alive() for process in processes)

    asyncio.run(scenario())


def test_a_burst_is_shared_among_the_free_workers_and_batched_only_beyond_them(collections):
    settings = app_settings(collections, "http://unused/v1", collection="project-docs")
    metrics = ServiceMetrics()

    def stage(name: str, part: str) -> float:
        return metrics.registry.get_sample_value(f"prefixrag_retrieval_stage_seconds_{part}", {"stage": name}) or 0

    async def scenario() -> None:
        pool = RetrievalPool(WorkerConfig(settings.chroma, settings.embedding, settings.retrieval,
                                          settings.pages), workers=2, stages=metrics.retrieval_stages)
        batches: list[int] = []
        ranked_on = pool._rank_on

        async def recorded(channel, batch):
            batches.append(len(batch))
            await ranked_on(channel, batch)

        pool._rank_on = recorded  # type: ignore[method-assign]
        try:
            await pool.prime()
            await asyncio.gather(*(pool.rank(q, 5) for q in QUESTIONS[:2]))
            assert sorted(batches) == [1, 1], "two questions, two free workers: one each, neither waits for the other"
            batches.clear()
            await asyncio.gather(*(pool.rank(q, 5) for q in QUESTIONS))
            assert sorted(batches) == [3, 3], "six at once: an even share each, in one pass"
            # Every question's time, by stage: the six waited for no worker; the workers' own time is timed there.
            assert {name: stage(name, "count") for name in ("waiting", "hop", "encode", "search")} == dict.fromkeys(
                ("waiting", "hop", "encode", "search"), 8)
            assert stage("encode", "sum") > 0 and stage("search", "sum") > 0
            assert stage("waiting", "sum") < stage("encode", "sum") + stage("search", "sum") + stage("hop", "sum")
        finally:
            await pool.aclose()

    asyncio.run(scenario())


def test_a_worker_logs_at_the_service_level_and_in_its_format(collections, capfd):
    """A worker's lines (here: which runtime its question encoder chose at load, an INFO line) reach the service's
    log at its level and in its format, one JSON object each with the request id's field, like the serving
    process's own (they were dropped below WARNING, and the rest written bare)."""
    settings = app_settings(collections, "http://unused/v1", collection="project-docs")
    config = WorkerConfig(settings.chroma, settings.embedding, settings.retrieval, settings.pages, "info", "json")

    async def scenario() -> None:
        pool = RetrievalPool(config, workers=1)
        try:
            await pool.prime()
        finally:
            await pool.aclose()

    asyncio.run(scenario())
    lines = [json.loads(line) for line in capfd.readouterr().err.splitlines() if line.startswith("{")]
    chosen = [line for line in lines if line["message"].startswith("question encoder: ")]
    assert len(chosen) == 1, lines
    assert chosen[0]["level"] == "INFO" and chosen[0]["logger"] == "prefixrag.embedder", chosen
    assert chosen[0]["request_id"] == "-"


def test_auto_workers_follow_the_cores_and_fewer_hold_the_encoder_on_a_gpu(monkeypatch):
    from app.core.settings import RetrievalSettings

    auto = RetrievalSettings()
    for cores, on_cpu, on_gpu in ((2, 0, 0), (8, 4, 2), (16, 8, 4), (64, 8, 4)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, n=cores: set(range(n)))
        assert (auto.worker_processes(False), auto.worker_processes(True)) == (on_cpu, on_gpu), cores
    assert RetrievalSettings(workers=3).worker_processes(True) == 3


def test_after_an_ingest_a_worker_answers_at_once_never_with_a_replaced_chunk_and_then_from_the_new_one(
        tmp_path, embedder):
    """The changed collection is opened beside what the worker had open: a question meanwhile neither waits for it
    nor loses BM25 (it used to be ranked dense-only while the index loaded again); the chunk rows read before are
    dropped at once, so a chunk the ingest replaced is never returned, and the new one is once the reload is in."""
    from ingest.pipeline import run_ingest
    from tests.support.corpora import FACTS

    docs = tmp_path / "facts"
    docs.mkdir()
    for name, text in FACTS.items():
        (docs / name).write_text(text + "\n")
    settings = app_settings(tmp_path / "chroma", "http://unused/v1", collection="facts")
    run_ingest([docs], settings, embedder)
    question, edited = "Why do tides rise and fall?", "Tides rise and fall twice a day: the moon's pull, and the sun's."

    async def scenario() -> tuple[str, list[tuple[list[str], str, bool]]]:
        pool = RetrievalPool(WorkerConfig(settings.chroma, settings.embedding, settings.retrieval,
                                          settings.pages), workers=1)
        try:
            await pool.prime()
            old = (await pool.rank(question, 4)).chunks[0]
            assert old.text.startswith(FACTS["tides.md"])
            (docs / "tides.md").write_text(edited + "\n")
            await asyncio.to_thread(run_ingest, [docs], settings, embedder)
            await pool.collection_changed(True)
            seen: list[tuple[list[str], str, bool]] = []
            for _ in range(300):
                ranking = await pool.rank(question, 4)
                seen.append((ids(ranking), ranking.chunks[0].text if ranking.chunks else "", ranking.complete))
                if seen[-1][1].startswith(edited):
                    break
                await asyncio.sleep(0.05)
            return old.id, seen
        finally:
            await pool.aclose()

    old_id, seen = asyncio.run(scenario())
    assert all(old_id not in ranked for ranked, _, _ in seen), seen  # never the replaced chunk, before or after
    assert all(complete for _, _, complete in seen), seen  # dense and BM25 throughout
    assert seen[-1][1].startswith(edited), seen  # the changed collection, once loaded
