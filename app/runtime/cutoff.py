"""The end of a stop's drain time: requests still running then end with ``ShuttingDown`` at that moment, also
those waiting on vLLM (a queued prefill, a slow decode step), whose next event may come only after the server has
cut their connection (no terminal event, a traceback in the log)."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import TypeVar

from app.core.errors import ShuttingDown

Event = TypeVar("Event")


class Cutoff:
    """Armed once, from the signal handler; ``cut`` (the server's shutdown calls it when the drain time is over)
    cancels every request waiting in the task that waits, which turns the cancel into ``ShuttingDown`` (its client
    gets a terminal event; closing the request's events aborts its vLLM request)."""

    def __init__(self) -> None:
        self._at: float | None = None  # when requests still running are ended (monotonic s)
        self._waiting: dict[object, asyncio.Task[object]] = {}  # a request's key -> the task awaiting its next event
        self._on_cut: list[Callable[[], None]] = []

    def arm(self, seconds: float) -> None:
        """The process is stopping: what still runs after ``seconds`` ends. Safe to call from a signal handler."""
        if self._at is None:
            self._at = time.monotonic() + seconds

    def on_cut(self, callback: Callable[[], None]) -> None:
        """``callback()`` when the drain time is over: ends what waits elsewhere (a request queued for admission)."""
        self._on_cut.append(callback)

    def over(self) -> bool:
        """Is the drain time over?"""
        return self._at is not None and time.monotonic() >= self._at

    def seconds_left(self) -> float:
        """Until the drain time is over (0 once it is; infinite while not stopping)."""
        return float("inf") if self._at is None else max(0.0, self._at - time.monotonic())

    def cut(self) -> None:
        """The drain time is over, from now (a loop's timer may fire a little ahead: uvloop rounds to 1 ms): end
        every request waiting for its next event."""
        self._at = time.monotonic() if self._at is None else min(self._at, time.monotonic())
        for task in list(self._waiting.values()):
            task.cancel()
        for callback in self._on_cut:
            callback()

    async def guard(self, events: AsyncIterator[Event]) -> AsyncGenerator[Event, None]:
        """``events`` until they end or the drain time is over, whichever is first."""
        key = object()
        while not self.over() and (task := asyncio.current_task()) is not None:
            self._waiting[key] = task  # the task consuming now: it may change between events
            try:
                event = await anext(events)
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if not self.over():  # the client's own hang-up, not the cut
                    raise
                task.uncancel()
                break
            finally:
                self._waiting.pop(key, None)
            yield event
        raise ShuttingDown("the service is shutting down; retry shortly")
