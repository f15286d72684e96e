"""Question -> ranked chunks: dense (embeddings, Chroma), lexical (BM25, ``app.core.lexical``) or both fused by
reciprocal rank. Embedding, queries and index builds run on worker threads, never on the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import TypeVar

from app.core import lexical, pages
from app.core.records import ChunkRecord
from app.core.settings import ChromaSettings, PageSettings, RetrievalSettings
from app.core.store import StoreError, forget_clients, open_collection, read_generation
from app.errors import StoreUnavailable
from app.rag.context import ContextChunk
from app.rag.traffic import BACKGROUND

T = TypeVar("T")
SOURCES_TTL_S = 60.0  # how long the list of sources (for prefix filters) is reused
PAGE = 500  # rows per read: one read holds the GIL for tens of ms at most, then a user's request may run


class Retriever:
    def __init__(self, embedder, chroma: ChromaSettings, executor: ThreadPoolExecutor,
                 retrieval: RetrievalSettings | None = None, paging: PageSettings | None = None) -> None:
        self.embedder, self.chroma, self.executor = embedder, chroma, executor
        self.retrieval, self.paging = retrieval or RetrievalSettings(), paging or PageSettings()
        # Background reads (pre-warm scanning the collection) queue here, not ahead of a user's retrieval.
        self.background_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="background-read")
        self._collection = None
        self._sources: tuple[float, list[str]] = (0.0, [])
        # Indexes derived from the collection as opened (BM25, pages), each loaded or being built.
        self._derived: dict[str, Future] = {}

    def close(self) -> None:
        self.background_executor.shutdown(wait=False, cancel_futures=True)

    async def _off_loop(self, work: Callable[..., T], *args) -> T:
        pool = self.executor
        if (pause := BACKGROUND.get()) is not None:
            await pause()  # background work reads only while no user request is present
            pool = self.background_executor
        return await asyncio.get_running_loop().run_in_executor(pool, work, *args)

    @property
    def collection(self):
        # Opened lazily and retried per request: the service may start before the first ingest.
        if self._collection is None:
            try:
                self._collection = open_collection(self.chroma, self.embedder, create=False)
            except StoreError as exc:
                raise StoreUnavailable(str(exc)) from exc
        return self._collection

    async def generation(self) -> str | None:
        """The collection's generation stamp as stored now (None: no collection yet); see ``reopen``."""
        try:
            return await self._off_loop(read_generation, self.chroma, self.embedder)
        except StoreError as exc:
            raise StoreUnavailable(str(exc)) from exc

    def reopen(self) -> None:
        """After an ingest changed the collection: open it afresh on the next request (embedded Chroma must
        reload from disk to see another process's writes)."""
        if not self.chroma.url:
            forget_clients()
        self._collection, self._sources, self._derived = None, (0.0, []), {}

    async def count(self) -> int:
        """Chunks in the collection (cheap: no documents are read)."""
        return await self._off_loop(self._count)

    def _count(self) -> int:
        with chroma_errors("count"):
            return self.collection.count()

    async def retrieve(self, question: str, k: int, source_prefix: str | None = None,
                       mode: str | None = None) -> list[ContextChunk]:
        return await self._off_loop(self.retrieve_sync, question, k, source_prefix, mode)

    def retrieve_sync(self, question: str, k: int, source_prefix: str | None = None,
                      mode: str | None = None) -> list[ContextChunk]:
        """The top ``k`` chunks by ``mode`` (default: the configured one). While the BM25 index is still being
        built (after a start or a reload), hybrid answers with the dense ranking alone rather than wait."""
        mode = mode or self.retrieval.mode
        where = self._where(source_prefix)
        if where == {"source": {"$in": []}}:
            return []  # the filter matches no source at all
        index = self.lexical_index(wait=mode == "lexical") if mode != "dense" else None
        if index is None:
            return self._dense(question, k, where)
        depth = max(k, self.retrieval.candidates)
        sources = set(where["source"]["$in"]) if where else None
        found = index.search(question, depth if mode == "hybrid" else k, sources)
        if mode == "lexical":
            return self._chunks([i for i, _ in found], [score for _, score in found])
        dense = self._query(question, depth, where, include=[])  # ids only: texts are read for the fused k alone
        fused = reciprocal_rank_fusion([dense["ids"][0], [i for i, _ in found]], self.retrieval.rrf_k)[:k]
        kept = self._chunks([i for i, _ in fused], [score for _, score in fused])  # deleted since indexed: gone
        return [replace(chunk, rank=rank) for rank, chunk in enumerate(kept)]

    def _query(self, question: str, k: int, where: dict | None, include: list[str]) -> dict:
        vector = self.embedder.embed([question])[0]
        with chroma_errors("query"):
            return self.collection.query(query_embeddings=[vector], n_results=k, where=where, include=include)

    def _dense(self, question: str, k: int, where: dict | None) -> list[ContextChunk]:
        found = self._query(question, k, where, include=["documents", "metadatas", "distances"])
        rows = zip(found["ids"][0], found["documents"][0], found["metadatas"][0], found["distances"][0])
        return [to_chunk(chunk_id, text, meta, 1.0 - distance, rank)
                for rank, (chunk_id, text, meta, distance) in enumerate(rows)]

    def _chunks(self, ids: list[str], scores: list[float]) -> list[ContextChunk]:
        """These chunks read from Chroma, in this order (ids it no longer holds are dropped)."""
        if not ids:
            return []
        with chroma_errors("read"):
            page = self.collection.get(ids=ids, include=["documents", "metadatas"])
        rows = {i: (text, meta) for i, text, meta in zip(page["ids"], page["documents"], page["metadatas"])}
        return [to_chunk(i, *rows[i], score, rank) for rank, (i, score) in enumerate(zip(ids, scores)) if i in rows]

    def lexical_index(self, wait: bool = False) -> lexical.LexicalIndex | None:
        """The BM25 index of the collection as opened: loaded from ingest's files when their stamp matches,
        else built from Chroma's rows, on the background thread. None while that runs (unless ``wait``)."""
        return self._index("lexical", lambda c: lexical.current(c, self.chroma, write=False), wait)

    def page_index(self, wait: bool = False) -> pages.PageIndex | None:
        """The collection's pages (``app.core.pages``), loaded or rebuilt like the BM25 index."""
        return self._index("pages", lambda c: pages.current(c, self.chroma, self.paging, write=False), wait)

    def indexes_in_use(self) -> tuple[str, ...]:
        """The derived indexes answers need: pages always (units), BM25 unless retrieval is dense alone."""
        return ("pages",) if self.retrieval.mode == "dense" else ("lexical", "pages")

    def indexes_loaded(self) -> bool:
        """Are the derived indexes answers need loaded (False while a start or a reload still loads them)?"""
        return all(kind in self._derived and self._derived[kind].done() and self._derived[kind].exception() is None
                   for kind in self.indexes_in_use())

    async def indexes_ready(self, kinds: tuple[str, ...] = ("lexical", "pages")) -> None:
        """Wait (without blocking the loop) until these derived indexes are loaded or built."""
        loaders = {"lexical": self.lexical_index, "pages": self.page_index}
        for kind in kinds:
            build = loaders[kind]
            if build() is None:
                with contextlib.suppress(Exception):  # a failed build raises below, as StoreUnavailable
                    await asyncio.wrap_future(self._derived[kind])
                build(True)

    def _index(self, kind: str, build: Callable, wait: bool):
        if kind not in self._derived:
            self._derived[kind] = self.background_executor.submit(build, self.collection)
        future = self._derived[kind]
        if not (wait or future.done()):
            return None
        try:
            return future.result()
        except Exception as exc:  # an unreadable collection: the next request tries again
            self._derived.pop(kind, None)
            raise StoreUnavailable(f"the {kind} index could not be built: {exc}") from exc

    async def chunks_where(self, where: dict | None, texts: bool = True) -> list[ContextChunk]:
        """All chunks matching a metadata filter (a parent document, or the whole collection), off the loop, a
        page per call (background work pauses for users between pages); ``texts=False`` reads metadata only
        (their ``text`` is then empty)."""
        chunks: list[ContextChunk] = []
        while True:
            page = await self._off_loop(self._read_page, where, texts, len(chunks))
            chunks += page
            if len(page) < PAGE:
                return chunks

    def _read_page(self, where: dict | None, texts: bool, offset: int) -> list[ContextChunk]:
        include = ["documents", "metadatas"] if texts else ["metadatas"]
        with chroma_errors("read"):
            page = self.collection.get(where=where, include=include, limit=PAGE, offset=offset)
        documents = page["documents"] if texts else [""] * len(page["ids"])
        return [to_chunk(i, text, meta, retrieved=False)
                for i, text, meta in zip(page["ids"], documents, page["metadatas"])]

    def _where(self, source_prefix: str | None) -> dict | None:
        if not source_prefix:
            return None
        return {"source": {"$in": [s for s in self.sources() if s.startswith(source_prefix)]}}

    def sources(self) -> list[str]:
        fetched_at, sources = self._sources
        if time.monotonic() - fetched_at > SOURCES_TTL_S:
            metas = self.collection.get(include=["metadatas"])["metadatas"]
            sources = sorted({ChunkRecord.from_metadata(meta).source for meta in metas})
            self._sources = (time.monotonic(), sources)
        return sources


