"""Retrieval in worker processes (``PREFIXRAG_RETRIEVAL__WORKERS``, ``python -m app --workers N``): the question
encoder, Chroma's query and BM25 are the CPU-bound part of a request, and in one process they share one GIL
with the HTTP serving, the relay of vLLM's tokens and the prompt's arrangement. Each worker ranks with its own
encoder, collection handle and BM25 index; everything with state stays in the serving process (admission,
pre-warm, the planner's hotness and served paths, metrics), so it is global by construction, and a worker
returns only a ``Ranking``.

Each worker is reached over a socket the event loop reads and writes itself (``app.runtime.worker_channel``):
no thread of the serving process stands between a question and its ranking, so a busy loop never makes a
ranking wait for a thread to get the GIL. A free worker takes its share of the questions waiting (all of them
when it is the only one free, up to ``BATCH``) and encodes them in one pass: a burst is spread over the free
workers first, since a batch's first question waits for its last one's encoding. After an ingest (the epoch a
question carries says so), a worker drops the chunk rows it read and opens the changed collection and its indexes
on a thread of its own, answering from what it had open until they are loaded: a reload never makes a question
wait for Chroma's reopening or BM25's loading (a chunk deleted meanwhile is left out: its row is read afresh).
While an ingest run is still writing, a worker only drops the rows it read (the question's second count). A
worker that dies is started again and primed before it takes a question; its questions in flight fail with a 503."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import Histogram

from app.core.errors import ServiceError, StoreUnavailable
from app.core.logformat import log_like_the_service
from app.core.settings import ChromaSettings, EmbeddingSettings, PageSettings, RetrievalSettings
from app.core.store import forget_clients
from app.rag.retriever import Ranking, Retriever
from app.runtime.pauses import freeze_start_up
from app.runtime.worker_channel import Channel, ChannelClosed, Message, serve_channel

if TYPE_CHECKING:
    from app.rag.index import CollectionIndex

log = logging.getLogger("prefixrag.retrieval")
DIED = "a retrieval worker died; it is being restarted, retry shortly"
BATCH = 16  # questions one worker encodes in one pass, at most: enough for any burst the loop hands it at once


@dataclass(frozen=True)
class WorkerConfig:
    """What a worker needs to rank: the settings sections, nothing with a secret in it; and how the service logs."""

    chroma: ChromaSettings
    embedding: EmbeddingSettings
    retrieval: RetrievalSettings
    paging: PageSettings
    log_level: str = "info"
    log_format: str = "text"


@dataclass
class _Asked:
    question: str
    k: int
    source_prefix: str | None
    ranking: asyncio.Future[Ranking] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    asked_at: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True)
class Ranked:
    """A worker's answer to a batch: each question's ranking (or its error), and what the batch took there."""

    outcomes: list[Any]  # a Ranking, or the error it raised (ServiceError)
    encode_s: float
    search_s: float


class RetrievalPool:
    """``Ranker`` over ``workers`` processes (spawned, not forked: the serving process has threads)."""

    def __init__(self, config: WorkerConfig, workers: int, stages: Histogram | None = None) -> None:
        """``stages``: where each question's time goes (``prefixrag_retrieval_stage_seconds``)."""
        self.config, self.workers, self.stages = config, workers, stages
        self.epoch = 0  # bumped when an ingest changed the collection; every question carries it
        self.rows = 0  # bumped when an ingest run starts writing (rows read before are dropped); carried too
        self._channels: list[Channel] = []
        self._asked: asyncio.Queue[_Asked] = asyncio.Queue()
        self._feeders: list[asyncio.Task[None]] = []
        self._free = 0  # feeders waiting for a question: a burst is shared among them

    async def rank(self, question: str, k: int, source_prefix: str | None = None) -> Ranking:
        self._start()
        asked = _Asked(question, k, source_prefix)
        self._asked.put_nowait(asked)
        return await asked.ranking

    async def prime(self) -> None:
        """At start-up (and when the collection first exists): every worker loads its encoder and indexes
        before the service reports ready. After a reload, workers reload at their next question."""
        self._start()
        await asyncio.gather(*(_prime(channel, self._epochs()) for channel in self._channels if not channel.primed))

    async def collection_changed(self, rewarm: bool) -> None:
        self.epoch += 1

    def rows_changing(self) -> None:
        self.rows += 1

    async def aclose(self) -> None:
        for feeder in self._feeders:
            feeder.cancel()
        await asyncio.gather(*self._feeders, return_exceptions=True)
        while not self._asked.empty():
            if not (asked := self._asked.get_nowait()).ranking.done():
                asked.ranking.set_exception(StoreUnavailable("retrieval is stopping"))
        await asyncio.gather(*(channel.aclose() for channel in self._channels))

    def _start(self) -> None:
        if self._feeders:
            return
        self._channels = [Channel.spawn(_serve, self.config) for _ in range(self.workers)]
        self._feeders = [asyncio.create_task(self._feed(slot), name=f"retrieval-feeder-{slot}")
                         for slot in range(self.workers)]

    async def _feed(self, slot: int) -> None:
        """Hand worker ``slot`` the questions waiting, a batch at a time; start it again if it died."""
        while True:
            if self._channels[slot].closed:
                await self._channels[slot].aclose()
                log.error("retrieval worker %d died: starting a new one", slot)
                self._channels[slot] = Channel.spawn(_serve, self.config)
                await _prime_logged(self._channels[slot], self._epochs())
            batch = await self._share()
            batch = [asked for asked in batch if not asked.ranking.done()]  # a client that gave up
            if batch:
                await self._rank_on(self._channels[slot], batch)

    async def _share(self) -> list[_Asked]:
        """The next questions for one worker: at least one, and of those waiting this worker's even share among
        the workers free now (the others woken by the same burst are still counted free: they take theirs)."""
        self._free += 1
        try:
            batch = [await self._asked.get()]
        finally:
            self._free -= 1
        share = min(BATCH, -(-(1 + self._asked.qsize()) // (1 + self._free)))
        while len(batch) < share and not self._asked.empty():
            batch.append(self._asked.get_nowait())
        return batch

    async def _rank_on(self, channel: Channel, batch: list[_Asked]) -> None:
        questions = [(asked.question, asked.k, asked.source_prefix) for asked in batch]
        sent = time.perf_counter()
        try:
            ranked: Ranked = await channel.exchange(("rank", self._epochs(), questions))
            outcomes = ranked.outcomes
            self._observe(batch, sent, ranked)
        except ChannelClosed:
            outcomes = [StoreUnavailable(DIED)] * len(batch)
        except asyncio.CancelledError:  # the pool is closing: nobody waits on a question for ever
            for asked in batch:
                if not asked.ranking.done():
                    asked.ranking.set_exception(StoreUnavailable("retrieval is stopping"))
            raise
        for asked, outcome in zip(batch, outcomes, strict=True):
            if asked.ranking.done():
                continue
            if isinstance(outcome, BaseException):
                asked.ranking.set_exception(outcome)
            else:
                asked.ranking.set_result(outcome)

    def _epochs(self) -> tuple[int, int]:
        return self.epoch, self.rows

    def _observe(self, batch: list[_Asked], sent: float, ranked: Ranked) -> None:
        if self.stages is None:
            return
        hop = time.perf_counter() - sent - ranked.encode_s - ranked.search_s
        for asked in batch:
            self.stages.labels("waiting").observe(sent - asked.asked_at)
            self.stages.labels("hop").observe(max(hop, 0.0))
            self.stages.labels("encode").observe(ranked.encode_s)
            self.stages.labels("search").observe(ranked.search_s)


async def _prime(channel: Channel, epoch: tuple[int, int]) -> None:
    try:
        outcome = await channel.exchange(("prime", epoch, None))
    except ChannelClosed as exc:
        raise StoreUnavailable(DIED) from exc
    if isinstance(outcome, BaseException):
        raise outcome
    channel.primed = True


async def _prime_logged(channel: Channel, epoch: tuple[int, int]) -> None:
    try:
        await _prime(channel, epoch)
    except ServiceError as exc:  # it ranks anyway, loading at its first question
        log.warning("a new retrieval worker could not load its indexes: %s", exc)


RELOAD_RETRY_S = 1.0  # after a worker's reload failed (e.g. Chroma mid-write), its next try at the earliest


class _Worker:
    """A worker process's retrieval: the serving process's own ``Retriever``, over a collection of its own."""

    def __init__(self, config: WorkerConfig) -> None:
        from app.core.embedder import Embedder, limit_threads

        limit_threads(config.embedding.query_threads)
        self.embedder = Embedder(config.embedding, questions=True).load()
        self.config, self.epoch, self.rows = config, 0, 0
        self.index, self.retriever = self._opened()

    def _opened(self) -> tuple[CollectionIndex, Retriever]:
        """A collection handle of its own, and the retriever over it."""
        from app.rag.index import CollectionIndex

        config = self.config
        # The index runs nothing on this pool (ranking is synchronous here); its own thread loads BM25.
        index = CollectionIndex(self.embedder, config.chroma, ThreadPoolExecutor(1), config.retrieval, config.paging)
        return index, Retriever(index, self.embedder, config.retrieval)

    def answer(self, message: Message) -> object:
        kind, (epoch, rows), questions = message
        if rows != self.rows:  # an ingest run started writing: rows are read afresh
            self.rows = rows
            self.index.forget_rows()
        if kind == "prime":
            if epoch != self.epoch:
                self.index.reopen()
                self.epoch = epoch
            primed = _outcome(self.prime)
            freeze_start_up()  # what loading left alive, out of the cyclic GC's scans between questions
            return primed
        if epoch != self.epoch:
            self.epoch = epoch
            self.index.forget_rows()
            threading.Thread(target=self._reload, args=(epoch,), name="reload", daemon=True).start()
        return self.rank(questions)

    def _reload(self, epoch: int) -> None:
        """The changed collection opened, queried once and its BM25 loaded, then swapped in, unless a newer
        change came meanwhile (its own reload swaps then)."""
        if not self.config.chroma.url:
            forget_clients()  # the next open reloads from disk; handles already open keep working
        index, retriever = self._opened()
        try:
            _primed(retriever)
        except Exception as exc:  # the old state answers meanwhile; a question a second from now tries again
            log.warning("a retrieval worker could not reload the collection: %s", exc)
            index.close()
            time.sleep(RELOAD_RETRY_S)
            if epoch == self.epoch:
                self.epoch = -1  # no epoch the pool sends: its next question starts another reload
            return
        if epoch != self.epoch:
            index.close()
            return
        old, self.index, self.retriever = self.index, index, retriever
        old.close()  # its background thread; a ranking still on it finishes (its handle stays open)

    def prime(self) -> None:
        _primed(self.retriever)

    def rank(self, questions: list[tuple[str, int, str | None]]) -> Ranked:
        """Every question's ranking (or its error), the questions encoded in one pass."""
        started = time.perf_counter()
        texts = [question for question, _, _ in questions]
        dense = self.index.retrieval.mode != "lexical"
        vectors = _outcome(lambda: self.embedder.embed(texts) if dense else [None] * len(texts))
        encoded = time.perf_counter()
        if isinstance(vectors, BaseException):
            return Ranked([vectors] * len(questions), encoded - started, 0.0)
        assert isinstance(vectors, list)
        together = _outcome(lambda: self.retriever.rank_batch_sync(questions, vectors))
        if not isinstance(together, list):
            together = [_outcome(lambda q=q, k=k, p=p, v=v: self.retriever.rank_sync(q, k, p, vector=v))
                        for (q, k, p), v in zip(questions, vectors, strict=True)]  # one by one
        return Ranked(together, encoded - started, time.perf_counter() - encoded)


def _primed(retriever: Retriever) -> None:
    """Rank once and load BM25: the first question pays for neither."""
    retriever.rank_sync("prime the index", 1)
    if retriever.index.retrieval.mode != "dense":
        retriever.index.lexical_index(wait=True)


def _outcome(work: object) -> object:
    """``work()``, or the error it raised as one the serving process can report (a ``ServiceError``)."""
    assert callable(work)
    try:
        return work()
    except ServiceError as exc:
        return exc
    except Exception as exc:
        log.exception("ranking failed in a retrieval worker")
        return ServiceError(f"ranking failed in a retrieval worker: {type(exc).__name__}: {exc}")


def _serve(config: WorkerConfig, channel_end: socket.socket) -> None:
    """A worker process: answer the serving process's messages until it closes the channel."""
    # The serving process decides when workers stop (after draining): a terminal's Ctrl-C or a SIGTERM sent
    # to the whole process group must not kill them under requests still in flight.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    log_like_the_service(config.log_level, config.log_format)
    serve_channel(channel_end, _Worker(config).answer)
