"""Chroma access shared by ingest (writes) and the app (reads): one way to open a collection.

Embeddings are always passed explicitly (``embedding_function=None``): Chroma's default one would try to
download a model. The collection records which encoder filled it, so a mismatched reader fails fast, and a
generation stamp that every ingest which changed something renews, so running services notice and reload.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, cast
from urllib.parse import urlparse

from app.core.seams import Collection, Embedder
from app.core.settings import ChromaSettings

if TYPE_CHECKING:
    from chromadb.api.collection_configuration import CreateCollectionConfiguration

os.environ.setdefault("ANONYMIZED_TELEMETRY", "False")
PAGE = 2000  # rows per paginated get: keeps memory flat on large collections
GENERATION_KEY = "prefixrag_generation"  # collection metadata: renewed by every ingest that changed something
# Collection metadata: "running" from the moment an ingest creates the collection until that first run ends; a
# service does not answer from a collection half-written by its first ingest (no key: made before this existed).
FIRST_RUN_KEY = "prefixrag_first_run"
FIRST_RUN_RUNNING = "\0first ingest running"  # read_generation's answer meanwhile
# A generation stamped before an ingest run's first write into an on-disk store starts with this, and the run's
# end stamps one without it: services drop what they read of the rows at the first, reload at the second.
WRITING = "writing:"
LOCK_FILE = ".prefixrag-ingest.lock"
SPACE: Final = "cosine"  # the vector index's distance: the encoders' vectors are compared by angle
# How ingest creates a collection (benchmarks make theirs the same way).
CONFIGURATION: CreateCollectionConfiguration = {"hnsw": {"space": SPACE}}


class StoreError(Exception):
    """Chroma cannot be opened or used as configured."""


class CollectionMissing(StoreError):
    """The collection does not exist (yet): nothing has been ingested into it."""


class LockBusy(StoreError):
    """Another ingest holds the on-disk collection's write lock."""


_CLIENT_LOCK = threading.Lock()


def open_client(cfg: ChromaSettings, create: bool = True) -> Any:
    """``create=False`` (the service): an on-disk store that is not there is missing, never made anew empty."""
    import chromadb
    from chromadb.config import Settings as ChromaClientSettings

    client_settings = ChromaClientSettings(anonymized_telemetry=False)
    try:
        if cfg.url:
            parsed = urlparse(cfg.url)
            return chromadb.HttpClient(host=parsed.hostname or "127.0.0.1",
                                       port=parsed.port or (443 if parsed.scheme == "https" else 80),
                                       ssl=parsed.scheme == "https", settings=client_settings)
        if not create and not (cfg.path / "chroma.sqlite3").exists():
            raise CollectionMissing(f"no Chroma store at {cfg.path}: ingest documents first (python -m ingest DIR)")
        cfg.path.mkdir(parents=True, exist_ok=True)
        # Two threads building the first client of a path at once break Chroma's shared state ("'RustBindingsAPI'
        # object has no attribute 'bindings'"): the service's watcher and its warm-up do exactly that at start-up;
        # and a reload's forget_clients on another thread must not clear the cache mid-build.
        with _CLIENT_LOCK:
            return chromadb.PersistentClient(path=str(cfg.path), settings=client_settings)
    except StoreError:
        raise
    except Exception as exc:
        where = cfg.url or cfg.path
        raise StoreError(f"cannot open Chroma at {where}: {exc}") from exc


def open_collection(cfg: ChromaSettings, embedder: Embedder, create: bool) -> Collection:
    """The collection (``create``: made if missing); ``embedder`` names the encoder the collection must have
    been embedded with (its ``dimension`` is read only to create one: opening never loads the encoder)."""
    embedder_name = embedder.name
    client = open_client(cfg, create)
    try:
        try:
            collection = client.get_collection(cfg.collection, embedding_function=None)
        except Exception as exc:
            if not create or "does not exist" not in str(exc):
                raise
            collection = client.get_or_create_collection(
                cfg.collection, configuration=CONFIGURATION, embedding_function=None,
                metadata={"embedder": embedder_name, "dimension": embedder.dimension, FIRST_RUN_KEY: "running"},
            )
    except Exception as exc:
        if not create and "does not exist" in str(exc):
            raise CollectionMissing(f"collection {cfg.collection!r} does not exist: ingest documents first") from exc
        raise StoreError(f"collection {cfg.collection!r} unavailable: {exc}") from exc
    stored = (collection.metadata or {}).get("embedder")
    if stored and stored != embedder_name:
        raise StoreError(f"collection {cfg.collection!r} was embedded with {stored!r}, not {embedder_name!r}: "
                         "use the same embedding model or another collection")
    return cast(Collection, collection)


