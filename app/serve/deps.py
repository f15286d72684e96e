"""Typed dependencies: everything heavy is built once in ``lifespan`` and read from ``app.state`` here. Each is
``async def`` although none awaits: FastAPI runs a plain ``def`` dependency in its thread pool, a thread hop (and
two hand-overs of the GIL) per dependency per request, on the path every request takes."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from app.core.errors import Unauthorized
from app.core.metrics import ServiceMetrics
from app.core.settings import Settings
from app.runtime.documents import Documents
from app.runtime.service import Service
from app.serve.edge import key_matches


async def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def get_service(request: Request) -> Service:
    service: Service = request.app.state.service
    return service


async def get_documents(request: Request) -> Documents:
    documents: Documents = request.app.state.services.documents
    return documents


async def get_metrics(request: Request) -> ServiceMetrics:
    metrics: ServiceMetrics = request.app.state.metrics
    return metrics


SettingsDep = Annotated[Settings, Depends(get_settings)]
ServiceDep = Annotated[Service, Depends(get_service)]
MetricsDep = Annotated[ServiceMetrics, Depends(get_metrics)]
DocumentsDep = Annotated[Documents, Depends(get_documents)]


# In the OpenAPI schema as the bearer scheme; absent or not "Bearer" gives None, and the check below answers 401
# in OpenAI's error shape (HTTPBearer's own error would be FastAPI's, and 403).
bearer = HTTPBearer(auto_error=False, description="PREFIXRAG_API_KEY, when the service is started with one.")


async def holds_key(settings: SettingsDep,
                    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> bool:
    """The caller may pass: no PREFIXRAG_API_KEY is set, or it sent that key (compared in constant time)."""
    expected = settings.service.api_key
    return not expected or (credentials is not None and key_matches(credentials.credentials, expected))


HoldsKey = Annotated[bool, Depends(holds_key)]


async def require_api_key(allowed: HoldsKey) -> None:
    """Requests with a body were already checked at the edge (``app.serve.edge``), before their body was read."""
    if not allowed:
        raise Unauthorized("missing or invalid API key: send 'Authorization: Bearer <PREFIXRAG_API_KEY>'")


Authorized = Depends(require_api_key)
