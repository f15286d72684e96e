"""Context strategies: how the retrieved chunks become the prompt's context, so that most of every prompt is
a prefix vLLM already holds. Each is a setting (PREFIXRAG_CONTEXT__STRATEGY) and a benchmark mode.

- canonical: the top-k chunks sorted by stable id. Identical sets share a prefix; in a shuffled stream rare.
- document: the top hit's stable unit (its whole parent document, or an aligned window of it) when it holds most
  hits (then at most ``unit_extras`` hits outside it follow), else the plain top-k; small units come several to a
  prompt, hot units first. A unit is shared by every question about it. When the top hit's document was grouped
  into a page (small documents, ``app.core.pages``), the page holding most hits comes first, then the hits
  outside it (at most ``page_extras`` of them).
- reuse: the top-k set ordered along the longest path already served (bounded trie), the rest canonically.
- corpus: the whole collection, parent document by parent document, as one fixed prefix, when it fits the window.
- auto: corpus when it is no bigger than a unit (max_unit_tokens, or half the window's room), else document.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple, Protocol

from app.rag.context import ContextChunk, canonical
from app.rag.index import CollectionIndex
from app.rag.trie import ServedTrie
from app.rag.units import Hotness, Placements, UnitIndex, estimate_tokens

log = logging.getLogger("prefixrag.strategies")
QUESTION_HEADROOM_TOKENS = 256  # room kept for the question when deciding whether the corpus fits
LOAD_PAGE = 128  # rows per read while the corpus is read to decide whether it fits (it stops once it cannot)


class ContextStrategy(Protocol):
    """How hits become a prompt's context. ``arrange`` only reads state; ``served`` is the one hook that
    changes it (what was sent shapes the next arrangement: hotness, the served-path trie)."""

    name: str

    async def arrange(self, ranked: list[ContextChunk], budget: int, stable: bool = False,
                      scoped: bool = False) -> list[ContextChunk]:
        """The context for these hits. ``stable``: a pure function of ``ranked`` (no state read), for a
        conversation's first turn, which is rebuilt on every later turn and must come out the same.
        ``scoped``: the request filters sources, so nothing may be shown beyond the hits' own documents (no
        page, no corpus)."""
        ...

    def served(self, kept: list[ContextChunk]) -> None:
        """Record what a request actually sent (after fitting the budget)."""
        ...


class Canonical:
    name = "canonical"

    async def arrange(self, ranked: list[ContextChunk], budget: int, stable: bool = False,
                      scoped: bool = False) -> list[ContextChunk]:
        return canonical(ranked)

    def served(self, kept: list[ContextChunk]) -> None:
        pass


class Document(Canonical):
    """A unit bigger than the plain top-k (an article) is the context when it holds at least ``quorum`` of the
    hits: retrieval agrees the answer lives there, and it is cached; at most ``unit_extras`` of the hits outside
    it follow (none by default: each is uncached text on top of it). When the hits are scattered there is no unit
    to bet on, and the plain top-k (canonical) it is. Units smaller than the top-k (abstracts, short files) come
    several to a prompt: each hit's unit while they stay within the top-k's size, else the hit itself, so no hit
    is ever dropped."""

    name = "document"

    def __init__(self, units: UnitIndex, hotness: Hotness, max_units: int | None = None, quorum: float = 0.5,
                 page_extras: int | None = None, unit_extras: int = 0) -> None:
        self.units, self.hotness, self.max_units, self.quorum = units, hotness, max_units, quorum
        self.page_extras, self.unit_extras = page_extras, unit_extras

    async def arrange(self, ranked: list[ContextChunk], budget: int, stable: bool = False,
                      scoped: bool = False) -> list[ContextChunk]:
        if not ranked:
            return []
        hits = {c.id: c for c in ranked}
        if not scoped and self.units.page_of(ranked[0]) is not None:
            return await self._paged(ranked, hits, stable)
        key, chunks = await self.units.unit_for(ranked[0], paged=not scoped)
        units = {key: self.units.placements.place(key, chunks, ranked[0].rank, hits)}
        inside = {c.id for c in chunks}
        room = estimate_tokens(ranked) - estimate_tokens(chunks)
        if room <= 0:
            if sum(c.id in inside for c in ranked) < self.quorum * len(ranked):
                return canonical(ranked)
            return self._leading(units, inside, ranked, self.unit_extras, stable)
        extras = []
        for hit in ranked[1:]:  # best-ranked first
            if hit.id in inside:
                continue
            key, chunks = await self.units.unit_for(hit, paged=not scoped)
            if key not in units and len(units) != self.max_units and estimate_tokens(chunks) <= room:
                units[key] = self.units.placements.place(key, chunks, hit.rank, hits)
                inside |= {c.id for c in chunks}
                room -= estimate_tokens(chunks)
            else:
                extras.append(hit)
        return self._in_order(units, [c for c in extras if c.id not in inside], stable)

    async def _paged(self, ranked: list[ContextChunk], hits: dict[str, ContextChunk],
                     stable: bool) -> list[ContextChunk]:
        """The page holding most hits (ties: the better-ranked hit) first, whether or not it holds a quorum: it is
        a cached prefix, so it costs little, and the hits outside it follow (fewer the more it holds; at most
        ``page_extras``, best-ranked first). Only one unit can lead a prompt, so no other page is added."""
        held: dict[str, list[ContextChunk]] = {}
        for hit in ranked:
            if (page := self.units.page_of(hit)) is not None:
                held.setdefault(page, []).append(hit)
        best = leading_page(held)
        key, chunks = await self.units.unit_for(held[best][0])
        inside = {c.id for c in chunks}
        unit = self.units.placements.place(key, chunks, held[best][0].rank, hits)
        return self._leading({key: unit}, inside, ranked, self.page_extras, stable)

    def _leading(self, units: dict[str, list[ContextChunk]], inside: set[str], ranked: list[ContextChunk],
                 most: int | None, stable: bool) -> list[ContextChunk]:
        """One unit (or page) leads, and at most ``most`` of the hits outside it follow (None: all), the
        best-ranked first: a long unit and a page share this rule, each with its own bound."""
        outside = [c for c in ranked if c.id not in inside]  # best-ranked first
        return self._in_order(units, outside[:most], stable)

    def _in_order(self, units: dict[str, list[ContextChunk]], extras: list[ContextChunk],
                  stable: bool) -> list[ContextChunk]:
        if stable:
            order = sorted(units)
        else:  # hot units first: the most shared unit is always at the very front of the prompt
            order = sorted(units, key=lambda key: (-self.hotness.score(key), key))
        return [c for key in order for c in units[key]] + canonical(extras)

    def served(self, kept: list[ContextChunk]) -> None:
        """The units a request sent get hotter (a page is one unit, whichever of its documents were shown)."""
        self.hotness.use(self.units.units_of(kept))


def leading_page(held: dict[str, list[ContextChunk]]) -> str:
    """Of the pages holding a question's hits (each with its hits, best-ranked first), the one that leads its
    prompt: the one holding most; ties: the one holding the better-ranked hit."""
    return min(held, key=lambda page: (-len(held[page]), held[page][0].rank))


class Reuse(Canonical):
    name = "reuse"

    def __init__(self, trie: ServedTrie) -> None:
        self.trie = trie

    async def arrange(self, ranked: list[ContextChunk], budget: int, stable: bool = False,
                      scoped: bool = False) -> list[ContextChunk]:
        if stable:  # the trie changes with every request
            return canonical(ranked)
        by_id = {c.id: c for c in ranked}
        path = self.trie.order(set(by_id))
        return [by_id[i] for i in path] + canonical([c for c in ranked if c.id not in set(path)])

    def served(self, kept: list[ContextChunk]) -> None:
        self.trie.insert([c.id for c in kept])


class CorpusRead(NamedTuple):
    """What ``Corpus.load`` read: the corpus's chunks (None: it stopped, they could not fit), rows and
    characters of text read."""

    chunks: list[ContextChunk] | None
    rows: int
    chars: int


class Corpus(Canonical):
    """Every request gets the same context: the whole collection. ``fits`` is decided at warm-up."""

    name = "corpus"

    def __init__(self, index: CollectionIndex) -> None:
        self.index = index
        self.chunks: list[ContextChunk] | None = None
        self.fits = False
        self.tokens = 0  # the corpus prompt's size (system + all chunks), measured at warm-up
        self.placements = Placements(1)  # the corpus at its one rank, made once

    def forget(self) -> None:
        """The collection changed: re-read and re-decided before it is used again."""
        self.chunks, self.fits, self.tokens = None, False, 0
        self.placements.clear()

    async def load(self, too_large: Callable[[int], bool] = lambda chars: False) -> CorpusRead:
        """Every chunk, parent by parent, each in natural order and rendered as one unit (one header per parent
        document); none as soon as ``too_large(characters of text read so far)``: a corpus that cannot fit is
        never read whole (that read would grow with the collection)."""
        chunks: list[ContextChunk] = []
        chars = 0
        async with contextlib.aclosing(self.index.chunk_pages(None, size=LOAD_PAGE)) as pages:
            async for page in pages:
                chunks += page
                chars += sum(len(c.text) for c in page)
                if too_large(chars):
                    return CorpusRead(None, len(chunks), chars)
        chunks.sort(key=lambda c: (c.parent, c.parent_pos, c.doc_id, c.chunk_index))
        self.chunks = [replace(c, unit=c.parent, retrieved=False) for c in chunks]
        return CorpusRead(self.chunks, len(chunks), chars)

    async def arrange(self, ranked: list[ContextChunk], budget: int, stable: bool = False,
                      scoped: bool = False) -> list[ContextChunk]:
        if scoped or not self.fits or self.chunks is None or self.tokens > budget - QUESTION_HEADROOM_TOKENS:
            # A source filter (the corpus shows every source), too large for the window (startup said so), or
            # for this request's answer budget: canonical.
            return canonical(ranked)
        # One rank for the whole corpus: it is kept or trimmed as a unit, never re-ordered.
        return self.placements.place(self.name, self.chunks, 0, {c.id: c for c in ranked})
