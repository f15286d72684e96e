"""The importable ingest pipeline: scan -> load -> chunk -> embed (only what is new) -> upsert -> delete stale.

Crash safety follows from the write order and from ids that are a pure function of content: a changed
document's new chunks are upserted before its stale ones are deleted, and a document counts as unchanged only
when every one of its expected chunks is present with the current hash. A run killed anywhere therefore
leaves extra or missing chunks that the next run detects and converges from, re-using stored embeddings.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import multiprocessing
import pickle
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from app.core import derived, withdrawals
from app.core.inventory import StoredDocument, stored_documents
from app.core.records import pipeline_identity, sha256
from app.core.settings import Settings
from app.core.store import (
    CollectionMissing,
    first_run_running,
    mark_changed,
    new_generation,
    open_collection,
    write_lock,
)
from ingest.chunking import Chunker
from ingest.documents import SourceDocument
from ingest.files import FileResult, Plan, discover, hashed, load
from ingest.report import IngestReport, Progress
from ingest.writer import ChunkWriter

PROCESSES_FROM_BYTES = 4_000_000  # a run smaller than this chunks on one thread (an upload of a few files)
SLICE_FROM_BYTES = 1_000_000  # a file this large is chunked in blocks of its documents (by every process, if any)
BLOCK_BYTES = 500_000  # about this much of such a file per block: writing starts when its first block is chunked


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

        # Stamped as being written before the first write (services drop what they read of the rows, reload at
        # the end); a Chroma server has no lock to tell a service that the writer died: a plain stamp there.
        writer = ChunkWriter(collection, embedder, settings.ingest.write_batch, dry_run, report,
                             before_first_write=lambda: mark_changed(collection, writing=not settings.chroma.url))
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
                derived.save_current(collection, settings.chroma, settings.pages, generation=final)
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


def plan(result: FileResult, stored: dict[str, StoredDocument], chunker: Callable[[], Chunker],
         identity: str) -> FileResult:
    """Hash each loaded document and chunk the changed ones (worker thread: reads ``stored``, writes nothing)."""
    plans = []
    for document in result.documents:
        doc_hash = document_hash(document, identity)
        unchanged = is_unchanged(stored.get(document.doc_id), doc_hash)
        plans.append((document, doc_hash, None if unchanged else chunker().chunk(document)))
    result.plans = plans
    return result


@contextlib.contextmanager
def file_preparers(files: list[tuple[Path, str]], settings: Settings,
                   prepare: tuple[Callable[[Path, str], FileResult], Callable[[FileResult], FileResult]],
                   prepare_apart: Callable[[Path, str], tuple[Any, ...]],
                   unchanged: Callable[[Path, str], FileResult | None], chunker: Callable[[], Chunker],
                   waited: Callable[[], AbstractContextManager[Any]]) -> Iterator[tuple[Any, int]]:
    """``(submit, depth)``: ``submit(path, rel)`` starts loading and chunking a file and returns its future;
    ``depth`` files are kept in progress. One worker thread (``prepare``: load a file, plan its documents), or, for
    a large enough run, ``chunk_processes()`` processes, which are given only the stored documents of the file's own
    source. A file stored unchanged (``unchanged``, one hash here) needs none of them: the processes start with the
    first file that changed, each given this process's ``chunker`` (a tokenizer, without the encoder or torch to
    import). Either way a large file is planned in blocks. ``waited`` times the wait for its later blocks."""
    workers = settings.ingest.chunk_processes() if _bytes(files) >= PROCESSES_FROM_BYTES else 0
    if not workers:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ingest-load") as thread:
            yield functools.partial(_submit_to_thread, thread, *prepare, waited), settings.ingest.prefetch_files
        return
    with contextlib.ExitStack() as stack:
        started: list[ProcessPoolExecutor] = []

        def pool() -> ProcessPoolExecutor:
            if not started:  # spawn: this process may hold CUDA and threads, which a forked child must not inherit
                shared = stack.enter_context(_pickled(chunker()))  # removed once the pool has shut down
                started.append(stack.enter_context(ProcessPoolExecutor(
                    max_workers=workers, mp_context=multiprocessing.get_context("spawn"), initializer=_adopt,
                    initargs=(shared,))))
            return started[0]

        def submit(path: Path, rel: str) -> Joined:
            """A large file (one jsonl of many records) is planned in blocks of its documents, by every process."""
            if (skipped := unchanged(path, rel)) is not None:
                done: Future[FileResult] = Future()
                done.set_result(skipped)
                return Joined([done], waited)
            size = _bytes([(path, rel)])
            parts = max(workers, math.ceil(size / BLOCK_BYTES)) if size >= SLICE_FROM_BYTES else 1
            work = functools.partial(prepare_in_worker, *prepare_apart(path, rel))
            return Joined([pool().submit(work, part, parts) for part in range(parts)], waited)

        yield submit, max(settings.ingest.prefetch_files, 2 * workers)


def _submit_to_thread(thread: ThreadPoolExecutor, loaded: Callable[[Path, str], FileResult],
                      planned: Callable[[FileResult], FileResult], waited: Callable[[], AbstractContextManager[Any]],
                      path: Path, rel: str) -> Future[FileResult] | Joined:
    """A file loaded and planned on the loading thread; a large one loaded once, then planned block by block (the
    thread runs them in order), so that its first documents are embedded while the thread chunks the rest."""
    size = _bytes([(path, rel)])
    if size < SLICE_FROM_BYTES:
        return thread.submit(lambda: planned(loaded(path, rel)))
    whole = thread.submit(loaded, path, rel)
    parts = math.ceil(size / BLOCK_BYTES)
    return Joined([thread.submit(_planned_block, whole, planned, part, parts) for part in range(parts)], waited)


def _planned_block(whole: Future[FileResult], planned: Callable[[FileResult], FileResult], part: int,
                   parts: int) -> FileResult:
    loaded = whole.result()
    if loaded.error is not None or loaded.skipped_unchanged:
        return loaded
    return planned(dataclasses.replace(loaded, documents=_block(loaded.documents, part, parts)))


class Joined:
    """The blocks of one file planned apart, read back as one ``FileResult`` whose plans come block by block in
    the file's own order: its first documents are embedded and written while the processes plan the rest."""

    def __init__(self, blocks: list[Future[FileResult]], waited: Callable[[], AbstractContextManager[Any]]) -> None:
        self.blocks, self.waited = blocks, waited

    def result(self) -> FileResult:
        whole = self.blocks[0].result()
        if len(self.blocks) > 1 and whole.error is None and not whole.skipped_unchanged:
            whole.plans = self._plans(whole.plans)
        return whole

    def _plans(self, first: Iterable[Plan]) -> Iterator[Plan]:
        yield from first
        for block in self.blocks[1:]:
            with self.waited():
                planned = block.result()
            yield from planned.plans


