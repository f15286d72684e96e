"""Documents deleted over HTTP whose rows are not deleted yet.

Chroma takes seconds to delete a big document's rows (~3 s for 17K chunks on two cores). So a ``DELETE`` only
records the document's chunk ids here, under the writers' lock, and the service stops citing them at once; the
rows are deleted after, by the next writer to take the lock: the service's own background work, or an ingest run,
which finishes what is recorded before it reads the collection. The record is a file beside the collection,
written whole and renamed into place, so it outlives a killed service.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from app.core.seams import Collection
from app.core.settings import ChromaSettings
from app.core.store import derived_dir, mark_changed

DELETE_BATCH = 5000  # ids per Chroma delete


def path_of(cfg: ChromaSettings) -> Path:
    folder = derived_dir(cfg, "withdrawn")
    return folder.with_name(f"{folder.name}.json")  # not with_suffix: collection names may hold dots


def pending(cfg: ChromaSettings) -> dict[str, list[str]]:
    """Each withdrawn document's chunk ids, rows still stored (empty when none)."""
    try:
        return {str(doc): [str(i) for i in ids] for doc, ids in json.loads(path_of(cfg).read_text()).items()}
    except FileNotFoundError:
        return {}


def withdrawn_ids(cfg: ChromaSettings) -> frozenset[str]:
    """Every withdrawn chunk id, rows still stored."""
    return frozenset(chunk_id for ids in pending(cfg).values() for chunk_id in ids)


def record(cfg: ChromaSettings, doc_id: str, ids: list[str]) -> None:
    """Add a document to the record (the caller holds the write lock)."""
    _write(cfg, pending(cfg) | {doc_id: ids})


def finish(collection: Collection, cfg: ChromaSettings) -> int:
    """Delete the rows of every recorded document and clear the record (the caller holds the write lock); the
    generation stamp moves before any row does, as every writer's. Returns the rows asked to be deleted."""
    ids = [chunk_id for chunk_ids in pending(cfg).values() for chunk_id in chunk_ids]
    if ids:
        mark_changed(collection)
        for start in range(0, len(ids), DELETE_BATCH):
            collection.delete(ids=ids[start:start + DELETE_BATCH])
    path_of(cfg).unlink(missing_ok=True)
    return len(ids)


def _write(cfg: ChromaSettings, withdrawn: dict[str, list[str]]) -> None:
    path = path_of(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    fresh = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    fresh.write_text(json.dumps(withdrawn, separators=(",", ":")))
    fresh.replace(path)
