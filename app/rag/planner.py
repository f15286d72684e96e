"""The configured context strategy at work: resolves ``auto``, arranges each request's context, and pre-warms
what will be asked (the stable prefix at once; then, in the background, the corpus or the hottest units)."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

from app.rag.budget import TokenEstimator
from app.rag.context import ContextChunk, PromptBuilder
from app.rag.strategies import QUESTION_HEADROOM_TOKENS, Canonical, Corpus, Document, Reuse
from app.rag.trie import ServedTrie
from app.rag.units import Hotness, UnitIndex
from app.rag.upstream import UpstreamInfo, WarmupStatus
from app.settings import GenerationSettings

log = logging.getLogger("prefixrag.planner")


class ContextPlanner:
    def __init__(self, settings: GenerationSettings, retriever, builder: PromptBuilder, llm, collection: str,
                 estimator: TokenEstimator) -> None:
        self.settings, self.retriever, self.builder, self.llm = settings, retriever, builder, llm
        self.estimator = estimator  # learns chars-per-token from what pre-warm sends
        hotness_path = settings.hotness_dir / f"{collection}.json" if settings.hotness_dir else None
        self.hotness = Hotness(hotness_path)
        self.units = UnitIndex(retriever, settings.max_unit_tokens)
        self.corpus = Corpus(retriever)
        self.strategies = {"canonical": Canonical(), "reuse": Reuse(ServedTrie()), "corpus": self.corpus,
                           "document": Document(self.units, self.hotness, settings.max_units,
                                                       settings.unit_quorum)}
        self.active = self.strategies["document" if settings.strategy == "auto" else settings.strategy]
        self._background: asyncio.Task | None = None
        self.progress: dict = {}
        self.warmed_prompts: list[list[dict]] = []  # what pre-warm sent (benchmarks prime their ceiling with it)

    @property
    def name(self) -> str:
        return self.active.name

    async def arrange(self, ranked: list[ContextChunk], budget: int, stable: bool = False) -> list[ContextChunk]:
        """The prompt's context for these hits; ``budget`` is the request's prompt-token budget; ``stable``: a
        pure function of the hits (see ``Canonical.arrange``)."""
        return await self.active.arrange(ranked, budget, stable)

    def strategy_for(self, arranged: list[ContextChunk]) -> str:
        """The strategy that actually built this context (corpus degrades to canonical when it cannot fit)."""
        if self.active is self.corpus and len(arranged) != len(self.corpus.chunks or []):
            return "canonical"
        return self.active.name

    def served(self, kept: list[ContextChunk]) -> None:
        self.active.served(kept)

    async def warm(self, info: UpstreamInfo) -> WarmupStatus:
        """Warm the stable prefix now; corpus or units continue in the background (answers never wait)."""
        # A unit must leave room for the question, the answer and the rest of the prompt.
        self.units.max_unit_tokens = min(self.settings.max_unit_tokens,
                                         (info.max_model_len - self.settings.max_tokens) // 2)
        if self._background:  # a re-warm (vLLM restarted, the collection changed) supersedes the last one
            self._background.cancel()
        self.warmed_prompts = []  # what is cached now, not every warm-up since start-up
        tokens = await self._warm_messages(self.builder.warmup_messages())
        if self.settings.strategy in ("corpus", "auto"):
            await self._decide_corpus(info)
        if self.active is self.corpus and self.corpus.fits:
            self._background = asyncio.create_task(self._warm_corpus())
        elif self.active.name == "document":
            self._background = asyncio.create_task(self._warm_units(info))
        return WarmupStatus(done=True, tokens=tokens, detail=self.progress)

    def forget_collection(self) -> None:
        """The collection changed: parents and corpus are re-read on next use (``warm`` re-decides the corpus)."""
        self.units.forget()
        self.corpus.chunks, self.corpus.fits = None, False

    async def warmed(self) -> None:
        """Wait until the background pre-warm is done (benchmarks measure warm traffic)."""
        if self._background:
            await self._background

    async def close(self) -> None:
        if self._background:
            self._background.cancel()
        self.hotness.save()

    async def _decide_corpus(self, info: UpstreamInfo) -> None:
        chunks = await self.corpus.load()
        tokens = len(await self.llm.tokenize(self.builder.messages(chunks, "")))
        room = info.max_model_len - self.settings.max_tokens - QUESTION_HEADROOM_TOKENS
        self.corpus.fits, self.corpus.tokens = tokens <= room, tokens
        if self.settings.strategy == "auto":
            # Every request attends over its whole prompt, cached or not: the corpus is worth it only while it
            # is no bigger than a unit may be. A long-window model must not turn every prompt into 60K tokens.
            cheap = self.corpus.fits and tokens <= self.settings.max_unit_tokens
            self.active = self.corpus if cheap else self.strategies["document"]
        verdict = "fits" if self.corpus.fits else "is too large for corpus mode"
        log.info("corpus of %d chunks is %d tokens; window leaves %d: it %s; max_unit_tokens=%d; strategy=%s",
                 len(chunks), tokens, room, verdict, self.settings.max_unit_tokens, self.active.name)
        self.progress["corpus_tokens"], self.progress["corpus_fits"] = tokens, self.corpus.fits

    async def _warm_corpus(self) -> None:
        tokens = await self._warm_messages(self.builder.messages(self.corpus.chunks, ""))
        self.progress.update(units_warmed=1, units_planned=1, unit_tokens=tokens)

    async def _warm_units(self, info: UpstreamInfo) -> None:
        """Hottest units first (persisted use; before any traffic: biggest parents), within a KV share."""
        try:
            metas = await self.retriever.chunks_where(None, texts=False)  # which parents, how big
        except Exception as exc:  # an empty or missing collection: nothing to warm yet
            log.warning("unit pre-warm skipped: %s", exc)
            return
        sizes = Counter(c.parent for c in metas)
        first = {}
        for chunk in metas:
            first.setdefault(chunk.parent, chunk)
        order = sorted(sizes, key=lambda p: (-self.hotness.score(p), -sizes[p], p))
        budget = int(info.kv_cache_tokens * self.settings.warm_kv_share)
        self.progress.update(units_planned=len(order), units_warmed=0, unit_tokens=0, kv_budget_tokens=budget)
        gate = asyncio.Semaphore(self.settings.warm_concurrency)

        async def warm_one(parent: str) -> None:
            async with gate:
                if self.progress["unit_tokens"] >= budget:
                    return
                _, chunks = await self.units.unit_for(first[parent])
                tokens = await self._warm_messages(self.builder.messages(chunks, ""))
                # Add after the await: `x += await f()` would read x first and lose concurrent updates.
                self.progress["unit_tokens"] += tokens
                self.progress["units_warmed"] += 1

        try:
            await asyncio.gather(*(warm_one(parent) for parent in order))
            log.info("unit pre-warm done: %(units_warmed)d/%(units_planned)d units, %(unit_tokens)d tokens",
                     self.progress)
        except Exception as exc:  # vLLM went away mid-warm: the monitor re-warms when it is back
            log.warning("unit pre-warm interrupted: %s", exc)

    async def _warm_messages(self, messages: list[dict]) -> int:
        request = self.llm.chat_request(messages, max_tokens=1, temperature=0.0, prefix_key="warmup", stream=False)
        response = await self.llm.complete(request)
        self.warmed_prompts.append(messages)
        self.estimator.observe(messages, response.usage.prompt_tokens)
        return response.usage.prompt_tokens  # vLLM counted the prompt it just cached: no second /tokenize
