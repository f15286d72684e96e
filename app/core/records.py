"""The chunk record: what each Chroma row's metadata holds. Ingest writes it with ``to_metadata``; the app, the
lexical index, pages and ingest's own bookkeeping read it back with ``from_metadata`` (one schema, one parser).
The row's text rides beside it in the same metadata (``TEXT_KEY``; ``row_text`` reads it)."""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, fields
from typing import Any

# The file types ingest reads (``ingest.loaders``); the service checks an upload's type against them.
DOCUMENT_SUFFIXES = (".md", ".markdown", ".txt", ".rst", ".html", ".htm", ".pdf", ".jsonl")


@dataclass(frozen=True, slots=True)
class ChunkRecord:
    doc_id: str  # path relative to the ingest root, or the jsonl record id
    source: str  # the file it came from, relative to the ingest root (source filters match on it)
    chunk_index: int
    n_chunks: int  # chunks of the document when it was written: fewer present means an interrupted write
    doc_hash: str  # the document's content with the chunking/encoder identity: equal means unchanged
    title: str = ""
    headings: str = ""  # "A > B > C"
    start: int = -1  # char offsets of the chunk in the document's text
    end: int = -1
    page: int = -1  # 1-based PDF page; -1: none
    parent_id: str = ""  # the document this one is a section of ("": itself)
    parent_pos: int = 0  # position within the parent, in file order
    kind: str = "text"
    content_hash: str = ""
    file_hash: str = ""  # the raw file's hash: equal and complete means the file need not even be parsed
    parent_chars: int = -1  # characters of all the parent's chunks, where the document is its parent's only one (a
    # file; -1: jsonl records, which may share one, and rows written before it was kept): with n_chunks, where a
    # window of a big document starts and ends, without reading the document whole

    @property
    def parent_key(self) -> str:
        """The document this chunk belongs to for units and pages: its parent, else itself."""
        return self.parent_id or self.doc_id

    def to_metadata(self) -> dict[str, str | int]:
        # Chroma metadata values must be scalars (no None): absent values are "" or -1, as the defaults are.
        return asdict(self)

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> ChunkRecord:
        """Rows written before a field existed read as its default; keys this version does not know are ignored."""
        return cls(**{name: meta[name] for name in _FIELDS if name in meta})


_FIELDS = tuple(f.name for f in fields(ChunkRecord))

# The chunk's text is a metadata value, not Chroma's document: single-node Chroma puts every document into a
# full-text index the service never searches, a large share of each row's write (bench.chroma_growth's write
# parts have the figures). Rows written before keep their text as the document; readers take it from either place.
TEXT_KEY = "text"


def row_text(meta: dict[str, Any] | None, document: str | None) -> str:
    """A row's text: its metadata's ``TEXT_KEY``, else (a row written before the text moved there) its document."""
    text = meta.get(TEXT_KEY) if meta else None
    return str(text) if text is not None else document or ""


def without_text(meta: dict[str, Any]) -> dict[str, Any]:
    """A row's metadata less its text (kept apart wherever rows are held, not twice)."""
    return {key: value for key, value in meta.items() if key != TEXT_KEY} if TEXT_KEY in meta else meta


def split_row(meta: dict[str, Any], document: str | None) -> tuple[str, dict[str, Any]]:
    """A row as its text and its metadata less the text: how rows are held once read."""
    return row_text(meta, document), without_text(meta)


def sha256(*parts: str) -> str:
    """The hash of ``parts`` joined by a separator: ("ab", "c") and ("a", "bc") hash apart."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode("utf-8"))
        digest.update(b"\x1f")  # unit separator
    return digest.hexdigest()


def pipeline_identity(size: int, overlap: int, parent_field: str | None, encoder: str) -> str:
    """Chunking parameters and the encoder: part of every hash, so changing them re-chunks everything."""
    return f"{size}/{overlap}/{parent_field}/{encoder}"


def file_hash(raw_sha256: str, identity: str) -> str:
    """A file's ``file_hash`` from the SHA-256 (hex) of its bytes: equal and complete means unchanged."""
    return sha256(raw_sha256, identity)
