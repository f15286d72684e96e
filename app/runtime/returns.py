"""Clients that come back when told. A 429's ``Retry-After`` is a promise to the connection it was sent on: a request
on that connection after the promised time is a client that obeyed, and it may wait (briefly) for the next place
freed instead of being refused again; one that comes back early, as a retry storm does, is refused at once and its
promise is forfeit until it is next admitted: a storm's client asks again at once after each 429, and when its own
loop or the network lags past a short ``Retry-After`` (1 s, often) a retry lands after the promised time without
having waited as told. Without this, a place freed goes to whichever request comes first, and clients that never
wait always come first.

The connection (client address and port, set by the request edge) is the only identity a refusal can be tied to
without one from the client; through a proxy that pools connections a return may be credited to another of its
users, who then only waits for a place rather than being refused."""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from contextvars import ContextVar

CLIENT: ContextVar[str | None] = ContextVar("prefixrag_client", default=None)  # this request's connection
MIN_HOLD_S = 5.0  # a client that came back when told waits at least this long with no place freed before a 429
MAX_HOLD_S = 30.0  # ... and at most this long in all, however long requests hold their places
REMEMBERED = 10_000  # promises kept at most (the oldest forgotten first)
FORFEIT = math.inf  # the promise of a connection that came back early: never on time again until admitted


class Returns:
    def __init__(self) -> None:
        self._due: OrderedDict[str, float] = OrderedDict()  # connection -> when its retry is welcome (monotonic s)

    def promise(self, retry_after_s: float) -> None:
        """This request's connection was refused and told to come back in ``retry_after_s`` from now; one that
        came back before an earlier promise's time is told nothing it could keep (``FORFEIT``) until admitted."""
        key = CLIENT.get()
        if key is None:
            return
        now = time.monotonic()
        due = self._due.pop(key, None)
        self._due[key] = FORFEIT if due is not None and now < due else now + retry_after_s
        while len(self._due) > REMEMBERED:
            self._due.popitem(last=False)

    def kept(self) -> None:
        """This request's connection was admitted: whatever it was told before is settled. A client admitted
        after a refusal (a place freed as it asked) that asks again later is a new request, not one returning
        when told: with its old promise still due it would be let wait ahead of the clients that did wait."""
        key = CLIENT.get()
        if key is not None:
            self._due.pop(key, None)

    def on_time(self) -> bool:
        """Does this request come back on its connection no earlier than it was told?"""
        key = CLIENT.get()
        due = self._due.get(key) if key is not None else None
        return due is not None and time.monotonic() >= due

    @staticmethod
    def longest_hold_s() -> float:
        """The longest a request that came back on time waits for a place, however the queue moves."""
        return MAX_HOLD_S

    def hold_s(self, service_s: float) -> float:
        """How long this request may wait for a place with none freed, if it came back on time (its promise is
        then spent; else 0): about as long as a request holds its place (``service_s``, recently), bounded by
        ``MIN_HOLD_S`` and ``MAX_HOLD_S``. Answers that started together (a burst admitted at once, decoded in
        step) end together, so places can free in waves a service time apart: a shorter wait would end in the
        gap between two waves, and the client that obeyed would be refused again."""
        if not self.on_time():
            return 0.0
        key = CLIENT.get()
        assert key is not None
        self._due.pop(key)
        return min(MAX_HOLD_S, max(MIN_HOLD_S, service_s))
