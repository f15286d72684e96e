"""What the collection holds, per document: the scan an ingest run starts from (which documents are stored, with
which hashes, complete or not) and what the documents API lists and syncs against.

Taken from the rows, that is every row's metadata read: at a million chunks tens of seconds, nearly all of an
unchanged re-ingest. So a writer records it beside the collection when it saves the other derived indexes, from
the same read of the rows (``app.core.derived``), stamped like them; a reader whose stamp matches the
collection's takes the record, any other reads the rows (a run killed mid-way has moved the stamp).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.core.records import ChunkRecord
from app.core.seams import Collection
from app.core.settings import ChromaSettings
from app.core.store import all_rows, derived_dir, stamp_of

ROWS_READ = ["metadatas"]  # what taking the inventory reads of each row
FORMAT = 3  # on the stamp's line: a record of another layout is not read (the rows are)


@dataclass
class StoredDocument:
    doc_hash: str
    n_chunks: int
    source: str
    ids: list[str]
    file_hash: str = ""  # hash of the raw source file: equal and complete -> the file need not even be parsed
    parent: str = ""  # the parent it belongs to for units and pages (``ChunkRecord.parent_key``)
    kind: str = ""  # ``ChunkRecord.kind``: "jsonl" for a record of a jsonl file
    parent_chars: int = -1  # ``ChunkRecord.parent_chars`` of its first row read (-1: not recorded)

    @property
    def complete(self) -> bool:
        return bool(self.doc_hash) and len(self.ids) == self.n_chunks

    @property
    def unsized(self) -> bool:
        """A file's document whose rows were written before ingest recorded the file's size (``parent_chars``)."""
        return self.kind != "jsonl" and self.parent_chars < 0 and self.complete


class DocumentRows:
    """The inventory taken a page of rows at a time."""

    def __init__(self) -> None:
        self.documents: dict[str, StoredDocument] = {}

    def add(self, rows: dict[str, Any]) -> None:
        for chunk_id, meta in zip(rows["ids"], rows["metadatas"]):
            record = ChunkRecord.from_metadata(meta)
            entry = self.documents.setdefault(record.doc_id, StoredDocument(
                record.doc_hash, record.n_chunks, record.source, [], record.file_hash, record.parent_key,
                record.kind, record.parent_chars))
            if record.doc_hash != entry.doc_hash:
                entry.doc_hash = ""  # mixed generations (an interrupted update): never "unchanged"
            if record.file_hash != entry.file_hash:
                entry.file_hash = ""
            entry.ids.append(chunk_id)


def stored_documents(collection: Collection, cfg: ChromaSettings | None = None) -> dict[str, StoredDocument]:
    """What the collection holds, per document id: its hash, expected chunk count and present chunk ids; the
    record beside the collection where ``cfg`` locates one whose stamp matches, else read from every row."""
    if cfg is not None and (recorded := load(path_of(cfg), stamp_of(collection))) is not None:
        return recorded
    rows = DocumentRows()
    for page in all_rows(collection, ROWS_READ):
        rows.add(page)
    return rows.documents


def parents_of(documents: dict[str, StoredDocument]) -> dict[str, tuple[int, str]]:
    """Each parent's chunk count and its first chunk's id (in the order the rows were read, as a scan finds them)."""
    parents: dict[str, tuple[int, str]] = {}
    for entry in documents.values():
        if entry.ids:
            count, first = parents.get(entry.parent, (0, entry.ids[0]))
            parents[entry.parent] = (count + len(entry.ids), first)
    return parents


def path_of(cfg: ChromaSettings) -> Path:
    folder = derived_dir(cfg, "documents")
    return folder.with_name(f"{folder.name}.jsonl")  # not with_suffix: collection names may hold dots


def save(documents: dict[str, StoredDocument], stamp: tuple[str, int], path: Path) -> None:
    """The stamp on the first line (read alone to check it), the documents on the second; written whole to a
    temporary file, then renamed over the old one: a reader never sees half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fresh = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    with fresh.open("w") as out:
        out.write(json.dumps([*stamp, FORMAT]) + "\n")
        out.write(json.dumps({doc_id: list(vars(entry).values()) for doc_id, entry in documents.items()},
                             separators=(",", ":")) + "\n")
    fresh.replace(path)


def recorded_stamp(path: Path) -> tuple[str, int] | None:
    try:
        with path.open() as saved:
            generation, count, layout = json.loads(saved.readline())
        return (str(generation), int(count)) if layout == FORMAT else None
    except (OSError, ValueError, TypeError):
        return None


def load(path: Path, stamp: tuple[str, int]) -> dict[str, StoredDocument] | None:
    """The recorded inventory if it was recorded for a collection of this stamp, else None."""
    try:
        with path.open() as saved:
            if tuple(json.loads(saved.readline())) != (*stamp, FORMAT):
                return None
            return {doc_id: StoredDocument(*fields) for doc_id, fields in json.loads(saved.readline()).items()}
    except (OSError, ValueError, TypeError):
        return None
