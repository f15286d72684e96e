"""Live traffic first: admission control for user requests, and background work that gives way to them.

Users hold *slots* (at most ``max_in_flight`` requests in the pipeline at once, ``max_queued`` more waiting
for one); beyond that a request is refused at once with 429 + Retry-After rather than answered late: vLLM
itself would queue without bound. Background work (pre-warm) gives way to users through
``app.runtime.background``, from the state kept here: users present or not, vLLM's queue as last read.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TypeVar

from app.core.errors import Overloaded, ShuttingDown
from app.runtime.cutoff import Cutoff
from app.runtime.returns import Returns

T = TypeVar("T")
MAX_RETRY_AFTER_S = 60


@dataclass(frozen=True)
class TrafficStatus:
    """The load as ``/readyz`` reports it."""

    present: int  # user requests admitted: in flight or queued
    max_in_flight: int  # the limit now (with "auto": as vLLM's queue has moved it)
    max_queued: int
    refused: int  # answered 429 since start
    warmup_yields: int  # background requests aborted for a user since start
    auto: bool = False  # the limit follows vLLM's queue


@dataclass(frozen=True)
class AutoLimit:
    """``max_in_flight=auto``: the limit starts at ``low``, grows while vLLM runs every request it is sent (between
    two readings of its queue, by as many requests as the KV cache vLLM has free would hold, judged by what ours
    use now; at least doubling) and shrinks to what vLLM runs once it queues. Beyond the limit, while vLLM's last
    reading showed no queue, a request waits for the next reading (at most ``wait_s``) rather than be refused."""

    low: int
    high: int
    fresh_s: float  # a reading of vLLM's queue older than this says nothing about room now
    wait_s: float = 0.0  # how long a request beyond the limit may wait for a reading that shows room
    full_s: float = 0.0  # this long after vLLM last queued, the limit is what it can serve: beyond it, refuse at once


class LiveTraffic:
    def __init__(self, max_in_flight: int, max_queued: int, auto: AutoLimit | None = None) -> None:
        self.max_in_flight, self.max_queued, self.auto = max_in_flight, max_queued, auto
        self.running = 0  # admitted requests holding an in-flight place
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        self._returning: set[asyncio.Future[None]] = set()  # places of returning clients: the front of _waiting
        self.present = 0  # user requests admitted: in flight or queued
        self.refused = 0
        self.yields = 0  # background requests aborted for a user (``Background`` counts them)
        self.service_s = 1.0  # moving average of how long a request holds its slot (for Retry-After)
        self._first_place_at: float | None = None  # when the first request took a place (monotonic s)
        self._ended = 0  # requests that held a place and gave it back
        self._idle, self._busy = asyncio.Event(), asyncio.Event()
        self._idle.set()
        self._room_until = 0.0  # vLLM queued nothing at its last reading, which counts until then
        self._growth = 0  # places the limit may still grow by before vLLM's queue is read again
        self._queued_at = -math.inf  # when a reading last showed requests waiting in vLLM's queue (monotonic s)
        self._congested = asyncio.Event()  # set while vLLM's last reading showed requests waiting in its queue
        self._refused_at = -math.inf  # when a request was last refused (monotonic s)
        self.cutoff = Cutoff()  # stopping: when requests still running are ended
        self.cutoff.on_cut(self._end_waits)
        self.returns = Returns()  # refused connections, and when each was told to come back
        self._changed = asyncio.Event()  # set (and replaced) at each reading of vLLM's queue and each freed place
        self.reading_wanted = asyncio.Event()  # a request waits beyond the limit: read vLLM's queue now, not later

    @property
    def busy(self) -> asyncio.Event:
        """Set while any user request is present."""
        return self._busy

    @property
    def idle(self) -> asyncio.Event:
        """Set while no user request is present."""
        return self._idle

    @property
    def congested(self) -> asyncio.Event:
        """Set while vLLM's last reading of its queue showed requests waiting there."""
        return self._congested

    @property
    def changed(self) -> asyncio.Event:
        """Set (and replaced) at the next reading of vLLM's queue or the next place freed."""
        return self._changed

    @property
    def _queueing(self) -> bool:
        return self._congested.is_set()

    @property
    def queued(self) -> int:
        """Admitted requests waiting for a place (the limit may have come down below those running)."""
        return self.present - self.running

    def status(self) -> TrafficStatus:
        return TrafficStatus(self.present, self.max_in_flight, self.max_queued, self.refused, self.yields,
                             self.auto is not None)

    def engine_queue(self, waiting: float, kv_usage: float | None = None) -> None:
        """vLLM's own queue, read now (``max_in_flight=auto``), and the fraction of its KV cache in use: none
        waiting lets the limit grow until the next reading (``_room``); requests waiting there bring it down to
        those vLLM runs of ours."""
        if self.auto is None:
            return
        (self._congested.set if waiting > 0 else self._congested.clear)()
        if self._queueing:
            self._queued_at, self._room_until, self._growth = time.monotonic(), 0.0, 0
            self._set_limit(max(self.auto.low, min(self.max_in_flight, self.running - int(waiting))))
        else:
            self._room_until, self._growth = time.monotonic() + self.auto.fresh_s, self._room(kv_usage)
        self._signal()

    def _room(self, kv_usage: float | None) -> int:
        """Requests the limit may grow by: as many as vLLM's free KV cache holds, at what ours in flight use now
        (the cache is read, not guessed: shared prefixes cost nothing more); at least the limit itself."""
        if not kv_usage or self.running == 0:
            return self.max_in_flight
        return max(self.max_in_flight, int(self.running * (1.0 - kv_usage) / kv_usage))

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one user slot for the body's duration; raise ``Overloaded`` when none is left (at once, or with
        ``auto`` once a reading of vLLM's queue shows no room); a request that came back when its Retry-After
        said (``Returns``) waits for the next place freed instead, for a while."""
        admissible = await self._admissible()
        hold_s = 0.0 if admissible else self.returns.hold_s(self.service_time_s())  # came back when told: may wait
        if not admissible and not hold_s:
            raise self._refusal()
        if admissible:
            self.returns.kept()
        self._arrive()
        try:
            await self._take_place(hold_s)
            started = time.monotonic()
            if self._first_place_at is None:
                self._first_place_at = started
            try:
                yield
            finally:
                self.service_s = 0.8 * self.service_s + 0.2 * (time.monotonic() - started)
                self._ended += 1
                self._free_place()
        finally:
            self._leave()

    async def _admissible(self) -> bool:
        """Is there a place (or a queue place) now? With ``auto``, while vLLM queued nothing at its last reading,
        wait for the next reading or a freed place, at most ``wait_s``: a burst after a quiet spell finds the
        reading stale, and refusing it would send clients away for a whole second of Retry-After."""
        deadline = time.monotonic() + (self.auto.wait_s if self.auto is not None else 0.0)
        while self._beyond_places() and not self._grow():
            if self._full() or deadline - time.monotonic() <= 0:
                return False  # vLLM queues (or did just now), the limit cannot grow, or the wait is over
            self.reading_wanted.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), deadline - time.monotonic())
        return True

    def refuses_now(self) -> Overloaded | None:
        """For the request edge, before a body is read: the refusal of a request that would be refused at once
        now (counted), else None. Under a retry storm a refusal then costs no parsing, no routing and no
        validation, so it comes back at once and leaves the event loop to the requests admitted."""
        if not self._beyond_places() or self._can_grow() or not self._full() or self.returns.on_time():
            return None
        return self._refusal()

    def _beyond_places(self) -> bool:
        """Every place in flight and in the queue is taken."""
        return self.present >= self.max_in_flight + self.max_queued

    def _refusal(self) -> Overloaded:
        self.refused, self._refused_at = self.refused + 1, time.monotonic()
        retry_after = self.retry_after_s()
        self.returns.promise(retry_after)
        return Overloaded(f"the service is at capacity ({self.max_in_flight} requests in flight, "
                          f"{self.max_queued} queued); retry later", retry_after_s=retry_after)

    def _full(self) -> bool:
        """Beyond the limit nothing is worth waiting for: fixed limits; vLLM queueing, or having queued or a
        request having been refused within ``full_s`` (the load is sustained, not a burst after a quiet spell:
        it is refused at once, not after ``wait_s``); or the limit at its top."""
        auto = self.auto
        if auto is None or self._queueing or self.max_in_flight >= auto.high:
            return True
        return time.monotonic() - max(self._queued_at, self._refused_at) < auto.full_s

    def _signal(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _grow(self) -> bool:
        """With ``auto``: one more place, while vLLM's last reading showed room and this reading's growth lasts."""
        if not self._can_grow():
            return False
        self._growth -= 1
        self._set_limit(self.max_in_flight + 1)
        return True

    def _can_grow(self) -> bool:
        auto = self.auto
        return (auto is not None and self._growth > 0 and time.monotonic() <= self._room_until
                and self.max_in_flight < auto.high)

    def _set_limit(self, limit: int) -> None:
        self.max_in_flight = limit
        while self._waiting and self.running < self.max_in_flight:
            place = self._waiting.popleft()
            self._returning.discard(place)
            if place.done():  # its request was cancelled while it waited: the place goes to the next one
                continue
            self.running += 1
            place.set_result(None)

    async def _take_place(self, hold_s: float = 0.0) -> None:
        """A place now, or the next one freed; ``hold_s``: a request beyond the limit and the queue (it came back
        when told) is refused once this long passes with no place freed (``_while_places_free``)."""
        if self.running < self.max_in_flight and not self._waiting:
            self.running += 1
            return
        place = asyncio.get_running_loop().create_future()
        if hold_s:  # it waited once already: ahead of the queue, behind those that came back before it
            self._waiting.insert(len(self._returning), place)
            self._returning.add(place)
        else:
            self._waiting.append(place)
        try:
            if hold_s:
                await self._while_places_free(place, hold_s)
            else:
                await place
        except TimeoutError:
            if place.done():  # given a place just as the wait ended: keep it
                return
            self._waiting.remove(place)
            self._returning.discard(place)
            raise self._refusal() from None
        except asyncio.CancelledError:
            if place.done() and not place.cancelled():
                self._free_place()  # given a place just as it was cancelled: hand it on
            else:
                with contextlib.suppress(ValueError):  # already passed over by _set_limit
                    self._waiting.remove(place)
                self._returning.discard(place)
            raise

    async def _while_places_free(self, place: asyncio.Future[None], idle_s: float) -> None:
        """Wait for ``place`` while places keep being freed: ``TimeoutError`` after ``idle_s`` in which none was,
        or ``Returns.longest_hold_s()`` in all. When vLLM queues, the limit comes down at once to what it runs, and
        every request running beyond it ends before a place is given: a fixed wait ended during that drain, and
        the client that obeyed was refused again while the queue moved."""
        deadline = time.monotonic() + Returns.longest_hold_s()
        while True:
            ended, wait_s = self._ended, min(idle_s, deadline - time.monotonic())
            if wait_s <= 0:
                raise TimeoutError
            try:
                await asyncio.wait_for(asyncio.shield(place), wait_s)
                return
            except TimeoutError:
                if place.done() or self._ended == ended:  # no request gave its place back meanwhile
                    raise

    def _end_waits(self) -> None:
        """The drain time is over: a request still queued for a place gets ``ShuttingDown`` (a 503 its client can
        tell from a crash), not a cut connection when the server closes."""
        self._returning.clear()
        while self._waiting:
            place = self._waiting.popleft()
            if not place.done():
                place.set_exception(ShuttingDown("the service is shutting down; retry shortly"))

    def _free_place(self) -> None:
        self.running -= 1
        self._set_limit(self.max_in_flight)  # hands the place to the next waiting request
        self._signal()

    def retry_after_s(self) -> int:
        """Seconds until a place is likely free: the queue ahead, drained ``max_in_flight`` at a time."""
        waves = (self.queued + 1) / self.max_in_flight
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(waves * self.service_time_s())))

    def service_time_s(self) -> float:
        """How long a request holds its place: the recent average; until a first request has ended (a burst
        at start-up), at least as long as the first one has held its place so far, not the average's first guess:
        a storm's first wave of answers ends together, and a client told to come back after the guess would be
        refused again before any place freed."""
        if self._ended or self._first_place_at is None:
            return self.service_s
        return max(self.service_s, time.monotonic() - self._first_place_at)

    def engine_has_room(self) -> bool:
        """vLLM's last reading of its queue (``auto`` only), still fresh, showed no request waiting."""
        return not self._queueing and time.monotonic() <= self._room_until

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
