"""Prometheus metrics of the service (own registry per app, so tests can build many apps)."""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)

_LATENCY_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)
_STAGE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5)


class ServiceMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        for standard in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):  # process_*, python_*: as usual
            r.register(standard)
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
                                    "tokenized here, app.vllm.prompt_ids) or chat (vLLM tokenizes all of it).",
                                    ["form"], registry=r)
        self.prompt_pieces = Counter("prefixrag_prompt_pieces_total", "Context pieces (units, chunks) in the tails "
                                     "of token-id prompts: reused (their ids kept, app.vllm.prompt_pieces) or "
                                     "tokenized (not known yet, or pieces off).", ["state"], registry=r)
        self.collection_reloads = Counter("prefixrag_collection_reloads_total",
                                          "Times an ingest changed the collection and the service reloaded it.",
                                          registry=r)
        self.admission_wait = Histogram("prefixrag_admission_wait_seconds", "Request received -> admitted: the "
                                        "wait for an in-flight place (max_in_flight).", buckets=_STAGE_BUCKETS,
                                        registry=r)
        self.retrieval_stages = Histogram(
            "prefixrag_retrieval_stage_seconds", "A question's ranking in the ranking workers, by stage: waiting "
            "(for a free worker), hop (to it and back: pickling, the socket, the event loop), encode and search "
            "(Chroma, BM25, the texts; both for its whole batch).", ["stage"], buckets=_STAGE_BUCKETS, registry=r)
        self.kv_tokens = Gauge("prefixrag_vllm_kv_cache_tokens", "Tokens vLLM's KV cache holds, by tier: gpu (its "
                               "own cache) and host (its KV offloading tier; 0: none), as last read from vLLM.",
                               ["tier"], registry=r)
        self._totals: dict[str, list[int]] = {}

    def observe_kv_tiers(self, info: Any) -> None:
        """Upstream subscriber: the KV cache's tiers as vLLM now serves them (``UpstreamInfo``)."""
        self.kv_tokens.labels("gpu").set(info.kv_cache_tokens)
        self.kv_tokens.labels("host").set(info.host_kv_tokens)

    def observe_answer(self, strategy: str, prompt_tokens: int, cached_tokens: int, ttft_s: float | None) -> None:
        self.prompt_tokens.labels(strategy).inc(prompt_tokens)
        self.cached_tokens.labels(strategy).inc(cached_tokens)
        totals = self._totals.setdefault(strategy, [0, 0])
        totals[0] += prompt_tokens
        totals[1] += cached_tokens
        self.hit_rate.labels(strategy).set(totals[1] / totals[0] if totals[0] else 0.0)
        if ttft_s is not None:
            self.ttft.labels(strategy).observe(ttft_s)
