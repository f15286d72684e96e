"""The collections the service serves: listed for the caller's key, and each described (documents, chunks,
generation, readiness, pre-warm)."""

from __future__ import annotations

from fastapi import APIRouter

from app.runtime.documents import Documents
from app.runtime.service import Service
from app.serve.deps import Authorized, DocumentsDep, Reader, ServiceDep, SettingsDep, TenantDep
from app.serve.protocol_documents import CollectionInfo, CollectionList
from app.serve.routers.documents import errors
from app.serve.tenants import collection_not_found

router = APIRouter(tags=["documents"], dependencies=[Authorized])


@router.get("/v1/collections", response_model=CollectionList, responses=errors(503))
async def listed(service: ServiceDep, documents: DocumentsDep, settings: SettingsDep,
                 tenant: TenantDep) -> CollectionList:
    """Those this key may read: the served one, or none."""
    readable = tenant.may_read(settings.chroma.collection)
    return CollectionList(data=[await described(service, documents)] if readable else [])


@router.get("/v1/collections/{name}", response_model=CollectionInfo, responses=errors(503))
async def collection(name: str, service: ServiceDep, documents: DocumentsDep, settings: SettingsDep,
                     _: Reader) -> CollectionInfo:
    if name != settings.chroma.collection:
        raise collection_not_found(name)
    return await described(service, documents)


async def described(service: Service, documents: Documents) -> CollectionInfo:
    return CollectionInfo(**await service.describe(), documents=await documents.count())
