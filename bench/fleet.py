"""The vLLM servers behind a benchmark's URL: the server itself, or the replicas behind vllm-router (read from
its ``/workers``, or given with ``--replica-metrics``). Prefix-cache counters are summed over them, caches reset
(a KV tier in host memory included) on each (through the router a reset would reach only the replica it picks),
and each replica's share of the requests and prompt tokens is reported."""

from __future__ import annotations

import httpx

from app.vllm.prometheus import metric_total
from app.vllm.wire import replicas_of

COUNTERS = {"hits": "vllm:prefix_cache_hits_total", "queries": "vllm:prefix_cache_queries_total",
            "requests": "vllm:request_success_total", "prompt_tokens": "vllm:prompt_tokens_total",
            # vLLM's KV tier in host memory (KV offloading): tokens looked up there after a GPU miss, and found.
            "host_hits": "vllm:external_prefix_cache_hits_total",
            "host_queries": "vllm:external_prefix_cache_queries_total"}


class Fleet:
    def __init__(self, servers: list[str], routed: bool) -> None:
        self.servers, self.routed = [s.rstrip("/") for s in servers], routed
        self.http = httpx.AsyncClient(timeout=60)

    @classmethod
    async def discover(cls, vllm_url: str, given: list[str] | None = None) -> Fleet:
        root = vllm_url.rstrip("/").removesuffix("/v1")
        if given:
            return cls(given, routed=True)
        async with httpx.AsyncClient(timeout=30) as http:
            response = await http.get(f"{root}/workers")  # vllm-router's; a vLLM server answers 404
        replicas = replicas_of(response) if response.status_code == 200 else None
        if replicas is not None:
            return cls([r.url for r in replicas], routed=True)
        return cls([root], routed=False)

    async def aclose(self) -> None:
        await self.http.aclose()

    async def reset(self) -> None:
        for server in self.servers:
            # The host tier too (vLLM's KV offloading), where there is one: no mode starts warm from it.
            response = await self.http.post(f"{server}/reset_prefix_cache", params={"reset_external": "true"})
            response.raise_for_status()

    async def metrics(self) -> dict[str, str]:
        """Per server, its Prometheus text (a replica that cannot be read is absent). Joined, the texts sum
        like one server's: ``metric_total`` adds every sample of a name."""
        found = {}
        for server in self.servers:
            try:
                found[server] = (await self.http.get(f"{server}/metrics")).text
            except httpx.HTTPError:
                continue
        return found

    async def counters(self) -> dict[str, dict[str, float]]:
        """Per server, the counters in ``COUNTERS``."""
        return {server: counters_of(text) for server, text in (await self.metrics()).items()}


def counters_of(text: str) -> dict[str, float]:
    return {key: metric_total(text, name) for key, name in COUNTERS.items()}


def difference(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict:
    """Counter deltas summed over the servers, and each server's share of requests and prompt tokens. A server
    that restarted in between (its counters went back) contributes what it counted since."""
    per_server = {}
    for server, now in after.items():
        then = before.get(server, {})
        per_server[server] = {k: v - then.get(k, 0.0) if v >= then.get(k, 0.0) else v for k, v in now.items()}
    total = {key: sum(d[key] for d in per_server.values()) for key in COUNTERS}
    shares = {server: {"requests": d["requests"], "prompt_tokens": d["prompt_tokens"],
                       "request_share": round(d["requests"] / total["requests"], 4) if total["requests"] else 0.0,
                       "token_share": round(d["prompt_tokens"] / total["prompt_tokens"], 4)
                       if total["prompt_tokens"] else 0.0,
                       "hit_rate": round(d["hits"] / d["queries"], 4) if d["queries"] else 0.0}
              for server, d in per_server.items()}
    return total | {"servers": shares}
