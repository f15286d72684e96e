"""The request pipeline: one for ``/ask`` (a one-turn conversation) and chat: retrieve -> arrange -> render ->
fit the budget -> stream from vLLM. FastAPI-free, and free of the monitors around it: admission, vLLM's health
and reloads are ``app.runtime.service``'s."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from app.core.errors import BadRequest, ContextTooLong
from app.core.metrics import ServiceMetrics
from app.core.settings import RequestLimits, SamplingSettings
from app.core.tracing import AnswerTraces
from app.rag.affinity import RouteKeys
from app.rag.budget import TokenEstimator
from app.rag.context import ContextChunk, PromptBuilder
from app.rag.conversation import Plan, fit_conversation, new_context_per_turn
from app.rag.index import CollectionIndex
from app.rag.lru import AsyncLRU
from app.rag.planner import ContextPlanner
from app.rag.requests import ChatQuery, Conversation, Lookup, Query, RequestRules
from app.rag.retriever import Ranking
from app.rag.seams import LLM, Ranker
from app.vllm.prompt_ids import PromptIds
from app.vllm.prompt_pieces import TokenPrompt
from app.vllm.wire import Completion, Delta, UpstreamInfo

log = logging.getLogger("prefixrag.pipeline")
RETRIEVAL_CACHE_SIZE = 1024


class Clock:
    """Marks the stages of one request, all measured from its arrival."""

    def __init__(self, started: float) -> None:
        self.started, self.marks = started, {"start": started}

    def mark(self, stage: str) -> None:
        self.marks[stage] = time.perf_counter()

    def times(self, first_token: float, done: float) -> StageTimes:
        retrieve, assemble, sent = self.marks["retrieve"], self.marks["assemble"], self.marks["send"]
        return StageTimes(admit=ms(self.marks["admitted"] - self.started), retrieve=ms(retrieve - self.started),
                          assemble=ms(assemble - retrieve), prepare=ms(sent - assemble),
                          ttft=ms(first_token - self.started), upstream_ttft=ms(first_token - sent),
                          total=ms(done - self.started))


@dataclass(frozen=True)
class StageTimes:
    """Milliseconds: admission and retrieval (both from arrival), building the prompt, making its request (token
    ids), first token (from arrival, and from the request's sending to vLLM) and all (from arrival)."""

    admit: float
    retrieve: float
    assemble: float
    prepare: float
    ttft: float
    upstream_ttft: float
    total: float


@dataclass
class Prompt:
    """A request's prompt as sent: its messages, the conversation plan behind them, the context kept after the
    budget, the last question's hits, the strategy that arranged it and its routing key."""

    messages: list[dict[str, Any]]
    plan: Plan
    kept: list[ContextChunk]
    hits: list[ContextChunk]
    strategy: str
    affinity: str

    @property
    def context(self) -> list[ContextChunk]:
        """Every chunk in the prompt, in prompt order."""
        return [c for earlier in self.plan.contexts[:-1] for c in earlier] + self.kept

    @property
    def first_context(self) -> list[ContextChunk]:
        return self.kept if len(self.plan.contexts) == 1 else self.plan.contexts[0]


@dataclass
class Answer:
    text: str
    sources: list[ContextChunk]
    completion: Completion
    strategy: str
    timings_ms: StageTimes
    prompt: Prompt
    cited: dict[str, str] = field(default_factory=dict)  # a source's chunk id -> the id the prompt showed it as

    def cite_id(self, chunk: ContextChunk) -> str:
        return self.cited.get(chunk.id, chunk.cite_id)


@dataclass(frozen=True)
class Retrieved:
    """A question's ranked hits, most relevant first, each with the stable unit it belongs to (``units``, in
    the same order): the page, document or window a prompt shows it in, and pre-warm warms."""

    hits: list[ContextChunk]
    units: list[str]
    retrieve_ms: float


class Pipeline:
    def __init__(self, limits: RequestLimits, sampling: SamplingSettings, index: CollectionIndex,
                 ranker: Ranker, llm: LLM, builder: PromptBuilder, planner: ContextPlanner,
                 estimator: TokenEstimator, metrics: ServiceMetrics, prompt_ids: PromptIds | None = None,
                 traces: AnswerTraces | None = None, route_keys: RouteKeys | None = None) -> None:
        """``route_keys``: spreads a hot unit over several replicas (None: one routing key per unit)."""
        self.limits, self.sampling, self.index, self.ranker, self.llm = limits, sampling, index, ranker, llm
        self.builder, self.planner, self.estimator = builder, planner, estimator
        self.metrics, self.prompt_ids, self.traces = metrics, prompt_ids, traces
        self.route_keys = route_keys or RouteKeys()
        self.rules = RequestRules(limits)
        self._retrievals: AsyncLRU[Ranking] = AsyncLRU(RETRIEVAL_CACHE_SIZE)
        self._first_contexts: AsyncLRU[list[ContextChunk]] = AsyncLRU(RETRIEVAL_CACHE_SIZE)

    def ask(self, query: Query, info: Callable[[], UpstreamInfo]) -> AsyncIterator[Delta | Answer]:
        """``/ask``: a one-turn conversation. Yields answer deltas as vLLM produces them, then one ``Answer``.
        A bad request raises ``BadRequest`` here, before anything runs; ``info``: what vLLM serves now."""
        return self._converse(self.rules.ask(query), info)

    def chat(self, chat: ChatQuery, info: Callable[[], UpstreamInfo]) -> AsyncIterator[Delta | Answer]:
        """A conversation whose prompt extends the previous turn's prompt; the same pipeline as ``/ask``."""
        return self._converse(self.rules.chat(chat), info)

    async def retrieve(self, lookup: Lookup) -> Retrieved:
        """``/v1/retrieve``: the ranking ``/ask`` would use (and share: the same cache), no prompt, no vLLM. A
        filtered question's unit is its hit's own document (or window), as its prompt would show it."""
        checked = self.rules.lookup(lookup)
        assert checked.top_k is not None
        hits = await self._retrieve_cached(checked.question, checked.top_k, checked.source_prefix, checked.cache_salt)
        paged = checked.source_prefix is None
        units = [(await self.planner.units.unit_for(hit, paged=paged))[0] for hit in hits]
        return Retrieved(hits, units, ms(time.perf_counter() - checked.received_at))

    def forget(self) -> None:
        """The collection changed: nothing retrieved or arranged before is used again."""
        self._retrievals.clear()
        self._first_contexts.clear()

    async def _converse(self, talk: Conversation, info: Callable[[], UpstreamInfo]) -> AsyncIterator[Delta | Answer]:
        """Retrieve every question, plan the context (turn 1 by the strategy, later turns only what is new),
        fit the budget, generate."""
        served = info()
        clock = Clock(talk.received_at)  # the request holds its admission place from here
        clock.mark("admitted")
        self.metrics.admission_wait.observe(clock.marks["admitted"] - clock.started)
        budget = self._budget(served.max_model_len, talk.max_tokens)  # a max_tokens beyond the window: no retrieval
        retrieved = [await self._retrieve_cached(q, talk.top_k, talk.source_prefix, talk.cache_salt)
                     for q in talk.questions]
        clock.mark("retrieve")
        first = await self._first_context(talk, retrieved[0], budget)
        plan = Plan(list(talk.turns), new_context_per_turn(first, retrieved[1:]))
        messages, kept = await fit_conversation(plan, self.builder, self.llm, talk.system, budget, self.estimator)
        self.planner.served(kept)
        clock.mark("assemble")
        # Every turn keyed by turn 1's context, where its prompt starts; a later turn by the unit's own key, on the
        # replica its pre-warm went to (a hot unit's turn 1 may have gone to another: the unit is cached there too).
        replicas = served.replicas if len(talk.questions) == 1 else 1
        prompt = Prompt(messages, plan, kept, retrieved[-1], self.planner.strategy_for(first),
                        self.route_keys.key(first, replicas, talk.route_hint))
        try:
            async for event in self._generate(prompt, talk, clock):
                yield event
        except ContextTooLong:
            # The estimate let through a prompt vLLM would not take (vLLM refuses before any token streams):
            # count exactly, trim, and send once more.
            prompt.messages, prompt.kept = await fit_conversation(plan, self.builder, self.llm, talk.system,
                                                                  budget, None)
            async for event in self._generate(prompt, talk, clock):
                yield event

    async def _first_context(self, talk: Conversation, ranked: list[ContextChunk], budget: int) -> list[ContextChunk]:
        """Turn 1's context. A request's first question is arranged by the strategy with what it has learned
        (hot units first, served paths), and remembered, so ``/ask`` and a chat's first turn share one prompt
        and the chat's later turns rebuild it exactly; a later turn whose first context was forgotten (evicted,
        another app process) rebuilds it as a pure function of the hits."""
        key = (talk.questions[0], talk.top_k, talk.source_prefix, budget, talk.cache_salt)
        forgotten = len(talk.questions) > 1  # a later turn reaches the planner only when turn 1 was forgotten
        # Arranged while a reload still loads the pages (documents unpaged): used once, not remembered.
        return await self._first_contexts.get(key, lambda: self.planner.arrange(
            ranked, budget, stable=forgotten, scoped=talk.source_prefix is not None),
            keep=lambda _: self.index.indexes_loaded())

    async def _retrieve_cached(self, question: str, top_k: int, source_prefix: str | None,
                               cache_salt: str | None) -> list[ContextChunk]:
        # Earlier turns are re-retrieved on every request; an LRU keeps that to one Chroma query per new turn.
        # A ranking made while a reload still loads BM25 (dense alone) is used once, not remembered. Each tenant
        # (``cache_salt``) remembers its own: none can time whether another asked a question.
        ranking = await self._retrievals.get((question, top_k, source_prefix, cache_salt),
                                             lambda: self.ranker.rank(question, top_k, source_prefix),
                                             keep=lambda found: found.complete)
        return self.index.visible(ranking.chunks)

    async def _generate(self, prompt: Prompt, talk: Conversation, clock: Clock) -> AsyncIterator[Delta | Answer]:
        sampling, defaults = talk.sampling, self.sampling
        request = self.llm.chat_request(
            prompt.messages, max_tokens=talk.max_tokens, prefix_key=prompt.affinity,
            temperature=defaults.temperature if sampling.temperature is None else sampling.temperature,
            repetition_penalty=defaults.repetition_penalty, sampling=defaults.extra_sampling,
            cache_salt=talk.cache_salt, **sampling.options())
        completion, first_token = Completion(), None
        ids = await self._prompt_ids(prompt, talk)
        self.metrics.prompts_sent.labels("token_ids" if ids is not None else "chat").inc()
        if ids is not None:
            self.metrics.prompt_pieces.labels("reused").inc(ids.reused)
            self.metrics.prompt_pieces.labels("tokenized").inc(ids.tokenized)
        clock.mark("send")
        async for delta in self.llm.stream_chat(request, completion, ids):
            first_token = first_token or time.perf_counter()
            yield delta
        done = time.perf_counter()
        self.estimator.observe(prompt.messages, completion.prompt_tokens)
        first_token = first_token or done
        self.metrics.observe_answer(prompt.strategy, completion.prompt_tokens, completion.cached_tokens,
                                    first_token - clock.started)
        times = clock.times(first_token, done)
        if self.traces is not None and self.traces.on:
            clock.marks["done"] = done
            self.traces.answer(clock.marks, first_token, {
                "prefixrag.strategy": prompt.strategy, "gen_ai.usage.input_tokens": completion.prompt_tokens,
                "prefixrag.cached_tokens": completion.cached_tokens,
                "gen_ai.usage.output_tokens": completion.completion_tokens,
                "prefixrag.finish_reason": completion.finish_reason or "", "prefixrag.ttft_ms": times.ttft})
        log.info("answered: strategy=%s prompt=%d cached=%d completion=%d finish=%s ttft_ms=%.0f total_ms=%.0f",
                 prompt.strategy, completion.prompt_tokens, completion.cached_tokens, completion.completion_tokens,
                 completion.finish_reason, times.ttft, times.total)
        sources = shown_hits(prompt.hits, prompt.context)
        yield Answer(text=completion.text, sources=sources, completion=completion, strategy=prompt.strategy,
                     timings_ms=times, prompt=prompt, cited={c.id: self.builder.cite(c) for c in sources})

    async def _prompt_ids(self, prompt: Prompt, talk: Conversation) -> TokenPrompt | None:
        """The prompt as token ids when one of its heads was seen before (vLLM then need not tokenize it, and of
        the rest only the text between the context's pieces is tokenized here once their ids are known); its
        heads end after the first turn's opening units, after the first of them and after the system prompt,
        and the longest seen is used. A context that opens with a hit of its own (scattered hits) is seldom
        sent twice: a head ending at the question would be learnt for nothing, and such prompts go as chats."""
        if self.prompt_ids is None or not self.prompt_ids.active:
            return None  # off or no tokenizer here: the leads are not rendered again for nothing
        pieces = [piece for context in (*prompt.plan.contexts[:-1], prompt.kept)
                  for piece in self.builder.pieces(context)]
        return await self.prompt_ids.ids(prompt.messages, self.builder.question(talk.questions[-1]),
                                         self.builder.leads(prompt.first_context), pieces)

    def _budget(self, max_model_len: int, max_tokens: int) -> int:
        if max_tokens >= max_model_len:
            raise BadRequest(f"max_tokens ({max_tokens}) must be below the model's context ({max_model_len})",
                             param="max_tokens")
        cap = self.limits.context_budget_tokens or max_model_len
        return min(cap, max_model_len) - max_tokens


async def final_answer(events: AsyncIterator[Delta | Answer]) -> Answer:
    """The ``Answer`` at the end of a stream; the stream is closed here and now (its slot is free on return)."""
    async with contextlib.aclosing(events):  # type: ignore[type-var]
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
