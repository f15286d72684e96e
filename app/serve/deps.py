"""Typed dependencies: everything heavy is built once in ``lifespan`` and read from ``app.state`` here. Each is
``async def`` although none awaits: FastAPI runs a plain ``def`` dependency in its thread pool, a thread hop (and
two hand-overs of the GIL) per dependency per request, on the path every request takes."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from app.core.errors import UNAUTHORIZED, Unauthorized
from app.core.metrics import ServiceMetrics
from app.core.settings import Settings
from app.runtime.documents import Documents
from app.runtime.service import Service
from app.serve.tenants import Tenant, Tenants


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
bearer = HTTPBearer(auto_error=False, description="PREFIXRAG_API_KEY, or a tenant's key "
                    "(PREFIXRAG_SERVICE__KEYS_FILE), when the service has keys.")


async def tenant_of(request: Request,
                    _: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> Tenant | None:
    """The caller's tenant (``app.serve.tenants``; None: no valid key); a request with a body was resolved at
    the edge (``app.serve.edge``), before its body was read. (``bearer`` only declares the scheme.)"""
    if (tenant := getattr(request.state, "tenant", None)) is not None:
        return tenant  # type: ignore[no-any-return]
    tenants: Tenants = request.app.state.tenants
    return tenants.of(request.headers.get("authorization", ""))


MaybeTenant = Annotated[Tenant | None, Depends(tenant_of)]


async def require_tenant(tenant: MaybeTenant) -> Tenant:
    if tenant is None:
        raise Unauthorized(UNAUTHORIZED)
    return tenant


TenantDep = Annotated[Tenant, Depends(require_tenant)]
Authorized = Depends(require_tenant)


async def require_reader(tenant: TenantDep, settings: SettingsDep) -> Tenant:
    tenant.reads(settings.chroma.collection)
    return tenant


async def require_writer(tenant: TenantDep, settings: SettingsDep) -> Tenant:
    tenant.writes(settings.chroma.collection)
    return tenant


Reader = Annotated[Tenant, Depends(require_reader)]  # a tenant that may read the served collection
Writer = Annotated[Tenant, Depends(require_writer)]  # ... and change it
