"""The collection as the service reads it: opened lazily, reopened after an ingest, its generation stamp, the
indexes derived from it (BM25, pages) loaded in the background, and paged reads. Every read runs on a worker
thread, never on the event loop; background work (pre-warm) reads on a thread of its own, and only while no
user request is present."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from app.core import inventory, lexical, pages, withdrawals
from app.core.errors import StoreUnavailable
from app.core.records import ChunkRecord, row_text, split_row
from app.core.settings import ChromaSettings, PageSettings, RetrievalSettings
from app.core.store import StoreError, all_rows, forget_clients, open_collection, read_generation, stamp_of
from app.rag.context import ContextChunk
from app.rag.seams import Embedder

T = TypeVar("T")
SOURCES_TTL_S = 60.0  # how long the list of sources (for prefix filters) is reused
ROWS_KEPT = 8192  # chunks whose text and metadata ``read`` keeps: a hot chunk is read from Chroma once
PAGE = 500  # rows per read: one read holds the GIL for tens of ms at most, then a user's request may run
# Inside background work (pre-warm), how it waits for users to be gone: its store reads then wait for that and
# use a thread of their own, never the ones that embed and query for users.
BACKGROUND: contextvars.ContextVar[Callable[[], Awaitable[object]] | None] = contextvars.ContextVar(
    "background", default=None)


class CollectionIndex:
    def __init__(self, embedder: Embedder, chroma: ChromaSettings, executor: ThreadPoolExecutor,
                 retrieval: RetrievalSettings | None = None, paging: PageSettings | None = None,
                 ranks: bool = True) -> None:
        """``ranks``: questions are ranked over this index (False: worker processes rank, with their own BM25)."""
        self.embedder, self.chroma, self.executor, self.ranks = embedder, chroma, executor, ranks
        self.retrieval, self.paging = retrieval or RetrievalSettings(), paging or PageSettings()
        # Background reads (pre-warm scanning the collection) queue here, not ahead of a user's retrieval.
        self.background_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="background-read")
        self._collection: Any = None
        self._fresh: Future[None] | None = None  # a reopened store's handle being opened (``reopen``)
        # The open handle was opened on an empty collection: embedded Chroma cannot search rows written after
        # through it (no vector index on disk then), so ``reopen`` drops it rather than keep it meanwhile.
        self._opened_empty = False
        self._sources: tuple[float, list[str]] = (0.0, [])
        # Indexes derived from the collection as opened (BM25, pages), each loaded or being built.
        self._derived: dict[str, Future[Any]] = {}
        self._rows: OrderedDict[str, tuple[str, dict[str, Any]]] = OrderedDict()  # ``read``'s, as of ``_opened``
        self._rows_lock, self._opened = threading.Lock(), 0  # reads run on several threads; reopen bumps _opened
        # Chunks of documents deleted over HTTP whose rows are still stored (``app.core.withdrawals``): never
        # returned by ``visible`` or ``chunks_where``.
        self.withdrawn: frozenset[str] = frozenset()

    def close(self) -> None:
        self.background_executor.shutdown(wait=False, cancel_futures=True)

    async def run(self, work: Callable[..., T], *args: Any) -> T:
        """``work(*args)`` on a worker thread: the users' pool, or (inside background work) the background one
        once no user request is present."""
        pool = self.executor
        if (pause := BACKGROUND.get()) is not None:
            await pause()
            pool = self.background_executor
        return await asyncio.get_running_loop().run_in_executor(pool, work, *args)

    @property
    def collection(self) -> Any:
        # Opened lazily and retried per request: the service may start before the first ingest.
        if self._collection is None:
            opened = self._open()
            self._opened_empty = opened.count() == 0
            self._collection = opened
        return self._collection

    def _open(self) -> Any:
        try:
            return open_collection(self.chroma, self.embedder, create=False)
        except StoreError as exc:
            raise StoreUnavailable(str(exc)) from exc

    @property
    def reopening(self) -> bool:
        """Is a fresh handle still being opened (``reopen``)? Vector searches meanwhile use the one open before."""
        return self._fresh is not None and not self._fresh.done()

    async def generation(self) -> str | None:
        """The collection's generation stamp as stored now (None: no collection yet); see ``reopen``."""
        try:
            return await self.run(read_generation, self.chroma, self.embedder)
        except StoreError as exc:
            raise StoreUnavailable(str(exc)) from exc

    def reopen(self) -> None:
        """After an ingest changed the collection: open it afresh (embedded Chroma must reload from disk to see
        another process's writes). An embedded store's fresh handle is opened and its vector index loaded on the
        background thread, ahead of the derived indexes (that load takes seconds at 100K chunks, and grows with
        the corpus); until then questions are searched on the handle open before, whose reads see the store as
        it is now and whose vector search misses only the chunks added since (such rankings are not remembered:
        hybrid ones are dense alone then, as BM25 reloads after). A Chroma server's opens at the next request."""
        self._sources, self._derived = (0.0, []), {}
        self.withdraw(withdrawals.withdrawn_ids(self.chroma))  # as recorded now (finished ones are cleared)
        if self.chroma.url or self._collection is None or self._opened_empty:
            if not self.chroma.url:
                forget_clients()
            self._collection = None
            return
        self._fresh = self.background_executor.submit(self._open_fresh)

    def _open_fresh(self) -> None:
        forget_clients()  # handles open keep working on the old state: questions in flight are not disturbed
        try:
            fresh = self._open()
        except StoreUnavailable:
            self._collection = None  # the next request opens it, or reports why not
            return
        if self.ranks:  # questions are searched here (else worker processes search their own handles)
            with contextlib.suppress(Exception):  # an empty collection has no vector index to load
                fresh.query(query_embeddings=self.embedder.embed(["load the vector index"]), n_results=1, include=[])
        self._opened_empty = fresh.count() == 0
        self._collection = fresh

    def forget_rows(self) -> None:
        """Drop the chunk rows read so far: from now on every row is read from the store (a chunk deleted since
        is never returned from memory), the handles and indexes kept."""
        with self._rows_lock:
            self._rows.clear()
            self._opened += 1

    def withdraw(self, ids: frozenset[str]) -> None:
        """From now on these chunks are never returned, whatever the store still holds; replaces the last set."""
        self.withdrawn = ids
        self.forget_rows()

    def visible(self, chunks: list[ContextChunk]) -> list[ContextChunk]:
        """``chunks`` less the withdrawn ones (a ranking made by another process, or before the withdrawal)."""
        withdrawn = self.withdrawn
        return [chunk for chunk in chunks if chunk.id not in withdrawn] if withdrawn else chunks

    def query(self, **search: Any) -> dict[str, Any]:
        """A vector search (Chroma's ``query``) on the open handle. One opened on the empty collection fails
        ("Nothing found on disk") once another process has written rows whose vector index is not on disk yet,
        as while an upload fills a collection made empty; a handle opened afresh searches them: the search is
        retried once on one."""
        handle, opened_empty = self.collection, self._opened_empty
        with chroma_errors("query"):
            try:
                return dict(handle.query(**search))
            except Exception:
                if self.chroma.url or not (opened_empty or handle is not self._collection):
                    raise
            if handle is self._collection:  # (else another thread has opened one afresh already)
                forget_clients()  # handles open elsewhere keep working on the state they saw
                self._collection = None
            return dict(self.collection.query(**search))

    async def count(self) -> int:
        """Chunks in the collection (cheap: no documents are read)."""
        return await self.run(self._count)

    def _count(self) -> int:
        with chroma_errors("count"):
            return int(self.collection.count())

    async def recorded_parents(self) -> dict[str, tuple[int, str]] | None:
        """Each parent's chunk count and first chunk id, from the inventory the last writer recorded beside the
        collection as opened (``app.core.inventory``); None where there is none for it (read the rows then)."""
        return await self.run(self._recorded_parents)

    def _recorded_parents(self) -> dict[str, tuple[int, str]] | None:
        with chroma_errors("read"):
            documents = inventory.load(inventory.path_of(self.chroma), stamp_of(self.collection))
        return inventory.parents_of(documents) if documents is not None else None

    def lexical_index(self, wait: bool = False) -> lexical.LexicalIndex | None:
        """The BM25 index of the collection as opened: loaded from ingest's files when their stamp matches,
        else built from Chroma's rows, on the background thread. None while that runs (unless ``wait``)."""
        found: lexical.LexicalIndex | None = self._index(
            "lexical", lambda c: lexical.current(c, self.chroma), wait)
        return found

    def page_index(self, wait: bool = False) -> pages.PageIndex | None:
        """The collection's pages (``app.core.pages``), loaded or rebuilt like the BM25 index."""
        found: pages.PageIndex | None = self._index(
            "pages", lambda c: pages.current(c, self.chroma, self.paging), wait)
        return found

    def indexes_in_use(self) -> tuple[str, ...]:
        """The derived indexes answers need here: pages always (units), BM25 where questions are ranked here,
        unless retrieval is dense alone."""
        return ("pages",) if self.retrieval.mode == "dense" or not self.ranks else ("lexical", "pages")

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

    def _index(self, kind: str, build: Callable[[Any], Any], wait: bool) -> Any:
        if kind not in self._derived:  # the handle taken on that thread: a reopened one once it is open
            self._derived[kind] = self.background_executor.submit(lambda: build(self.collection))
        future = self._derived[kind]
        if not (wait or future.done()):
            return None
        try:
            return future.result()
        except Exception as exc:  # an unreadable collection: the next request tries again
            self._derived.pop(kind, None)
            raise StoreUnavailable(f"the {kind} index could not be built: {exc}") from exc

    async def chunks_where(self, where: dict[str, Any] | None, texts: bool = True) -> list[ContextChunk]:
        """All chunks matching a metadata filter (a parent document, or the whole collection), off the loop, a
        page per call (background work pauses for users between pages); ``texts=False`` reads metadata only
        (their ``text`` is then empty)."""
        chunks: list[ContextChunk] = []
        async for page in self.chunk_pages(where, texts):
            chunks += page
        return chunks

    async def chunk_pages(self, where: dict[str, Any] | None, texts: bool = True,
                          size: int = PAGE) -> AsyncGenerator[list[ContextChunk], None]:
        """``chunks_where``'s chunks, ``size`` rows per read, a page at a time (a reader may stop early). Rows
        become chunks on the reading thread: a big document read (thousands of rows) never stalls the loop."""
        include = ["documents", "metadatas"] if texts else ["metadatas"]
        with chroma_errors("read"):
            rows = all_rows(self.collection, include, where, size)
            while (page := await self.run(_next_chunks, rows, texts)) is not None:
                yield self.visible(page)

    def chunks(self, ids: list[str], scores: list[float],
               rows: dict[str, tuple[str, dict[str, Any]]] | None = None) -> list[ContextChunk]:
        """These chunks, in this order, from ``rows`` (``read``) or read from Chroma now (ids it no longer
        holds are dropped)."""
        rows = self.read(ids) if rows is None else rows
        return [to_chunk(i, *rows[i], score, rank) for rank, (i, score) in enumerate(zip(ids, scores)) if i in rows]

    def read(self, ids: list[str], present: set[str] | frozenset[str] = frozenset()
             ) -> dict[str, tuple[str, dict[str, Any]]]:
        """Text and metadata of these chunks, by id, in one Chroma read; ``present``: ids Chroma itself has just
        returned (a query's), whose rows are taken from memory when read before. A chunk's id carries its
        content's hash and a reopen forgets every row, so a kept row is never stale; an id only BM25 found is
        always read (deleted since BM25 was built, it is left out)."""
        with self._rows_lock:
            kept = {i: self._rows[i] for i in ids if i in present and i in self._rows}
            for i in kept:
                self._rows.move_to_end(i)
            opened = self._opened
        missing = [i for i in ids if i not in kept]
        if not missing:
            return kept
        with chroma_errors("read"):
            page = self.collection.get(ids=missing, include=["documents", "metadatas"])
        fresh = {i: split_row(meta, text)
                 for i, text, meta in zip(page["ids"], page["documents"], page["metadatas"]) if meta is not None}
        with self._rows_lock:
            if opened == self._opened:  # not reopened meanwhile: what was read is still the collection's
                self._rows.update(fresh)
                while len(self._rows) > ROWS_KEPT:
                    self._rows.popitem(last=False)
        return kept | fresh

    def sources(self) -> list[str]:
        """Every source in the collection: the BM25 index's list where it is loaded (it holds each row's
        source: nothing is read), else read page by page and reused for ``SOURCES_TTL_S``."""
        loaded = self._derived.get("lexical")
        if loaded is not None and loaded.done() and loaded.exception() is None:
            return loaded.result().distinct_sources  # type: ignore[no-any-return]
        fetched_at, sources = self._sources
        if time.monotonic() - fetched_at > SOURCES_TTL_S:
            with chroma_errors("read"):
                found = {ChunkRecord.from_metadata(meta).source
                         for page in all_rows(self.collection, ["metadatas"]) for meta in page["metadatas"]}
            sources = sorted(found)
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


def _next_chunks(rows: Iterator[dict[str, Any]], texts: bool) -> list[ContextChunk] | None:
    """The next page of ``rows`` as chunks (None: no more); ``texts=False``: their text left empty."""
    page = next(rows, None)
    if page is None:
        return None
    read = list(map(row_text, page["metadatas"], page["documents"])) if texts else [""] * len(page["ids"])
    return [to_chunk(i, text, meta, retrieved=False)
            for i, text, meta in zip(page["ids"], read, page["metadatas"], strict=True)]


def to_chunk(chunk_id: str, text: str, meta: dict[str, Any], score: float = 0.0, rank: int = 0,
             retrieved: bool = True) -> ContextChunk:
    record = ChunkRecord.from_metadata(meta)
    return ContextChunk(
        id=chunk_id, doc_id=record.doc_id, chunk_index=record.chunk_index, text=text, title=record.title,
        headings=record.headings, score=round(float(score), 4), rank=rank, parent_id=record.parent_id,
        parent_pos=record.parent_pos, retrieved=retrieved, start=record.start, end=record.end, page=record.page,
        n_chunks=record.n_chunks, parent_chars=record.parent_chars,
    )
