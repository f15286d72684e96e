"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from app.deps import Authorized, MetricsDep, UpstreamDep

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(upstream: UpstreamDep) -> JSONResponse:
    status = upstream.status()
    return JSONResponse(status, status_code=200 if status["ready"] else 503)


@router.get("/metrics", dependencies=[Authorized])
async def metrics(registry: MetricsDep, upstream: UpstreamDep) -> Response:
    registry.upstream_ready.set(1 if upstream.ready else 0)
    return Response(generate_latest(registry.registry), media_type=CONTENT_TYPE_LATEST)