def reciprocal_rank_fusion(rankings: list[list[str]], k: int) -> list[tuple[str, float]]:
    """Ids by the sum over rankings of 1 / (k + rank); ties by id, so the order is the same on every run."""
    scores: dict[str, float] = {}
    for ranking in rankings:
        for rank, chunk_id in enumerate(ranking, start=1):
            scores[chunk_id] = scores.get(chunk_id, 0.0) + 1.0 / (k + rank)
    return sorted(scores.items(), key=lambda item: (-item[1], item[0]))


@contextlib.contextmanager
def chroma_errors(action: str) -> Iterator[None]:
    """Chroma's own errors (a store deleted or rewritten under us) become ``StoreUnavailable``."""
    try:
        yield
    except StoreUnavailable:
        raise
    except Exception as exc:
        raise StoreUnavailable(f"Chroma {action} failed: {exc}") from exc


def to_chunk(chunk_id: str, text: str, meta: dict, score: float = 0.0, rank: int = 0,
             retrieved: bool = True) -> ContextChunk:
    record = ChunkRecord.from_metadata(meta)
    return ContextChunk(
        id=chunk_id, doc_id=record.doc_id, chunk_index=record.chunk_index, text=text, title=record.title,
        headings=record.headings, score=round(float(score), 4), rank=rank, parent_id=record.parent_id,
        parent_pos=record.parent_pos, retrieved=retrieved, start=record.start, end=record.end, page=record.page,
    )
