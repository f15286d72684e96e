"""Batched writes: embed only content never embedded before, upsert, then delete each document's stale chunks."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import numpy as np

from app.core.records import TEXT_KEY, ChunkRecord, split_row
from app.core.seams import Embedder
from app.core.store import StoreError
from ingest.chunking import Chunk
from ingest.documents import SourceDocument


@dataclass
class _Pending:
    chunk_ids: set[str]
    stale_ids: list[str]
    remaining: int  # chunks of this document not yet upserted


def max_write_batch(collection: Any, wanted: int) -> int:
    """``wanted``, capped to the most rows Chroma accepts in one write (it refuses a larger upsert outright)."""
    limit = collection._client.get_max_batch_size() if collection is not None else wanted
    return max(1, min(wanted, limit))


class ChunkWriter:
    def __init__(self, collection: Any, embedder: Embedder, batch: int, dry_run: bool, report: Any,
                 before_first_write: Callable[[], None] = lambda: None,
                 stored: Callable[[dict[str, list[Any]]], None] | None = None) -> None:
        self.collection, self.embedder = collection, embedder
        # Called on the writing thread with each write's rows once stored (the indexes built as the run goes).
        self._stored = stored
        # Called once, before the collection is first changed: the generation stamp moves before any row does,
        # so a run killed mid-way never leaves changed rows under the old stamp (readers rebuild what they keep).
        self._before_first_write: Callable[[], None] | None = before_first_write
        self.batch = max_write_batch(collection, batch)
        self.dry_run, self.report = dry_run, report
        self.vectors: dict[str, np.ndarray] = {}  # content hash -> embedding, this run and re-used stored ones
        self.buffer: list[tuple[str, Chunk, dict[str, Any]]] = []
        self.pending: dict[str, _Pending] = {}
        self.metadata_changes: list[tuple[list[str], dict[str, Any] | None]] = []  # queued by relabel, record_size
        # Chroma's writes run on a thread of their own, so the encoder embeds the next batch meanwhile.
        self._writes = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ingest-write")
        self._in_flight: tuple[Future[None], list[tuple[str, Chunk, dict[str, Any]]]] | None = None

    def add_document(self, document: SourceDocument, chunks: list[Chunk], doc_hash: str,
                     previous_ids: list[str]) -> None:
        new_ids = {chunk.chunk_id for chunk in chunks}
        self.pending[document.doc_id] = _Pending(new_ids, [i for i in previous_ids if i not in new_ids], len(chunks))
        if previous_ids and not self.dry_run:
            self._settled()
            self._remember_stored(previous_ids)
        alone = document.kind != "jsonl"  # a file is its own parent; jsonl records may share theirs
        chars = sum(len(chunk.text) for chunk in chunks) if alone else -1
        for chunk in chunks:
            meta = chunk_metadata(document, chunk, doc_hash, len(chunks), chars)
            self.buffer.append((document.doc_id, chunk, meta))
        if len(self.buffer) >= self.batch:
            self.flush()

    def _remember_stored(self, ids: list[str]) -> None:
        """Keep the embeddings of a changed document's current chunks: unchanged text is never re-embedded."""
        for batch in self._batches(ids):
            stored = self.collection.get(ids=batch, include=["embeddings", "metadatas"])
            for vector, meta in zip(stored["embeddings"], stored["metadatas"]):
                self.vectors.setdefault(meta["content_hash"], np.asarray(vector, dtype=np.float32))

    def flush(self) -> None:
        """Write everything buffered, in writes of at most ``batch`` rows (one document may be far larger), wait
        until the last write is stored, then write the queued metadata changes."""
        buffered, self.buffer = self.buffer, []
        for batch in self._batches(buffered):
            self._write(batch)
        self._settled()
        self._write_metadata()

    def close(self) -> None:
        """Wait for the write in flight (its error, if any, is raised) and stop the writing thread."""
        try:
            self._settled()
        finally:
            self._writes.shutdown(wait=True)

    def _settled(self) -> None:
        """The write in flight stored (or its error raised here) and its bookkeeping done: the collection is as
        this thread left it."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            future, batch = in_flight
            with self.report.timed("store"):
                future.result()
            self._written(batch)

    def _batches(self, items: list[Any]) -> Iterator[list[Any]]:
        """``items`` in slices Chroma accepts: every read and write here goes through this."""
        for start in range(0, len(items), self.batch):
            yield items[start:start + self.batch]

    def _write(self, batch: list[tuple[str, Chunk, dict[str, Any]]]) -> None:
        """Embed this batch here while the one before is stored on the writing thread, then hand it over: one
        write in flight, in order (the write order is what crash safety rests on). Everything but Chroma's call
        stays on this thread: the bookkeeping of a batch is done once its write has landed (``_settled``)."""
        self._embed_missing([chunk for _, chunk, _ in batch])
        rows: dict[str, list[Any]] = {
            "ids": [chunk.chunk_id for _, chunk, _ in batch],
            "embeddings": [self.vectors[chunk.content_hash] for _, chunk, _ in batch],
            "metadatas": [meta | {TEXT_KEY: chunk.text} for _, chunk, meta in batch]}
        self._settled()
        if not self.dry_run:
            self._changing()
        self._in_flight = (self._writes.submit(self._upsert, rows), batch)

    def _upsert(self, rows: dict[str, list[Any]]) -> None:
        if self.dry_run:
            return
        try:
            self.collection.upsert(**rows)
        except Exception as exc:  # systemic (disk full, server gone): one clear line; a re-run converges
            raise StoreError(f"Chroma refused a write of {len(rows['ids'])} chunks: {exc}") from exc
        if self._stored is not None:
            self._stored(rows)

    def _written(self, batch: list[tuple[str, Chunk, dict[str, Any]]]) -> None:
        """A batch's write landed: count it, and delete the stale chunks of the documents it completed."""
        self.report.chunks_written += len(batch)
        for doc_id, _, _ in batch:
            self.pending[doc_id].remaining -= 1
        self._delete_stale_of_complete_documents()

    def _changing(self) -> None:
        if self._before_first_write is not None:
            announce, self._before_first_write = self._before_first_write, None
            announce()

    def _embed_missing(self, chunks: list[Chunk]) -> None:
        todo: dict[str, str] = {}
        for chunk in chunks:
            if chunk.content_hash not in self.vectors:
                todo.setdefault(chunk.content_hash, chunk.text)
        self.report.chunks_embedded += len(todo)
        if self.dry_run:
            self.vectors.update({h: np.zeros(0, dtype=np.float32) for h in todo})
            return
        with self.report.timed("embed"):
            vectors = self.embedder.embed(list(todo.values()))
        for content_hash, vector in zip(todo, vectors):
            self.vectors[content_hash] = np.asarray(vector, dtype=np.float32)

    def _delete_stale_of_complete_documents(self) -> None:
        # Only once ALL of a document's new chunks are stored do its old ones go: it is never without chunks.
        done = [doc_id for doc_id, pending in self.pending.items() if pending.remaining == 0]
        stale = [chunk_id for doc_id in done for chunk_id in self.pending.pop(doc_id).stale_ids]
        self._delete(stale)

    def relabel(self, ids: list[str], file_hash: str, source: str) -> None:
        """Record a new file (its hash, its path) on chunks whose content did not change: a record moved to
        another file, or its file changed elsewhere (a metadata-only write, batched)."""
        self._queue_metadata(ids, {"file_hash": file_hash, "source": source})

    def record_size(self, ids: list[str]) -> None:
        """Record a file's size (``parent_chars``: its chunks' characters, as ``add_document`` counts them) on
        its chunks, written before ingest recorded it: the service then reads a window of a big file alone.
        Once per such file, a metadata-only write, batched."""
        self._queue_metadata(ids, None)

    def _queue_metadata(self, ids: list[str], changes: dict[str, Any] | None) -> None:
        """Chroma's cost is mostly per call, and these come a document (a chunk or two) at a time: they are
        written ``batch`` chunks at a time, by ``flush``. ``None`` stands for the size of the chunks' file."""
        if self.dry_run:
            return
        self.metadata_changes.append((ids, changes))
        if sum(len(group) for group, _ in self.metadata_changes) >= self.batch:
            self._write_metadata()

    def _write_metadata(self) -> None:
        """The queued metadata changes, each merged into its rows as stored: one read and one write per batch."""
        queued, self.metadata_changes = self.metadata_changes, []
        if not queued:
            return
        self._settled()
        self._changing()
        with_text = any(changes is None for _, changes in queued)
        stored: dict[str, tuple[str, dict[str, Any]]] = {}
        for batch in self._batches([chunk_id for group, _ in queued for chunk_id in group]):
            rows = self.collection.get(ids=batch, include=["metadatas", "documents"] if with_text else ["metadatas"])
            stored.update((i, split_row(meta, text))
                          for i, meta, text in zip(rows["ids"], rows["metadatas"], rows["documents"] or repeat(None)))
        merged: dict[str, dict[str, Any]] = {}
        for group, changes in queued:
            found = [chunk_id for chunk_id in group if chunk_id in stored]
            if changes is None:
                changes = {"parent_chars": sum(len(stored[chunk_id][0]) for chunk_id in found)}
            for chunk_id in found:  # Chroma merges what an update names into the row: its text stays as it is
                merged[chunk_id] = merged.get(chunk_id, stored[chunk_id][1]) | changes
            self.report.chunks_relabeled += len(group)
        for batch in self._batches(list(merged)):
            self.collection.update(ids=batch, metadatas=[merged[chunk_id] for chunk_id in batch])

    def delete_documents(self, ids_by_doc: dict[str, list[str]]) -> None:
        self._settled()
        self._delete([chunk_id for ids in ids_by_doc.values() for chunk_id in ids])

    def _delete(self, ids: list[str]) -> None:
        if not ids:
            return
        self.report.chunks_deleted += len(ids)
        if not self.dry_run:
            self._changing()
            for batch in self._batches(ids):
                self.collection.delete(ids=batch)


def chunk_metadata(document: SourceDocument, chunk: Chunk, doc_hash: str, n_chunks: int,
                   parent_chars: int = -1) -> dict[str, Any]:
    return ChunkRecord(
        doc_id=document.doc_id, source=document.source, title=document.title, chunk_index=chunk.index,
        n_chunks=n_chunks, start=chunk.start, end=chunk.end, headings=" > ".join(chunk.headings),
        page=chunk.page if chunk.page is not None else -1, parent_id=document.parent_id,
        parent_pos=document.parent_pos, kind=document.kind, content_hash=chunk.content_hash, doc_hash=doc_hash,
        file_hash=document.file_hash, parent_chars=parent_chars,
    ).to_metadata()
