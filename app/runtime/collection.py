"""Is the collection there, and did an ingest change it? A background watcher of its generation stamp: the
service is not ready while the collection is missing or unreadable, and reloads (and re-warms) when an
ingest in another process changed it. While a run is still writing (its first stamp, ``WRITING``) the service
only drops what it read of the rows: the store's handles and search indexes are reopened and re-warmed once,
at the run's end, from the indexes the run saved, never rebuilt from half-written rows beside the writer."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from app.core.errors import ServiceError
from app.core.store import FIRST_RUN_RUNNING, WRITING, being_written
from app.rag.index import CollectionIndex
from app.rag.seams import Ranker

log = logging.getLogger("prefixrag.collection")
_UNSEEN = object()
NOT_CHECKED, LOADING = "collection not checked yet", "loading the search indexes"


class CollectionWatcher:
    def __init__(self, index: CollectionIndex, ranker: Ranker) -> None:
        self.index, self.ranker = index, ranker
        self.problem: str | None = NOT_CHECKED  # why it cannot answer now (None: it can)
        self._subscribers: list[Callable[[bool], Awaitable[None]]] = []
        self._writing: list[Callable[[], None]] = []
        self._seen: object = _UNSEEN  # the stamp last acted on; the first look only records what start-up loaded
        self._looking = asyncio.Lock()  # the poll and a write of this process's own never look at once

    @property
    def settling(self) -> bool:
        """Still being opened at start-up (or when it first appeared): not yet answered from, nor found wanting."""
        return self.problem in (NOT_CHECKED, LOADING)

    def subscribe(self, changed: Callable[[bool], Awaitable[None]]) -> None:
        """``await changed(rewarm)`` each time an ingest changed the collection (``rewarm``: it still exists)."""
        self._subscribers.append(changed)

    def subscribe_writing(self, writing: Callable[[], None]) -> None:
        """``writing()`` each time an ingest run starts writing (rows change until it stamps its end)."""
        self._writing.append(writing)

    async def run_forever(self, interval_s: float) -> None:
        """Poll the generation stamp; when an ingest changed it, call ``changed(rewarm)`` (the service drops
        everything cached of it: Chroma's embedded state, retrievals, units, the corpus, and re-warms)."""
        while True:
            try:
                await self.check_now()
            except ServiceError as exc:
                if self.problem != exc.message:  # once per state change
                    log.warning("cannot check the collection for changes: %s", exc.message)
                self.problem = exc.message
            await asyncio.sleep(interval_s)

    async def check_now(self, prime: bool = True) -> None:
        """Look at the stamp now and act on a change (a write of this process's own: an upload, a deletion),
        returning once the service has dropped what it cached: nothing cached from before is used after this;
        ``prime``: and once its indexes are loaded again (else they load at the next question)."""
        async with self._looking:
            self._seen = await self._look(self._seen, prime)

    async def _look(self, seen: object, prime: bool = True) -> str | None:
        name = self.index.chroma.collection
        now = await self.index.generation()
        if now is None:
            self.problem = f"collection {name!r} does not exist: ingest documents first"
        elif now == FIRST_RUN_RUNNING:  # half-written: answering from it would cite a part of the documents
            self.problem = f"collection {name!r} is being ingested for the first time: ready when that run ends"
            return now
        now = await self._settled(now)
        changed = seen is not _UNSEEN and now != seen
        writing = changed and _starts_writing(seen, now)
        if writing:
            log.info("collection %r is being written (an ingest runs): rows are read afresh; reloading when the "
                     "run ends", name)
            for subscriber in self._writing:
                subscriber()
        elif changed:
            if now is None:  # deleted under us: answer 503 from now on, never from a stale handle
                log.warning("collection %r is gone (store deleted?): requests get 503 until the next ingest", name)
            else:
                log.info("collection %r changed (an ingest ran): reloading and re-warming", name)
            for changed_subscriber in self._subscribers:
                await changed_subscriber(now is not None)
        if now is not None:
            if seen is _UNSEEN or (changed and not writing and prime):  # the first look always: readiness waits
                await self._prime()
            self.problem = None
        return now

    async def _settled(self, now: str | None) -> str | None:
        """``now``, less its ``WRITING`` mark where the run that stamped it died mid-way: what it wrote is what
        there is, reloaded as after a run's end."""
        if now is None or not now.startswith(WRITING) or await self.index.run(being_written, now, self.index.chroma):
            return now
        return now.removeprefix(WRITING)

    async def _prime(self) -> None:
        """Load the vector index and run the encoder once, then wait for the search indexes (BM25, pages): not
        ready (at start-up, or when the collection appears) until a question would pay for none of them (the
        first one took 0.6 s against 0.1 s after), nor find them still loading (it would get dense hits alone
        and its document unpaged, a prompt unlike the next one's). A ready service stays ready through a reload
        and answers meanwhile."""
        if self.problem is not None:
            self.problem = LOADING
        await self.ranker.prime()
        await self.index.indexes_ready(self.index.indexes_in_use())


def _starts_writing(seen: object, now: str | None) -> bool:
    """From a settled stamp to a run's first: rows change from now on, the run will stamp its end. (From one run's
    first stamp straight to the next run's, the end between them went unseen: that is a reload.)"""
    return now is not None and now.startswith(WRITING) and not str(seen).startswith(WRITING)
