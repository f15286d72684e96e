"""The collections a service serves, as they come and go: those of its settings, those made over HTTP (recorded
beside the store, ``app.core.collections_store``), and what runs for each (its pre-warm and its watcher).

A collection made here is served at once, empty, by a graph of its own over the process's clients (``another_
collection``); one dropped stops being served before its rows and indexes are deleted, so no question is answered
from a half-deleted collection. The collections of the settings are not dropped over HTTP: a restart would serve
them again. Another service process on the same store (a replica) follows the record at every poll: it serves what
was made and stops serving what was deleted, without a restart."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from app.core import collections_store
from app.core.errors import BadRequest, Conflict, NotFound, StoreUnavailable
from app.core.store import StoreError
from app.runtime.retrieval_pool import RetrievalPool
from app.runtime.services import Services, another_collection, warm_share

log = logging.getLogger("prefixrag.collections")


class Shelf:
    def __init__(self, services: Services) -> None:
        self.services, self.settings = services, services.settings
        self.configured = frozenset(services.collections)
        self._tasks: dict[str, list[asyncio.Task[None]]] = {}
        self._changing = asyncio.Lock()  # one make, drop or follow of the record at a time
        self._following: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Pre-warm and watch every collection served now, and follow the record of those made over HTTP."""
        for name, graph in self.services.collections.items():
            self._run(name, graph)
        self._following = asyncio.create_task(self.follow_record(), name="collections-record")

    async def make(self, name: str) -> Services:
        """Create collection ``name`` empty in the store and serve it; ``Conflict`` if it exists."""
        if not collections_store.NAME.fullmatch(name):
            raise BadRequest(f"collection name {name!r}: 3-512 characters of letters, digits, '.', '_' and '-', "
                             "starting and ending with a letter or digit", param="id", code="invalid_collection_name")
        async with self._changing:
            if name in self.services.collections:
                raise Conflict(f"collection {name!r} is served already", param="id", code="collection_exists")
            cfg = self.settings.chroma.serving(name)
            try:
                await asyncio.to_thread(collections_store.make, cfg, self.services.clients.embedder,
                                        self.settings.ingest.lock_timeout_s)
            except collections_store.CollectionExists as exc:
                raise Conflict(f"{exc}; add it to PREFIXRAG_CHROMA__COLLECTIONS to serve it", param="id",
                               code="collection_exists") from None
            except StoreError as exc:
                raise StoreUnavailable(str(exc)) from None
            graph = self._serve(name)
            await graph.watcher.check_now()  # ready (primed) before it is listed as made
            log.info("collection %r made and served", name)
            return graph

    def serve_recorded(self) -> None:
        """At start-up: serve the collections made over HTTP by earlier runs on this store."""
        for name in collections_store.recorded(self.settings.chroma):
            if name not in self.services.collections:
                self._serve(name)

    async def drop(self, name: str) -> None:
        """Stop serving collection ``name`` (made over HTTP), then delete it and what was derived from it."""
        async with self._changing:
            if name not in self.services.collections:
                raise NotFound(f"collection {name!r} not found", param="collection", code="collection_not_found")
            if name in self.configured:
                raise Conflict(f"collection {name!r} is served by the settings (PREFIXRAG_CHROMA__COLLECTION or "
                               "__COLLECTIONS): remove it there, then delete it", param="collection",
                               code="collection_configured")
            graph = await self._unserve(name)
            try:
                await asyncio.to_thread(collections_store.drop, graph.settings.chroma,
                                        self.settings.ingest.lock_timeout_s)
            except StoreError as exc:
                raise StoreUnavailable(str(exc)) from None
            log.info("collection %r no longer served, and deleted", name)

    async def follow_record(self) -> None:
        """Serve what another service process on this store made over HTTP, and stop serving what it deleted:
        the record beside the store is read at every watcher poll (``PREFIXRAG_CHROMA__POLL_S``)."""
        while True:
            await asyncio.sleep(self.settings.chroma.poll_s)
            try:
                await self.follow_once()
            except Exception as exc:  # e.g. the record unreadable for now
                log.warning("following the record of collections made over HTTP failed (again at the next poll): %s",
                            exc)

    async def follow_once(self) -> None:
        async with self._changing:  # the record read under the lock: a make or drop of ours lands before or after
            recorded = set(await asyncio.to_thread(collections_store.recorded, self.settings.chroma))
            for name in sorted(recorded - set(self.services.collections)):
                await self._serve(name).watcher.check_now()
                log.info("collection %r made by another service process: served", name)
            for name in sorted(set(self.services.collections) - recorded - self.configured):
                await self._unserve(name)
                log.info("collection %r deleted by another service process: no longer served", name)

    async def aclose(self) -> None:
        tasks = [task for running in self._tasks.values() for task in running]
        tasks += [self._following] if self._following is not None else []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _unserve(self, name: str) -> Services:
        """Stop serving collection ``name``: its monitors stopped, its graph closed, every ranking worker told."""
        graph = self.services.collections.pop(name)
        self._share_warmup()
        for task in self._tasks.pop(name, []):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await graph.close_collection()
        if isinstance(self.services.clients.ranker, RetrievalPool):
            await self.services.clients.ranker.forget(name)
        return graph

    def _serve(self, name: str) -> Services:
        graph = self.services.collections[name] = another_collection(self.services, name)
        self._share_warmup()
        if self._tasks:  # serving already: its monitors start now (else with the others, in ``start``)
            self._run(name, graph)
        return graph

    def _share_warmup(self) -> None:
        """Pre-warm's bounds split evenly among the collections served now (each pre-warm's next plan uses them)."""
        bounds = warm_share(self.settings, len(self.services.collections)).warmup
        for graph in self.services.collections.values():
            graph.warmer.settings = bounds

    def _run(self, name: str, graph: Services) -> None:
        self._tasks[name] = [asyncio.create_task(graph.warmer.run_forever(), name=f"warmer-{name}"),
                             asyncio.create_task(graph.watcher.run_forever(self.settings.chroma.poll_s),
                                                 name=f"collection-watcher-{name}")]
