"""Turn one file into SourceDocuments; every failure is a LoadError with a reason a person can act on."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any

from app.core.records import DOCUMENT_SUFFIXES
from ingest.documents import LoadError, SourceDocument, sections_from_blocks
from ingest.html import html_to_blocks

TEXT_EXTENSIONS = {".md": "markdown", ".markdown": "markdown", ".txt": "text", ".rst": "text"}
HTML_EXTENSIONS = {".html", ".htm"}
SUPPORTED = set(TEXT_EXTENSIONS) | HTML_EXTENSIONS | {".pdf", ".jsonl"}
assert SUPPORTED == set(DOCUMENT_SUFFIXES), "the kernel's list is what the service accepts as uploads"
ID_FIELDS = ("id", "passage_id", "_id")
PARENT_FIELDS = ("doc_id", "context_id", "title")
_MD_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
_MD_FENCE = re.compile(r"^\s*(```|~~~)")


def is_supported(path: Path) -> bool:
    return path.suffix.lower() in SUPPORTED


def load_file(path: Path, rel: str, parent_field: str | None = None, raw: bytes | None = None) -> list[SourceDocument]:
    """``raw``: the file's bytes when the caller already read them (they are not read again)."""
    raw = path.read_bytes() if raw is None else raw
    suffix = path.suffix.lower()
    if suffix == ".pdf":
        return [_load_pdf(raw, rel)]
    if suffix == ".jsonl":  # decoded line by line: one bad line costs that record, not the file
        return _load_jsonl(raw.removeprefix(b"\xef\xbb\xbf"), rel, parent_field)
    text = decode_text(raw)
    if suffix in HTML_EXTENSIONS:
        title, blocks = html_to_blocks(text)
        return [_single(rel, title or Path(rel).stem, blocks, "html")]
    if TEXT_EXTENSIONS[suffix] == "markdown":
        title, blocks = _markdown_blocks(text)
        return [_single(rel, title or Path(rel).stem, blocks, "markdown")]
    return [_single(rel, Path(rel).stem, [((), text, None)], "text")]


def decode_text(raw: bytes) -> str:
    if b"\x00" in raw[:8192]:
        raise LoadError("binary file (NUL bytes), not text")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise LoadError(f"not valid UTF-8: byte 0x{raw[exc.start]:02x} at offset {exc.start}") from None


def _single(rel: str, title: str, blocks: Any, kind: str) -> SourceDocument:
    sections = sections_from_blocks(blocks)
    if not sections:
        raise LoadError("empty: no text to ingest")
    return SourceDocument(doc_id=rel, source=rel, title=title, sections=sections, parent_id=rel, kind=kind)


def _markdown_blocks(text: str) -> Any:
    """Split markdown at headings (outside code fences), keeping the heading path of each block."""
    blocks, path, lines, title, in_fence = [], list[tuple[int, str]](), list[str](), "", False
    for line in text.splitlines():
        if _MD_FENCE.match(line):
            in_fence = not in_fence
        heading = None if in_fence else _MD_HEADING.match(line)
        if heading:
            blocks.append((tuple(h for _, h in path), "\n".join(lines), None))
            level, name = len(heading.group(1)), heading.group(2)
            path = [(lvl, h) for lvl, h in path if lvl < level] + [(level, name)]
            title = title or (name if level == 1 else "")
            lines = [line]
        else:
            lines.append(line)
    blocks.append((tuple(h for _, h in path), "\n".join(lines), None))
    return title, blocks


def _load_pdf(raw: bytes, rel: str) -> SourceDocument:
    from pypdf import PdfReader
    from pypdf.errors import PdfReadError

    try:
        reader = PdfReader(io.BytesIO(raw))
        if reader.is_encrypted and not reader.decrypt(""):
            raise LoadError("encrypted PDF (needs a password)")
        pages = [((), page.extract_text() or "", number) for number, page in enumerate(reader.pages, 1)]
        title = (reader.metadata.title if reader.metadata else None) or Path(rel).stem
    except LoadError:
        raise
    except (PdfReadError, ValueError, KeyError, TypeError, OSError) as exc:
        raise LoadError(f"unreadable PDF: {exc}") from None
    except Exception as exc:  # pypdf raises many internal types on corrupt input
        if "encrypt" in str(exc).lower() or "crypt" in type(exc).__name__.lower():
            raise LoadError(f"encrypted PDF: {exc}") from None
        raise LoadError(f"unreadable PDF: {type(exc).__name__}: {exc}") from None
    document = _single(rel, str(title), pages, "pdf")
    return document


def _load_jsonl(raw: bytes, rel: str, parent_field: str | None) -> list[SourceDocument]:
    """One document per record; records sharing a parent key are that parent's sections, in file order."""
    documents, positions, problems, seen = [], dict[str, int](), [], set()
    for number, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(decode_text(line))
            document = _record_document(record, rel, parent_field)
        except (ValueError, LoadError, RecursionError) as exc:  # JSON errors are ValueErrors; deep nesting recurses
            problems.append(f"line {number}: {type(exc).__name__ if isinstance(exc, RecursionError) else exc}")
            continue
        if document.doc_id in seen:
            problems.append(f"line {number}: duplicate id {document.doc_id!r} (first one kept)")
            continue
        seen.add(document.doc_id)
        document.parent_pos = positions.get(document.parent_id, 0)
        positions[document.parent_id] = document.parent_pos + 1
        documents.append(document)
    if not documents:
        raise LoadError("no usable records" + (f" ({problems[0]})" if problems else " (empty file)"))
    documents[0].warnings.extend(problems)
    return documents


def _scalar(value: object) -> bool:
    return isinstance(value, str | int) and not isinstance(value, bool)


def _record_document(record: dict[str, Any], rel: str, parent_field: str | None) -> SourceDocument:
    if not isinstance(record, dict):
        raise LoadError("record is not a JSON object")
    record_id = next((record[f] for f in ID_FIELDS if record.get(f) not in (None, "")), None)
    if record_id is None:
        raise LoadError(f"record has none of the id fields {ID_FIELDS}")
    if not _scalar(record_id):
        raise LoadError(f"record id must be a string or an integer, not {type(record_id).__name__}")
    body = record.get("text")
    if not isinstance(body, str) or not body.strip():
        raise LoadError(f"record {record_id!r} has no text")
    title = str(record.get("title") or "")
    fields = (parent_field,) if parent_field else PARENT_FIELDS
    parent = next((record[f] for f in fields if _scalar(record.get(f)) and record.get(f) != ""), record_id)
    for value in (body, title, str(record_id), str(parent)):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # a JSON escape like "\ud800": no tokenizer or store accepts it
            raise LoadError(f"record {record_id!r}: text is not valid Unicode (lone surrogate)") from None
    sections = sections_from_blocks([((), body, None)])
    return SourceDocument(doc_id=str(record_id), source=rel, title=title, sections=sections,
                          parent_id=str(parent), kind="jsonl")
