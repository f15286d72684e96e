"""The RAG service: retrieve -> order -> render -> fit the budget -> stream from vLLM. FastAPI-free."""

from __future__ import annotations

import hashlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from app.errors import BadRequest, UpstreamUnavailable
from app.llm import Completion, Delta, LLMClient
from app.metrics import ServiceMetrics
from app.rag.budget import fit_to_budget
from app.rag.context import ContextChunk, PromptBuilder, canonical
from app.rag.retriever import Retriever
from app.rag.upstream import Upstream, WarmupStatus
from app.settings import GenerationSettings


@dataclass
class Query:
    question: str
    top_k: int | None = None
    source_prefix: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    received_at: float = field(default_factory=time.perf_counter)


@dataclass
class Answer:
    text: str
    sources: list[ContextChunk]
    completion: Completion
    strategy: str
    timings_ms: dict[str, float]


class RAGService:
    def __init__(self, settings: GenerationSettings, retriever: Retriever, llm: LLMClient, builder: PromptBuilder,
                 upstream: Upstream, metrics: ServiceMetrics) -> None:
        self.settings, self.retriever, self.llm, self.builder = settings, retriever, llm, builder
        self.upstream, self.metrics = upstream, metrics
        upstream.warm = self.warm

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

    async def answer_stream(self, query: Query) -> AsyncIterator[Delta | Answer]:
        """Yield answer deltas as vLLM produces them, then one final ``Answer``."""
        try:
            async for event in self._answer_stream(query):
                yield event
        except UpstreamUnavailable as exc:
            if exc.code != "collection_unavailable":  # vLLM went away: readiness drops, the monitor re-probes
                self.upstream.mark_down(exc.message)
            raise

    async def _answer_stream(self, query: Query) -> AsyncIterator[Delta | Answer]:
        question, top_k, max_tokens = self.validate(query)
        info = self.upstream.require()
        started = query.received_at
        ranked = await self.retriever.retrieve(question, top_k, query.source_prefix)
        retrieved = time.perf_counter()
        ordered = canonical(ranked)
        messages, kept, _ = await fit_to_budget(self.builder, self.llm, ordered, question,
                                                self._budget(info.max_model_len, max_tokens))
        assembled = time.perf_counter()
        request = self.llm.chat_request(
            messages, max_tokens=max_tokens, prefix_key=prefix_key(kept),
            repetition_penalty=self.settings.repetition_penalty,
            temperature=self.settings.temperature if query.temperature is None else query.temperature)
        completion, first_token = Completion(), None
        async for delta in self.llm.stream_chat(request, completion):
            first_token = first_token or time.perf_counter()
            yield delta
        done = time.perf_counter()
        ttft = (first_token or done) - started
        self.metrics.observe_answer("canonical", completion.prompt_tokens, completion.cached_tokens, ttft)
        yield Answer(
            text=completion.text, sources=sorted(kept, key=lambda c: c.rank), completion=completion,
            strategy="canonical",
            timings_ms={"retrieve": ms(retrieved - started), "assemble": ms(assembled - retrieved),
                        "ttft": ms(ttft), "total": ms(done - started)},
        )

    async def answer(self, query: Query) -> Answer:
        async for event in self.answer_stream(query):
            if isinstance(event, Answer):
                return event
        raise AssertionError("answer_stream ended without an Answer")

    def _budget(self, max_model_len: int, max_tokens: int) -> int:
        if max_tokens >= max_model_len:
            raise BadRequest(f"max_tokens ({max_tokens}) must be below the model's context ({max_model_len})",
                             param="max_tokens")
        cap = self.settings.context_budget_tokens or max_model_len
        return min(cap, max_model_len) - max_tokens

    async def warm(self) -> WarmupStatus:
        """Put the stable prefix (system prompt + fixed start of the user turn) into vLLM's cache."""
        messages = self.builder.warmup_messages()
        request = self.llm.chat_request(messages, max_tokens=1, temperature=0.0, prefix_key=prefix_key([]),
                                        stream=False)
        await self.llm.openai.chat.completions.create(**request)
        tokens = len(await self.llm.tokenize(messages))
        self.metrics.warmup_tokens.set(tokens)
        return WarmupStatus(done=True, tokens=tokens)


def prefix_key(chunks: list[ContextChunk]) -> str:
    """Routing key for prefix affinity: requests that share a context set share a key (and a replica)."""
    return hashlib.sha256("\x1f".join(c.id for c in chunks).encode()).hexdigest()[:16]


def ms(seconds: float) -> float:
    return round(seconds * 1000, 2)
