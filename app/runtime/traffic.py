"""Live traffic first: admission control for user requests, and background work that gives way to them.

Users hold *slots* (at most ``max_in_flight`` requests in the pipeline at once, ``max_queued`` more waiting
for one); beyond that a request is refused at once with 429 + Retry-After rather than answered late: vLLM
itself would queue without bound. Background requests (pre-warm) run through ``yielding``: they start only
while no user request is present and are aborted (and later re-sent) the moment one arrives, because vLLM's
scheduler never preempts a running chunked prefill for a newly arrived request, whatever its priority.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from app.core.errors import Overloaded
from app.rag.index import BACKGROUND

T = TypeVar("T")
MAX_RETRY_AFTER_S = 60


@dataclass(frozen=True)
class TrafficStatus:
    """The load as ``/readyz`` reports it."""

    present: int  # user requests admitted: in flight or queued
    max_in_flight: int
    max_queued: int
    refused: int  # answered 429 since start
    warmup_yields: int  # background requests aborted for a user since start


class LiveTraffic:
    def __init__(self, max_in_flight: int, max_queued: int) -> None:
        self.max_in_flight, self.max_queued = max_in_flight, max_queued
        self._slots = asyncio.Semaphore(max_in_flight)
        self.present = 0  # user requests admitted: in flight or queued
        self.refused = 0
        self.yields = 0  # background requests aborted for a user
        self.service_s = 1.0  # moving average of how long a request holds its slot (for Retry-After)
        self._idle, self._busy = asyncio.Event(), asyncio.Event()
        self._idle.set()

    @property
    def queued(self) -> int:
        return max(0, self.present - self.max_in_flight)

    def status(self) -> TrafficStatus:
        return TrafficStatus(self.present, self.max_in_flight, self.max_queued, self.refused, self.yields)

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one user slot for the body's duration; raise ``Overloaded`` at once when none is left."""
        if self.present >= self.max_in_flight + self.max_queued:
            self.refused += 1
            raise Overloaded(f"the service is at capacity ({self.max_in_flight} requests in flight, "
                             f"{self.max_queued} queued); retry later", retry_after_s=self.retry_after_s())
        self._arrive()
        try:
            async with self._slots:
                started = time.monotonic()
                try:
                    yield
                finally:
                    self.service_s = 0.8 * self.service_s + 0.2 * (time.monotonic() - started)
        finally:
            self._leave()

    def retry_after_s(self) -> int:
        """Seconds until a place is likely free: the queue ahead, drained ``max_in_flight`` at a time."""
        waves = (self.queued + 1) / self.max_in_flight
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(waves * self.service_s)))

    @contextlib.contextmanager
    def background(self) -> Iterator[None]:
        """Mark the work run inside as background: its store reads wait until no user request is present."""
        token = BACKGROUND.set(self._idle.wait)
        try:
            yield
        finally:
            BACKGROUND.reset(token)

    async def yielding(self, work: Callable[[], Awaitable[T]]) -> T:
        """Run ``work`` (a background request) while no user request is present; abort it when one arrives
        and run it again once they are all gone. Blocks computed before an abort stay in vLLM's prefix cache,
        so a re-run mostly hits."""
        while True:
            await self._idle.wait()
            finished, result = await unless(work(), self._busy.wait())  # cancelling closes its HTTP request
            if finished:
                return result  # type: ignore[return-value]  # finished: work's own result
            self.yields += 1

    def _arrive(self) -> None:
        self.present += 1
        self._idle.clear()
        self._busy.set()

    def _leave(self) -> None:
        self.present -= 1
        if self.present == 0:
            self._busy.clear()
            self._idle.set()


async def unless(work: Awaitable[T], interrupt: Awaitable[object]) -> tuple[bool, T | None]:
    """Await ``work`` unless ``interrupt`` completes first; then ``work`` is cancelled and unwound before this
    returns. (True, its result) or (False, None)."""
    task, stop = asyncio.ensure_future(work), asyncio.ensure_future(interrupt)
    try:
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        return (True, task.result()) if task.done() else (False, None)
    finally:
        stop.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
