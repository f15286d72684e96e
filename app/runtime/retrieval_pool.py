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
workers first, since a batch's first question waits for its last one's encoding. One pool ranks every collection
the process serves: a question carries its collection's name, and a batch's questions are encoded together
whichever collections they search. After an ingest (the epoch each message carries for the collection says so),
a worker drops the chunk rows it read and opens the changed collection and its indexes on a thread of its own
(``app.runtime.retrieval_worker``), answering from what it had open until they are loaded: a reload never makes
a question wait for Chroma's reopening or BM25's loading (a chunk deleted meanwhile is left out: its row is read
afresh). While an ingest run is still writing, a worker only drops the rows it read (the collection's second
count). A worker that dies is started again and primed before it takes a question; its questions in flight fail
with a 503."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from prometheus_client import Histogram

from app.core.errors import ServiceError, StoreUnavailable
from app.rag.retriever import Ranking
from app.runtime.retrieval_worker import Ranked, WorkerConfig, serve
from app.runtime.worker_channel import Channel, ChannelClosed

__all__ = ["CollectionRanker", "RetrievalPool", "WorkerConfig"]

log = logging.getLogger("prefixrag.retrieval")
DIED = "a retrieval worker died; it is being restarted, retry shortly"
BATCH = 16  # questions one worker encodes in one pass, at most: enough for any burst the loop hands it at once
PRIME_POLL_S = 0.05  # how often a prime asks the workers whether their reload is done
PRIME_WAIT_S = 120.0  # a prime waits this long for the workers' reloads at most


Stamps = dict[str, tuple[int, int]]  # a collection's (epoch, rows): the reloads and the writes the pool saw


@dataclass
class _Asked:
    collection: str
    question: str
    k: int
    source_prefix: str | None
    ranking: asyncio.Future[Ranking] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    asked_at: float = field(default_factory=time.perf_counter)


