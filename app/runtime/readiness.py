"""What ``/readyz`` says and ``/metrics`` publishes: can the service answer now (vLLM reachable, the collection
readable), with pre-warm's progress and the load beside it, reported and never waited for."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from app.runtime.traffic import TrafficStatus
from app.runtime.upstream import UpstreamStatus
from app.runtime.warmup import WarmupProgress


@dataclass(frozen=True)
class Readiness:
    upstream: UpstreamStatus
    collection_problem: str | None  # None: the collection is there and readable
    warmup: WarmupProgress
    traffic: TrafficStatus

    @property
    def ready(self) -> bool:
        return self.upstream.ready and not self.collection_problem

    @property
    def reason(self) -> str:
        return self.collection_problem or self.upstream.reason

    def to_json(self) -> dict[str, Any]:
        upstream = self.upstream
        body = {"ready": self.ready, "reason": self.reason, "vllm_url": upstream.vllm_url,
                "vllm": asdict(upstream.vllm) if upstream.vllm else None}
        if upstream.router is not None:  # behind vllm-router: how many replicas it can route to
            body["router"] = asdict(upstream.router)
        return body | {"warmup": asdict(self.warmup), "traffic": asdict(self.traffic)}


def publish(registry: CollectorRegistry, readiness: Callable[[], Readiness]) -> None:
    """Publish, at every scrape, the state the service keeps anyway (``Service.readiness``)."""
    registry.register(_StateCollector(readiness))


class _StateCollector:
    """Readiness, pre-warm progress and admission, read at scrape time (no second copy to keep in step)."""

    def __init__(self, readiness: Callable[[], Readiness]) -> None:
        self.readiness = readiness

    def collect(self) -> Iterator[Metric]:
        state = self.readiness()
        warmup, traffic = state.warmup, state.traffic
        yield GaugeMetricFamily("prefixrag_ready", "1 when the service can answer (vLLM up, collection readable).",
                                value=int(state.ready))
        units = GaugeMetricFamily("prefixrag_warmup_units", "Pre-warm units planned, warmed, and of those warmed "
                                  "kept (unchanged since an earlier pre-warm, not sent again).", labels=["kind"])
        units.add_metric(["planned"], warmup.units_planned)
        units.add_metric(["warmed"], warmup.units_warmed)
        units.add_metric(["kept"], warmup.units_kept)
        yield units
        yield GaugeMetricFamily("prefixrag_warmup_tokens", "Prompt tokens the current pre-warm has sent or kept.",
                                value=warmup.tokens)
        yield GaugeMetricFamily("prefixrag_warmup_done", "1 once the current pre-warm has finished.",
                                value=int(warmup.done))
        yield GaugeMetricFamily("prefixrag_requests_present", "User requests admitted (in flight or queued).",
                                value=traffic.present)
        yield GaugeMetricFamily("prefixrag_admission_limit", "User requests admission lets in flight at once now "
                                "(max_in_flight; with auto, where vLLM's queue has moved it).",
                                value=traffic.max_in_flight)
        yield CounterMetricFamily("prefixrag_requests_refused", "Requests refused with 429 (at capacity).",
                                  value=traffic.refused)
        yield CounterMetricFamily("prefixrag_warmup_yields", "Pre-warm requests aborted to let a user go first.",
                                  value=traffic.warmup_yields)
