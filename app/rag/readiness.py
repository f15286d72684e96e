"""What ``/readyz`` says and ``/metrics`` publishes: can the service answer now (vLLM reachable, the collection
readable), with pre-warm's progress and the load beside it, reported and never waited for."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from app.rag.traffic import TrafficStatus
from app.rag.upstream import UpstreamStatus
from app.rag.warmup import WarmupProgress


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

    def to_json(self) -> dict:
        upstream = self.upstream
        body = {"ready": self.ready, "reason": self.reason, "vllm_url": upstream.vllm_url,
                "vllm": asdict(upstream.vllm) if upstream.vllm else None}
        if upstream.router is not None:  # behind vllm-router: how many replicas it can route to
            body["router"] = asdict(upstream.router)
        return body | {"warmup": asdict(self.warmup), "traffic": asdict(self.traffic)}
