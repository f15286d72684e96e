"""The configured context strategy at work: resolves ``auto`` (does the corpus fit?) and arranges each
request's context. Pre-warming what it arranges is ``app.rag.warmup``'s job."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from app.core.pages import CHARS_PER_TOKEN
from app.core.settings import GenerationSettings
from app.rag.budget import TokenEstimator, prompt_chars
from app.rag.context import ContextChunk, PromptBuilder
from app.rag.strategies import QUESTION_HEADROOM_TOKENS, Canonical, ContextStrategy, Corpus, Document, Reuse
from app.rag.trie import ServedTrie
from app.rag.units import Hotness, UnitIndex
from app.rag.upstream import UpstreamInfo

log = logging.getLogger("prefixrag.planner")
MIN_CHUNK_TOKENS = 4  # a rendered chunk is never shorter: its header alone (id, title) takes more
NEAR_LIMIT = 2.0  # an estimate within this factor of the limit is counted exactly


class ContextPlanner:
    def __init__(self, settings: GenerationSettings, retriever, builder: PromptBuilder, llm, collection: str,
                 estimator: TokenEstimator) -> None:
        self.settings, self.retriever, self.builder, self.llm = settings, retriever, builder, llm
        self.estimator = estimator  # learns chars-per-token from what pre-warm sends
        hotness_path = settings.hotness_dir / f"{collection}.json" if settings.hotness_dir else None
        self.hotness = Hotness(hotness_path)
        self.units = UnitIndex(retriever, settings.max_unit_tokens)
        self.corpus = Corpus(retriever)
        self.strategies: dict[str, ContextStrategy] = {
            "canonical": Canonical(), "reuse": Reuse(ServedTrie()), "corpus": self.corpus,
            "document": Document(self.units, self.hotness, settings.max_units, settings.unit_quorum,
                                 settings.page_extras)}
        # auto starts as document and becomes corpus once ``decide_corpus`` found that it fits.
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
        """The collection changed: parents and corpus are re-read on next use (``warm`` re-decides the corpus)."""
        self.units.forget()
        self.corpus.chunks, self.corpus.fits = None, False

    def close(self) -> None:
        self.hotness.close()

    async def decide_corpus(self, info: UpstreamInfo) -> CorpusVerdict:
        """Does the whole collection fit the window (and, for ``auto``, is it worth it)? Decided from the chunk
        count and the text's size; only a corpus near the limit is counted exactly, so a large collection is
        never sent to ``/tokenize`` (1.27M tokens took minutes, inside every reload)."""
        room = info.max_model_len - self.settings.max_tokens - QUESTION_HEADROOM_TOKENS
        limit = min(room, self.settings.max_unit_tokens) if self.settings.strategy == "auto" else room
        verdict = CorpusVerdict(chunks=await self.retriever.count())
        if verdict.chunks * MIN_CHUNK_TOKENS <= limit:  # else it cannot fit: no chunk renders under that
            chunks = await self.corpus.load()
            messages = self.builder.messages(chunks, "")
            verdict.estimate = self.estimator.estimate(messages) or int(prompt_chars(messages) / CHARS_PER_TOKEN)
            if verdict.estimate <= NEAR_LIMIT * limit:
                verdict.tokens = len(await self.llm.tokenize(messages))
                verdict.fits = verdict.tokens <= limit
        self.corpus.fits, self.corpus.tokens = verdict.fits, verdict.tokens or 0
        if self.settings.strategy == "auto":
            # Every request attends over its whole prompt, cached or not: the corpus is worth it only while it
            # is no bigger than a unit may be. A long-window model must not turn every prompt into 60K tokens.
            self.active = self.corpus if verdict.fits else self.strategies["document"]
        log.info("corpus: %d chunks, %s tokens (estimate %s); limit %d: %s; strategy=%s", verdict.chunks,
                 verdict.tokens, verdict.estimate, limit, "fits" if verdict.fits else "too large for corpus mode",
                 self.active.name)
        return verdict


@dataclass
class CorpusVerdict:
    chunks: int
    estimate: int | None = None  # tokens, from characters (None: not read, the count alone ruled it out)
    tokens: int | None = None  # counted exactly (only when the estimate came near the limit)
    fits: bool = False
