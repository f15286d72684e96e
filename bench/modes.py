"""How each benchmark mode turns a question into a streamed vLLM answer, timed the same way for all.

``naive`` is LangChain's RAG tutorial layout: instructions + retrieved chunks in relevance order joined by blank
lines in the system message, the question as the user message; ``naive-fill`` is the same layout with as many
chunks as a long window's budget holds. ``prefixrag`` modes go through the service's
own path (``Service.answer_stream``), in process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from app.core.pages import CHARS_PER_TOKEN
from app.rag.pipeline import Answer
from app.rag.requests import Query
from app.vllm.wire import Completion, Delta

# Verbatim from LangChain's RAG tutorial (the usual way RAG prompts are built).
NAIVE_SYSTEM = (
    "You are an assistant for question-answering tasks. Use the following pieces of retrieved context to answer "
    "the question. If you don't know the answer, say that you don't know. Use three sentences maximum and keep "
    "the answer concise.\n\n{context}"
)
FILL_K_MAX = 1000  # chunks ranked for naive-fill: more than any window this benchmark fills holds


@dataclass
class Record:
    question_id: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    overhead_s: float = 0.0  # request -> vLLM call (embed + retrieve + assemble)
    doc_ids: set[str] = field(default_factory=set)
    messages: list[dict] = field(default_factory=list)
    prefix_key: str = ""  # the routing key it was sent with (a replay through vllm-router sends it again)
    error: str | None = None


async def run_naive(question, k: int, retriever, llm, max_tokens: int) -> Record:
    started = time.perf_counter()
    ranked = await retriever.retrieve(question.text, k, mode="dense")  # naive RAG: embeddings only
    return await _naive_answer(question, ranked, llm, max_tokens, started)


async def run_naive_fill(question, budget_tokens: int, retriever, llm, max_tokens: int) -> Record:
    """Naive RAG given a long window: the dense ranking's chunks in relevance order, as many as fit
    ``budget_tokens`` (estimated at the service's characters per token), as long-context RAG code fills it."""
    started = time.perf_counter()
    ranked = await retriever.retrieve(question.text, FILL_K_MAX, mode="dense")
    chosen, used = [], 0.0
    for chunk in ranked:
        used += len(chunk.text) / CHARS_PER_TOKEN
        if used > budget_tokens:
            break
        chosen.append(chunk)
    return await _naive_answer(question, chosen, llm, max_tokens, started)


async def _naive_answer(question, ranked, llm, max_tokens: int, started: float) -> Record:
    context = "\n\n".join(chunk.text for chunk in ranked)
    messages = [{"role": "system", "content": NAIVE_SYSTEM.format(context=context)},
                {"role": "user", "content": question.text}]
    record = Record(question.id, doc_ids={c.doc_id for c in ranked}, messages=messages, prefix_key="naive")
    record.overhead_s = time.perf_counter() - started
    completion = Completion()
    request = llm.chat_request(messages, max_tokens=max_tokens, temperature=0.0, prefix_key=record.prefix_key)
    async for _ in llm.stream_chat(request, completion):
        record.ttft_s = record.ttft_s or time.perf_counter() - started
    return _finish(record, completion, started)


async def run_prefixrag(question, k: int, services, max_tokens: int) -> Record:
    started = time.perf_counter()
    record = Record(question.id)
    async for event in services.service.answer_stream(Query(question.text, top_k=k, max_tokens=max_tokens,
                                                   received_at=started)):
        if isinstance(event, Delta):
            record.ttft_s = record.ttft_s or time.perf_counter() - started
        elif isinstance(event, Answer):
            context = event.prompt.context
            record.doc_ids = {c.doc_id for c in context}  # recall: is the gold passage in the prompt?
            record.messages = event.prompt.messages
            record.prefix_key = event.prompt.affinity
            record.overhead_s = (event.timings_ms.retrieve + event.timings_ms.assemble) / 1000
            return _finish(record, event.completion, started)
    raise AssertionError("no answer")


def _finish(record: Record, completion: Completion, started: float) -> Record:
    record.e2e_s = time.perf_counter() - started
    record.ttft_s = record.ttft_s or record.e2e_s
    record.prompt_tokens, record.cached_tokens = completion.prompt_tokens, completion.cached_tokens
    return record
