"""Stable context units: a retrieved chunk's whole parent document (a file, or the jsonl records sharing a
parent), the page its parent was grouped into when the parent is small (``app.core.pages``), or, when a parent is
too big, a fixed window of neighbouring chunks aligned to multiples of the window size, so the same unit always
renders the same bytes. Plus how hot each unit is."""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

from app.core.pages import CHARS_PER_TOKEN
from app.rag.context import ContextChunk
from app.rag.index import BACKGROUND, CollectionIndex
from app.rag.lru import AsyncLRU

log = logging.getLogger("prefixrag.units")
UNKNOWN_WINDOW_UNIT_TOKENS = 4096  # until the served window is known (ContextPlanner.fit_units)


def natural_order(chunks: list[ContextChunk]) -> list[ContextChunk]:
    return sorted(chunks, key=lambda c: (c.parent_pos, c.doc_id, c.chunk_index))


def in_background() -> bool:
    return BACKGROUND.get() is not None


def estimate_tokens(chunks: list[ContextChunk]) -> int:
    return chars_to_tokens(sum(len(c.text) for c in chunks))


def chars_to_tokens(chars: int) -> int:
    return int(chars / CHARS_PER_TOKEN)


class UnitIndex:
    """Fetches parent documents from Chroma (LRU-cached) and cuts them into units that fit."""

    def __init__(self, index: CollectionIndex, max_unit_tokens: int | None, cache_size: int = 1024) -> None:
        """``max_unit_tokens``: the configured cap (None: the served window's room alone, ``limit_to``)."""
        self.index, self.configured_max = index, max_unit_tokens or sys.maxsize
        self.max_unit_tokens = max_unit_tokens or UNKNOWN_WINDOW_UNIT_TOKENS
        # Parents, a hit's unit (tagged), a unit's chunks (tagged: once per unit). Pre-warm's reads yield to users,
        # so a question never waits on a load pre-warm started: each has its own lane.
        self._parents: AsyncLRU[list[ContextChunk]] = AsyncLRU(cache_size, lane=in_background)
        self._tagged: AsyncLRU[tuple[str, list[ContextChunk]]] = AsyncLRU(cache_size, lane=in_background)
        self._units: AsyncLRU[list[ContextChunk]] = AsyncLRU(cache_size, lane=in_background)
        self.placements = Placements(4 * cache_size)

    def limit_to(self, tokens: int) -> None:
        """Units no bigger than ``tokens`` (the served window's room) nor than configured."""
        if min(self.configured_max, tokens) != self.max_unit_tokens:
            self.max_unit_tokens = min(self.configured_max, tokens)
            self._tagged.clear()  # windows are cut anew
            self._units.clear()

    def forget(self) -> None:
        self._parents.clear()
        self._tagged.clear()
        self._units.clear()
        self.placements.clear()

    async def parent(self, parent_id: str) -> list[ContextChunk]:
        return await self._parents.get(parent_id, lambda: self._fetch(parent_id))

    async def _fetch(self, parent_id: str) -> list[ContextChunk]:
        return natural_order(await self.index.chunks_where({"parent_id": parent_id}))

    def page_of(self, chunk: ContextChunk) -> str | None:
        """The page holding this chunk's parent (None: not paged, or the pages are still being loaded)."""
        index = self.index.page_index()
        return index.page_of(chunk.parent) if index is not None else None

    def units_of(self, chunks: list[ContextChunk]) -> list[str]:
        """The distinct units these chunks belong to, in order; a paged document's unit is its page."""
        index = self.index.page_index()  # once, not per chunk
        units = [(index.page_of(c.parent) if index is not None else None) or c.unit for c in chunks if c.unit]
        return list(dict.fromkeys(units))

    async def unit_for(self, hit: ContextChunk, paged: bool = True) -> tuple[str, list[ContextChunk]]:
        """(unit key, its chunks in natural order, tagged with the key) for a retrieved chunk. A page's chunks
        are tagged with their own parent: the page renders as its documents, one header each. ``paged=False``:
        the hit's own document (or window), even when it was grouped into a page."""
        if paged and (page := self.page_of(hit)) is not None:
            # Cached beside the parents under a key no parent id has.
            return page, await self._parents.get(f"\0{page}", lambda: self._fetch_page(page))
        return await self._tagged.get(hit.id, lambda: self._tag(hit))

    async def _tag(self, hit: ContextChunk) -> tuple[str, list[ContextChunk]]:
        if (window := self._window_by_size(hit)) is not None:
            found = await self._units.get(window.key, lambda: self._read_window(window, hit), keep=bool)
            if found:
                return window.key, found
        key, chunks = await self._locate(hit)

        async def tagged() -> list[ContextChunk]:
            return [replace(c, unit=key) for c in chunks]

        return key, await self._units.get(key, tagged)  # every hit of a big parent once, not a copy per hit

    async def _fetch_page(self, page: str) -> list[ContextChunk]:
        index = self.index.page_index()
        members = index.pages.get(page, []) if index is not None else []  # None: reloaded since page_of
        if not members:
            return []
        position = {parent: i for i, parent in enumerate(members)}
        chunks = await self.index.chunks_where({"parent_id": {"$in": members}})
        ordered = sorted(natural_order(chunks), key=lambda c: position.get(c.parent, len(members)))
        return [replace(c, unit=c.parent) for c in ordered]

    def _window_by_size(self, hit: ContextChunk) -> Window | None:
        """The window ``_locate`` would cut for this hit, from the size its row records (a file's chunk count and
        characters), where the file is too big to be one unit; None where it fits whole or its size is unknown."""
        if hit.parent_chars < 0 or hit.n_chunks <= 0 or hit.parent != hit.doc_id:
            return None
        return self._cut(hit.parent, chars_to_tokens(hit.parent_chars), hit.n_chunks, hit.chunk_index)

    def _cut(self, parent: str, tokens: int, chunks: int, position: int) -> Window | None:
        """The window holding ``position`` of a parent of ``tokens`` in ``chunks`` (None: it fits one unit):
        as many of its average chunk as fit, aligned, so every hit in a window maps to the same bytes."""
        if tokens <= self.max_unit_tokens:
            return None
        size = max(1, self.max_unit_tokens // max(1, tokens // chunks))
        return Window(parent, position // size * size, size)

    async def _read_window(self, window: Window, hit: ContextChunk) -> list[ContextChunk]:
        """The window's rows alone, tagged; [] where they are not each position once as the hit's row counted
        them (a chunk withdrawn, a file shortened, or one of several records): the whole parent's read decides
        then. While an ingest rewrites the file, its rows mix two versions, here as in a whole read."""
        chunks = natural_order(await self._rows(window.parent_id, window.start, window.start + window.size))
        expected = range(window.start, min(window.start + window.size, hit.n_chunks))
        if [c.chunk_index for c in chunks] != list(expected) or any(c.doc_id != hit.doc_id for c in chunks):
            return []
        return [replace(c, unit=window.key) for c in chunks]

    async def _locate(self, hit: ContextChunk) -> tuple[str, list[ContextChunk]]:
        chunks = await self.parent(hit.parent)
        if not chunks:
            return hit.id, [hit]
        position = next((i for i, c in enumerate(chunks) if c.id == hit.id), 0)
        if (window := self._cut(hit.parent, estimate_tokens(chunks), len(chunks), position)) is None:
            return hit.parent, chunks
        return window.key, chunks[window.start:window.start + window.size]

    async def _rows(self, parent: str, start: int, stop: int) -> list[ContextChunk]:
        """A parent's chunks whose ``chunk_index`` is in [start, stop): a file's chunks at those positions."""
        return await self.index.chunks_where({"$and": [
            {"parent_id": parent}, {"chunk_index": {"$gte": start}}, {"chunk_index": {"$lt": stop}}]})

    async def window_start(self, key: str) -> ContextChunk | None:
        """The first chunk of the window ``key`` names (``window_of``), or None when ``key`` names no window or
        its parent no longer has that many chunks."""
        if (window := window_of(key)) is None:
            return None
        if (chunks := self._parents.cached(window.parent_id)) is None:  # not read yet: one row may do
            found = await self._rows(window.parent_id, window.start, window.start + 1)
            if len(found) == 1 and found[0].parent_chars >= 0 and found[0].doc_id == window.parent_id:
                return found[0]
            chunks = await self.parent(window.parent_id)
        return chunks[window.start] if window.start < len(chunks) else None


class Window(NamedTuple):
    """A window of a parent too big for one unit: ``size`` chunks from ``start``."""
    parent_id: str
    start: int
    size: int

    @property
    def key(self) -> str:
        """Its unit key, ``parent@start:size``: what hotness counts and a citation names."""
        return f"{self.parent_id}@{self.start}:{self.size}"


def window_of(key: str) -> Window | None:
    """The window a unit key names (``Window.key``); None for a whole document or a page."""
    parent_id, at, span = key.rpartition("@")
    start, colon, size = span.partition(":")
    return Window(parent_id, int(start), int(size)) if at and colon and start.isdigit() and size.isdigit() else None


class Placements:
    """A unit as a prompt places it: its chunks all carrying the unit's rank, the retrieved ones flagged with
    their score. Everything rendered comes from the unit's own chunks, so the unit's bytes never depend on the
    question. Units recur across requests: a unit's chunks at a rank are made once, and a request copies only its
    own hits (a page of 40 chunks cost 40 copies per request)."""

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self._at_rank: OrderedDict[tuple[str, int], list[ContextChunk]] = OrderedDict()

    def clear(self) -> None:
        self._at_rank.clear()

    def place(self, key: str, chunks: list[ContextChunk], rank: int,
              hits: dict[str, ContextChunk]) -> list[ContextChunk]:
        base = self._at_rank.get((key, rank))
        if base is None or len(base) != len(chunks) or (chunks and base[0].id != chunks[0].id):
            base = [replace(c, rank=rank, retrieved=False) for c in chunks]
            self._at_rank[(key, rank)] = base
            if len(self._at_rank) > self.size:
                self._at_rank.popitem(last=False)
        else:
            self._at_rank.move_to_end((key, rank))
        return [replace(c, score=hits[c.id].score, retrieved=True) if c.id in hits else c for c in base]


class Hotness:
    """Exponentially decayed use counts per unit, persisted across restarts (JSON file)."""

    def __init__(self, path: Path | None, half_life: int = 500, save_every: int = 50) -> None:
        self.path, self.half_life, self.save_every = path, half_life, save_every
        self.scores: dict[str, float] = {}
        self._uses = 0
        self._lock = threading.Lock()  # scores: requests (the event loop) and the saver
        # ``use`` runs on the event loop: the periodic save (7.5 ms for 10K units) is written on this thread.
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hotness-save")
        if path and path.exists():
            try:
                self.scores = {k: float(v) for k, v in json.loads(path.read_text()).items()}
            except (OSError, ValueError) as exc:
                log.warning("ignoring unreadable hotness file %s: %s", path, exc)

    def use(self, keys: list[str]) -> None:
        # Lazy decay: instead of shrinking every score per use, each use weighs 2^(1/half_life) more than the
        # last (O(keys) per request); scores are rescaled once weights grow large.
        with self._lock:
            self._uses += 1
            weight = 2.0 ** (self._uses / self.half_life)
            for key in keys:
                self.scores[key] = self.scores.get(key, 0.0) + weight
            if weight > 1e100:
                self.scores = {k: v / weight for k, v in self.scores.items()}
                self._uses = 0
            due = self.path is not None and self._uses % self.save_every == 0
        if due:
            with contextlib.suppress(RuntimeError):  # closed (a request outlived shutdown): close() saved
                self._saver.submit(self.save)

    def score(self, key: str) -> float:
        return self.scores.get(key, 0.0)

    def keys(self) -> list[str]:
        with self._lock:
            return list(self.scores)

    def save(self) -> None:
        """Write the hottest 10K scores now, on the caller's thread (``close`` at shutdown; ``use`` sends it to
        the saver thread)."""
        if not self.path:
            return
        with self._lock:
            scores = list(self.scores.items())  # a snapshot: requests keep scoring while it is written
        top = dict(sorted(scores, key=lambda kv: -kv[1])[:10_000])
        # One writer at a time without a lock: saves queue on the one saver thread, and close() waits for it.
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(top))
        tmp.replace(self.path)  # atomic: a crash never leaves half a file

    def close(self) -> None:
        """Finish any save under way, then save the final scores."""
        self._saver.shutdown(wait=True)
        self.save()
