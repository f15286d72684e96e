"""Streams start only once their first event exists, so a failure before the first byte (vLLM down, the
collection missing, a prompt vLLM refuses) becomes the response's status code (503, 504, 400), as on the
non-streamed path, and not an error event inside a 200."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")


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
