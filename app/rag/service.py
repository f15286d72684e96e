"""The RAG service: one pipeline for ``/ask`` (a one-turn conversation) and chat: retrieve -> arrange -> render
-> fit the budget -> stream from vLLM. FastAPI-free."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field, replace

from app.core.settings import GenerationSettings, TrafficSettings
from app.errors import BadRequest, ContextTooLong, StoreUnavailable, UpstreamUnavailable
from app.llm import Completion, Delta, LLMClient
from app.metrics import ServiceMetrics
from app.prompt_ids import PromptIds
from app.rag.affinity import affinity_key
from app.rag.budget import TokenEstimator
from app.rag.collection import CollectionWatcher
from app.rag.context import ContextChunk, PromptBuilder
from app.rag.conversation import Plan, fit_conversation, new_context_per_turn
from app.rag.lru import AsyncLRU
from app.rag.planner import ContextPlanner
from app.rag.readiness import Readiness
from app.rag.requests import ChatQuery, Conversation, Query, RequestRules
from app.rag.retriever import Retriever
from app.rag.traffic import LiveTraffic
from app.rag.upstream import Upstream
from app.rag.warmup import Warmer

log = logging.getLogger("prefixrag.service")
RETRIEVAL_CACHE_SIZE = 1024


class Clock:
    """Marks the phases of one request, all measured from its arrival."""

    def __init__(self, started: float) -> None:
        self.started, self.marks = started, {"start": started}

    def mark(self, phase: str) -> None:
        self.marks[phase] = time.perf_counter()

    def timings(self, ttft: float, done: float) -> Timings:
        retrieve, assemble = self.marks["retrieve"], self.marks["assemble"]
        return Timings(retrieve=ms(retrieve - self.started), assemble=ms(assemble - retrieve), ttft=ms(ttft),
                       total=ms(done - self.started))


@dataclass(frozen=True)
class Timings:
    """Milliseconds: retrieval (from arrival), building the prompt, first token and all (from arrival)."""

    retrieve: float
    assemble: float
    ttft: float
    total: float


@dataclass
class Answer:
    text: str
    sources: list[ContextChunk]
    completion: Completion
    strategy: str
    timings_ms: Timings
    messages: list[dict] = field(default_factory=list)  # the exact prompt sent (benchmarks, debugging)
    context: list[ContextChunk] = field(default_factory=list)  # every chunk in the prompt, in prompt order


class RAGService:
    def __init__(self, settings: GenerationSettings, retriever: Retriever, llm: LLMClient, builder: PromptBuilder,
                 upstream: Upstream, metrics: ServiceMetrics, traffic: TrafficSettings | None = None,
                 prompt_ids: PromptIds | None = None) -> None:
        self.settings, self.retriever, self.llm, self.builder = settings, retriever, llm, builder
        self.upstream, self.metrics, self.prompt_ids = upstream, metrics, prompt_ids
        # Untrusted text never carries the served tokenizer's special tokens, whatever vLLM serves now.
        upstream.subscribe(lambda info: builder.inert.use(info.special_tokens))
        self.estimator = TokenEstimator()
        self.planner = ContextPlanner(settings, retriever, builder, llm, retriever.chroma.collection, self.estimator)
        limits = traffic or TrafficSettings()
        self.traffic = LiveTraffic(limits.max_in_flight, limits.max_queued)
        self.warmer = Warmer(self.planner, upstream, self.traffic)
        self.rules = RequestRules(settings)
        self._retrievals: AsyncLRU[list[ContextChunk]] = AsyncLRU(RETRIEVAL_CACHE_SIZE)
        self._first_contexts: AsyncLRU[list[ContextChunk]] = AsyncLRU(RETRIEVAL_CACHE_SIZE)
        self.collection = CollectionWatcher(retriever, self._collection_changed)

    def readiness(self) -> Readiness:
        """Can it answer now? vLLM's status, not ready while the collection is missing or unreadable; pre-warm's
        progress and the load are reported, never waited for."""
        return Readiness(self.upstream.status(), self.collection.problem, self.warmer.progress,
                         self.traffic.status())

    def answer_stream(self, query: Query) -> AsyncGenerator[Delta | Answer, None]:
        """``/ask``: a one-turn conversation. Yields answer deltas as vLLM produces them, then one ``Answer``.
        A bad request raises ``BadRequest`` here, before anything runs."""
        return self._watching_upstream(self._converse(self.rules.ask(query)))

    def chat_stream(self, chat: ChatQuery) -> AsyncGenerator[Delta | Answer, None]:
        """A conversation whose prompt extends the previous turn's prompt; the same pipeline as ``/ask``."""
        return self._watching_upstream(self._converse(self.rules.chat(chat)))

    async def _watching_upstream(self, events: AsyncIterator[Delta | Answer],
                                 ) -> AsyncGenerator[Delta | Answer, None]:
        """Admission (a slot, or 429 at once) around the whole request, and vLLM's health watched."""
        try:
            async with self.traffic.slot():
                async for event in events:
                    yield event
        except StoreUnavailable:
            raise  # Chroma's problem, not vLLM's: the collection watcher keeps readiness for it
        except UpstreamUnavailable as exc:  # vLLM went away: readiness drops, the monitor re-probes
            self.upstream.mark_down(exc.message)
            raise

    async def _converse(self, talk: Conversation) -> AsyncIterator[Delta | Answer]:
        """The one pipeline: retrieve every question, plan the context (turn 1 by the strategy, later turns only
        what is new), fit the budget, generate."""
        info = self.upstream.require()
        clock = Clock(talk.received_at)
        questions = talk.questions
        retrieved = [await self._retrieve_cached(q, talk.top_k, talk.source_prefix) for q in questions]
        clock.mark("retrieve")
        budget = self._budget(info.max_model_len, talk.max_tokens)
        first = await self._first_context(talk, retrieved[0], budget)
        strategy = self.planner.strategy_for(first)
        plan = Plan(list(talk.turns), new_context_per_turn(first, retrieved[1:]))
        messages, kept = await fit_conversation(plan, self.builder, self.llm, talk.system, budget, self.estimator)
        self.planner.served(kept)
        clock.mark("assemble")
        affinity = affinity_key(first)  # every turn keyed by turn 1's context, where its prompt starts
        try:
            async for event in self._generate(messages, plan, kept, retrieved[-1], talk, clock, strategy, affinity):
                yield event
        except ContextTooLong:
            # The estimate let through a prompt vLLM would not take (vLLM refuses before any token streams):
            # count exactly, trim, and send once more.
            messages, kept = await fit_conversation(plan, self.builder, self.llm, talk.system, budget, None)
            async for event in self._generate(messages, plan, kept, retrieved[-1], talk, clock, strategy, affinity):
                yield event

    async def _first_context(self, talk: Conversation, ranked: list[ContextChunk], budget: int) -> list[ContextChunk]:
        """Turn 1's context. A request's first question is arranged by the strategy with what it has learned
        (hot units first, served paths), and remembered, so ``/ask`` and a chat's first turn share one prompt
        and the chat's later turns rebuild it exactly; a later turn whose first context was forgotten (evicted,
        another app process) rebuilds it as a pure function of the hits."""
        key = (talk.questions[0], talk.top_k, talk.source_prefix, budget)
        forgotten = len(talk.questions) > 1  # a later turn reaches the planner only when turn 1 was forgotten
        # Arranged while a reload still loads the pages (documents unpaged): used once, not remembered.
        return await self._first_contexts.get(key, lambda: self.planner.arrange(
            ranked, budget, stable=forgotten, scoped=talk.source_prefix is not None),
            keep=self.retriever.indexes_loaded)

    async def _retrieve_cached(self, question: str, top_k: int, source_prefix: str | None) -> list[ContextChunk]:
        # Earlier turns are re-retrieved on every request; an LRU keeps that to one Chroma query per new turn.
        # A ranking made while a reload still loads BM25 (dense alone) is used once, not remembered.
        return await self._retrievals.get((question, top_k, source_prefix),
                                          lambda: self.retriever.retrieve(question, top_k, source_prefix),
                                          keep=self.retriever.indexes_loaded)

    async def _generate(self, messages: list[dict], plan: Plan, kept: list[ContextChunk], hits: list[ContextChunk],
                        talk: Conversation, clock: Clock, strategy: str, affinity: str,
                        ) -> AsyncIterator[Delta | Answer]:
        request = self.llm.chat_request(
            messages, max_tokens=talk.max_tokens, prefix_key=affinity,
            temperature=self.settings.temperature if talk.sampling.temperature is None else talk.sampling.temperature,
            repetition_penalty=self.settings.repetition_penalty, sampling=self.settings.extra_sampling,
            **talk.sampling.options())
        completion, first_token = Completion(), None
        ids = await self._prompt_ids(messages, plan, kept, talk)
        self.metrics.prompts_sent.labels("token_ids" if ids is not None else "chat").inc()
        async for delta in self.llm.stream_chat(request, completion, ids):
            first_token = first_token or time.perf_counter()
            yield delta
        done = time.perf_counter()
        self.estimator.observe(messages, completion.prompt_tokens)
        ttft = (first_token or done) - clock.started
        self.metrics.observe_answer(strategy, completion.prompt_tokens, completion.cached_tokens, ttft)
        timings = clock.timings(ttft, done)
        log.info("answered: strategy=%s prompt=%d cached=%d completion=%d finish=%s ttft_ms=%.0f total_ms=%.0f",
                 strategy, completion.prompt_tokens, completion.cached_tokens, completion.completion_tokens,
                 completion.finish_reason, timings.ttft, timings.total)
        context = [c for earlier in plan.contexts[:-1] for c in earlier] + kept
        yield Answer(text=completion.text, sources=shown_hits(hits, context), completion=completion,
                     strategy=strategy, timings_ms=timings, messages=messages, context=context)

    async def _prompt_ids(self, messages: list[dict], plan: Plan, kept: list[ContextChunk],
                          talk: Conversation) -> list[int] | None:
        """The prompt as token ids when its head was seen before (vLLM then need not tokenize it: bench/README.md,
        vLLM's front end); the head ends after the first turn's opening units, else before the last question."""
        if self.prompt_ids is None or not self.prompt_ids.active:
            return None  # off (the default) or no tokenizer here: the lead is not rendered again for nothing
        first_context = kept if len(plan.contexts) == 1 else plan.contexts[0]
        return await self.prompt_ids.ids(messages, self.builder.question(talk.questions[-1]),
                                         self.builder.lead(first_context))

    async def chat(self, chat: ChatQuery) -> Answer:
        return await _final(self.chat_stream(chat))

    async def answer(self, query: Query) -> Answer:
        return await _final(self.answer_stream(query))

    def _budget(self, max_model_len: int, max_tokens: int) -> int:
        if max_tokens >= max_model_len:
            raise BadRequest(f"max_tokens ({max_tokens}) must be below the model's context ({max_model_len})",
                             param="max_tokens")
        cap = self.settings.context_budget_tokens or max_model_len
        return min(cap, max_model_len) - max_tokens

    async def _collection_changed(self, rewarm: bool) -> None:
        """An ingest changed the collection (or it is gone): drop everything cached of it; re-warm."""
        self.retriever.reopen()
        self._retrievals.clear()
        self._first_contexts.clear()
        self.planner.forget_collection()
        self.metrics.collection_reloads.inc()
        if rewarm:  # in the background; a deleted collection has nothing to warm
            self.warmer.restart()


async def _final(events: AsyncGenerator[Delta | Answer, None]) -> Answer:
    async with contextlib.aclosing(events):  # closed here and now: its slot is free before we return
        async for event in events:
            if isinstance(event, Answer):
                return event
    raise AssertionError("the stream ended without an Answer")


def shown_hits(hits: list[ContextChunk], context: list[ContextChunk]) -> list[ContextChunk]:
    """The last question's hits as the prompt shows them (alone or inside a unit: that decides their cited
    id), with this question's scores, most relevant first."""
    shown = {c.id: c for c in context}
    found = [replace(shown[c.id], score=c.score, rank=c.rank, retrieved=True) for c in hits if c.id in shown]
    return sorted(found, key=lambda c: -c.score)


def ms(seconds: float) -> float:
    return round(seconds * 1000, 2)
