"""What loaders produce and the chunker consumes: documents made of heading-scoped sections."""

from __future__ import annotations

from dataclasses import dataclass, field


class LoadError(Exception):
    """A file (or a record in it) cannot be ingested; the message says why, for the report."""


@dataclass(frozen=True)
class Section:
    text: str
    start: int  # char offset of this section in the document's full text
    headings: tuple[str, ...] = ()
    page: int | None = None  # 1-based PDF page


@dataclass
class SourceDocument:
    doc_id: str  # path relative to the ingest root, or the jsonl record id
    source: str  # the file it came from, relative to the ingest root
    title: str
    sections: list[Section]
    parent_id: str  # the document this one is a section of (itself for plain files)
    parent_pos: int = 0  # position within the parent, in file order
    kind: str = "text"
    warnings: list[str] = field(default_factory=list)
    file_hash: str = ""  # set by the pipeline: the raw file's hash (with chunking/encoder identity)

    @property
    def text(self) -> str:
        return "".join(section.text for section in self.sections)


def sections_from_blocks(blocks: list[tuple[tuple[str, ...], str, int | None]]) -> list[Section]:
    """Lay (headings, text, page) blocks end to end, separated by blank lines, recording offsets."""
    sections: list[Section] = []
    offset = 0
    for headings, text, page in blocks:
        text = text.strip()
        if not text:
            continue
        if sections:
            text = "\n\n" + text
        sections.append(Section(text=text, start=offset, headings=headings, page=page))
        offset += len(text)
    return sections
