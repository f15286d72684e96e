"""A request's life against its client. Streams start only once their first event exists, so a failure before
the first byte (vLLM down, the collection missing, a prompt vLLM refuses, 429) becomes the response's status
code, as on the non-streamed path, and not an error event inside a 200. A non-streamed request is cancelled
when its client goes away (Starlette already stops a stream then), which closes its vLLM request: vLLM aborts
it instead of decoding for nobody."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi.sse import EventSourceResponse, format_sse_event
from starlette.requests import Request

from app.core.errors import ClientGone
from app.runtime.traffic import unless

T = TypeVar("T")
log = logging.getLogger("prefixrag.http")


async def unless_client_leaves(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise ``ClientGone``."""
    # A cancelled pipeline unwinds: its slot is freed, its vLLM stream closed.
    finished, result = await unless(work, _disconnected(request))
    if finished:
        return result  # type: ignore[return-value]  # finished: work's own result
    log.info("client left %s before its answer: request cancelled, vLLM's aborted", request.url.path)
    raise ClientGone("the client disconnected")


async def _disconnected(request: Request) -> None:
    # The body has been read: the next ASGI message is the disconnect (or never comes).
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def started(events: AsyncIterator[T]) -> AsyncIterator[T]:
    """Await the first event here (errors propagate to the caller); return a stream that replays it."""
    iterator = aiter(events)
    try:
        first = await anext(iterator)
    except StopAsyncIteration:
        return _empty()

    async def replayed() -> AsyncIterator[T]:
        yield first
        async for event in iterator:
            yield event

    return replayed()


async def _empty() -> AsyncIterator[Any]:
    return
    yield  # an async generator that yields nothing


def sse(data: str, event: str | None = None) -> bytes:
    """One Server-Sent Event, framed by FastAPI's encoder (``data`` is already serialised: JSON or ``[DONE]``)."""
    return format_sse_event(data_str=data, event=event)


def event_stream(frames: AsyncIterator[bytes]) -> EventSourceResponse:
    # No caching, and no buffering by a reverse proxy (nginx): each token reaches the client as it is made.
    return EventSourceResponse(frames, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
