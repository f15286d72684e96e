"""The importable ingest pipeline: scan -> load -> chunk -> embed (only what is new) -> upsert -> delete stale.

Crash safety follows from the write order and from ids that are a pure function of content: a changed
document's new chunks are upserted before its stale ones are deleted, and a document counts as unchanged only
when every one of its expected chunks is present with the current hash. A run killed anywhere therefore
leaves extra or missing chunks that the next run detects and converges from, re-using stored embeddings.
"""

from __future__ import annotations

import contextlib
import functools
import time
from pathlib import Path
from typing import Any

from app.core import derived, withdrawals
from app.core.inventory import StoredDocument, stored_documents
from app.core.records import pipeline_identity
from app.core.settings import Settings
from app.core.store import (
    CollectionMissing,
    first_run_running,
    mark_changed,
    new_generation,
    open_collection,
    write_lock,
)
from ingest.files import FileResult, discover, hashed, load
from ingest.preparing import chunker_for, file_preparers, is_unchanged, plan, prefetched
from ingest.report import IngestReport, Progress
from ingest.writer import ChunkWriter


def run_ingest(roots: list[Path], settings: Settings, embedder: Any, *, prune: bool = False, dry_run: bool = False,
               progress: Progress | None = None) -> IngestReport:
    started = time.perf_counter()
    progress = progress or Progress(enabled=False)
    report = IngestReport(dry_run=dry_run)
    files, report.skipped_unknown, report.skipped_unreadable = discover(roots)
    report.files_seen = len(files)
    with write_lock(settings.chroma, settings.ingest.lock_timeout_s):
        collection = _open_for(settings, embedder, dry_run)
        with report.timed("scan"):
            stored = _stored(collection, settings, report, dry_run)
        by_source: dict[str, list[StoredDocument]] = {}
        ids_by_source: dict[str, list[str]] = {}
        for doc_id, entry in stored.items():
            by_source.setdefault(entry.source, []).append(entry)
            ids_by_source.setdefault(entry.source, []).append(doc_id)
        c = settings.chunking
        identity = pipeline_identity(c.size, c.overlap, c.parent_field, embedder.name)
        # Built on first use: a re-ingest where nothing changed never loads the encoder (its tokenizer).
        chunker = functools.cache(lambda: chunker_for(settings, embedder))

        def loaded(path: Path, rel: str) -> FileResult:
            return load(path, rel, settings, identity, by_source)

        def planned(result: FileResult) -> FileResult:
            return plan(result, stored, chunker, identity)

        def prepare_apart(path: Path, rel: str) -> tuple[Any, ...]:  # what a chunking process needs of this file
            known = {doc_id: stored[doc_id] for doc_id in ids_by_source.get(rel, [])}
            return path, rel, settings, identity, {rel: by_source.get(rel, [])}, known

        def unchanged(path: Path, rel: str) -> FileResult | None:  # decided here, without a chunking process
            result, _ = hashed(path, rel, settings, identity, by_source)
            return result if result.skipped_unchanged else None

        # A run on an empty collection builds the indexes from its own writes as they land: none read back at the end.
        written = derived.Builders(settings.pages) if collection is not None and not dry_run \
            and collection.count() == 0 else None
        # Stamped as being written before the first write (services drop what they read of the rows, reload at
        # the end); a Chroma server has no lock to tell a service that the writer died: a plain stamp there.
        writer = ChunkWriter(collection, embedder, settings.ingest.write_batch, dry_run, report,
                             before_first_write=lambda: mark_changed(collection, writing=not settings.chroma.url),
                             stored=written.add if written is not None else None)
        try:
            with file_preparers(files, settings, (loaded, planned), prepare_apart, unchanged, chunker,
                                lambda: report.timed("load")) as (submit, depth):
                _write_and_prune(files, submit, depth, stored, ids_by_source, writer, report, prune, progress)
        except BaseException:
            with contextlib.suppress(Exception):  # the write in flight lands (or fails) before the stamp moves
                writer.close()
            if report.writes and not dry_run:  # stamped again: readers that reloaded mid-run reload
                mark_changed(collection)
            raise
        writer.close()
        # Stamped again when done (readers that reloaded mid-run reload), and a first run's end lets services answer;
        # the indexes are saved under that stamp first, so services reloading on it load them, none builds its own.
        final = new_generation() if not dry_run and (report.writes or first_run_running(collection)) else None
        if collection is not None and not dry_run:  # rebuilt only when the collection's stamp moved
            with report.timed("indexes"):
                derived.save_current(collection, settings.chroma, settings.pages, generation=final, written=written)
        if final is not None:
            mark_changed(collection, run_ended=True, generation=final)
    report.seconds = round(time.perf_counter() - started, 3)
    return report


