"""The configured context strategy at work: arranges each request's context, decides ``auto`` (does the corpus
fit?) whenever vLLM (re)appears or the collection changes, and plans what pre-warm sends. Sending it is
``app.runtime.warmup``'s job."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from app.core.pages import CHARS_PER_TOKEN
from app.core.settings import ContextSettings
from app.rag.affinity import affinity_key
from app.rag.budget import TokenEstimator, prompt_chars
from app.rag.context import ContextChunk, PromptBuilder
from app.rag.index import CollectionIndex
from app.rag.seams import LLM
from app.rag.strategies import QUESTION_HEADROOM_TOKENS, Canonical, ContextStrategy, Corpus, Document, Reuse
from app.rag.trie import ServedTrie
from app.rag.units import Hotness, UnitIndex, Window, window_of
from app.vllm.wire import UpstreamInfo

log = logging.getLogger("prefixrag.planner")
MIN_CHUNK_TOKENS = 4  # a rendered chunk is never shorter: its header alone (id, title) takes more
NEAR_LIMIT = 2.0  # an estimate within this factor of the limit is counted exactly


@dataclass
class CorpusVerdict:
    chunks: int
    estimate: int | None = None  # tokens, from characters (None: not read, the count alone ruled it out; of the
    # rows read where reading stopped early: the corpus has more)
    read: int = 0  # rows read to decide (fewer than ``chunks`` when those already could not fit)
    tokens: int | None = None  # counted exactly (only when the estimate came near the limit)
    fits: bool = False


@dataclass
class WarmUnit:
    """One unit to warm: its prompt in pieces (each extends the one before; the last is the whole unit) and the
    routing key of the requests that will use it."""

    key: str
    pieces: list[list[dict[str, Any]]]
    affinity: str
    lead: str = ""  # the unit as it opens a question's context (PromptBuilder.lead): where its prompt head ends


@dataclass
class WarmPlan:
    """What pre-warm sends, hottest first: the stable prefix, then units as the plan reads them."""

    prefix: list[dict[str, Any]]
    units: AsyncIterator[WarmUnit]
    prefix_lead: str  # where the stable prefix's prompt head ends (the system prompt), learnt once it is sent
    piece_tokens: int  # each unit is sent in pieces of about this many new tokens (0: whole)
    verdict: CorpusVerdict | None = None
    planned: int = 0  # units the plan holds so far (it grows as a big document's windows are found)
    sent: set[str] = field(default_factory=set)


class ContextPlanner:
    def __init__(self, settings: ContextSettings, answer_tokens: int, index: CollectionIndex, builder: PromptBuilder,
                 llm: LLM, collection: str, estimator: TokenEstimator) -> None:
        self.settings, self.index, self.builder, self.llm = settings, index, builder, llm
        self.answer_tokens = answer_tokens  # a request's default answer length: room kept beside a unit
        self.estimator = estimator  # learns chars-per-token from what pre-warm sends
        hotness_path = settings.hotness_dir / f"{collection}.json" if settings.hotness_dir else None
        self.hotness = Hotness(hotness_path)
        self.units = UnitIndex(index, settings.max_unit_tokens)
        self.corpus = Corpus(index)
        self.strategies: dict[str, ContextStrategy] = {
            "canonical": Canonical(), "reuse": Reuse(ServedTrie()), "corpus": self.corpus,
            "document": Document(self.units, self.hotness, settings.max_units, settings.unit_quorum,
                                 settings.page_extras, settings.unit_extras)}
        # auto starts as document and becomes corpus once ``prepare`` found that it fits.
        self.active = self.strategies["document" if settings.strategy == "auto" else settings.strategy]

    @property
    def name(self) -> str:
        return self.active.name

    async def arrange(self, ranked: list[ContextChunk], budget: int, stable: bool = False,
                      scoped: bool = False) -> list[ContextChunk]:
        """The prompt's context for these hits; ``budget`` is the request's prompt-token budget; ``stable``: a
        pure function of the hits; ``scoped``: the request filters sources (see ``ContextStrategy.arrange``)."""
        return await self.active.arrange(ranked, budget, stable, scoped)

    def strategy_for(self, arranged: list[ContextChunk]) -> str:
        """The strategy that actually built this context (corpus degrades to canonical when it cannot fit)."""
        if self.active is self.corpus and len(arranged) != len(self.corpus.chunks or []):
            return "canonical"
        return self.active.name

    def served(self, kept: list[ContextChunk]) -> None:
        self.active.served(kept)

    def forget_collection(self) -> None:
        """The collection changed: parents and corpus are re-read on next use (``prepare`` re-decides)."""
        self.units.forget()
        self.corpus.forget()

    def close(self) -> None:
        self.hotness.close()

    def fit_units(self, info: UpstreamInfo) -> None:
        """What vLLM serves sets the units' size: half the room its window leaves beside the answer, or less
        where configured (called as vLLM is first seen or changes, before any request is planned)."""
        self.units.limit_to((info.max_model_len - self.answer_tokens) // 2)

    async def prepare(self, info: UpstreamInfo) -> CorpusVerdict | None:
        """For ``corpus`` and ``auto``: does the whole collection fit (the units' size is fitted already, as
        vLLM was seen)?"""
        if self.settings.strategy not in ("corpus", "auto"):
            return None
        return await self.decide_corpus(info)

    async def decide_corpus(self, info: UpstreamInfo) -> CorpusVerdict:
        """Does the whole collection fit the window (and, for ``auto``, is it worth it)? Decided from the chunk
        count and the text's size; only a corpus near the limit is counted exactly, so a large collection is
        never sent to ``/tokenize``."""
        room = info.max_model_len - self.answer_tokens - QUESTION_HEADROOM_TOKENS
        # auto: only a corpus no bigger than a unit (each new token attends over the whole of it)
        limit = min(room, self.units.max_unit_tokens) if self.settings.strategy == "auto" else room
        verdict = CorpusVerdict(chunks=await self.index.count())
        if verdict.chunks * MIN_CHUNK_TOKENS <= limit:  # else it cannot fit: no chunk renders under that
            # Read until the text read alone is too large (the rendered prompt only adds to it), else whole.
            read = await self.corpus.load(lambda chars: self._estimate(chars) > NEAR_LIMIT * limit)
            verdict.read = read.rows
            if read.chunks is None:
                verdict.estimate = self._estimate(read.chars)  # of the rows read: the corpus has more
            else:
                messages = self.builder.messages(read.chunks, "")
                verdict.estimate = self._estimate(prompt_chars(messages))
                if verdict.estimate <= NEAR_LIMIT * limit:
                    verdict.tokens = len(await self.llm.tokenize(messages))
                    verdict.fits = verdict.tokens <= limit
        self.corpus.fits, self.corpus.tokens = verdict.fits, verdict.tokens or 0
        if self.settings.strategy == "auto":
            # Every request attends over its whole prompt, cached or not: the corpus is worth it only while it
            # is no bigger than a unit may be. A long-window model must not turn every prompt into 60K tokens.
            self.active = self.corpus if verdict.fits else self.strategies["document"]
        log.info("corpus: %d chunks (%d read), %s tokens (estimate %s); limit %d: %s; strategy=%s", verdict.chunks,
                 verdict.read, verdict.tokens, verdict.estimate, limit,
                 "fits" if verdict.fits else "too large for corpus mode", self.active.name)
        return verdict

    def _estimate(self, chars: int) -> int:
        """Tokens of a prompt of ``chars`` characters: pessimistic once calibrated, else a typical ratio."""
        return self.estimator.estimate_chars(chars) or int(chars / CHARS_PER_TOKEN)

    async def warm_plan(self, info: UpstreamInfo, piece_tokens: int) -> WarmPlan:
        """Decide (``prepare``), then plan: the corpus when it is the context, else every unit, hottest first;
        each unit in pieces of about ``piece_tokens`` new tokens (0: whole)."""
        verdict = await self.prepare(info)
        builder = self.builder
        plan = WarmPlan(builder.warmup_messages(), _no_units(), builder.system_prompt, piece_tokens, verdict)
        if self.active is self.corpus and self.corpus.fits:
            plan.planned, plan.units = 1, self._corpus_unit(plan)
        elif self.active.name == "document":
            plan.units = self._document_units(plan)
        return plan

    async def _corpus_unit(self, plan: WarmPlan) -> AsyncIterator[WarmUnit]:
        yield self._warm_unit("corpus", self.corpus.chunks or [], plan.piece_tokens)

    async def _document_units(self, plan: WarmPlan) -> AsyncIterator[WarmUnit]:
        """Hottest units first (persisted use; before any traffic: biggest first). A page is one unit; a parent
        cut into windows is planned as its first window and as each of its windows that was used (hotness
        counts windows, never their parent). Then every other window of those parents in the same order, so a
        question about any part of a big document finds it cached."""
        await self.index.indexes_ready(("pages",))  # which parents are paged (BM25 is not needed)
        parents = await self._parents()
        pages = self.index.page_index()
        sizes: Counter[str] = Counter()
        first: dict[str, str | ContextChunk] = {}  # unit key -> its first chunk (or that chunk's id, read when due)
        for parent, (count, chunk) in parents.items():
            key = (pages.page_of(parent) if pages is not None else None) or parent
            sizes[key] += count
            first.setdefault(key, chunk)
        used = {key for key in self.hotness.keys() if (window := window_of(key)) and window.parent_id in parents}
        order = sorted([*sizes, *used], key=lambda key: (-self.hotness.score(key), -sizes[key], key))
        plan.planned = len(order)
        window_size: dict[str, int] = {}  # parent id -> its windows' size, for each parent found cut into windows
        for key in order:
            hit = await self._chunk(first[key]) if key in first else await self.units.window_start(key)  # a window
            unit = await self._unit_of(plan, hit, window_size)
            if unit is not None:
                yield unit
        rest = [key for parent in order if parent in window_size  # from the scan's counts: nothing read again
                for start in range(0, sizes[parent], window_size[parent])
                if (key := Window(parent, start, window_size[parent]).key) not in plan.sent]
        plan.planned += len(rest)
        for key in rest:
            unit = await self._unit_of(plan, await self.units.window_start(key), window_size)
            if unit is not None:
                yield unit

    async def _parents(self) -> dict[str, tuple[int, str | ContextChunk]]:
        """Each parent's chunk count and first chunk: from the inventory ingest recorded (nothing read but that
        file), else from every chunk's metadata."""
        recorded = await self.index.recorded_parents()
        if recorded is not None:
            return dict(recorded)
        parents: dict[str, tuple[int, str | ContextChunk]] = {}
        for chunk in await self.index.chunks_where(None, texts=False):
            count, first = parents.get(chunk.parent, (0, chunk))
            parents[chunk.parent] = (count + 1, first)
        return parents

    async def _chunk(self, chunk: str | ContextChunk) -> ContextChunk | None:
        """The chunk, read by id where only its id is known (None: gone since)."""
        if isinstance(chunk, ContextChunk):
            return chunk
        found = await self.index.run(self.index.chunks, [chunk], [0.0])
        return found[0] if found else None

    async def _unit_of(self, plan: WarmPlan, hit: ContextChunk | None,
                       window_size: dict[str, int]) -> WarmUnit | None:
        """The unit ``hit`` belongs to, unless it is gone or already planned (a used window that is its
        parent's first): then it leaves the plan."""
        if hit is None:
            plan.planned -= 1
            return None
        key, chunks = await self.units.unit_for(hit)
        if window := window_of(key):
            window_size[window.parent_id] = window.size
        if not chunks or key in plan.sent:
            plan.planned -= 1
            return None
        plan.sent.add(key)
        return self._warm_unit(key, chunks, plan.piece_tokens)

    def _warm_unit(self, key: str, chunks: list[ContextChunk], piece_tokens: int) -> WarmUnit:
        pieces = [self.builder.messages(chunks[:end], "") for end in self._piece_ends(chunks, piece_tokens)]
        return WarmUnit(key, pieces, affinity_key(chunks), self.builder.lead(chunks))

    def _piece_ends(self, chunks: list[ContextChunk], piece_tokens: int) -> list[int]:
        """Where to cut ``chunks``: each piece adds to the one before the chunks up to the first boundary past
        ``piece_tokens`` (estimated from characters); the last end is the whole unit."""
        chars_per_token = self.estimator.chars_per_token or CHARS_PER_TOKEN
        per_piece = piece_tokens * chars_per_token
        ends, grown = [], 0.0
        for end, chunk in enumerate(chunks, 1):
            grown += len(chunk.text)
            if per_piece and grown >= per_piece and end < len(chunks):
                ends.append(end)
                grown = 0.0
        return ends + [len(chunks)]


async def _no_units() -> AsyncIterator[WarmUnit]:
    return
    yield  # an async generator that yields nothing
