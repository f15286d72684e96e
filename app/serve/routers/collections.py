"""The collections the service serves: listed for the caller's key, each described (documents, chunks,
generation, readiness, pre-warm, the model that answers from it), made and deleted."""

from __future__ import annotations

from fastapi import APIRouter, Request

from app.core.errors import StoreUnavailable
from app.runtime.services import Services
from app.runtime.shelf import Shelf
from app.serve.deps import Authorized, SettingsDep, TenantDep, collection_for, model_of
from app.serve.protocol_documents import CollectionDeleted, CollectionInfo, CollectionList, CollectionRequest
from app.serve.routers.documents import errors

router = APIRouter(tags=["documents"], dependencies=[Authorized])


@router.get("/v1/collections", response_model=CollectionList, responses=errors(503))
async def listed(request: Request, settings: SettingsDep, tenant: TenantDep) -> CollectionList:
    """Those this key may read, the first served first."""
    collections: dict[str, Services] = request.app.state.services.collections
    return CollectionList(data=[await described(graph, settings.service.model_id)
                                for name, graph in collections.items() if tenant.may_read(name)])


@router.post("/v1/collections", status_code=201, response_model=CollectionInfo, responses=errors(400, 403, 409, 503))
async def make(body: CollectionRequest, request: Request, settings: SettingsDep, tenant: TenantDep) -> CollectionInfo:
    """A new collection, empty, served at once (and by every later start on this store) as model
    ``prefixrag/<id>``: upload documents to it with ``?collection=<id>``."""
    tenant.writes(body.id)
    shelf: Shelf = request.app.state.shelf
    return await described(await shelf.make(body.id), settings.service.model_id)


@router.delete("/v1/collections/{name}", response_model=CollectionDeleted, responses=errors(403, 409, 503))
async def drop(name: str, request: Request, tenant: TenantDep) -> CollectionDeleted:
    """A collection made over HTTP: no longer served, then deleted with every index derived from it."""
    tenant.writes(name)
    shelf: Shelf = request.app.state.shelf
    await shelf.drop(name)
    return CollectionDeleted(id=name)


@router.get("/v1/collections/{name}", response_model=CollectionInfo, responses=errors(503))
async def collection(name: str, request: Request, settings: SettingsDep, tenant: TenantDep) -> CollectionInfo:
    return await described(collection_for(request, tenant, name), settings.service.model_id)


async def described(graph: Services, model_id: str) -> CollectionInfo:
    about = await graph.service.describe()
    try:
        documents = await graph.documents.count()
    except StoreUnavailable:  # missing or unreadable: ``about`` says why
        documents = 0
    return CollectionInfo(**about, documents=documents, model=model_of(graph, model_id))