def derived_dir(cfg: ChromaSettings, kind: str) -> Path:
    """Where ingest keeps an index derived from the collection (``lexical``, ``pages``): beside an on-disk Chroma;
    for a Chroma server, under ``lexical_dir`` per server (the lexical index keeps its first layout)."""
    name = cfg.collection if kind == "lexical" else f"{cfg.collection}.{kind}"
    if cfg.lexical_dir is not None or cfg.url:
        server = urlparse(cfg.url).netloc.replace(":", "_") if cfg.url else "local"
        return Path(cfg.lexical_dir or "data/lexical") / server / name
    return Path(cfg.path) / f"prefixrag-{kind}" / cfg.collection


def stamp_of(collection: Collection) -> tuple[str, int]:
    """(generation, row count): what an index derived from the collection must match to be current."""
    return (collection.metadata or {}).get(GENERATION_KEY, ""), collection.count()


def new_generation() -> str:
    return uuid.uuid4().hex


def mark_changed(collection: Collection, run_ended: bool = False, generation: str | None = None,
                 writing: bool = False) -> None:
    """Renew the collection's generation stamp (under the write lock): services drop what they cached of it.
    ``run_ended``: an ingest run finished, the collection's first included; ``generation``: the new stamp, where
    the writer has already saved the derived indexes under it (else a new one); ``writing``: a run starts
    writing and will stamp again when it ends (``WRITING``; on-disk stores only, whose lock tells a service
    whether the writer is still alive)."""
    ended = {FIRST_RUN_KEY: "done"} if run_ended else {}
    stamp = (WRITING if writing else "") + (generation or new_generation())
    collection.modify(metadata={**(collection.metadata or {}), GENERATION_KEY: stamp, **ended})


def first_run_running(collection: Collection) -> bool:
    return (collection.metadata or {}).get(FIRST_RUN_KEY) == "running"


def read_generation(cfg: ChromaSettings, embedder: Embedder) -> str | None:
    """The collection's generation as stored now (opened afresh, not a cached object); None while it is missing,
    ``FIRST_RUN_RUNNING`` while the ingest that made it has not finished."""
    try:
        collection = open_collection(cfg, embedder, create=False)
    except CollectionMissing:
        return None
    if first_run_running(collection):
        return FIRST_RUN_RUNNING
    return str((collection.metadata or {}).get(GENERATION_KEY, ""))


def forget_clients() -> None:
    """Drop Chroma's in-process state, so the next open reloads from disk: an embedded client's vector index
    does not see what another process wrote (its queries miss new chunks) until it is reopened. Collections
    already open keep working on the old state, so requests in flight are not disturbed. Never while a client is
    being built: Chroma registers a new client's system in that cache and reads it back (KeyError in between)."""
    from chromadb.api.shared_system_client import SharedSystemClient

    with _CLIENT_LOCK:
        SharedSystemClient.clear_system_cache()


def being_written(generation: str | None, cfg: ChromaSettings) -> bool:
    """Is this the stamp of a run still writing (``WRITING``, its writer holding the lock)? A stamp left by a
    writer that died mid-run is not: what it wrote is what there is."""
    if generation is None or not generation.startswith(WRITING) or cfg.url:
        return False
    from filelock import Timeout

    probe = _writers_lock(cfg)
    try:
        probe.acquire(timeout=0)
    except Timeout:
        return True
    probe.release()
    return False


def all_rows(collection: Collection, include: list[str], where: dict[str, Any] | None = None,
             size: int = PAGE) -> Iterator[dict[str, Any]]:
    """Every row of the collection (or those matching ``where``), ``size`` rows per read: memory stays flat on
    large collections, and a reader may hand each page to another thread (``next`` per page)."""
    offset = 0
    while True:
        page = collection.get(where=where, include=include, limit=size, offset=offset)
        yield page
        if len(page["ids"]) < size:
            return
        offset += size


def _writers_lock(cfg: ChromaSettings) -> Any:
    """The on-disk store's writers' lock (a file beside it): held by ``write_lock``, probed by ``being_written``."""
    from filelock import FileLock

    return FileLock(str(Path(cfg.path) / LOCK_FILE))


@contextmanager
def write_lock(cfg: ChromaSettings, timeout_s: float) -> Iterator[None]:
    """Serialise writers of an on-disk collection; a Chroma server serialises writes itself."""
    if cfg.url:
        yield
        return
    from filelock import Timeout

    cfg.path.mkdir(parents=True, exist_ok=True)
    lock = _writers_lock(cfg)
    try:
        lock.acquire(timeout=timeout_s)
    except Timeout:
        raise LockBusy(f"another ingest is writing to {cfg.path} (waited {timeout_s:g}s); "
                       "try again when it finishes") from None
    try:
        yield
    finally:
        lock.release()
