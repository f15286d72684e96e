"""Files loaded and chunked ahead of the run's thread: on one loading thread, or in chunking processes for a large
run; a large file in blocks of its documents, so that writing starts before it is all chunked. Each document is
hashed and only a changed one is chunked (``plan``).
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
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from app.core.inventory import StoredDocument
from app.core.records import sha256
from app.core.settings import Settings
from ingest.chunking import Chunker
from ingest.documents import SourceDocument
from ingest.files import FileResult, Plan, load
from ingest.report import IngestReport

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
