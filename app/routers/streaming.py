"""A request's life against its client. Streams start only once their first event exists, so a failure before
the first byte (vLLM down, the collection missing, a prompt vLLM refuses, 429) becomes the response's status
code, as on the non-streamed path, and not an error event inside a 200. A non-streamed request is cancelled
when its client goes away (Starlette already stops a stream then), which closes its vLLM request: vLLM aborts
it instead of decoding for nobody."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from starlette.requests import Request

from app.errors import ClientGone

T = TypeVar("T")
log = logging.getLogger("prefixrag.http")


async def unless_client_leaves(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise ``ClientGone``."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()  # unwinds the pipeline: its slot is freed, its vLLM stream closed
            with contextlib.suppress(asyncio.CancelledError):
                await task
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


async def _empty() -> AsyncIterator:
    return
    yield  # an async generator that yields nothing
