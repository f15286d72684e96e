"""Context strategies: how the retrieved chunks become the prompt's context, so that most of every prompt is
a prefix vLLM already holds. Each is a setting (RAG_GENERATION__STRATEGY) and a benchmark mode.

- canonical: the top-k chunks sorted by stable id. Identical sets share a prefix; in a shuffled stream rare.
- document: the top hit's stable unit (its whole parent document, or an aligned window of it) first, hot units
  ahead of cold ones, then the remaining hits canonically. The unit is shared by every question about it.
- reuse: the top-k set ordered along the longest path already served (bounded trie), the rest canonically.
- corpus: the whole collection, parent document by parent document, as one fixed prefix, when it fits the window.
- auto: corpus when it fits, else document.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from app.rag.context import ContextChunk, canonical
from app.rag.trie import ServedTrie
from app.rag.units import Hotness, UnitIndex, as_unit

log = logging.getLogger("prefixrag.strategies")
QUESTION_HEADROOM_TOKENS = 256  # room kept for the question when deciding whether the corpus fits


class Canonical:
    name = "canonical"

    async def arrange(self, ranked: list[ContextChunk], budget: int) -> list[ContextChunk]:
        return canonical(ranked)

    def served(self, kept: list[ContextChunk]) -> None:
        pass


class Document(Canonical):
    name = "document"

    def __init__(self, units: UnitIndex, hotness: Hotness, max_units: int = 1) -> None:
        self.units, self.hotness, self.max_units = units, hotness, max_units

    async def arrange(self, ranked: list[ContextChunk], budget: int) -> list[ContextChunk]:
        hits = {c.id: c for c in ranked}
        units: dict[str, list[ContextChunk]] = {}
        for hit in ranked:  # best-ranked first
            if len(units) == self.max_units:
                break
            key, chunks = await self.units.unit_for(hit)
            if key not in units and not any(hit.id in {c.id for c in u} for u in units.values()):
                units[key] = as_unit(chunks, hit.rank, hits)
        # Hot units first: the most shared unit is always at the very front of the prompt.
        order = sorted(units, key=lambda key: (-self.hotness.score(key), key))
        self.hotness.use(order)
        inside = {c.id for unit in units.values() for c in unit}
        rest = canonical([c for c in ranked if c.id not in inside])
        return [c for key in order for c in units[key]] + rest


class Reuse(Canonical):
    name = "reuse"

    def __init__(self, trie: ServedTrie) -> None:
        self.trie = trie

    async def arrange(self, ranked: list[ContextChunk], budget: int) -> list[ContextChunk]:
        by_id = {c.id: c for c in ranked}
        path = self.trie.order(set(by_id))
        return [by_id[i] for i in path] + canonical([c for c in ranked if c.id not in set(path)])

    def served(self, kept: list[ContextChunk]) -> None:
        self.trie.insert([c.id for c in kept])


class Corpus(Canonical):
    """Every request gets the same context: the whole collection. ``fits`` is decided at warm-up."""

    name = "corpus"

    def __init__(self, retriever) -> None:
        self.retriever = retriever
        self.chunks: list[ContextChunk] | None = None
        self.fits = False
        self.tokens = 0  # the corpus prompt's size (system + all chunks), measured at warm-up

    async def load(self) -> list[ContextChunk]:
        # Parent by parent, each in natural order and rendered as one unit (one header per parent document).
        chunks = sorted(await self.retriever.chunks_where(None),
                        key=lambda c: (c.parent_id or c.doc_id, c.parent_pos, c.doc_id, c.chunk_index))
        self.chunks = [replace(c, unit=c.parent_id or c.doc_id, retrieved=False) for c in chunks]
        return self.chunks

    async def arrange(self, ranked: list[ContextChunk], budget: int) -> list[ContextChunk]:
        if not self.fits or self.chunks is None or self.tokens > budget - QUESTION_HEADROOM_TOKENS:
            # Too large for the window (startup said so), or for this request's answer budget: canonical.
            return canonical(ranked)
        # One rank for the whole corpus: it is kept or trimmed as a unit, never re-ordered.
        return as_unit(self.chunks, 0, {c.id: c for c in ranked})