class RetrievalPool:
    """``Ranker`` over ``workers`` processes (spawned, not forked: the serving process has threads)."""

    def __init__(self, config: WorkerConfig, workers: int, stages: Histogram | None = None) -> None:
        """``stages``: where each question's time goes (``prefixrag_retrieval_stage_seconds``)."""
        self.config, self.workers, self.stages = config, workers, stages
        # Per collection: the epoch, bumped when an ingest changed it, and rows, bumped when an ingest run starts
        # writing (rows read before are dropped); every message carries them all.
        self.stamps: Stamps = {config.chroma.collection: (0, 0)}
        self._primed: dict[str, set[int]] = {}  # per collection, the workers (ids of their channels) that loaded it
        self._channels: list[Channel] = []
        self._asked: asyncio.Queue[_Asked] = asyncio.Queue()
        self._feeders: list[asyncio.Task[None]] = []
        self._free = 0  # feeders waiting for a question: a burst is shared among them

    async def rank(self, question: str, k: int, source_prefix: str | None = None,
                   collection: str | None = None) -> Ranking:
        """``collection``: the name of the one searched (default: the settings' own)."""
        self._start()
        asked = _Asked(collection or self.config.chroma.collection, question, k, source_prefix)
        self._asked.put_nowait(asked)
        return await asked.ranking

    async def prime(self, collection: str | None = None) -> None:
        """Returns once every worker has loaded the collection as it is now: at start-up (and when the collection
        first exists) its encoder and the collection's indexes, before the service reports it ready; after a
        change (an upload's job is done only then), its reload, which each worker does in the background,
        answering questions meanwhile. Gives up waiting once the collection changed again, or after
        ``PRIME_WAIT_S``."""
        self._start()
        name = collection or self.config.chroma.collection
        stamp = self.stamps.setdefault(name, (0, 0))
        primed = self._primed.setdefault(name, set())
        deadline = time.monotonic() + PRIME_WAIT_S
        while True:
            loaded = await asyncio.gather(*(_prime(channel, self.stamps, name) for channel in self._channels))
            primed.update(id(channel) for channel, done in zip(self._channels, loaded, strict=True) if done)
            if all(loaded) or self.stamps.get(name) != stamp:
                return
            if time.monotonic() > deadline:
                log.warning("retrieval workers still reloading collection %r after %gs", name, PRIME_WAIT_S)
                return
            await asyncio.sleep(PRIME_POLL_S)

    def primed(self, collection: str | None = None) -> bool:
        """Whether every worker loaded the collection (default: the settings' own)."""
        done = self._primed.get(collection or self.config.chroma.collection, set())
        return bool(self._channels) and all(id(channel) in done for channel in self._channels)

    def serving(self, collection: str) -> CollectionRanker:
        """The ``Ranker`` of one collection, over this pool."""
        self.stamps.setdefault(collection, (0, 0))
        return CollectionRanker(self, collection)

    async def collection_changed(self, rewarm: bool, collection: str | None = None) -> None:
        epoch, rows = self.stamps.get(name := collection or self.config.chroma.collection, (0, 0))
        self.stamps[name] = (epoch + 1, rows)

    def rows_changing(self, collection: str | None = None) -> None:
        epoch, rows = self.stamps.get(name := collection or self.config.chroma.collection, (0, 0))
        self.stamps[name] = (epoch, rows + 1)

    async def forget(self, collection: str) -> None:
        """No longer served: every worker closes it now (one made again later under that name is opened afresh)."""
        self.stamps.pop(collection, None)
        self._primed.pop(collection, None)
        await asyncio.gather(*(channel.exchange(("sync", dict(self.stamps), None)) for channel in self._channels),
                             return_exceptions=True)  # a dead worker has nothing open

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
        self._channels = [Channel.spawn(serve, self.config) for _ in range(self.workers)]
        self._feeders = [asyncio.create_task(self._feed(slot), name=f"retrieval-feeder-{slot}")
                         for slot in range(self.workers)]

    async def _feed(self, slot: int) -> None:
        """Hand worker ``slot`` the questions waiting, a batch at a time; start it again if it died."""
        while True:
            if self._channels[slot].closed:
                await self._channels[slot].aclose()
                log.error("retrieval worker %d died: starting a new one", slot)
                self._channels[slot] = Channel.spawn(serve, self.config)
                for name in list(self.stamps):
                    await _prime_logged(self._channels[slot], self.stamps, name)
                    self._primed.setdefault(name, set()).add(id(self._channels[slot]))
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
        questions = [(asked.collection, asked.question, asked.k, asked.source_prefix) for asked in batch]
        sent = time.perf_counter()
        try:
            ranked: Ranked = await channel.exchange(("rank", dict(self.stamps), questions))
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

    def _observe(self, batch: list[_Asked], sent: float, ranked: Ranked) -> None:
        if self.stages is None:
            return
        hop = time.perf_counter() - sent - ranked.encode_s - ranked.search_s
        for asked in batch:
            self.stages.labels("waiting").observe(sent - asked.asked_at)
            self.stages.labels("hop").observe(max(hop, 0.0))
            self.stages.labels("encode").observe(ranked.encode_s)
            self.stages.labels("search").observe(ranked.search_s)


class CollectionRanker:
    """One collection's ``Ranker`` over the pool: what its pipeline and its collection watcher hold."""

    def __init__(self, pool: RetrievalPool, collection: str) -> None:
        self.pool, self.collection = pool, collection

    async def rank(self, question: str, k: int, source_prefix: str | None = None) -> Ranking:
        return await self.pool.rank(question, k, source_prefix, self.collection)

    async def prime(self) -> None:
        await self.pool.prime(self.collection)

    async def collection_changed(self, rewarm: bool) -> None:
        await self.pool.collection_changed(rewarm, self.collection)

    def rows_changing(self) -> None:
        self.pool.rows_changing(self.collection)


async def _prime(channel: Channel, stamps: Stamps, collection: str) -> bool:
    try:
        outcome = await channel.exchange(("prime", dict(stamps), collection))
    except ChannelClosed as exc:
        raise StoreUnavailable(DIED) from exc
    if isinstance(outcome, BaseException):
        raise outcome
    return bool(outcome)


async def _prime_logged(channel: Channel, stamps: Stamps, collection: str) -> None:
    try:
        await _prime(channel, stamps, collection)
    except ServiceError as exc:  # it ranks anyway, loading at its first question
        log.warning("a new retrieval worker could not load its indexes: %s", exc)
