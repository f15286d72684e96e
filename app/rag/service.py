"""The RAG service: retrieve -> order -> render -> fit the budget -> stream from vLLM. FastAPI-free."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field, replace

from app.errors import BadRequest, ContextTooLong, ServiceError, StoreUnavailable, UpstreamUnavailable
from app.llm import Completion, Delta, LLMClient
from app.metrics import ServiceMetrics
from app.rag.affinity import affinity_key
from app.rag.budget import OverBudget, TokenEstimator, fit_to_budget
from app.rag.context import ContextChunk, PromptBuilder
from app.rag.conversation import Turn, conversation_messages, new_context_per_turn
from app.rag.lru import AsyncLRU
from app.rag.planner import ContextPlanner
from app.rag.retriever import Retriever
from app.rag.traffic import LiveTraffic
from app.rag.upstream import Upstream
from app.rag.warmup import Warmer
from app.settings import GenerationSettings, TrafficSettings

log = logging.getLogger("prefixrag.service")
_UNSEEN = object()
RETRIEVAL_CACHE_SIZE = 1024


@dataclass
class Query:
    question: str
    top_k: int | None = None
    source_prefix: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    received_at: float = field(default_factory=time.perf_counter)


@dataclass
class ChatQuery:
    turns: list[Turn]
    system: str = ""
    top_k: int | None = None
    source_prefix: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: list[str] | None = None
    received_at: float = field(default_factory=time.perf_counter)


class Clock:
    """Marks the phases of one request, all measured from its arrival."""

    def __init__(self, started: float) -> None:
        self.started, self.marks = started, {"start": started}

    def mark(self, phase: str) -> None:
        self.marks[phase] = time.perf_counter()

    def timings(self, ttft: float, done: float) -> dict[str, float]:
        retrieve, assemble = self.marks["retrieve"], self.marks["assemble"]
        return {"retrieve": ms(retrieve - self.started), "assemble": ms(assemble - retrieve), "ttft": ms(ttft),
                "total": ms(done - self.started)}


@dataclass
class Answer:
    text: str
    sources: list[ContextChunk]
    completion: Completion
    strategy: str
    timings_ms: dict[str, float]
    messages: list[dict] = field(default_factory=list)  # the exact prompt sent (benchmarks, debugging)
    context: list[ContextChunk] = field(default_factory=list)  # every chunk in the prompt, in prompt order


class RAGService:
    def __init__(self, settings: GenerationSettings, retriever: Retriever, llm: LLMClient, builder: PromptBuilder,
                 upstream: Upstream, metrics: ServiceMetrics, traffic: TrafficSettings | None = None) -> None:
        self.settings, self.retriever, self.llm, self.builder = settings, retriever, llm, builder
        self.upstream, self.metrics = upstream, metrics
        self.estimator = TokenEstimator()
        self.planner = ContextPlanner(settings, retriever, builder, llm, retriever.chroma.collection, self.estimator)
        limits = traffic or TrafficSettings()
        self.traffic = LiveTraffic(limits.max_in_flight, limits.max_queued)
        self.warmer = Warmer(self.planner, upstream, self.traffic)
        self._retrievals: AsyncLRU[list[ContextChunk]] = AsyncLRU(RETRIEVAL_CACHE_SIZE)
        self.collection_problem: str | None = "collection not checked yet"  # kept by watch_collection

    def readiness(self) -> dict:
        """Can it answer now? vLLM's status (``Upstream.status``), not ready while the collection is missing or
        unreadable; pre-warm's progress and the load are reported, never waited for."""
        status = self.upstream.status()
        if self.collection_problem:
            status |= {"ready": False, "reason": self.collection_problem}
        traffic = self.traffic
        return status | {"warmup": asdict(self.warmer.progress),
                         "traffic": {"present": traffic.present, "max_in_flight": traffic.max_in_flight,
                                     "max_queued": traffic.max_queued, "refused": traffic.refused,
                                     "warmup_yields": traffic.yields}}

    def validate(self, query: Query) -> tuple[str, int, int]:
        question = query.question.strip() if isinstance(query.question, str) else ""
        if not question:
            raise BadRequest("question must be a non-empty string", param="question", code="empty_question")
        if len(question) > self.settings.max_question_chars:
            raise BadRequest(f"question is {len(question)} characters; the limit is "
                             f"{self.settings.max_question_chars}", param="question", code="question_too_long")
        top_k = self.settings.top_k if query.top_k is None else query.top_k
        if not 1 <= top_k <= self.settings.max_top_k:
            raise BadRequest(f"top_k must be between 1 and {self.settings.max_top_k}", param="top_k",
                             code="top_k_out_of_range")
        return question, top_k, query.max_tokens or self.settings.max_tokens

    def answer_stream(self, query: Query) -> AsyncIterator[Delta | Answer]:
        """Yield answer deltas as vLLM produces them, then one final ``Answer``."""
        return self._watching_upstream(self._answer_stream(query))

    def chat_stream(self, chat: ChatQuery) -> AsyncIterator[Delta | Answer]:
        """Like ``answer_stream`` for a conversation whose prompt extends the previous turn's prompt."""
        return self._watching_upstream(self._chat_stream(chat))

    async def _watching_upstream(self, events: AsyncIterator[Delta | Answer]) -> AsyncIterator[Delta | Answer]:
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

    async def _answer_stream(self, query: Query) -> AsyncIterator[Delta | Answer]:
        question, top_k, max_tokens = self.validate(query)
        info = self.upstream.require()
        self.builder.inert.use(info.special_tokens)
        clock = Clock(query.received_at)
        ranked = await self.retriever.retrieve(question, top_k, query.source_prefix)
        clock.mark("retrieve")
        budget = self._budget(info.max_model_len, max_tokens)
        arranged = await self.planner.arrange(ranked, budget)
        strategy = self.planner.strategy_for(arranged)

        async def fit(estimator: TokenEstimator | None) -> tuple[list[dict], list[ContextChunk], int]:
            return await fit_to_budget(lambda chunks: self.builder.messages(chunks, question), self.llm, arranged,
                                       budget, self._chunk_chars, estimator)

        messages, kept, _ = await fit(self.estimator)
        self.planner.served(kept)
        clock.mark("assemble")
        try:
            async for event in self._generate(messages, kept, max_tokens, query.temperature, clock, strategy,
                                              affinity_key(kept)):
                yield event
        except ContextTooLong:
            # The estimate let through a prompt vLLM would not take (vLLM refuses before any token streams):
            # count exactly, trim, and send once more.
            messages, kept, _ = await fit(None)
            async for event in self._generate(messages, kept, max_tokens, query.temperature, clock, strategy,
                                              affinity_key(kept)):
                yield event

    async def _chat_stream(self, chat: ChatQuery) -> AsyncIterator[Delta | Answer]:
        questions = [turn.content for turn in chat.turns if turn.role == "user"]
        _, top_k, max_tokens = self.validate(Query(questions[-1], chat.top_k, None, chat.max_tokens))
        info = self.upstream.require()
        self.builder.inert.use(info.special_tokens)
        clock = Clock(chat.received_at)
        retrieved = [await self._retrieve_cached(q, top_k, chat.source_prefix) for q in questions]
        clock.mark("retrieve")
        budget = self._budget(info.max_model_len, max_tokens)
        first = await self.planner.arrange(retrieved[0], budget, stable=True)
        strategy = self.planner.strategy_for(first)
        contexts = new_context_per_turn(first, retrieved[1:])
        turns = list(chat.turns)
        while True:
            def render(last: list[ContextChunk]) -> list[dict]:  # called within this iteration only
                return conversation_messages(self.builder, turns, contexts[:-1] + [last], chat.system)  # noqa: B023

            try:
                messages, kept, _ = await fit_to_budget(render, self.llm, contexts[-1], budget, self._chunk_chars)
                break
            except OverBudget:
                # Even without new context the conversation is too long: drop the oldest exchange (this
                # request then misses the cache, as its prefix changed) and try again.
                if len(contexts) == 1:
                    raise
                turns, contexts = _drop_oldest_exchange(turns), contexts[1:]
        clock.mark("assemble")
        # The last question's hits as the prompt shows them (in a unit or alone: that decides their cited id).
        shown = {c.id: c for ctx in contexts[:-1] for c in ctx} | {c.id: c for c in kept}
        context = [replace(shown[c.id], score=c.score, rank=c.rank, retrieved=True)
                   for c in retrieved[-1] if c.id in shown]
        # Every turn is keyed by turn 1's context, where its prompt starts: a conversation stays on one replica.
        async for event in self._generate(messages, context, max_tokens, chat.temperature, clock, strategy,
                                          affinity_key(first), top_p=chat.top_p, stop=chat.stop):
            yield event

    async def _retrieve_cached(self, question: str, top_k: int, source_prefix: str | None) -> list[ContextChunk]:
        # Earlier turns are re-retrieved on every request; an LRU keeps that to one Chroma query per new turn.
        return await self._retrievals.get((question, top_k, source_prefix),
                                          lambda: self.retriever.retrieve(question, top_k, source_prefix))

    async def _generate(self, messages: list[dict], context: list[ContextChunk], max_tokens: int,
                        temperature: float | None, clock: Clock, strategy: str, affinity: str,
                        **options) -> AsyncIterator[Delta | Answer]:
        request = self.llm.chat_request(
            messages, max_tokens=max_tokens, prefix_key=affinity,
            temperature=self.settings.temperature if temperature is None else temperature,
            repetition_penalty=self.settings.repetition_penalty, sampling=self.settings.extra_sampling, **options)
        completion, first_token = Completion(), None
        async for delta in self.llm.stream_chat(request, completion):
            first_token = first_token or time.perf_counter()
            yield delta
        done = time.perf_counter()
        self.estimator.observe(messages, completion.prompt_tokens)
        ttft = (first_token or done) - clock.started
        self.metrics.observe_answer(strategy, completion.prompt_tokens, completion.cached_tokens, ttft)
        # Most relevant first (ranks can be shared: a unit or the corpus carries one rank for all its chunks).
        sources = sorted((c for c in context if c.retrieved), key=lambda c: -c.score)
        timings = clock.timings(ttft, done)
        log.info("answered: strategy=%s prompt=%d cached=%d completion=%d finish=%s ttft_ms=%.0f total_ms=%.0f",
                 strategy, completion.prompt_tokens, completion.cached_tokens, completion.completion_tokens,
                 completion.finish_reason, timings["ttft"], timings["total"])
        yield Answer(text=completion.text, sources=sources, completion=completion, strategy=strategy,
                     timings_ms=timings, messages=messages, context=context)

    def _chunk_chars(self, chunk: ContextChunk) -> int:
        return len(self.builder.render_chunk(chunk))

    def validate_chat(self, chat: ChatQuery) -> None:
        """Bad conversations are 400s before any streaming starts."""
        if not chat.turns or chat.turns[-1].role != "user":
            raise BadRequest("the last message must be a user message", param="messages", code="invalid_messages")
        limits = self.settings
        if len(chat.turns) > limits.max_chat_messages:
            raise BadRequest(f"{len(chat.turns)} messages; the limit is {limits.max_chat_messages}",
                             param="messages", code="too_many_messages")
        size = len(chat.system) + sum(len(turn.content) for turn in chat.turns)
        if size > limits.max_chat_chars:
            raise BadRequest(f"the messages hold {size} characters; the limit is {limits.max_chat_chars}",
                             param="messages", code="conversation_too_long")
        for number, turn in enumerate(chat.turns):
            if turn.role == "user":  # every question is retrieved for, not only the last: each is checked
                try:
                    self.validate(Query(turn.content, chat.top_k, None, chat.max_tokens))
                except BadRequest as exc:
                    raise BadRequest(f"messages[{number}]: {exc.message}", param="messages", code=exc.code) from None

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

    async def watch_collection(self, interval_s: float) -> None:
        """Poll the collection's generation stamp; when an ingest changed it, drop everything cached of it
        (Chroma's embedded state, chat retrievals, units, the corpus) and re-warm for the new content."""
        seen: object = _UNSEEN  # the first look only records what start-up already loaded
        while True:
            try:
                now = await self.retriever.generation()
                if now is None:
                    self.collection_problem = (f"collection {self.retriever.chroma.collection!r} does not exist: "
                                               "ingest documents first")
                changed = seen is not _UNSEEN and now != seen
                if changed:
                    if now is None:  # deleted under us: answer 503 from now on, never from a stale handle
                        log.warning("collection %r is gone (store deleted?): requests get 503 until the next "
                                    "ingest", self.retriever.chroma.collection)
                    else:
                        log.info("collection %r changed (an ingest ran): reloading and re-warming",
                                 self.retriever.chroma.collection)
                    await self._collection_changed(rewarm=now is not None)
                if now is not None:
                    if changed or seen is _UNSEEN:
                        # Load the vector index and run the encoder once now: not ready until a question would
                        # not pay for either (the first one took 0.6 s against 0.1 s after).
                        await self.retriever.retrieve("prime the index", 1)
                    self.collection_problem = None
                seen = now
            except ServiceError as exc:
                if self.collection_problem != exc.message:  # once per state change
                    log.warning("cannot check the collection for changes: %s", exc.message)
                self.collection_problem = exc.message
            await asyncio.sleep(interval_s)

    async def _collection_changed(self, rewarm: bool) -> None:
        self.retriever.reopen()
        self._retrievals.clear()
        self.planner.forget_collection()
        self.metrics.collection_reloads.inc()
        if rewarm:  # in the background; a deleted collection has nothing to warm
            self.warmer.restart()


async def _final(events: AsyncIterator[Delta | Answer]) -> Answer:
    async with contextlib.aclosing(events):  # closed here and now: its slot is free before we return
        async for event in events:
            if isinstance(event, Answer):
                return event
    raise AssertionError("the stream ended without an Answer")


def _drop_oldest_exchange(turns: list[Turn]) -> list[Turn]:
    """Remove the first user turn and everything up to the next user turn."""
    first_user = next(i for i, t in enumerate(turns) if t.role == "user")
    rest = turns[first_user + 1:]
    next_user = next(i for i, t in enumerate(rest) if t.role == "user")
    return turns[:first_user] + rest[next_user:]


def ms(seconds: float) -> float:
    return round(seconds * 1000, 2)
