"""The collections the service serves: listed for the caller's key, and each described (documents, chunks,
generation, readiness, pre-warm)."""

from __future__ import annotations

from fastapi import APIRouter

from app.core.errors import NotFound
from app.runtime.documents import Documents
from app.runtime.service import Service
from app.serve.deps import Authorized, DocumentsDep, ServiceDep, SettingsDep, TenantDep
from app.serve.protocol_documents import CollectionInfo, CollectionList
from app.serve.routers.documents import errors

router = APIRouter(tags=["documents"], dependencies=[Authorized])


@router.get("/v1/collections", response_model=CollectionList, responses=errors(503))
async def listed(service: ServiceDep, documents: DocumentsDep, settings: SettingsDep,
                 tenant: TenantDep) -> CollectionList:
    """Those this key may read: the served one, or none."""
    try:
        tenant.reads(settings.chroma.collection)
    except NotFound:
        return CollectionList(data=[])
    return CollectionList(data=[await described(service, documents)])


@router.get("/v1/collections/{name}", response_model=CollectionInfo, responses=errors(503))
async def collection(name: str, service: ServiceDep, documents: DocumentsDep, settings: SettingsDep,
                     tenant: TenantDep) -> CollectionInfo:
    if name != settings.chroma.collection:
        raise NotFound(f"collection {name!r} not found", param="name", code="collection_not_found")
    tenant.reads(name)
    return await described(service, documents)


async def described(service: Service, documents: Documents) -> CollectionInfo:
    return CollectionInfo(**await service.describe(), documents=len(await documents.listed()))
