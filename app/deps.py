"""Typed dependencies: everything heavy is built once in ``lifespan`` and read from ``app.state`` here."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from app.edge import bearer_ok
from app.errors import Unauthorized
from app.metrics import ServiceMetrics
from app.rag.service import RAGService
from app.settings import Settings


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_service(request: Request) -> RAGService:
    return request.app.state.service


def get_metrics(request: Request) -> ServiceMetrics:
    return request.app.state.metrics


SettingsDep = Annotated[Settings, Depends(get_settings)]
ServiceDep = Annotated[RAGService, Depends(get_service)]
MetricsDep = Annotated[ServiceMetrics, Depends(get_metrics)]


def require_api_key(request: Request, settings: SettingsDep) -> None:
    """Optional Bearer key (RAG_API_KEY), compared in constant time."""
    expected = settings.service.api_key
    if not expected:
        return
    if not bearer_ok(request.headers.get("authorization", ""), expected):
        raise Unauthorized("missing or invalid API key: send 'Authorization: Bearer <RAG_API_KEY>'")


Authorized = Depends(require_api_key)
