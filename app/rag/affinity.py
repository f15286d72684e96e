"""Which vLLM replica a request should reach: the one that already holds its prompt's prefix; and, for a unit so
hot that its replica would carry more than its share, more than one."""

from __future__ import annotations

import hashlib
import math

from app.rag.context import ContextChunk

SPREAD_AFTER = 100  # recent requests (decayed) seen before any unit is spread: a few requests show no pattern
KEPT_UNITS = 10_000  # units whose recent share is tracked; the least used are forgotten beyond it


def affinity_key(context: list[ContextChunk]) -> str:
    """Routing key for prefix affinity (vllm-router keys by it): the prompt's first stable unit -- the unit
    (document strategy) or first parent (corpus) its first chunk was placed in, else that chunk; with no
    context, the system prompt alone. Requests that can share a cached prefix go to the same replica, and so
    does the pre-warm of that unit."""
    first = (context[0].unit or context[0].id) if context else ""
    return hashlib.sha256(first.encode()).hexdigest()[:16]


class RouteKeys:
    """A request's routing key: its unit's ``affinity_key``, except for a hot unit behind a router with several
    replicas. A unit asked about in a share ``s`` of recent requests is given ``ceil(s * replicas * 2)`` keys
    (its own, then ``key.1``, ``key.2``...; at most one per replica) that its requests take in turn, so that no key
    carries more than half a replica's fair share, and the router can cache the unit on more than one replica
    instead of piling its traffic on one (``consistent_hash`` sends a new key to another replica with chance
    (n-1)/n; ``sticky_least_loaded`` to the least loaded one).
    Shares are counts decayed with a half-life of ``half_life`` requests."""

    def __init__(self, spreading: bool = True, half_life: int = 500) -> None:
        """``spreading`` False: every unit keeps its one key."""
        self.spreading, self.half_life = spreading, half_life
        self._counts: dict[str, float] = {}
        self._total = 0.0
        self._uses = 0
        self._turns: dict[str, int] = {}

    def key(self, context: list[ContextChunk], replicas: int, hint: str | None = None) -> str:
        """``hint``: the client's ``prompt_cache_key``, the key of a request without context (else unused)."""
        if hint and not context:
            return hashlib.sha256(f"client:{hint}".encode()).hexdigest()[:16]
        unit = affinity_key(context)
        weight = self._count(unit)
        copies = min(replicas, math.ceil(self._counts[unit] / self._total * replicas * 2))
        if not self.spreading or copies < 2 or self._total / weight < SPREAD_AFTER:
            return unit
        turn = self._turns[unit] = (self._turns.get(unit, -1) + 1) % copies
        return unit if turn == 0 else f"{unit}.{turn}"

    def _count(self, unit: str) -> float:
        """Count one request for ``unit``; returns this request's weight (each weighs 2^(1/half_life) more than
        the last, so earlier ones fade without touching every count)."""
        self._uses += 1
        weight: float = 2.0 ** (self._uses / self.half_life)
        if weight > 1e100:
            self._counts = {key: count / weight for key, count in self._counts.items()}
            self._total, self._uses, weight = self._total / weight, 0, 1.0
        self._counts[unit] = self._counts.get(unit, 0.0) + weight
        self._total += weight
        if len(self._counts) > KEPT_UNITS:
            kept = sorted(self._counts.items(), key=lambda item: -item[1])[:KEPT_UNITS // 2]
            self._counts = dict(kept)
            self._turns = {key: turn for key, turn in self._turns.items() if key in self._counts}
        return weight
