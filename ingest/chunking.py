"""Split documents into chunks measured in the embedder's tokens, headings first, then recursively.

Loaders already cut documents at headings (markdown/HTML) or pages (PDF); inside each section
langchain's RecursiveCharacterTextSplitter cuts at paragraphs, lines, sentences, words. A final check
re-measures every chunk, so nothing is ever silently truncated by the encoder's window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from langchain_text_splitters import RecursiveCharacterTextSplitter

from app.core.records import sha256
from ingest.documents import Section, SourceDocument

SEPARATORS = ["\n\n", "\n", ". ", "? ", "! ", "; ", ", ", " ", ""]


@dataclass(frozen=True)
class Chunk:
    doc_id: str
    index: int
    text: str
    start: int  # char offsets into the document's full text
    end: int
    headings: tuple[str, ...]
    page: int | None

    @property
    def content_hash(self) -> str:
        return sha256(self.text)

    @property
    def chunk_id(self) -> str:
        # Deterministic: same document, position and content give the same id on any machine.
        return f"{self.doc_id}::{self.index}::{self.content_hash[:12]}"


class Chunker:
    def __init__(self, tokenizer: Any, size: int, overlap: int, window: int) -> None:
        self.tokenizer = tokenizer
        self.window = window
        self.size = min(size, window)
        self.splitter = RecursiveCharacterTextSplitter(
            chunk_size=self.size, chunk_overlap=min(overlap, self.size // 2), separators=SEPARATORS,
            length_function=self.count, add_start_index=True, strip_whitespace=True,
        )

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def chunk(self, document: SourceDocument) -> list[Chunk]:
        pieces: list[tuple[str, int, Section]] = []
        for section in document.sections:
            whole = section.text.strip()
            if whole and self.count(whole) <= self.size:  # the splitter would keep it whole: one count, not a dozen
                pieces.append((whole, section.start + section.text.find(whole), section))
                continue
            for part in self.splitter.create_documents([section.text]):
                start = section.start + part.metadata["start_index"]
                pieces.extend((text, start + offset, section) for text, offset in self._fit(part.page_content))
        return [
            Chunk(document.doc_id, index, text, start, start + len(text), section.headings, section.page)
            for index, (text, start, section) in enumerate(pieces)
        ]

    def _fit(self, text: str) -> list[tuple[str, int]]:
        """Hard-split by token offsets if a piece is still over the window (e.g. one endless 'word')."""
        if self.count(text) <= self.window:
            return [(text, 0)]
        encoding = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = encoding["offset_mapping"]
        parts = []
        for first in range(0, len(offsets), self.size):
            window = offsets[first:first + self.size]
            begin, end = window[0][0], window[-1][1]
            parts.append((text[begin:end], begin))
        return parts
