"""What we know about vLLM, kept fresh by a background monitor: reachable? which model, which window,
is prefix caching on, which block size? Behind vllm-router: which replicas are healthy. It only probes and
publishes: subscribers hear what is served whenever it changes (the client adopts the model name, prompt builders
the tokenizer's special tokens); ``appeared`` is set each time vLLM (re)appears or restarts, or the router's set of
healthy replicas changes (units now route elsewhere), which is when the warmer (``app.runtime.warmup``) starts over."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from app.core.errors import ServiceError, UpstreamUnavailable
from app.core.settings import VLLMSettings
from app.vllm.client import LLMClient
from app.vllm.kv_tiers import host_tier_gib, host_tier_tokens
from app.vllm.prometheus import metric_total, parse_metric_labels
from app.vllm.wire import Replica, UpstreamInfo

log = logging.getLogger("prefixrag.upstream")


@dataclass(frozen=True)
class RouterStatus:
    healthy: int
    total: int
    replicas: list[Replica]


@dataclass(frozen=True)
class UpstreamStatus:
    ready: bool
    reason: str
    vllm_url: str
    vllm: UpstreamInfo | None
    router: RouterStatus | None = None  # behind vllm-router: how many replicas it can route to


class Upstream:
    def __init__(self, llm: LLMClient, settings: VLLMSettings) -> None:
        self.llm, self.settings = llm, settings
        self.info: UpstreamInfo | None = None
        self.reachable = False
        self.reason = "not checked yet"
        self.appeared = asyncio.Event()  # set on every (re)appearance or restart; the warmer clears it
        self._wake = asyncio.Event()
        self.replicas: list[Replica] | None = None  # behind vllm-router: its replicas; None: vLLM itself
        self._queries_seen: dict[str, float] = {}  # per vLLM server read directly: a drop means it restarted
        self._subscribers: list[Callable[[UpstreamInfo], None]] = []

    def subscribe(self, subscriber: Callable[[UpstreamInfo], None]) -> None:
        """``subscriber(info)`` now if vLLM is known, then each time it is first seen, comes back or serves another
        model (what it serves may have changed)."""
        self._subscribers.append(subscriber)
        if self.info is not None:
            subscriber(self.info)

    @property
    def ready(self) -> bool:
        """vLLM can answer now (warm or not: readiness never waits for pre-warm)."""
        return self.reachable and self.info is not None

    def require(self) -> UpstreamInfo:
        if self.info is None:
            raise UpstreamUnavailable(f"vLLM is not ready: {self.reason}")
        return self.info

    def mark_down(self, reason: str) -> None:
        """Called when a request finds vLLM gone: readiness drops now and, the first time only, the monitor
        re-probes at once. Later failures change nothing: probes keep their own pace whatever the request rate."""
        was_reachable = self.reachable
        self.reachable, self.reason = False, reason
        if was_reachable:
            self._wake.set()

    async def run_forever(self) -> None:
        failures, last_warning = 0, None
        while True:
            try:
                await self.refresh()
                failures, last_warning = 0, None
            except ServiceError as exc:
                failures += 1
                self.reachable, self.reason = False, exc.message
                if exc.message != last_warning:  # once per state change, not once per probe
                    last_warning = exc.message
                    log.warning("vLLM at %s not ready (attempt %d): %s", self.settings.url, failures, exc.message)
            interval = self.settings.retry_interval_s if not self.ready else self.settings.retry_interval_s * 5
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=interval)
            except TimeoutError:
                pass

    async def refresh(self) -> None:
        replicas = await self.llm.replicas()
        if replicas is not None and not any(r.healthy for r in replicas):
            self.replicas = replicas  # /readyz shows 0 of N, not the last good count
            raise UpstreamUnavailable(f"vllm-router has no healthy replica (0/{len(replicas)})")
        models = await self.llm.list_models()
        metrics = await self.metrics_texts(replicas)
        info = self._read_info(models, list(metrics.values()))
        # Read once per (re)appearance of vLLM, not on every probe: a restart may serve another model.
        known = self.info if self.reachable and self.info and self.info.model == info.model else None
        info.special_tokens = known.special_tokens if known else tuple(await self.llm.special_tokens())
        self.info = info
        if known is None:  # first seen, back, or serving another model: subscribers adopt it
            for subscriber in self._subscribers:
                subscriber(info)
        if self._restarted(metrics):
            self.appeared.set()
        if self.reachable and self._healthy(self.replicas) != self._healthy(replicas):
            log.warning("vllm-router's healthy replicas changed %s -> %s: re-warming, each unit where it now routes",
                        sorted(self._healthy(self.replicas)), sorted(self._healthy(replicas)))
            self.appeared.set()
        self.replicas = replicas
        if not self.reachable:
            log.info("vLLM ready at %s: model=%s max_model_len=%d block_size=%d prefix_caching=%s kv_tokens=%d%s%s",
                     self.settings.url, self.info.model, self.info.max_model_len, self.info.block_size,
                     self.info.prefix_caching, self.info.kv_cache_tokens,
                     f" host_kv_tokens={self.info.host_kv_tokens}" if self.info.host_kv_tokens else "",
                     f" replicas={self._replica_count()}" if replicas is not None else "")
            self.appeared.set()
        self.reachable, self.reason = True, "ready"

    async def metrics_texts(self, replicas: list[Replica] | None = None) -> dict[str, str]:
        """Prometheus text per vLLM server read directly: the URL itself, or each healthy replica behind the
        router (those last seen, unless given). Where the replicas cannot be reached from here, the router's
        /metrics (one replica's, its pick): enough for the cache config, not for restart detection (keyed "")."""
        replicas = self.replicas if replicas is None else replicas
        if replicas is None:
            return {self.settings.url: await self.llm.metrics_text()}
        found: dict[str, str] = {}
        for replica in (r for r in replicas if r.healthy):
            try:
                found[replica.url] = await self.llm.metrics_text(replica.url)
            except ServiceError:
                continue
        return found or {"": await self.llm.metrics_text()}

    def _restarted(self, metrics: dict[str, str]) -> bool:
        restarted = False
        for server, text in metrics.items():
            queries = metric_total(text, "vllm:prefix_cache_queries_total")
            if server and queries < self._queries_seen.get(server, 0.0):
                log.warning("vLLM counters at %s went back (%s -> %s): it restarted; re-warming",
                            server, self._queries_seen[server], queries)
                restarted = True
            self._queries_seen[server] = queries
        return restarted

    @staticmethod
    def _healthy(replicas: list[Replica] | None) -> frozenset[str]:
        return frozenset(r.url for r in replicas or () if r.healthy)

    def _replica_count(self) -> str:
        return f"{len(self._healthy(self.replicas))}/{len(self.replicas or ())} healthy"

    def _read_info(self, models: list[dict[str, Any]], metrics: list[str]) -> UpstreamInfo:
        """From the model list and each server's metrics; behind a router the KV cache (each tier) is the
        replicas' sum (each unit is cached on one replica), the rest is read from the first."""
        wanted = self.settings.model
        names = [m["id"] for m in models]
        if wanted and wanted not in names:
            raise UpstreamUnavailable(f"vLLM serves {names}, not the configured model {wanted!r}")
        if not wanted and len(names) != 1:
            raise UpstreamUnavailable(f"vLLM serves {names}: set PREFIXRAG_MODEL to pick one")
        card = next(m for m in models if m["id"] == (wanted or names[0]))
        caches = [parse_metric_labels(text, "vllm:cache_config_info") or {} for text in metrics]
        cache = caches[0]
        prefix_caching = cache.get("enable_prefix_caching") == "True"
        if not prefix_caching:
            log.error("!!! vLLM prefix caching is OFF (enable_prefix_caching=%s): every prompt pays full "
                      "prefill. Start vLLM with --enable-prefix-caching (python -m app.vllm_server does).",
                      cache.get("enable_prefix_caching"))
        root = str(card.get("root") or "")
        host_tokens = sum(host_tier_tokens(host_tier_gib(c), root, c.get("cache_dtype") or "auto") for c in caches)
        return UpstreamInfo(model=card["id"], max_model_len=int(card.get("max_model_len") or 2048),
                            block_size=int(cache.get("block_size") or 16), prefix_caching=prefix_caching,
                            kv_cache_tokens=sum(int(c.get("kv_cache_size_tokens") or 0) for c in caches),
                            root=root, replicas=len(metrics), host_kv_tokens=host_tokens)

    def status(self) -> UpstreamStatus:
        router = None
        if self.replicas is not None:
            router = RouterStatus(len(self._healthy(self.replicas)), len(self.replicas), list(self.replicas))
        return UpstreamStatus(self.ready, self.reason, self.settings.url, self.info, router)