def _write_and_prune(files: Any, submit: Any, depth: int, stored: dict[str, StoredDocument],
                     ids_by_source: dict[str, list[str]], writer: ChunkWriter, report: IngestReport, prune: bool,
                     progress: Progress) -> None:
    """Ingest every file, then delete what is stale: documents no longer in a file that loaded (or, with
    ``prune``, in no file at all)."""
    seen_docs: set[str] = set()
    loaded_sources: set[str] = set()
    with progress.files(len(files), written=lambda: report.chunks_written) as advance:
        # Files are loaded and chunked a few ahead (a worker thread, or processes) while this thread embeds and writes.
        for result in prefetched(files, submit, depth, report):
            if result.skipped_unchanged:
                seen_docs.update(ids_by_source[result.rel])
                report.files_unchanged += 1
                for doc_id in ids_by_source[result.rel]:
                    _record_size(stored[doc_id], writer)
            else:
                _ingest_file(result, stored, writer, report, seen_docs)
            if result.error is None:
                loaded_sources.add(result.rel)
            advance(result.rel)
        writer.flush()
    stale = [doc for doc, entry in stored.items() if doc not in seen_docs
             and (entry.source in loaded_sources or (prune and entry.source not in _failed(report)))]
    writer.delete_documents({doc: stored[doc].ids for doc in stale})
    report.documents_removed = len(stale)
    report.files_removed = len({stored[doc].source for doc in stale} - loaded_sources)


def _stored(collection: Any, settings: Settings, report: IngestReport, dry_run: bool) -> dict[str, StoredDocument]:
    """What the collection holds, once the documents the service withdrew (deleted over HTTP, rows not yet
    deleted) are gone: their rows deleted now, first (a dry run only leaves them out)."""
    if collection is None:
        return {}
    if dry_run:
        withdrawn = withdrawals.pending(settings.chroma)
        return {doc: entry for doc, entry in stored_documents(collection, settings.chroma).items()
                if doc not in withdrawn}
    report.chunks_deleted += withdrawals.finish(collection, settings.chroma)
    return stored_documents(collection, settings.chroma)


def _open_for(settings: Settings, embedder: Any, dry_run: bool) -> Any:
    """A dry run creates nothing: a collection that does not exist yet reads as empty."""
    try:
        return open_collection(settings.chroma, embedder, create=not dry_run)
    except CollectionMissing:
        return None


def _failed(report: IngestReport) -> set[str]:
    return {failure["path"] for failure in report.failed}




def _record_size(stored: StoredDocument, writer: ChunkWriter) -> None:
    """An unchanged file stored before ingest recorded its size gets it now (once: the inventory then has it)."""
    if stored.unsized:
        writer.record_size(stored.ids)


def _ingest_file(result: FileResult, stored: dict[str, StoredDocument], writer: ChunkWriter,
                 report: IngestReport, seen_docs: set[str]) -> None:
    if result.error is not None:
        report.failed.append({"path": result.rel, "reason": result.error})
        return
    statuses = set()
    for document, doc_hash, chunks in result.plans:
        report.warnings.extend(f"{result.rel}: {w}" for w in document.warnings)
        seen_docs.add(document.doc_id)
        previous = stored.get(document.doc_id)
        if chunks is not None and is_unchanged(previous, doc_hash):  # moved from another file: a process chunked it
            chunks = None
        if chunks is None:
            assert previous is not None  # only a stored document can be unchanged
            statuses.add("unchanged")
            if (previous.file_hash, previous.source) != (result.file_hash, result.rel):  # its file changed
                writer.relabel(previous.ids, result.file_hash, result.rel)  # elsewhere, or it moved: relabel only
            _record_size(previous, writer)
            continue
        statuses.add("added" if previous is None else "updated")
        writer.add_document(document, chunks, doc_hash, previous.ids if previous else [])
    # A file is "added" only if all its documents are new; any change to a known one makes it "updated".
    status = "unchanged" if statuses == {"unchanged"} else "added" if statuses == {"added"} else "updated"
    setattr(report, f"files_{status}", getattr(report, f"files_{status}") + 1)
