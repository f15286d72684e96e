"""The service as it runs: the request pipeline behind admission (a slot, or 429 at once), with vLLM's health
watched around every request, readiness assembled from the monitors, and a reload when an ingest changed the
collection. Routers call this; FastAPI-free."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable
from dataclasses import asdict
from typing import Any

from app.core.errors import Overloaded, StoreUnavailable, UpstreamUnavailable
from app.core.metrics import ServiceMetrics
from app.rag.pipeline import Answer, Pipeline, Retrieved, final_answer
from app.rag.planner import ContextPlanner
from app.rag.requests import ChatQuery, Lookup, Query
from app.runtime.collection import CollectionWatcher
from app.runtime.readiness import Readiness
from app.runtime.traffic import LiveTraffic
from app.runtime.upstream import Upstream
from app.runtime.warmup import Warmer
from app.vllm.wire import Delta

log = logging.getLogger("prefixrag.service")


class Service:
    def __init__(self, pipeline: Pipeline, planner: ContextPlanner, traffic: LiveTraffic, upstream: Upstream,
                 warmer: Warmer, watcher: CollectionWatcher, metrics: ServiceMetrics, max_retrievals: int = 64) -> None:
        """``max_retrievals``: ``/v1/retrieve`` requests ranked at once (they take no place in vLLM's admission)."""
        self.pipeline, self.planner, self.traffic, self.upstream = pipeline, planner, traffic, upstream
        self.warmer, self.watcher, self.metrics = warmer, watcher, metrics
        self.max_retrievals, self._retrievals = max_retrievals, 0
        # every served collection's watcher, where this one answers readiness for all of them (the composition
        # root points it at the collections served, as they come and go)
        self.watchers: Callable[[], Iterable[CollectionWatcher]] = lambda: (watcher,)
        watcher.subscribe(self.collection_changed)
        watcher.subscribe_writing(self.rows_changing)

    def readiness(self) -> Readiness:
        """Can it answer now? vLLM's status, not ready while this collection is missing or unreadable, nor while
        any other served one is still loading at start-up (one missing later is its own requests' 503, and
        ``GET /v1/collections`` says why: the others are still answered); pre-warm's progress and the load are
        reported, never waited for."""
        problem = self.watcher.problem
        if problem is None:
            name, problem = next(((watcher.index.chroma.collection, watcher.problem) for watcher in self.watchers()
                                  if watcher.settling), ("", None))
            problem = problem and f"collection {name!r}: {problem}"
        return Readiness(self.upstream.status(), problem, self.warmer.progress, self.traffic.status())

    def answer_stream(self, query: Query) -> AsyncGenerator[Delta | Answer, None]:
        """``/ask``: deltas as vLLM produces them, then one ``Answer``; ``BadRequest`` at once for a bad query."""
        return self._admitted(self.pipeline.ask(query, self.upstream.require))

    def chat_stream(self, chat: ChatQuery) -> AsyncGenerator[Delta | Answer, None]:
        return self._admitted(self.pipeline.chat(chat, self.upstream.require))

    async def answer(self, query: Query) -> Answer:
        return await final_answer(self.answer_stream(query))

    async def chat(self, chat: ChatQuery) -> Answer:
        return await final_answer(self.chat_stream(chat))

    async def retrieve(self, lookup: Lookup) -> Retrieved:
        """``/v1/retrieve``: ranking alone, answered while vLLM is down too; beyond ``max_retrievals`` at once,
        ``Overloaded`` at once (the ranking queue is not allowed to grow without bound)."""
        if self._retrievals >= self.max_retrievals:
            raise Overloaded(f"{self.max_retrievals} retrievals are running, the limit; retry shortly",
                             retry_after_s=1)
        self._retrievals += 1
        try:
            return await self.pipeline.retrieve(lookup)
        finally:
            self._retrievals -= 1

    async def describe(self) -> dict[str, Any]:
        """The served collection now: its chunks (less those withdrawn) and generation, readiness, strategy and
        pre-warm's progress; one that cannot be read now holds nothing, and says why (``problem``)."""
        index, problem = self.pipeline.index, self.watcher.problem
        try:
            chunks, generation = await index.count() - len(index.withdrawn), await index.generation()
        except StoreUnavailable as exc:
            chunks, generation, problem = 0, None, problem or exc.message
        return {"id": index.chroma.collection, "chunks": chunks, "generation": generation,
                "ready": problem is None, "problem": problem, "strategy": self.planner.name,
                "warmup": asdict(self.warmer.progress)}

    async def _admitted(self, events: AsyncIterator[Delta | Answer]) -> AsyncGenerator[Delta | Answer, None]:
        """Admission (a slot, or 429 at once) around the whole request, and vLLM's health watched. Once a stop's
        drain time is over, a request still running ends with ``ShuttingDown`` then (its client gets a terminal
        event; closing ``events`` aborts its vLLM request) rather than be cut off mid-body."""
        try:
            async with (self.traffic.slot(), contextlib.aclosing(events),  # type: ignore[type-var]
                        contextlib.aclosing(self.traffic.cutoff.guard(events)) as guarded):
                async for event in guarded:
                    yield event
        except StoreUnavailable:
            raise  # Chroma's problem, not vLLM's: the collection watcher keeps readiness for it
        except UpstreamUnavailable as exc:  # vLLM went away: readiness drops, the monitor re-probes
            self.upstream.mark_down(exc.message)
            raise

    async def collection_changed(self, rewarm: bool) -> None:
        """An ingest changed the collection (or it is gone): drop everything cached of it; re-warm."""
        self.pipeline.index.reopen()
        self.forget_arranged()
        self.metrics.collection_reloads.inc()
        if rewarm:  # in the background; a deleted collection has nothing to warm
            self.warmer.restart()

    def rows_changing(self) -> None:
        """An ingest run started writing: nothing read of the rows before is used again; the store's handles, the
        search indexes and the warm set stay until the run ends (then ``collection_changed``)."""
        self.pipeline.index.forget_rows()
        self.forget_arranged()

    def forget_arranged(self) -> None:
        """Nothing retrieved, arranged or read of the collection before is used again (a document was
        withdrawn: the store's handles stay open)."""
        self.pipeline.forget()
        self.planner.forget_collection()
