"""Typed dependencies: everything heavy is built once in ``lifespan`` and read from ``app.state`` here. Each is
``async def`` although none awaits: FastAPI runs a plain ``def`` dependency in its thread pool, a thread hop (and
two hand-overs of the GIL) per dependency per request, on the path every request takes."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Query, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from app.core.errors import UNAUTHORIZED, Unauthorized
from app.core.metrics import ServiceMetrics
from app.core.settings import Settings
from app.runtime.service import Service
from app.runtime.services import Services
from app.serve.tenants import Tenant, Tenants, collection_not_found


async def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def get_service(request: Request) -> Service:
    service: Service = request.app.state.service
    return service


async def get_metrics(request: Request) -> ServiceMetrics:
    metrics: ServiceMetrics = request.app.state.metrics
    return metrics


SettingsDep = Annotated[Settings, Depends(get_settings)]
ServiceDep = Annotated[Service, Depends(get_service)]
MetricsDep = Annotated[ServiceMetrics, Depends(get_metrics)]


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


def collection_for(request: Request, tenant: Tenant, name: str | None = None, *, write: bool = False) -> Services:
    """The graph of collection ``name`` (default: the first served) if ``tenant`` may read it (and, with
    ``write``, change it): one the key may not read is not found, as one not served."""
    collections: dict[str, Services] = request.app.state.services.collections
    name = name or next(iter(collections))
    tenant.writes(name) if write else tenant.reads(name)
    if (graph := collections.get(name)) is None:
        raise collection_not_found(name)
    return graph


def model_of(graph: Services, model_id: str) -> str:
    """The model that answers from ``graph``'s collection: ``model_id`` for the first served, else
    ``model_id/<collection>``."""
    return model_id if next(iter(graph.collections), graph.name) == graph.name else f"{model_id}/{graph.name}"


CollectionParam = Annotated[str | None, Query(description="The collection (default: the service's first, "
                                              "PREFIXRAG_CHROMA__COLLECTION).")]


async def require_reader(request: Request, tenant: TenantDep, collection: CollectionParam = None) -> Services:
    return collection_for(request, tenant, collection)


async def require_writer(request: Request, tenant: TenantDep, collection: CollectionParam = None) -> Services:
    return collection_for(request, tenant, collection, write=True)


# The collection a request names in its ``collection`` query parameter (default: the first served), for a
# tenant that may read it (``Read``), and change it (``Write``); a body's own ``collection`` goes through
# ``collection_for``.
Read = Annotated[Services, Depends(require_reader)]
Write = Annotated[Services, Depends(require_writer)]
