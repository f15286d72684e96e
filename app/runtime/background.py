"""Background work (pre-warm) beside live traffic: it never delays a user, and still gets done under steady load.

A background request starts while no user request is present and is aborted (and later re-sent) the moment one
arrives, because vLLM's scheduler never preempts a running chunked prefill for a newly arrived request, whatever
its priority. Under steady traffic no moment is free of users, so that alone would never warm anything (after an
ingest, every user would then pay a cold prefill). So a bounded share, ``beside_users`` requests at once, also
runs while users are present, as long as vLLM's last reading of its queue (``LiveTraffic.engine_queue``) showed
nothing waiting: the engine has room, the request is small (pre-warm sends pieces) and of a lower vLLM priority,
and it is aborted as soon as a reading shows requests waiting. Blocks computed before an abort stay in vLLM's
prefix cache, so a re-sent request mostly hits.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

from app.rag.index import BACKGROUND
from app.runtime.traffic import LiveTraffic, unless

T = TypeVar("T")


class Background:
    """One per admission: every collection's pre-warm shares it, so the bounds hold for all of them together."""

    def __init__(self, traffic: LiveTraffic, beside_users: int = 0, concurrency: int = 1) -> None:
        """``beside_users``: background requests that may run at once while users are present (0: none);
        ``concurrency``: background requests in flight at most, users present or not."""
        self.traffic, self.beside_users = traffic, beside_users
        self.beside = 0  # background requests running while users are present
        self._slots = asyncio.Semaphore(concurrency)

    @contextlib.contextmanager
    def reads(self) -> Iterator[None]:
        """Mark the work run inside as background: its store reads wait for their turn (``_turn``)."""
        token = BACKGROUND.set(self._turn)
        try:
            yield
        finally:
            BACKGROUND.reset(token)

    async def yielding(self, work: Callable[[], Awaitable[T]]) -> T:
        """Run ``work`` (a background request) in its turn; abort it when a user arrives (beside users: when vLLM
        queues) and run it again in its next turn."""
        traffic = self.traffic
        while True:
            async with self._slots:
                beside = await self._turn()
                self.beside += beside
                try:  # cancelling ``work`` closes its HTTP request
                    finished, result = await unless(work(), (traffic.congested if beside else traffic.busy).wait())
                finally:
                    self.beside -= beside
            if finished:
                return result  # type: ignore[return-value]  # finished: work's own result
            traffic.yields += 1

    async def _turn(self) -> bool:
        """Wait until background work may run: no user present (False), or beside them (True)."""
        traffic = self.traffic
        while not traffic.idle.is_set():
            if self.beside < self.beside_users and traffic.engine_has_room():
                return True
            waits = {asyncio.ensure_future(traffic.idle.wait()), asyncio.ensure_future(traffic.changed.wait())}
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for wait in waits:
                    wait.cancel()
        return False
