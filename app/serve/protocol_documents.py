"""Wire schemas of documents over HTTP: upload jobs, the documents a collection holds, a deletion."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


class JobResponse(BaseModel):
    """An upload being ingested (``202`` when queued; ``GET /v1/jobs/{id}`` until it ends)."""

    id: str
    object: Literal["ingest.job"] = "ingest.job"
    status: Literal["queued", "running", "done", "failed"] = Field(
        description="done: every file ingested or reported in report.failed, and the service answers from them.")
    files: list[str] = Field(description="The uploaded files' names: their documents' ids (a .jsonl file's "
                             "records have their own).")
    created_at: float = Field(description="When it was queued (Unix time, s).")
    finished_at: float | None = Field(None, description="When it ended (Unix time, s).")
    report: dict[str, Any] | None = Field(None, description="python -m ingest --json's summary: files ingested, "
                                          "unchanged, failed (each with its reason), chunks written and deleted.")
    error: str | None = Field(None, description="Why the job failed as a whole (status failed).")


class DocumentInfo(BaseModel):
    id: str = Field(description="Document id: the file's path as uploaded or ingested, or a jsonl record's id.")
    source: str = Field(description="The file it came from.")
    hash: str = Field(description="Hash of its content with the chunking and encoder (equal: unchanged).")
    chunks: int = Field(description="Chunks stored.")
    complete: bool = Field(description="False while a write of it is interrupted or under way.")


class DocumentList(BaseModel):
    object: Literal["list"] = "list"
    data: list[DocumentInfo]


class DocumentDeleted(BaseModel):
    id: str
    object: Literal["document.deleted"] = "document.deleted"
    deleted: Literal[True] = True
    chunks: int = Field(description="Chunks removed.")
