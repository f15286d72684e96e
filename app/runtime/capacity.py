"""``max_in_flight=auto``: admission follows what vLLM can serve. While user requests are present, vLLM's own
queue (``vllm:num_requests_waiting``, summed over the servers behind the URL) and its KV cache in use (the
fullest server's ``vllm:kv_cache_usage_perc``) are read every ``load_interval_s`` and handed to admission
(``LiveTraffic.engine_queue``): an empty queue lets the limit grow as far as the free cache holds, requests
waiting in vLLM bring it down to what vLLM runs. A request waiting beyond the limit asks for a reading at once
(at most ten per interval), so a burst does not wait out the interval at each step of the limit's growth. Idle,
nothing is read."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from app.core.errors import ServiceError
from app.runtime.traffic import LiveTraffic
from app.runtime.upstream import Upstream
from app.vllm.prometheus import metric_max, metric_total

log = logging.getLogger("prefixrag.capacity")
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"


class EngineQueue:
    def __init__(self, traffic: LiveTraffic, upstream: Upstream, interval_s: float) -> None:
        self.traffic, self.upstream, self.interval_s = traffic, upstream, interval_s

    async def run_forever(self) -> None:
        wanted = self.traffic.reading_wanted
        while True:
            await self.traffic.busy.wait()
            wanted.clear()  # this reading answers whoever asked before it
            try:
                texts = await self.upstream.metrics_texts()
            except ServiceError as exc:  # vLLM away: the monitor marks it down; admission keeps its limit
                log.debug("vLLM's queue not read: %s", exc.message)
            else:
                before = self.traffic.max_in_flight
                usage = [found for text in texts.values() if (found := metric_max(text, KV_USAGE)) is not None]
                self.traffic.engine_queue(sum(metric_total(text, WAITING) for text in texts.values()),
                                          max(usage, default=None))
                if self.traffic.max_in_flight < before:
                    log.info("vLLM queues requests: admission limit %d -> %d", before, self.traffic.max_in_flight)
            await asyncio.sleep(self.interval_s / 10)
            with contextlib.suppress(TimeoutError):  # the interval's end, or a request waiting beyond the limit
                await asyncio.wait_for(wanted.wait(), self.interval_s * 0.9)
