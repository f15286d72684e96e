"""Question -> ranked chunks. Embedding and the Chroma query run on a worker thread, never on the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from app.errors import StoreUnavailable
from app.rag.context import ContextChunk
from app.settings import ChromaSettings
from ingest.store import PAGE, StoreError, forget_clients, open_collection, read_generation

SOURCES_TTL_S = 60.0  # how long the list of sources (for prefix filters) is reused


class Retriever:
    def __init__(self, embedder, chroma: ChromaSettings, executor: ThreadPoolExecutor) -> None:
        self.embedder, self.chroma, self.executor = embedder, chroma, executor
        self._collection = None
        self._sources: tuple[float, list[str]] = (0.0, [])

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
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self.executor, read_generation, self.chroma, self.embedder)
        except StoreError as exc:
            raise StoreUnavailable(str(exc)) from exc

    def reopen(self) -> None:
        """After an ingest changed the collection: open it afresh on the next request (embedded Chroma must
        reload from disk to see another process's writes)."""
        if not self.chroma.url:
            forget_clients()
        self._collection, self._sources = None, (0.0, [])

    async def count(self) -> int:
        """Chunks in the collection (cheap: no documents are read)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, self._count)

    def _count(self) -> int:
        with chroma_errors("count"):
            return self.collection.count()

    async def retrieve(self, question: str, k: int, source_prefix: str | None = None) -> list[ContextChunk]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, self.retrieve_sync, question, k, source_prefix)

    def retrieve_sync(self, question: str, k: int, source_prefix: str | None = None) -> list[ContextChunk]:
        vector = self.embedder.embed([question])[0]
        where = self._where(source_prefix)
        if where == {"source": {"$in": []}}:
            return []  # the filter matches no source at all
        with chroma_errors("query"):
            found = self.collection.query(query_embeddings=[vector], n_results=k, where=where,
                                          include=["documents", "metadatas", "distances"])
        rows = zip(found["ids"][0], found["documents"][0], found["metadatas"][0], found["distances"][0])
        return [to_chunk(chunk_id, text, meta, 1.0 - distance, rank)
                for rank, (chunk_id, text, meta, distance) in enumerate(rows)]

    async def chunks_where(self, where: dict | None, texts: bool = True) -> list[ContextChunk]:
        """All chunks matching a metadata filter (a parent document, or the whole collection), off the loop;
        ``texts=False`` reads metadata only (their ``text`` is then empty)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, self._get_all, where, texts)

    def _get_all(self, where: dict | None, texts: bool) -> list[ContextChunk]:
        with chroma_errors("read"):
            return self._read_pages(where, texts)

    def _read_pages(self, where: dict | None, texts: bool) -> list[ContextChunk]:
        chunks, offset = [], 0
        include = ["documents", "metadatas"] if texts else ["metadatas"]
        while True:
            page = self.collection.get(where=where, include=include, limit=PAGE, offset=offset)
            documents = page["documents"] if texts else [""] * len(page["ids"])
            chunks += [to_chunk(i, text, meta, retrieved=False)
                       for i, text, meta in zip(page["ids"], documents, page["metadatas"])]
            if len(page["ids"]) < PAGE:
                return chunks
            offset += PAGE

    def _where(self, source_prefix: str | None) -> dict | None:
        if not source_prefix:
            return None
        return {"source": {"$in": [s for s in self.sources() if s.startswith(source_prefix)]}}

    def sources(self) -> list[str]:
        fetched_at, sources = self._sources
        if time.monotonic() - fetched_at > SOURCES_TTL_S:
            metas = self.collection.get(include=["metadatas"])["metadatas"]
            sources = sorted({meta["source"] for meta in metas})
            self._sources = (time.monotonic(), sources)
        return sources


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
    return ContextChunk(
        id=chunk_id, doc_id=meta["doc_id"], chunk_index=int(meta["chunk_index"]), text=text,
        title=meta.get("title", ""), headings=meta.get("headings", ""), score=round(float(score), 4), rank=rank,
        parent_id=meta.get("parent_id", ""), parent_pos=int(meta.get("parent_pos", 0)), retrieved=retrieved,
        start=int(meta.get("start", -1)), end=int(meta.get("end", -1)),
    )