def _bytes(files: list[tuple[Path, str]]) -> int:
    with contextlib.suppress(OSError):
        return sum(path.stat().st_size for path, _ in files)
    return 0


_worker_chunker: Chunker | None = None  # a chunking process's copy of the parent's, given when the pool started


@contextlib.contextmanager
def _pickled(chunker: Chunker) -> Iterator[Path]:
    """The chunker pickled to a private file, for the chunking processes to read. Given to them directly, its
    tokenizer (~1 MB) would be written down each process's start-up pipe, and that write blocks this thread until
    the child, importing as it goes, has read it all: one process after another, seconds each."""
    with tempfile.TemporaryDirectory(prefix="prefixrag-chunker-") as folder:
        path = Path(folder) / "chunker.pickle"
        path.write_bytes(pickle.dumps(chunker, protocol=pickle.HIGHEST_PROTOCOL))
        yield path


def _adopt(pickled: Path) -> None:
    """A chunking process's start: the parent's chunker, read from the file ``_pickled`` wrote."""
    global _worker_chunker
    _worker_chunker = pickle.loads(pickled.read_bytes())


def prepare_in_worker(path: Path, rel: str, settings: Settings, identity: str,
                      by_source: dict[str, list[StoredDocument]], stored: dict[str, StoredDocument],
                      part: int = 0, parts: int = 1) -> FileResult:
    """``prepare`` in a chunking process: the file loaded (parsing is cheap next to chunking), its documents of
    block ``part`` of ``parts`` hashed and the changed ones chunked with the tokenizer the pool gave it."""
    chunker = _worker_chunker
    assert chunker is not None, "a chunking process starts with the parent's chunker (_adopt)"
    loaded = load(path, rel, settings, identity, by_source)
    loaded.documents = _block(loaded.documents, part, parts)
    return plan(loaded, stored, lambda: chunker, identity)


def _block(documents: list[Any], part: int, parts: int) -> list[Any]:
    """Block ``part`` of ``parts`` of a file's documents, in file order."""
    count = len(documents)
    return documents[count * part // parts:count * (part + 1) // parts]


def prefetched(items: list[Any], submit: Callable[..., Any], depth: int, report: IngestReport) -> Any:
    """``submit(*item)``'s result for each item, in order, at most ``depth`` in progress (waits count as "load",
    and so do the submits: they hash files and may start the chunking processes)."""
    with report.timed("load"):
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
