"""The end of a stop's drain time: requests still running then end with ``ShuttingDown`` at that moment, also
those waiting on vLLM (a queued prefill, a slow decode step), whose next event may come only after uvicorn has cut
their connection (no terminal event, a traceback in the log)."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TypeVar

from app.core.errors import ShuttingDown

Event = TypeVar("Event")


class Cutoff:
    """Armed once, from the signal handler; at the deadline every request waiting is cancelled in the task that
    waits, which turns the cancel into ``ShuttingDown`` (its client gets a terminal event; closing the request's
    events aborts its vLLM request)."""

    def __init__(self) -> None:
        self._at: float | None = None  # when requests still running are ended (monotonic s)
        self._loop: asyncio.AbstractEventLoop | None = None  # the serving loop, known from the first request
        self._waiting: dict[object, asyncio.Task[object]] = {}  # a request's key -> the task awaiting its next event

    def arm(self, seconds: float) -> None:
        """The process is stopping: end what still runs after ``seconds``. Safe to call from a signal handler."""
        if self._at is not None:
            return
        self._at = time.monotonic() + seconds
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.call_later, seconds, self._cut)

    def over(self) -> bool:
        """Is the drain time over?"""
        return self._at is not None and time.monotonic() >= self._at

    async def guard(self, events: AsyncIterator[Event]) -> AsyncGenerator[Event, None]:
        """``events`` until they end or the drain time is over, whichever is first."""
        self._loop = self._loop or asyncio.get_running_loop()
        key = object()
        while not self.over() and (task := asyncio.current_task()) is not None:
            self._waiting[key] = task  # the task consuming now: it may change between events
            try:
                event = await anext(events)
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if not self.over():  # the client's own hang-up, not the deadline's cut
                    raise
                task.uncancel()
                break
            finally:
                self._waiting.pop(key, None)
            yield event
        raise ShuttingDown("the service is shutting down; retry shortly")

    def _cut(self) -> None:
        for task in list(self._waiting.values()):
            task.cancel()
