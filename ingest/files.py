"""The file side of ingest: which files under the roots are ingested, and one file loaded into documents, or the
reason it cannot be (reported; the run goes on). An unchanged file costs one hash: its stored chunks carry it."""

from __future__ import annotations

import hashlib
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.core.records import file_hash
from app.core.settings import Settings
from ingest.chunking import Chunk
from ingest.documents import LoadError, SourceDocument
from ingest.loaders import is_supported, load_file

Plan = tuple[SourceDocument, str, list[Chunk] | None]


@dataclass
class FileResult:
    path: Path
    rel: str
    documents: list[SourceDocument] = field(default_factory=list)
    error: str | None = None
    file_hash: str = ""
    skipped_unchanged: bool = False  # the raw bytes match what is stored: not parsed at all
    plans: Iterable[Plan] = ()  # each document, its hash, its chunks (None: stored unchanged), in file order


def discover(roots: list[Path]) -> tuple[list[tuple[Path, str]], int, list[dict[str, Any]]]:
    """Supported files under the roots, sorted (deterministic order); how many were skipped as unknown; and the
    entries that are no readable file (dangling or looping links, FIFOs, linked folders), each with why."""
    found, unknown, unreadable = [], 0, []
    for root in roots:
        if not root.exists():
            raise FileNotFoundError(f"no such file or directory: {root}")
        base = root.parent if root.is_file() else root
        for path in [root] if root.is_file() else sorted(root.rglob("*")):
            rel = path.relative_to(base).as_posix()
            if any(part.startswith(".") for part in Path(rel).parts):
                continue  # hidden files and folders (.git, editor swap files)
            if path.is_dir() and not path.is_symlink():
                continue
            if not path.is_file():
                unreadable.append({"path": rel, "reason": not_a_file(path)})
            elif is_supported(path):
                found.append((path, rel))
            else:
                unknown += 1
    return found, unknown, unreadable


def not_a_file(path: Path) -> str:
    if path.is_symlink():
        try:
            target = path.resolve(strict=True)
        except FileNotFoundError:
            return "dangling symbolic link"
        except (OSError, RuntimeError):
            return "symbolic link loop"
        return "symbolic link to a folder (not followed)" if target.is_dir() else "not a regular file"
    mode = path.lstat().st_mode
    return "FIFO (named pipe), not a regular file" if stat.S_ISFIFO(mode) else "not a regular file"


def load(path: Path, rel: str, settings: Settings, identity: str, stored_by_source: dict[str, Any]) -> FileResult:
    result, raw = hashed(path, rel, settings, identity, stored_by_source)
    if raw is None:  # unreadable, or unchanged
        return result
    try:
        result.documents = load_file(path, rel, settings.chunking.parent_field, raw)
        for document in result.documents:
            document.file_hash = result.file_hash
    except LoadError as exc:
        result.error = str(exc)
    except (OSError, RecursionError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def hashed(path: Path, rel: str, settings: Settings, identity: str,
           stored_by_source: dict[str, Any]) -> tuple[FileResult, bytes | None]:
    """The file read and hashed: its bytes to parse, or None where it cannot be read (``error``) or is stored
    unchanged (``skipped_unchanged``: an unchanged file costs one hash, not a parse)."""
    result = FileResult(path, rel)
    try:
        size_mb = path.stat().st_size / 1e6
        if size_mb > settings.ingest.max_file_mb:
            raise LoadError(f"too large: {size_mb:.1f} MB > limit {settings.ingest.max_file_mb:g} MB")
        raw = path.read_bytes()
    except LoadError as exc:
        result.error = str(exc)
        return result, None
    except OSError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result, None
    result.file_hash = file_hash(hashlib.sha256(raw).hexdigest(), identity)
    known = stored_by_source.get(rel, [])
    if known and all(doc.file_hash == result.file_hash and doc.complete for doc in known):
        result.skipped_unchanged = True
        return result, None
    return result, raw
