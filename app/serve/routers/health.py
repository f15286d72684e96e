"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from app.serve.deps import Authorized, MaybeTenant, MetricsDep, ServiceDep
from app.serve.protocol import ErrorResponse

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, Any]:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(service: ServiceDep, tenant: MaybeTenant) -> JSONResponse:
    """Ready = it can answer now: vLLM answers and the collection is readable (pre-warm's progress is reported
    under ``warmup``, never waited for; the load under ``traffic``). Open to
    probes without a key; with keys set, only a caller holding one sees the details (vLLM's URL,
    model, window, KV size, warm-up progress)."""
    status = service.readiness()
    brief = {"ready": status.ready, "reason": "ready" if status.ready else "not ready"}
    body = status.to_json() if tenant is not None else brief
    return JSONResponse(body, status_code=200 if status.ready else 503)


@router.get("/metrics", dependencies=[Authorized], response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {}}, "description": "Prometheus text"},
                       401: {"model": ErrorResponse, "description": "PREFIXRAG_API_KEY is set and the key is wrong"}})
async def metrics(registry: MetricsDep) -> Response:
    return Response(generate_latest(registry.registry), media_type=CONTENT_TYPE_LATEST)
