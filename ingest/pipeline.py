"""The importable ingest pipeline: scan -> load -> chunk -> embed (only what is new) -> upsert -> delete stale.

Crash safety follows from the write order and from ids that are a pure function of content: a changed
document's new chunks are upserted before its stale ones are deleted, and a document counts as unchanged only
when every one of its expected chunks is present with the current hash. A run killed anywhere therefore
leaves extra or missing chunks that the next run detects and converges from, re-using stored embeddings.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import multiprocessing
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from itertools import zip_longest
from pathlib import Path
from typing import Any

from app.core import derived
from app.core.inventory import StoredDocument, stored_documents
from app.core.records import pipeline_identity, sha256
from app.core.settings import Settings
from app.core.store import (
    CollectionMissing,
    first_run_running,
    mark_changed,
    open_collection,
    write_lock,
)
from ingest.chunking import Chunker
from ingest.documents import SourceDocument
from ingest.files import FileResult, discover, hashed, load
from ingest.report import IngestReport, Progress
from ingest.writer import ChunkWriter

PROCESSES_FROM_BYTES = 4_000_000  # a run smaller than this chunks on one thread (an upload of a few files)
SLICE_FROM_BYTES = 1_000_000  # a file this large is chunked by every process, a slice of its documents each


def chunker_for(settings: Settings, embedder: Any) -> Chunker:
    # Its own tokenizer copy: chunking runs on a worker thread while the encoder tokenizes on the caller's.
    return Chunker(copy.deepcopy(embedder.tokenizer), settings.chunking.size, settings.chunking.overlap,
                   embedder.max_tokens)


def document_hash(document: SourceDocument, identity: str) -> str:
    return sha256(document.text, document.title, document.parent_id, str(document.parent_pos),
                  repr([s.headings for s in document.sections]), identity)


def is_unchanged(stored: StoredDocument | None, doc_hash: str) -> bool:
    return stored is not None and stored.doc_hash == doc_hash and stored.complete


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
            stored = stored_documents(collection, settings.chroma) if collection is not None else {}
        by_source: dict[str, list[StoredDocument]] = {}
        ids_by_source: dict[str, list[str]] = {}
        for doc_id, entry in stored.items():
            by_source.setdefault(entry.source, []).append(entry)
            ids_by_source.setdefault(entry.source, []).append(doc_id)
        c = settings.chunking
        identity = pipeline_identity(c.size, c.overlap, c.parent_field, embedder.name)
        # Built on first use: a re-ingest where nothing changed never loads the encoder (its tokenizer).
        chunker = functools.cache(lambda: chunker_for(settings, embedder))

        def prepare(path: Path, rel: str) -> FileResult:
            return plan(load(path, rel, settings, identity, by_source), stored, chunker, identity)

        def prepare_apart(path: Path, rel: str) -> tuple[Any, ...]:  # what a chunking process needs of this file
            known = {doc_id: stored[doc_id] for doc_id in ids_by_source.get(rel, [])}
            return path, rel, settings, identity, {rel: by_source.get(rel, [])}, known

        def unchanged(path: Path, rel: str) -> FileResult | None:  # decided here, without a chunking process
            result, _ = hashed(path, rel, settings, identity, by_source)
            return result if result.skipped_unchanged else None

        writer = ChunkWriter(collection, embedder, settings.ingest.write_batch, dry_run, report,
                             before_first_write=lambda: mark_changed(collection))
        try:
            with file_preparers(files, settings, prepare, prepare_apart, unchanged) as (submit, depth):
                _write_and_prune(files, submit, depth, stored, ids_by_source, writer, report, prune, progress)
        except BaseException:
            with contextlib.suppress(Exception):  # the write in flight lands (or fails) before the stamp moves
                writer.close()
            if report.writes and not dry_run:  # stamped again: readers that reloaded mid-run reload
                mark_changed(collection)
            raise
        writer.close()
        # Stamped again when done (readers that reloaded mid-run reload), and a first run's end lets services answer.
        if not dry_run and (report.writes or first_run_running(collection)):
            mark_changed(collection, run_ended=True)
        if collection is not None and not dry_run:  # rebuilt only when the collection's stamp moved
            with report.timed("indexes"):
                derived.save_current(collection, settings.chroma, settings.pages)
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


def _open_for(settings: Settings, embedder: Any, dry_run: bool) -> Any:
    """A dry run creates nothing: a collection that does not exist yet reads as empty."""
    try:
        return open_collection(settings.chroma, embedder, create=not dry_run)
    except CollectionMissing:
        return None


def _failed(report: IngestReport) -> set[str]:
    return {failure["path"] for failure in report.failed}


def plan(result: FileResult, stored: dict[str, StoredDocument], chunker: Callable[[], Chunker],
         identity: str) -> FileResult:
    """Hash each loaded document and chunk the changed ones (worker thread: reads ``stored``, writes nothing)."""
    for document in result.documents:
        doc_hash = document_hash(document, identity)
        unchanged = is_unchanged(stored.get(document.doc_id), doc_hash)
        result.plans.append((document, doc_hash, None if unchanged else chunker().chunk(document)))
    return result


@contextlib.contextmanager
def file_preparers(files: list[tuple[Path, str]], settings: Settings, prepare: Callable[[Path, str], FileResult],
                   prepare_apart: Callable[[Path, str], tuple[Any, ...]],
                   unchanged: Callable[[Path, str], FileResult | None]) -> Iterator[tuple[Any, int]]:
    """``(submit, depth)``: ``submit(path, rel)`` starts loading and chunking a file and returns its future;
    ``depth`` files are kept in progress. One worker thread, or, for a large enough run, ``chunk_processes()``
    processes (each with its own copy of the encoder's tokenizer, seconds to start), which are given only the
    stored documents of the file's own source; a file stored unchanged (``unchanged``, one hash) needs none of
    them, and a run that changes nothing starts no process (the pool starts each on demand)."""
    workers = settings.ingest.chunk_processes() if _bytes(files) >= PROCESSES_FROM_BYTES else 0
    if not workers:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ingest-load") as thread:
            yield (lambda path, rel: thread.submit(prepare, path, rel)), settings.ingest.prefetch_files
        return
    # spawn: this process may hold CUDA and threads, which a forked child must not inherit
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:

        def submit(path: Path, rel: str) -> Joined:
            """A large file (one jsonl of many records) is planned in ``workers`` slices of its documents."""
            if (skipped := unchanged(path, rel)) is not None:
                done: Future[FileResult] = Future()
                done.set_result(skipped)
                return Joined([done])
            parts = workers if _bytes([(path, rel)]) >= SLICE_FROM_BYTES else 1
            work = functools.partial(prepare_in_worker, *prepare_apart(path, rel))
            return Joined([pool.submit(work, part, parts) for part in range(parts)])

        yield submit, max(settings.ingest.prefetch_files, 2 * workers)


class Joined:
    """The slices of one file planned apart, read back as one ``FileResult`` in the file's own document order
    (slice k holds documents k, k + n, k + 2n ...)."""

    def __init__(self, slices: list[Future[FileResult]]) -> None:
        self.slices = slices

    def result(self) -> FileResult:
        parts = [future.result() for future in self.slices]
        whole = parts[0]
        if len(parts) > 1 and whole.error is None and not whole.skipped_unchanged:
            whole.documents = [d for row in zip_longest(*(p.documents for p in parts)) for d in row if d is not None]
            whole.plans = [p for row in zip_longest(*(p.plans for p in parts)) for p in row if p is not None]
        return whole


def _bytes(files: list[tuple[Path, str]]) -> int:
    with contextlib.suppress(OSError):
        return sum(path.stat().st_size for path, _ in files)
    return 0


_worker_chunker: Chunker | None = None  # a chunking process's own, built on its first changed file


def prepare_in_worker(path: Path, rel: str, settings: Settings, identity: str,
                      by_source: dict[str, list[StoredDocument]], stored: dict[str, StoredDocument],
                      part: int = 0, parts: int = 1) -> FileResult:
    """``prepare`` in a chunking process: the file loaded, its documents (slice ``part`` of ``parts``) hashed and
    the changed ones chunked with the encoder's tokenizer, loaded here on the CPU (the tokenizer is all it uses
    of it)."""
    from app.core.embedder import Embedder

    def chunker() -> Chunker:
        global _worker_chunker
        if _worker_chunker is None:
            cpu = settings.embedding.model_copy(update={"device": "cpu"})
            _worker_chunker = chunker_for(settings, Embedder(cpu))
        return _worker_chunker

    loaded = load(path, rel, settings, identity, by_source)
    loaded.documents = loaded.documents[part::parts]
    return plan(loaded, stored, chunker, identity)


def prefetched(items: list[Any], submit: Callable[..., Any], depth: int, report: IngestReport) -> Any:
    """``submit(*item)``'s result for each item, in order, at most ``depth`` in progress (waits count as "load")."""
    pending = deque(submit(*item) for item in items[:depth])
    for item in items[depth:]:
        with report.timed("load"):
            result = pending.popleft().result()
        pending.append(submit(*item))
        yield result
    while pending:
        with report.timed("load"):
            result = pending.popleft().result()
        yield result


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
            if previous.file_hash != result.file_hash:  # its file changed elsewhere: relabel, don't re-embed
                writer.relabel(previous.ids, result.file_hash)
            continue
        statuses.add("added" if previous is None else "updated")
        writer.add_document(document, chunks, doc_hash, previous.ids if previous else [])
    # A file is "added" only if all its documents are new; any change to a known one makes it "updated".
    status = "unchanged" if statuses == {"unchanged"} else "added" if statuses == {"added"} else "updated"
    setattr(report, f"files_{status}", getattr(report, f"files_{status}") + 1)
