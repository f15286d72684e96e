"""Where an ingest run's Chroma calls run: in this process (writes on a thread of their own), or, for a large run,
in a process of their own (``PREFIXRAG_INGEST__WRITE_PROCESS``).

Chroma's embedded client holds the interpreter's lock for nearly all of a write (its validation, the
conversion of every row, its Rust side); on a thread, a write and the encoder's next batch take turns on the
lock instead of running side by side, which is what sets ingest's pace where the encoder is fast (a GPU). In a
process of its own, every call of the run goes there -- reads, writes, the stamps, the derived indexes -- so
one process alone opens the store (on-disk Chroma is not safe for two writers, and a reader in another process
does not see new rows until it reopens). The calls run one at a time in the order they were made, which is
what crash safety rests on; that process ignores a terminal's Ctrl-C and a group's SIGTERM (its parent decides
when it stops) and dies with its parent, so a killed run never leaves a writer behind its released lock.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import sys
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast

from app.core.seams import Collection
from app.core.settings import ChromaSettings
from app.core.store import CollectionMissing, StoreError, open_collection

T = TypeVar("T")
Work = Callable[[Collection], T]
DIED = "the process writing to Chroma died"


class ChromaCalls(Protocol):
    """Calls on the run's collection, ``work(collection)``, run one at a time in the order they were made."""

    def call(self, work: Work[T]) -> T: ...

    def submit(self, work: Work[T]) -> Future[T]: ...

    def close(self) -> None: ...


class LocalCalls:
    """The collection open in this process; submitted calls run on one thread of its own."""

    def __init__(self, collection: Collection) -> None:
        self.collection = collection
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ingest-write")

    def call(self, work: Work[T]) -> T:
        return work(self.collection)

    def submit(self, work: Work[T]) -> Future[T]:
        return self._thread.submit(work, self.collection)

    def close(self) -> None:
        self._thread.shutdown(wait=True)


class ProcessCalls:
    """The collection open in a process of its own; every call is sent there (``work`` must pickle: a module-level
    function, a ``functools.partial`` or ``operator.methodcaller`` of one)."""

    def __init__(self, cfg: ChromaSettings, embedder: Any, create: bool) -> None:
        """Opens the collection there (``create``: made if missing, with ``embedder``'s dimension, read only then)."""
        self._pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                         initializer=_serve_the_parent, initargs=(os.getpid(),))
        try:
            try:
                self._send(_open, cfg, _Encoder(embedder.name, None), False).result()
            except CollectionMissing:
                if not create:
                    raise
                self._send(_open, cfg, _Encoder(embedder.name, embedder.dimension), True).result()
        except BaseException:
            self.close()
            raise

    def call(self, work: Work[T]) -> T:
        return self.submit(work).result()

    def submit(self, work: Work[T]) -> Future[T]:
        return self._send(_apply, work)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _send(self, function: Callable[..., T], *args: Any) -> Future[T]:
        """``function(*args)`` run there; its future reports a dead process as a ``StoreError``."""
        try:
            sent = self._pool.submit(function, *args)
        except BrokenProcessPool as exc:
            raise StoreError(DIED) from exc
        done: Future[T] = Future()
        sent.add_done_callback(lambda _: _settle(done, sent))
        return done


def _settle(done: Future[T], sent: Future[T]) -> None:
    """``done`` as ``sent`` ended, a dead process reported as a ``StoreError``."""
    if sent.cancelled():
        done.cancel()
    elif isinstance(error := sent.exception(), BrokenProcessPool):
        done.set_exception(StoreError(DIED))
    elif error is not None:
        done.set_exception(error)
    else:
        done.set_result(sent.result())


def open_calls(cfg: ChromaSettings, embedder: Any, create: bool, apart: bool) -> ChromaCalls:
    """The run's collection (``create``: made if missing; else ``CollectionMissing``), in a process of its own if
    ``apart``."""
    if apart:
        return ProcessCalls(cfg, embedder, create)
    return LocalCalls(open_collection(cfg, embedder, create))


@dataclass(frozen=True)
class _Encoder:
    """What opening a collection needs of the encoder, without it: its name, and its dimension where one is made."""

    name: str
    known_dimension: int | None

    @property
    def dimension(self) -> int:
        assert self.known_dimension is not None, "a collection is made only with the encoder's dimension"
        return self.known_dimension


_collection: Collection | None = None  # the writing process's collection


def _serve_the_parent(parent: int) -> None:
    """The writing process's start: deaf to the signals meant for its parent, dead with it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if sys.platform == "linux":
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before the line above
            os._exit(1)


def _open(cfg: ChromaSettings, encoder: _Encoder, create: bool) -> None:
    global _collection
    _collection = open_collection(cfg, cast(Any, encoder), create)  # its name and dimension are all it reads


def _apply(work: Work[T]) -> T:
    assert _collection is not None, "the collection is opened first"
    try:
        return work(_collection)
    except Exception as exc:  # raised again in the parent: an error it cannot rebuild becomes a StoreError
        raise _portable(exc) from None


def _portable(exc: Exception) -> Exception:
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return StoreError(f"{type(exc).__name__}: {exc}")
    return exc
