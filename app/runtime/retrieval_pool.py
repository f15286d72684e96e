"""Retrieval in worker processes (``RAG_RETRIEVAL__WORKERS``, ``python -m app --workers N``): the question
encoder, Chroma's query and BM25 are the CPU-bound part of a request, and in one process they share one GIL
with the HTTP serving, the relay of vLLM's tokens and the prompt's arrangement. Each worker ranks with its own
encoder, collection handle and BM25 index; everything with state stays in the serving process (admission,
pre-warm, the planner's hotness and served paths, metrics), so it is global by construction, and a worker
returns only a ``Ranking``.

A worker answers one question at a time; questions go to the next free worker. After an ingest, a worker
reopens the collection at its next question (the epoch it is sent says so) and answers dense-only, not to be
remembered, until its BM25 index is loaded again, as the serving process itself would."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import threading
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from app.core.errors import StoreUnavailable
from app.core.settings import ChromaSettings, EmbeddingSettings, PageSettings, RetrievalSettings
from app.rag.retriever import Ranking, Retriever

log = logging.getLogger("prefixrag.retrieval")
PRIME_TIMEOUT_S = 600.0  # a worker that needs longer to load its encoder and indexes is broken


@dataclass(frozen=True)
class WorkerConfig:
    """What a worker needs to rank: the settings sections, nothing with a secret in it."""

    chroma: ChromaSettings
    embedding: EmbeddingSettings
    retrieval: RetrievalSettings
    paging: PageSettings


class RetrievalPool:
    """``Ranker`` over ``workers`` processes (spawned, not forked: the serving process has threads)."""

    def __init__(self, config: WorkerConfig, workers: int) -> None:
        self.config, self.workers = config, workers
        self.epoch = 0  # bumped when an ingest changed the collection; every question carries it
        self._primed = False
        self._pool = self._new_pool()

    def _new_pool(self) -> ProcessPoolExecutor:
        context = multiprocessing.get_context("spawn")
        self._barrier = context.Barrier(self.workers)  # one prime per worker: each waits for the others
        return ProcessPoolExecutor(self.workers, mp_context=context, initializer=_start_worker,
                                   initargs=(self.config, self._barrier))

    async def rank(self, question: str, k: int, source_prefix: str | None = None) -> Ranking:
        ranking: Ranking = await self._submit(_rank, self.epoch, question, k, source_prefix)
        return ranking

    async def prime(self) -> None:
        """At start-up (and once the collection first exists): every worker loads its encoder and indexes
        before the service reports ready. After that, workers reload at their next question, while answering."""
        if self._primed:
            return
        await asyncio.gather(*(self._submit(_prime, self.epoch) for _ in range(self.workers)))
        self._primed = True

    async def collection_changed(self, rewarm: bool) -> None:
        self.epoch += 1

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    async def _submit(self, work: Any, *args: Any) -> Any:
        pool = self._pool
        try:
            return await asyncio.wrap_future(pool.submit(work, *args))
        except BrokenProcessPool as exc:  # a worker died (killed, out of memory): start them all again
            if pool is self._pool:
                log.error("a retrieval worker died (%s): starting %d new ones", exc, self.workers)
                self._primed, self._pool = False, self._new_pool()
                pool.shutdown(wait=False, cancel_futures=True)
            raise StoreUnavailable("a retrieval worker died; it is being restarted, retry shortly") from exc


class _Worker:
    """A worker process's retrieval: the serving process's own ``Retriever``, over a collection of its own."""

    def __init__(self, config: WorkerConfig, barrier: threading.Barrier) -> None:
        from app.core.embedder import Embedder, limit_threads
        from app.rag.index import CollectionIndex

        limit_threads(config.embedding.query_threads)
        embedder = Embedder(config.embedding).load()
        # The index runs nothing on this pool (ranking is synchronous here); its own thread loads BM25.
        self.index = CollectionIndex(embedder, config.chroma, ThreadPoolExecutor(1), config.retrieval,
                                     config.paging)
        self.retriever = Retriever(self.index, embedder, config.retrieval)
        self.barrier, self.epoch = barrier, 0

    def follow(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.index.reopen()
            self.epoch = epoch


_worker: _Worker | None = None


def _start_worker(config: WorkerConfig, barrier: threading.Barrier) -> None:
    # The serving process decides when workers stop (after draining): a terminal's Ctrl-C or a SIGTERM sent
    # to the whole process group must not kill them under requests still in flight.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    global _worker
    _worker = _Worker(config, barrier)


def _rank(epoch: int, question: str, k: int, source_prefix: str | None) -> Ranking:
    assert _worker is not None
    _worker.follow(epoch)
    return _worker.retriever.rank_sync(question, k, source_prefix)


def _prime(epoch: int) -> None:
    """Rank once and load BM25, then wait for every other worker's prime: no worker takes two."""
    assert _worker is not None
    _worker.follow(epoch)
    try:
        _worker.retriever.rank_sync("prime the index", 1)
        if _worker.index.retrieval.mode != "dense":
            _worker.index.lexical_index(wait=True)
    finally:
        _worker.barrier.wait(PRIME_TIMEOUT_S)
