"""Documents over HTTP: upload (an ingest job, 202), a job's status, list, sync, delete."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated, Any

from fastapi import APIRouter, File, Request, UploadFile
from fastapi.responses import JSONResponse

from app.runtime.documents import job_not_found
from app.serve.deps import Authorized, Read, TenantDep, Write
from app.serve.protocol import ErrorResponse
from app.serve.protocol_documents import (
    DocumentDeleted,
    DocumentInfo,
    DocumentList,
    JobResponse,
    SyncPlan,
    SyncRequest,
)

router = APIRouter(tags=["documents"], dependencies=[Authorized])


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": ErrorResponse} for code in (401, 404, *codes)}


@router.post("/v1/documents", status_code=202, response_model=JobResponse, responses=errors(400, 403, 413, 415))
async def upload(files: Annotated[list[UploadFile], File(description="Files of the types python -m ingest reads; "
                                                         "each file's name is its document's id.")],
                 collection: Write) -> JSONResponse:
    job = await collection.documents.submit([(file.filename or "", file.file) for file in files])
    return JSONResponse(JobResponse(**asdict(job)).model_dump(), status_code=202,
                        headers={"Location": f"/v1/jobs/{job.id}"})


@router.post("/v1/documents/sync", response_model=SyncPlan, responses=errors(400, 403, 415, 503))
async def sync(body: SyncRequest, collection: Write) -> SyncPlan:
    """What to upload and delete so that the collection holds exactly a folder's files: one call."""
    return SyncPlan(**await collection.documents.sync(body.files, body.prefix))


@router.get("/v1/jobs/{job_id}", response_model=JobResponse, responses=errors())
async def job(job_id: str, request: Request, tenant: TenantDep) -> JobResponse:
    """An upload's job, in whichever collection this key may change."""
    for name, collection in request.app.state.services.collections.items():
        if tenant.write and tenant.may_read(name) and (found := collection.documents.job(job_id)) is not None:
            return JobResponse(**asdict(found))
    raise job_not_found(job_id)


@router.get("/v1/documents", response_model=DocumentList, responses=errors(503))
async def listed(collection: Read) -> DocumentList:
    return DocumentList(data=[DocumentInfo(**entry) for entry in await collection.documents.listed()])


@router.delete("/v1/documents/{doc_id:path}", response_model=DocumentDeleted, responses=errors(403, 503))
async def delete(doc_id: str, collection: Write) -> DocumentDeleted:
    return DocumentDeleted(id=doc_id, chunks=await collection.documents.delete(doc_id))
