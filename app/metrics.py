"""Prometheus metrics of the service (own registry per app, so tests can build many apps)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:  # the service imports these metrics; its readiness is only read here
    from app.rag.readiness import Readiness

_LATENCY_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)


class ServiceMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("prefixrag_requests_total", "Requests by endpoint and status.",
                                ["endpoint", "status"], registry=r)
        self.latency = Histogram("prefixrag_request_seconds", "End-to-end answer latency.", ["endpoint"],
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("prefixrag_ttft_seconds", "Request received -> first answer token.", ["strategy"],
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("prefixrag_prompt_tokens_total", "Prompt tokens sent to vLLM.",
                                     ["strategy"], registry=r)
        self.cached_tokens = Counter("prefixrag_cached_tokens_total", "Prompt tokens vLLM served from cache.",
                                     ["strategy"], registry=r)
        self.hit_rate = Gauge("prefixrag_prefix_cache_hit_rate", "cached_tokens / prompt_tokens since start.",
                              ["strategy"], registry=r)
        self.prompts_sent = Counter("prefixrag_prompts_total", "Prompts sent to vLLM, by form: token_ids (the head "
                                    "tokenized here, app.prompt_ids) or chat (vLLM tokenizes all of it).",
                                    ["form"], registry=r)
        self.collection_reloads = Counter("prefixrag_collection_reloads_total",
                                          "Times an ingest changed the collection and the service reloaded it.",
                                          registry=r)
        self._totals: dict[str, list[int]] = {}

    def watch(self, readiness: Callable[[], Readiness]) -> None:
        """Publish, at every scrape, the state the service keeps anyway (``RAGService.readiness``)."""
        self.registry.register(_StateCollector(readiness))

    def observe_answer(self, strategy: str, prompt_tokens: int, cached_tokens: int, ttft_s: float | None) -> None:
        self.prompt_tokens.labels(strategy).inc(prompt_tokens)
        self.cached_tokens.labels(strategy).inc(cached_tokens)
        totals = self._totals.setdefault(strategy, [0, 0])
        totals[0] += prompt_tokens
        totals[1] += cached_tokens
        self.hit_rate.labels(strategy).set(totals[1] / totals[0] if totals[0] else 0.0)
        if ttft_s is not None:
            self.ttft.labels(strategy).observe(ttft_s)


class _StateCollector:
    """Readiness, pre-warm progress and admission, read at scrape time (no second copy to keep in step)."""

    def __init__(self, readiness: Callable[[], Readiness]) -> None:
        self.readiness = readiness

    def collect(self) -> Iterator[Metric]:
        state = self.readiness()
        warmup, traffic = state.warmup, state.traffic
        yield GaugeMetricFamily("prefixrag_ready", "1 when the service can answer (vLLM up, collection readable).",
                                value=int(state.ready))
        units = GaugeMetricFamily("prefixrag_warmup_units", "Pre-warm units planned and warmed.", labels=["kind"])
        units.add_metric(["planned"], warmup.units_planned)
        units.add_metric(["warmed"], warmup.units_warmed)
        yield units
        yield GaugeMetricFamily("prefixrag_warmup_tokens", "Prompt tokens the current pre-warm has sent.",
                                value=warmup.tokens)
        yield GaugeMetricFamily("prefixrag_warmup_done", "1 once the current pre-warm has finished.",
                                value=int(warmup.done))
        yield GaugeMetricFamily("prefixrag_requests_present", "User requests admitted (in flight or queued).",
                                value=traffic.present)
        yield CounterMetricFamily("prefixrag_requests_refused", "Requests refused with 429 (at capacity).",
                                  value=traffic.refused)
        yield CounterMetricFamily("prefixrag_warmup_yields", "Pre-warm requests aborted to let a user go first.",
                                  value=traffic.warmup_yields)
