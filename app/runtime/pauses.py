"""Short pauses for the event loop: Python's cyclic garbage collector stops the whole process while it scans.

After start-up the process holds ~0.5M tracked objects that live as long as it does (torch, transformers,
Chroma, the encoder); a full collection scans them all (288 ms beside the Python docs' service graph, 19 ms once
they were frozen: ``bench/results/gc-pause.json``), and every request waits while one runs. ``freeze_start_up``
moves them out of the collector's sight once, before the first request (still freed by reference counting if
ever dropped); ``GCPauses`` publishes every collection's pause, and ``LoopLag`` how late the loop itself runs, so
a request's wait for the loop shows in ``/metrics`` apart from the machine's own load.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import gc
import logging
import time
from typing import Any

from prometheus_client import CollectorRegistry, Histogram

log = logging.getLogger("prefixrag.runtime")
_PAUSE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


@functools.cache  # once per process: a second app in it (the tests) finds its start-up objects frozen already
def freeze_start_up() -> None:
    """Collect once (start-up garbage must not be frozen), then freeze everything alive. Whether anything was
    frozen before is no sign that this ran: the GPU machine's Python starts with 375 objects frozen, the app took
    them for its own freeze and skipped it, and its full collections took ~360 ms."""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    # Thawed at exit, so the interpreter's last collection still sees them (native extensions report objects
    # left alive then as leaks).
    atexit.register(gc.unfreeze)
    log.info("start-up objects frozen out of the cyclic GC: %d (%.0f ms)", gc.get_freeze_count(),
             (time.perf_counter() - started) * 1000)


@functools.cache  # once per kind: a load repeated (vLLM back with another model) is not frozen again
def freeze_late_load(what: str) -> None:
    """Freeze what a load after start-up left alive: the served model's tokenizer is loaded when vLLM is first
    seen, and with it transformers' modules (in a serving process whose encoder lives in ranking workers, their
    first import), all scanned by every full collection from then on. The young generations are collected first;
    what garbage older ones hold is frozen with it, once."""
    started, before = time.perf_counter(), gc.get_freeze_count()
    gc.collect(1)
    gc.freeze()
    log.info("%s: %d more objects frozen out of the cyclic GC (%.0f ms)", what, gc.get_freeze_count() - before,
             (time.perf_counter() - started) * 1000)


class GCPauses:
    """``prefixrag_gc_pause_seconds{generation}``: how long each collection stopped the process."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.pauses = Histogram("prefixrag_gc_pause_seconds", "Cyclic garbage collections: how long each stopped "
                                "the process.", ["generation"], buckets=_PAUSE_BUCKETS, registry=registry)
        self._started = 0.0

    def start(self) -> None:
        gc.callbacks.append(self._observe)

    def stop(self) -> None:
        gc.callbacks.remove(self._observe)

    def _observe(self, phase: str, info: dict[str, Any]) -> None:
        # Called by the collector in whichever thread triggered it; the histogram is thread-safe.
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.pauses.labels(str(info["generation"])).observe(time.perf_counter() - self._started)


class LoopLag:
    """``prefixrag_event_loop_lag_seconds``: how much later than asked the loop resumes a task that sleeps
    ``interval`` -- what any request (``/healthz`` too) would have waited for the loop at that moment."""

    def __init__(self, registry: CollectorRegistry, interval_s: float = 0.1) -> None:
        self.interval_s = interval_s
        self.lag = Histogram("prefixrag_event_loop_lag_seconds", "How late the event loop resumed a sleeping task.",
                             buckets=_PAUSE_BUCKETS, registry=registry)

    async def run_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            asleep = loop.time()
            await asyncio.sleep(self.interval_s)
            self.lag.observe(max(0.0, loop.time() - asleep - self.interval_s))
