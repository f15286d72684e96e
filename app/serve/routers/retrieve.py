"""POST /v1/retrieve: the ranking alone, for frontends that generate themselves (no vLLM involved)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from app.rag.requests import Lookup
from app.serve.deps import Authorized, MetricsDep, TenantDep, collection_for
from app.serve.protocol import ErrorResponse, RetrieveRequest, RetrieveResponse, retrieved_chunks

router = APIRouter(tags=["retrieve"], dependencies=[Authorized])
ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 503)}


@router.post("/v1/retrieve", response_model=RetrieveResponse, responses=ERRORS)
async def retrieve(body: RetrieveRequest, request: Request, metrics: MetricsDep,
                   tenant: TenantDep) -> RetrieveResponse:
    service = collection_for(request, tenant, body.collection).service
    lookup = Lookup(question=body.question, top_k=body.top_k,
                    source_prefix=body.filters.source_prefix if body.filters else None, cache_salt=tenant.cache_salt)
    with metrics.latency.labels("retrieve").time():
        found = await service.retrieve(lookup)
    metrics.requests.labels("retrieve", "200").inc()
    return RetrieveResponse(data=retrieved_chunks(found.hits, found.units), retrieve_ms=found.retrieve_ms)
