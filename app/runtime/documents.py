"""Documents over HTTP: uploads ingested as jobs by ``python -m ingest`` itself, in a child process (the CLI's
pipeline, ids, write lock and crash safety; the service never imports ingest), deletions, and what the
collection holds. Jobs run one at a time, in order, so two uploads to one collection both land; a job is
``done`` only once the service has reloaded the collection (an uploaded document is answerable then, a deleted
one never cited again once its ``DELETE`` returned). Jobs live in memory: one queued or running when the service
stops is lost (upload again; what it had finished is stored)."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, Literal

from app.core import derived, withdrawals
from app.core.errors import BadRequest, NotFound, StoreUnavailable, UnsupportedMediaType
from app.core.inventory import StoredDocument, stored_documents
from app.core.records import DOCUMENT_SUFFIXES, file_hash, pipeline_identity
from app.core.settings import Settings, environment_of
from app.core.settings_names import LEGACY, PREFIX
from app.core.store import (
    CollectionMissing,
    LockBusy,
    StoreError,
    open_collection,
    write_lock,
)
from app.rag.index import CollectionIndex, chroma_errors

log = logging.getLogger("prefixrag.documents")
JOBS_KEPT = 256  # finished jobs whose status can still be read


def job_not_found(job_id: str) -> NotFound:
    return NotFound(f"no job {job_id!r} (finished jobs are kept while {JOBS_KEPT} newer ones are not)",
                    param="job_id", code="job_not_found")
CHILD_SECTIONS = ("chroma", "embedding", "chunking", "pages", "ingest")  # what ingest reads of the settings


@dataclass
class Job:
    """An upload being ingested: its files, its state, and ingest's own summary once it ended."""

    id: str
    files: list[str]
    status: Literal["queued", "running", "done", "failed"] = "queued"
    created_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    report: dict[str, Any] | None = None  # ``python -m ingest --json``'s summary (failed files listed there)
    error: str | None = None


