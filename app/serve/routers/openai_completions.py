"""OpenAI-compatible ``/v1/completions`` (JSON or SSE): the prompt is the question, answered by the pipeline that
answers a chat's single turn (clients such as LlamaIndex's ``OpenAILike`` call this route by default)."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from app.core.errors import ServiceError
from app.rag.conversation import Turn
from app.rag.pipeline import Answer
from app.rag.requests import ChatQuery
from app.serve.deps import Authorized, SettingsDep, TenantDep
from app.serve.http_errors import reported
from app.serve.protocol import INTERNAL_ERROR, TextChoice, TextCompletion, TextCompletionRequest, sources_of
from app.serve.routers.openai_chat import ERRORS, sampling_of, served_model, sources_text, usage_of
from app.serve.routers.streaming import event_stream, sse, started, unless_client_leaves
from app.vllm.wire import Delta

log = logging.getLogger("prefixrag.completions")
router = APIRouter(prefix="/v1", tags=["openai"], dependencies=[Authorized])


@router.post("/completions", response_model=TextCompletion, response_model_exclude_none=True, responses=ERRORS)
async def completions(body: TextCompletionRequest, request: Request, settings: SettingsDep,
                      tenant: TenantDep) -> Any:
    model, service = served_model(body, request, settings, tenant)
    query = ChatQuery(turns=[Turn("user", body.question())], max_tokens=body.max_tokens, sampling=sampling_of(body),
                      cache_salt=tenant.cache_salt, route_hint=body.prompt_cache_key)
    ident, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
    append = settings.service.append_sources
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = await started(service.chat_stream(query))  # failures before the first token keep their status
        return event_stream(_sse(events, TextCompletion(id=ident, created=created, model=model, choices=[]),
                                 include_usage, append))
    answer = await unless_client_leaves(request, service.chat(query))
    text = answer.text + (sources_text(answer) if append else "")
    return TextCompletion(id=ident, created=created, model=model, usage=usage_of(answer),
                          sources=sources_of(answer.sources, answer.cited),
                          choices=[TextChoice(text=text, finish_reason=answer.completion.finish_reason or "stop")])


async def _sse(events: AsyncIterator[Delta | Answer], head: TextCompletion, include_usage: bool,
               append_sources: bool) -> AsyncIterator[bytes]:
    def chunk(**fields: Any) -> bytes:
        return sse(head.model_copy(update=fields).model_dump_json(exclude_none=True))

    try:
        async for event in events:
            if isinstance(event, Delta):
                yield chunk(choices=[TextChoice(text=event.text)])
                continue
            if append_sources and event.sources:
                yield chunk(choices=[TextChoice(text=sources_text(event))])
            yield chunk(choices=[TextChoice(text="", finish_reason=event.completion.finish_reason or "stop")],
                        sources=sources_of(event.sources, event.cited))
            if include_usage:
                yield chunk(choices=[], usage=usage_of(event))
    except ServiceError as exc:
        yield sse(json.dumps(reported(exc)))  # the openai client raises APIError on an "error" event
    except Exception:  # the stream has begun: whatever failed, the client is told, never just cut off
        log.exception("unhandled error in a completion stream")
        yield sse(json.dumps(INTERNAL_ERROR))
    yield sse("[DONE]")
