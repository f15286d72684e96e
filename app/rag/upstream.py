"""What we know about vLLM, kept fresh by a background monitor: reachable? which model, which window,
is prefix caching on, which block size? It only probes and publishes: ``appeared`` is set each time vLLM
(re)appears or restarts, which is when the warmer (``app.rag.warmup``) starts over."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict, dataclass

from app.errors import ServiceError, UpstreamUnavailable
from app.llm import LLMClient, metric_total, parse_metric_labels
from app.settings import VLLMSettings

log = logging.getLogger("prefixrag.upstream")


@dataclass
class UpstreamInfo:
    model: str
    max_model_len: int
    block_size: int
    prefix_caching: bool
    kv_cache_tokens: int
    special_tokens: tuple[str, ...] = ()  # the served tokenizer's, kept out of untrusted text


class Upstream:
    def __init__(self, llm: LLMClient, settings: VLLMSettings) -> None:
        self.llm, self.settings = llm, settings
        self.info: UpstreamInfo | None = None
        self.reachable = False
        self.reason = "not checked yet"
        self.appeared = asyncio.Event()  # set on every (re)appearance or restart; the warmer clears it
        self._wake = asyncio.Event()
        self._queries_seen = 0.0

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
        models = await self.llm.list_models()
        metrics = await self.llm.metrics_text()
        info = self._read_info(models, metrics)
        # Read once per (re)appearance of vLLM, not on every probe: a restart may serve another model.
        known = self.info if self.reachable and self.info and self.info.model == info.model else None
        info.special_tokens = known.special_tokens if known else tuple(await self.llm.special_tokens())
        self.info = info
        self.llm.model = self.info.model
        queries = metric_total(metrics, "vllm:prefix_cache_queries_total")
        if queries < self._queries_seen:
            log.warning("vLLM counters went back (%s -> %s): it restarted; re-warming", self._queries_seen, queries)
            self.appeared.set()
        self._queries_seen = queries
        if not self.reachable:
            log.info("vLLM ready at %s: model=%s max_model_len=%d block_size=%d prefix_caching=%s",
                     self.settings.url, self.info.model, self.info.max_model_len, self.info.block_size,
                     self.info.prefix_caching)
            self.appeared.set()
        self.reachable, self.reason = True, "ready"

    def _read_info(self, models: list[dict], metrics: str) -> UpstreamInfo:
        wanted = self.settings.model
        names = [m["id"] for m in models]
        if wanted and wanted not in names:
            raise UpstreamUnavailable(f"vLLM serves {names}, not the configured model {wanted!r}")
        if not wanted and len(names) != 1:
            raise UpstreamUnavailable(f"vLLM serves {names}: set RAG_MODEL to pick one")
        card = next(m for m in models if m["id"] == (wanted or names[0]))
        cache = parse_metric_labels(metrics, "vllm:cache_config_info") or {}
        prefix_caching = cache.get("enable_prefix_caching") == "True"
        if not prefix_caching:
            log.error("!!! vLLM prefix caching is OFF (enable_prefix_caching=%s): every prompt pays full "
                      "prefill. Start vLLM with --enable-prefix-caching (python -m app.vllm_server does).",
                      cache.get("enable_prefix_caching"))
        return UpstreamInfo(model=card["id"], max_model_len=int(card.get("max_model_len") or 2048),
                            block_size=int(cache.get("block_size") or 16), prefix_caching=prefix_caching,
                            kv_cache_tokens=int(cache.get("kv_cache_size_tokens") or 0))

    def status(self) -> dict:
        return {"ready": self.ready, "reason": self.reason, "vllm_url": self.settings.url,
                "vllm": asdict(self.info) if self.info else None}