class Documents:
    def __init__(self, settings: Settings, index: CollectionIndex, changed: Callable[[bool], Awaitable[None]],
                 forget: Callable[[], None]) -> None:
        """``changed(prime)``: makes the service see the collection as it is now (it forgets what it cached of it,
        re-warms, and with ``prime`` loads its indexes again) and returns when it has; ``forget()``: makes it drop
        what it retrieved and arranged, its handles kept (a document was withdrawn)."""
        self.settings, self.index, self.changed, self.forget = settings, index, changed, forget
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self._work: asyncio.Queue[Callable[[], Awaitable[None]]] = asyncio.Queue()  # jobs, deletions: in order
        self._runner: asyncio.Task[None] | None = None
        self._writing = asyncio.Lock()  # jobs and deletions of this process, one at a time
        self._resume()

    def _resume(self) -> None:
        """Deletions a stopped service had answered but not finished: withdrawn at once, their rows deleted as
        the first work."""
        if withdrawn := withdrawals.withdrawn_ids(self.settings.chroma):
            self.index.withdraw(withdrawn)
            self._queue(self._finish_withdrawals)

    async def submit(self, files: list[tuple[str, BinaryIO]]) -> Job:
        """Queue an upload of ``(name, content)`` pairs; every name is checked before anything is stored."""
        names = [checked_name(name) for name, _ in files]
        if not names:
            raise BadRequest("no files in the upload", param="files", code="no_files")
        folder = Path(tempfile.mkdtemp(prefix="prefixrag-upload-"))
        await asyncio.to_thread(_stage, folder, [(name, content) for name, (_, content) in zip(names, files,
                                                                                            strict=True)])
        job = Job(uuid.uuid4().hex, names)
        self._jobs[job.id] = job
        while len(self._jobs) > JOBS_KEPT and (oldest := next(iter(self._jobs.values()))).finished_at is not None:
            self._jobs.pop(oldest.id)
        self._queue(functools.partial(self._upload, job, folder))
        return job

    def _queue(self, work: Callable[[], Awaitable[None]]) -> None:
        self._work.put_nowait(work)
        if self._runner is None:
            self._runner = asyncio.create_task(self._run_work(), name="document-jobs")

    def job(self, job_id: str) -> Job | None:
        return self._jobs.get(job_id)

    async def listed(self) -> list[dict[str, Any]]:
        """Every document the collection holds: id, source file, content hash, chunks (complete or not)."""
        held = await asyncio.to_thread(self._held)  # reads every row's metadata: not on the users' threads
        return [{"id": doc_id, "source": entry.source, "hash": entry.doc_hash, "chunks": len(entry.ids),
                 "complete": entry.complete} for doc_id, entry in sorted(held.items())]

    async def count(self) -> int:
        """Documents the collection holds (complete or not)."""
        return len(await asyncio.to_thread(self._held))  # reads every row's metadata: not on the users' threads

    async def sync(self, manifest: dict[str, str], prefix: str = "") -> dict[str, list[str]]:
        """What to upload and delete for the collection to hold exactly the files of ``manifest`` (name -> the
        SHA-256 of its bytes, hex) among its files under ``prefix``: ``add`` (not held), ``update`` (held, but
        changed or incomplete), ``unchanged``, and ``delete``: the documents of files held but not listed."""
        names = {checked_name(name): digest.lower() for name, digest in manifest.items()}
        held = await asyncio.to_thread(self._held)
        chunking = self.settings.chunking
        identity = pipeline_identity(chunking.size, chunking.overlap, chunking.parent_field,
                                     self.settings.embedding.model)
        by_source: dict[str, list[tuple[str, StoredDocument]]] = {}
        for doc_id, entry in held.items():
            if entry.source.startswith(prefix):
                by_source.setdefault(entry.source, []).append((doc_id, entry))
        plan: dict[str, list[str]] = {"add": [], "update": [], "unchanged": [], "delete": []}
        for name, digest in sorted(names.items()):
            docs = by_source.get(name)
            same = docs and all(e.complete and e.file_hash == file_hash(digest, identity) for _, e in docs)
            plan["add" if not docs else "unchanged" if same else "update"].append(name)
        plan["delete"] = sorted(doc_id for source, docs in by_source.items() if source not in names
                                for doc_id, _ in docs)
        return plan

    def _held(self) -> dict[str, StoredDocument]:
        """What the collection holds, per document (nothing while it does not exist yet), as stored now, less the
        withdrawn documents."""
        try:
            chroma = self.settings.chroma
            held = stored_documents(open_collection(chroma, self.index.embedder, create=False), chroma)
            withdrawn = withdrawals.pending(chroma)
            return {doc_id: entry for doc_id, entry in held.items() if doc_id not in withdrawn}
        except CollectionMissing:
            return {}
        except StoreError as exc:
            raise StoreUnavailable(str(exc)) from exc

    async def delete(self, doc_id: str) -> int:
        """Withdraw a document: its chunk ids recorded under the writers' lock, and the service drops what it
        retrieved and arranged, so none is cited once this returns; its rows are deleted after, as the next work,
        then BM25 and the pages saved again (``app.core.withdrawals``). Returns its chunk count."""
        async with self._writing:
            ids = await asyncio.to_thread(self._withdraw, doc_id)  # the lock may wait for a writer: not the loop
            self.index.withdraw(self.index.withdrawn | ids)
            self.forget()
        self._queue(self._finish_withdrawals)
        return len(ids)

    def _withdraw(self, doc_id: str) -> frozenset[str]:
        chroma = self.settings.chroma
        with write_lock(chroma, self.settings.ingest.lock_timeout_s), chroma_errors("delete"):
            withdrawn = withdrawals.pending(chroma)
            ids = [] if doc_id in withdrawn else self.index.collection.get(where={"doc_id": doc_id}, include=[])["ids"]
            if ids:
                withdrawals.record(chroma, doc_id, ids)
        if not ids:
            raise NotFound(f"no document {doc_id!r} in the collection", param="doc_id", code="document_not_found")
        return frozenset(ids)

    async def _finish_withdrawals(self) -> None:
        """Delete the withdrawn documents' rows (an ingest run may have done it first), then reload the
        collection (``CollectionIndex.reopen`` takes the withdrawn set from the record, empty now). BM25 and the
        pages are saved again after."""
        async with self._writing:
            try:
                await asyncio.to_thread(self._finish_now)
            except LockBusy:  # the ingest holding the lock took it after the record was written: it finishes it
                log.info("withdrawn documents' rows left to the ingest run holding the write lock")
                return
            await self.changed(False)  # the stamp moved: handles reopened, the withdrawn set read again (empty)
            self.forget()  # rankings remembered while the set held their chunks: filtered out until now
        self._queue(self._save_indexes)

    def _finish_now(self) -> None:
        chroma = self.settings.chroma
        with write_lock(chroma, self.settings.ingest.lock_timeout_s), chroma_errors("delete"):
            withdrawals.finish(self.index.collection, chroma)

    async def _save_indexes(self) -> None:
        """BM25 and the pages as ingest leaves them at its end, saved: every process loads them, none rebuilds
        its own (until then, a process that needs them builds them in memory; stale ones are never used)."""
        async with self._writing:
            await asyncio.to_thread(self._save_indexes_now)

    def _save_indexes_now(self) -> None:
        chroma = self.settings.chroma
        with write_lock(chroma, self.settings.ingest.lock_timeout_s), chroma_errors("index"):
            collection = open_collection(chroma, self.index.embedder, create=False)
            derived.save_current(collection, chroma, self.settings.pages)

    async def aclose(self) -> None:
        if self._runner is not None:
            self._runner.cancel()
            await asyncio.gather(self._runner, return_exceptions=True)

    async def _run_work(self) -> None:
        while True:
            work = await self._work.get()
            try:
                await work()
            except Exception:  # the next one still runs
                log.exception("document work failed")

    async def _upload(self, job: Job, folder: Path) -> None:
        try:
            async with self._writing:
                await self._ingest(job, folder)
        except Exception as exc:
            job.status, job.error = "failed", f"{type(exc).__name__}: {exc}"
            raise
        finally:
            shutil.rmtree(folder, ignore_errors=True)
            job.finished_at = job.finished_at or time.time()

    async def _ingest(self, job: Job, folder: Path) -> None:
        job.status = "running"
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "ingest", str(folder), "--json", env=self._child_env(),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            out, err = await child.communicate()
        except asyncio.CancelledError:  # the service stops: the job is lost (its files with it), not left writing
            child.terminate()  # ingest ends a run on SIGTERM with its finished files stored
            await child.wait()
            raise
        summary = out.decode(errors="replace").strip().splitlines()
        if child.returncode in (0, 1) and summary:  # 1: some files failed, reported, the rest ingested
            job.report = json.loads(summary[-1])
            await self.changed(True)
            job.status = "done"
        else:
            job.status = "failed"
            job.error = (err.decode(errors="replace").strip().splitlines() or ["ingest failed"])[-1]
            log.warning("upload job %s failed: %s", job.id, job.error)
        job.finished_at = time.time()

    def _child_env(self) -> dict[str, str]:
        """This process's environment, its settings of what ingest reads in place of any ``PREFIXRAG_`` (or
        legacy ``RAG_``) value."""
        env = {name: value for name, value in os.environ.items() if not name.startswith((PREFIX, LEGACY))}
        return env | environment_of({
            f"{section}.{name}": json.dumps(value) if isinstance(value, (list, dict)) else value
            for section in CHILD_SECTIONS
            for name, value in getattr(self.settings, section).model_dump(mode="json").items()})


def _stage(folder: Path, files: list[tuple[str, BinaryIO]]) -> None:
    for name, content in files:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        with open(folder / name, "wb") as staged:
            shutil.copyfileobj(content, staged)


def checked_name(name: str) -> str:
    """An uploaded file's name as ingest will see it (its document id): a relative path, no ``..``, a type ingest
    reads."""
    path = PurePosixPath(name.replace("\\", "/"))
    if not name or path.is_absolute() or ".." in path.parts or not path.name:
        raise BadRequest(f"file name {name!r}: give a relative path without '..'", param="files",
                         code="invalid_file_name")
    if path.suffix.lower() not in DOCUMENT_SUFFIXES:
        raise UnsupportedMediaType(f"file {name!r}: the types ingest reads are {' '.join(DOCUMENT_SUFFIXES)}",
                                   param="files", code="unsupported_file_type")
    return str(path)
