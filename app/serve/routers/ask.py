"""POST /ask: translate HTTP <-> the RAG service; JSON or Server-Sent Events."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import APIRouter, Request

from app.core.errors import ServiceError
from app.rag.pipeline import Answer
from app.rag.requests import Query
from app.serve.deps import Authorized, MetricsDep, TenantDep, collection_for
from app.serve.http_errors import reported
from app.serve.protocol import (
    INTERNAL_ERROR,
    STREAMED_200,
    AskRequest,
    AskResponse,
    AskUsage,
    ErrorResponse,
    Timings,
    sources_of,
)
from app.serve.routers.streaming import event_stream, sse, started, unless_client_leaves
from app.vllm.wire import Delta

log = logging.getLogger("prefixrag.ask")
router = APIRouter(tags=["ask"], dependencies=[Authorized])
ERRORS: dict[int | str, dict[str, Any]] = STREAMED_200 | {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 503, 504)}


@router.post("/ask", response_model=AskResponse, responses=ERRORS)
async def ask(body: AskRequest, request: Request, metrics: MetricsDep, tenant: TenantDep) -> Any:
    service = collection_for(request, tenant, body.collection).service
    query = Query(question=body.question, top_k=body.top_k, max_tokens=body.max_tokens,
                  source_prefix=body.filters.source_prefix if body.filters else None, cache_salt=tenant.cache_salt)
    if body.stream:
        events = await started(service.answer_stream(query))  # failures before the first token keep their status
        return event_stream(_sse(events))
    with metrics.latency.labels("ask").time():
        answer = await unless_client_leaves(request, service.answer(query))
    metrics.requests.labels("ask", "200").inc()
    return to_response(answer)


def to_response(answer: Answer) -> AskResponse:
    return AskResponse(
        answer=answer.text,
        sources=sources_of(answer.sources, answer.cited),
        usage=AskUsage(prompt_tokens=answer.completion.prompt_tokens,
                       completion_tokens=answer.completion.completion_tokens,
                       cached_tokens=answer.completion.cached_tokens),
        timings_ms=Timings.model_validate(answer.timings_ms, from_attributes=True), strategy=answer.strategy,
        finish_reason=answer.completion.finish_reason,
    )


async def _sse(events: AsyncIterator[Delta | Answer]) -> AsyncIterator[bytes]:
    """``event: delta`` {"text"} per token batch, then ``event: done`` with the full response, or ``event: error``."""
    try:
        async for event in events:
            if isinstance(event, Delta):
                yield sse(orjson.dumps({"text": event.text}).decode(), "delta")
            else:
                yield sse(to_response(event).model_dump_json(), "done")
    except ServiceError as exc:
        yield sse(json.dumps(reported(exc)), "error")
    except Exception:  # the stream has begun: whatever failed, the client is told, never just cut off
        log.exception("unhandled error in an /ask stream")
        yield sse(json.dumps(INTERNAL_ERROR), "error")
