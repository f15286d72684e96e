"""A retrieval worker process (``app.runtime.retrieval_pool``): one question encoder, and a ``Retriever`` per
collection it was asked about, each over a collection handle and BM25 index of its own. It answers the serving
process's messages: ``("prime", stamps, collection)`` opens and loads a collection the first time, and later says
whether its reload for the current epoch is done; ``("rank", stamps, questions)`` ranks a batch, its questions
encoded in one pass whichever collections they search; ``("sync", stamps, None)`` only follows the stamps.
``stamps`` carries every served collection's (epoch, rows): a changed epoch reloads that collection on a thread of
its own while what was open answers; changed rows (an ingest run started writing) drop the rows read; a collection
no longer in them is closed."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from app.core.errors import ServiceError
from app.core.logformat import log_like_the_service
from app.core.settings import ChromaSettings, EmbeddingSettings, PageSettings, RetrievalSettings
from app.core.store import forget_clients
from app.rag.retriever import Retriever
from app.runtime.pauses import freeze_start_up
from app.runtime.worker_channel import Message, serve_channel

if TYPE_CHECKING:
    from app.core.embedder import Embedder
    from app.rag.index import CollectionIndex

log = logging.getLogger("prefixrag.retrieval")
RELOAD_RETRY_S = 1.0  # after a worker's reload failed (e.g. Chroma mid-write), its next try at the earliest
Question = tuple[str, str, int, str | None]  # (collection, question, k, source prefix)


@dataclass(frozen=True)
class WorkerConfig:
    """What a worker needs to rank: the settings sections, nothing with a secret in it; and how the service logs."""

    chroma: ChromaSettings
    embedding: EmbeddingSettings
    retrieval: RetrievalSettings
    paging: PageSettings
    log_level: str = "info"
    log_format: str = "text"


@dataclass(frozen=True)
class Ranked:
    """A worker's answer to a batch: each question's ranking (or its error), and what the batch took there."""

    outcomes: list[Any]  # a Ranking, or the error it raised (ServiceError)
    encode_s: float
    search_s: float


class _Opened:
    """One collection in a worker: its index and retriever, the (epoch, rows) they were opened at, and their
    reload when the epoch moves."""

    def __init__(self, config: WorkerConfig, embedder: Embedder, name: str, epoch: int, rows: int) -> None:
        self.config = replace(config, chroma=config.chroma.serving(name))
        self.embedder, self.epoch, self.rows = embedder, epoch, rows
        self.index, self.retriever = self._opened()
        _primed(self.retriever)
        self.loaded = epoch  # the epoch its open index and retriever are of

    def _opened(self) -> tuple[CollectionIndex, Retriever]:
        from app.rag.index import CollectionIndex

        config = self.config
        # The index runs nothing on this pool (ranking is synchronous here); its own thread loads BM25.
        index = CollectionIndex(self.embedder, config.chroma, ThreadPoolExecutor(1), config.retrieval, config.paging)
        return index, Retriever(index, self.embedder, config.retrieval)

    def follow(self, epoch: int, rows: int) -> None:
        """Catch up with the pool's stamps: rows read afresh after a write began; after a change, reloaded in
        the background."""
        if rows != self.rows or epoch != self.epoch:
            self.rows = rows
            self.index.forget_rows()
        if epoch != self.epoch:
            self.epoch = epoch
            threading.Thread(target=self._reload, args=(epoch,), name="reload", daemon=True).start()

    def _reload(self, epoch: int) -> None:
        """The changed collection opened, queried once and its BM25 loaded, then swapped in, unless a newer
        change came meanwhile (its own reload swaps then)."""
        if not self.config.chroma.url:
            forget_clients()  # the next open reloads from disk; handles already open keep working
        index, retriever = self._opened()
        try:
            _primed(retriever)
        except Exception as exc:  # the old state answers meanwhile; a question a second from now tries again
            log.warning("a retrieval worker could not reload collection %r: %s", self.config.chroma.collection, exc)
            index.close()
            time.sleep(RELOAD_RETRY_S)
            if epoch == self.epoch:
                self.epoch = -1  # no epoch the pool sends: its next question starts another reload
            return
        if epoch != self.epoch:
            index.close()
            return
        old, self.index, self.retriever, self.loaded = self.index, index, retriever, epoch
        old.close()  # its background thread; a ranking still on it finishes (its handle stays open)

    def rank(self, questions: list[tuple[str, int, str | None]], vectors: list[Any]) -> list[Any]:
        together = _outcome(lambda: self.retriever.rank_batch_sync(questions, vectors))
        if isinstance(together, list):
            return together
        return [_outcome(lambda q=q, k=k, p=p, v=v: self.retriever.rank_sync(q, k, p, vector=v))
                for (q, k, p), v in zip(questions, vectors, strict=True)]  # one by one


class Worker:
    """A worker process's retrieval: the serving process's own ``Retriever``, over collections of its own."""

    def __init__(self, config: WorkerConfig) -> None:
        from app.core.embedder import Embedder, limit_threads

        limit_threads(config.embedding.query_threads)
        self.embedder = Embedder(config.embedding, questions=True).load()
        self.config = config
        self.opened: dict[str, _Opened] = {}

    def answer(self, message: Message) -> object:
        kind, stamps, body = message
        for name in [name for name in self.opened if name not in stamps]:  # no longer served
            self.opened.pop(name).index.close()
        for name, opened in self.opened.items():
            opened.follow(*stamps[name])
        if kind == "prime":
            return _outcome(lambda: self.loaded(body, stamps))
        if kind == "sync":  # the stamps alone: a collection no longer served was closed above
            return None
        return self.rank(body, stamps)

    def loaded(self, name: str, stamps: dict[str, tuple[int, int]]) -> bool:
        """Whether collection ``name`` is loaded as of its current epoch: opened and loaded now the first time,
        else whether its reload (in the background) is done."""
        if name in self.opened:
            return self.opened[name].loaded == self.opened[name].epoch
        self._collection(name, stamps)
        freeze_start_up()  # what loading left alive, out of the cyclic GC's scans between questions
        return True

    def _collection(self, name: str, stamps: dict[str, tuple[int, int]]) -> _Opened:
        if (opened := self.opened.get(name)) is None:
            opened = self.opened[name] = _Opened(self.config, self.embedder, name, *stamps.get(name, (0, 0)))
        return opened

    def rank(self, questions: list[Question], stamps: dict[str, tuple[int, int]]) -> Ranked:
        """Every question's ranking (or its error), the questions encoded in one pass."""
        started = time.perf_counter()
        texts = [question for _, question, _, _ in questions]
        dense = self.config.retrieval.mode != "lexical"
        vectors = _outcome(lambda: self.embedder.embed(texts) if dense else [None] * len(texts))
        encoded = time.perf_counter()
        if isinstance(vectors, BaseException):
            return Ranked([vectors] * len(questions), encoded - started, 0.0)
        assert isinstance(vectors, list)
        outcomes: list[Any] = [None] * len(questions)
        for name in dict.fromkeys(collection for collection, _, _, _ in questions):
            slots = [n for n, (collection, _, _, _) in enumerate(questions) if collection == name]
            ranked = _outcome(lambda name=name, slots=slots: self._collection(name, stamps).rank(
                [questions[n][1:] for n in slots], [vectors[n] for n in slots]))
            for at, n in enumerate(slots):
                outcomes[n] = ranked[at] if isinstance(ranked, list) else ranked
        return Ranked(outcomes, encoded - started, time.perf_counter() - encoded)


def _primed(retriever: Retriever) -> None:
    """Rank once and load BM25: the first question pays for neither."""
    retriever.rank_sync("prime the index", 1)
    if retriever.index.retrieval.mode != "dense":
        retriever.index.lexical_index(wait=True)


def _outcome(work: object) -> object:
    """``work()``, or the error it raised as one the serving process can report (a ``ServiceError``)."""
    assert callable(work)
    try:
        return work()
    except ServiceError as exc:
        return exc
    except Exception as exc:
        log.exception("ranking failed in a retrieval worker")
        return ServiceError(f"ranking failed in a retrieval worker: {type(exc).__name__}: {exc}")


def serve(config: WorkerConfig, channel_end: socket.socket) -> None:
    """A worker process: answer the serving process's messages until it closes the channel."""
    # The serving process decides when workers stop (after draining): a terminal's Ctrl-C or a SIGTERM sent
    # to the whole process group must not kill them under requests still in flight.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    log_like_the_service(config.log_level, config.log_format)
    serve_channel(channel_end, Worker(config).answer)
