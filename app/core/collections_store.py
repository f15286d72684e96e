"""Collections made and dropped over HTTP, and the record of which of them a service serves.

A collection made over HTTP exists in the store at once, empty and stamped as a finished first ingest (so a
service answers from it, with no context, until documents are uploaded); it is recorded in a file beside the store
(``prefixrag-collections.json``: in an on-disk Chroma's directory, for a Chroma server under ``lexical_dir``),
so every service process started on that store serves it too, and those running follow it at each poll
(``app.runtime.shelf``). Dropping one deletes its rows and every index
derived from it (BM25, pages, the document inventory, pending withdrawals) and its record.
"""

from __future__ import annotations

import json
import re
import shutil
import uuid
from pathlib import Path

from app.core.seams import Embedder
from app.core.settings import ChromaSettings
from app.core.store import StoreError, derived_dir, mark_changed, open_client, open_collection, write_lock

DERIVED = ("lexical", "pages", "documents", "withdrawn")  # derived_dir's kinds: folders, or files named after them
SUFFIXES = (".json", ".jsonl")  # of those files
RECORD = "prefixrag-collections.json"  # the collections made over HTTP: a JSON list of names
# Chroma's own rule for a collection's name, which every store accepts: 3-512 characters of [a-zA-Z0-9._-],
# starting and ending with a letter or digit.
NAME = re.compile(r"[a-zA-Z0-9](?:[a-zA-Z0-9._-]{1,510})[a-zA-Z0-9]")


class CollectionExists(StoreError):
    """The store already holds a collection of that name."""


def record_path(cfg: ChromaSettings) -> Path:
    """In the on-disk Chroma's directory; else where the derived indexes of the server's collections are."""
    if cfg.url or cfg.lexical_dir is not None:
        return derived_dir(cfg, "lexical").parent / RECORD
    return Path(cfg.path) / RECORD


def recorded(cfg: ChromaSettings) -> list[str]:
    """The collections made over HTTP and not dropped since, oldest first."""
    try:
        return [str(name) for name in json.loads(record_path(cfg).read_text())]
    except FileNotFoundError:
        return []


def make(cfg: ChromaSettings, embedder: Embedder, lock_timeout_s: float) -> None:
    """Create collection ``cfg.collection`` empty and recorded (``CollectionExists`` if the store has one)."""
    with write_lock(cfg, lock_timeout_s):
        try:
            open_collection(cfg, embedder, create=False)
        except StoreError as exc:
            if "does not exist" not in str(exc):
                raise
        else:
            raise CollectionExists(f"collection {cfg.collection!r} exists already")
        mark_changed(open_collection(cfg, embedder, create=True), run_ended=True)
        _record(cfg, [*recorded(cfg), cfg.collection])


def drop(cfg: ChromaSettings, lock_timeout_s: float) -> None:
    """Delete collection ``cfg.collection``, everything derived from it and its record."""
    with write_lock(cfg, lock_timeout_s):
        try:
            open_client(cfg).delete_collection(cfg.collection)
        except Exception as exc:
            if "does not exist" not in str(exc):
                raise StoreError(f"collection {cfg.collection!r} could not be deleted: {exc}") from exc
        for kind in DERIVED:
            folder = derived_dir(cfg, kind)
            shutil.rmtree(folder, ignore_errors=True)
            for suffix in SUFFIXES:  # exact names: another collection's may start with this one's and a dot
                folder.with_name(folder.name + suffix).unlink(missing_ok=True)
        _record(cfg, [name for name in recorded(cfg) if name != cfg.collection])


def _record(cfg: ChromaSettings, names: list[str]) -> None:
    path = record_path(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    temporary.write_text(json.dumps(names))
    temporary.replace(path)  # whole or not at all
