"""Prompt assembly: fixed system prompt -> context block -> question.

The context block is a pure function of the SET of chunks: they are rendered in canonical order (document id,
chunk index), never in relevance order, so two questions that retrieve the same set share every token up to
the question, and vLLM's prefix cache serves that shared part.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property

from app.rag.prompts import Neutraliser, PromptTemplates

SNIPPET_CHARS = 240


@dataclass(frozen=True)
class ContextChunk:
    id: str
    doc_id: str
    chunk_index: int
    text: str
    title: str = ""
    headings: str = ""
    score: float = 0.0  # cosine similarity to the question; never rendered into the prompt
    rank: int = 0  # 0 = most relevant; used only to decide what to drop when over budget
    parent_id: str = ""
    parent_pos: int = 0
    retrieved: bool = True  # False for chunks a strategy added around the hits (rest of a unit, corpus)
    start: int = -1  # char offsets in the source document (-1: unknown); overlapping neighbours are merged
    end: int = -1
    unit: str = ""  # the stable unit this chunk was placed in (document/corpus strategies); "" = on its own
    page: int = -1  # 1-based PDF page (-1: not from a PDF)
    n_chunks: int = 0  # chunks of its document as written (0: unknown)
    parent_chars: int = -1  # characters of its parent's chunks, where the parent is this document alone (-1: unknown)

    @property
    def parent(self) -> str:
        """The document this chunk belongs to for units: its parent (jsonl records sharing one), else its own."""
        return self.parent_id or self.doc_id

    @property
    def cite_id(self) -> str:
        """The id the prompt shows for this text, which the model cites and the API returns as a source's ``id``:
        the unit's (one header per unit: a document, or a window of one), else document and position (the
        content hash in ``id`` would only cost tokens)."""
        return self.unit or f"{self.doc_id}::{self.chunk_index}"

    def snippet(self, limit: int = SNIPPET_CHARS) -> str:
        """The start of the text, whitespace collapsed, cut at a word: what a client shows for a citation."""
        text = " ".join(self.text.split())
        return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " …"

    @property
    def canonical_key(self) -> tuple[str, int, str]:
        return (self.doc_id, self.chunk_index, self.id)


def canonical(chunks: list[ContextChunk]) -> list[ContextChunk]:
    return sorted(chunks, key=lambda chunk: chunk.canonical_key)


RENDERED_UNITS = 4096  # units and chunks whose rendered text is kept: the same bytes for every request that shows them


class PromptBuilder:
    def __init__(self, templates: PromptTemplates) -> None:
        self.templates = templates
        self.inert = Neutraliser()  # every untrusted text goes through it; it learns the served special tokens
        self._units: OrderedDict[tuple[object, ...], str] = OrderedDict()

    @cached_property
    def system_prompt(self) -> str:
        return self.templates.render("system", "text")

    def cite(self, chunk: ContextChunk) -> str:
        """The id the prompt shows for this chunk, byte for byte (neutralised): what an answer cites and the API
        returns as its source's id."""
        return self.inert.attribute(chunk.cite_id)

    def render_chunk(self, chunk: ContextChunk) -> str:
        """A chunk of its own in the prompt, rendered once and reused (its key holds its text: a string is
        hashed once, so the lookup costs little beside rendering it again)."""
        key = ("chunk", chunk.id, chunk.text, chunk.cite_id, chunk.title, chunk.headings, self.inert.served)
        if (text := self._units.get(key)) is not None:
            self._units.move_to_end(key)
            return text
        attribute = self.inert.attribute
        text = self.templates.render("context", "document", id=self.cite(chunk),
                                     title=attribute(chunk.title), headings=attribute(chunk.headings),
                                     text=self.inert(chunk.text))
        return self._kept(key, text)

    def render_unit(self, unit: list[ContextChunk]) -> str:
        """A unit is one document in the prompt: one header, its chunks' text in natural order (headings are part
        of that text), so a 40-paragraph article does not pay 40 headers. Rendered once per unit (its chunk ids
        carry their content's hash) and served tokenizer, then reused by every prompt that shows it."""
        key = (unit[0].cite_id, unit[0].title, self.inert.served, *(c.id for c in unit))
        if (text := self._units.get(key)) is not None:
            self._units.move_to_end(key)
            return text
        attribute = self.inert.attribute
        text = self.templates.render("context", "unit", id=self.cite(unit[0]), title=attribute(unit[0].title),
                                     text=self.inert(unit_text(unit)))
        return self._kept(key, text)

    def _kept(self, key: tuple[object, ...], text: str) -> str:
        self._units[key] = text
        if len(self._units) > RENDERED_UNITS:
            self._units.popitem(last=False)
        return text

    def pieces(self, ordered: list[ContextChunk]) -> list[str]:
        """The context's units and chunks as rendered, in the order given: the same strings ``context_block``
        joins (token-id prompts keep each one's ids)."""
        return [piece for group in _runs_of_units(ordered)
                for piece in ([self.render_unit(group)] if group[0].unit else map(self.render_chunk, group))]

    def context_block(self, ordered: list[ContextChunk]) -> str:
        """Render chunks in the order given (callers pass canonical or strategy order, never relevance)."""
        if not ordered:
            return self.templates.render("context", "empty")
        return self.templates.render("context", "block", documents="".join(self.pieces(ordered)))

    def lead(self, ordered: list[ContextChunk]) -> str:
        """The rendered units that open the context (a unit, a page's documents, the corpus): the part of the
        prompt that questions about them share, whatever follows it; "" when the context opens with a chunk of
        its own (then the whole context is what a question shares with others on the same set)."""
        return "".join(self._opening_units(ordered))

    def leads(self, ordered: list[ContextChunk]) -> list[str]:
        """Where a token-id prompt's head may end, longest first: after the units that open the context
        (``lead``); after the first of them alone (pre-warm sends each unit alone, so its head is known where
        several open a context together); after the system prompt (every prompt, pre-warm's stable prefix)."""
        opening = self._opening_units(ordered)
        first = opening[0] if opening else ""
        return [lead for lead in dict.fromkeys(("".join(opening), first, self.system_prompt)) if lead]

    def _opening_units(self, ordered: list[ContextChunk]) -> list[str]:
        """The rendered units the context opens with, in order, up to its first chunk of its own."""
        groups = itertools.takewhile(lambda group: bool(group[0].unit), _runs_of_units(ordered))
        return [self.render_unit(group) for group in groups]

    def client_instructions(self, text: str) -> str:
        return self.templates.render("question", "client_instructions", instructions=self.inert(text))

    def question(self, question: str) -> str:
        return self.templates.render("question", "text", question=self.inert(question))

    def assistant(self, text: str) -> str:
        """An earlier answer as the client sends it back: untrusted text, so inert."""
        return self.inert(text)

    def messages(self, ordered: list[ContextChunk], question: str) -> list[dict[str, str]]:
        return [
            {"role": "system", "content": self.system_prompt},
            {"role": "user", "content": self.context_block(ordered) + self.question(question)},
        ]

    def warmup_messages(self) -> list[dict[str, str]]:
        """The stable prefix: system prompt and the fixed start of the user turn."""
        return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": ""}]


def _runs_of_units(ordered: list[ContextChunk]) -> list[list[ContextChunk]]:
    """Consecutive chunks of the same unit, grouped; chunks outside any unit form runs of their own."""
    runs: list[list[ContextChunk]] = []
    for chunk in ordered:
        if runs and runs[-1][0].unit == chunk.unit:
            runs[-1].append(chunk)
        else:
            runs.append([chunk])
    return runs


def unit_text(unit: list[ContextChunk]) -> str:
    """The unit's chunks joined in order; a chunk that overlaps its predecessor (splitter overlap) contributes
    only its new text, so the document reads as it was written."""
    text = unit[0].text
    for previous, chunk in zip(unit, unit[1:]):
        overlap = previous.end - chunk.start if chunk.doc_id == previous.doc_id and chunk.start >= 0 else 0
        if 0 < overlap < len(chunk.text) and chunk.start >= previous.start:
            text += chunk.text[overlap:]
        else:
            text += "\n\n" + chunk.text
    return text
