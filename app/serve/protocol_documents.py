"""Wire schemas of documents over HTTP: upload jobs, the documents a collection holds, a deletion, the
collection itself."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from app.serve.protocol import Text


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


Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-fA-F]{64}$")]


class SyncRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    files: dict[Text, Sha256] = Field(description="Each file the collection should hold (its name as uploaded) -> "
                                      "the SHA-256 of its bytes, hex.")
    prefix: Text = Field("", description="Only the collection's files whose name starts with this are compared "
                         "(a folder kept in step apart from the others).")


class SyncPlan(BaseModel):
    object: Literal["documents.sync"] = "documents.sync"
    add: list[str] = Field(description="Files the collection does not hold: upload them.")
    update: list[str] = Field(description="Files held with other content (or partly written): upload them.")
    unchanged: list[str] = Field(description="Files held as they are: nothing to do.")
    delete: list[str] = Field(description="Documents of files held under the prefix but not listed: delete them.")


class CollectionInfo(BaseModel):
    """A collection the service serves, as it stands now."""

    id: str = Field(description="The collection's name (PREFIXRAG_CHROMA__COLLECTION or __COLLECTIONS).")
    object: Literal["collection"] = "collection"
    model: str = Field(description="The model a chat client names to be answered from it (GET /v1/models).")
    documents: int = Field(description="Documents it holds.")
    chunks: int = Field(description="Chunks it holds.")
    generation: str | None = Field(description="Its generation stamp: changes with every ingest, upload or deletion.")
    ready: bool = Field(description="Questions are answered from it now.")
    problem: str | None = Field(None, description="Why it is not ready (missing, being ingested, unreadable).")
    strategy: str = Field(description="The context strategy in use (auto settles on corpus or document).")
    warmup: dict[str, Any] = Field(description="Pre-warm's progress: state, units planned / warmed / kept, tokens.")


class CollectionList(BaseModel):
    object: Literal["list"] = "list"
    data: list[CollectionInfo]


class CollectionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    id: str = Field(description="The new collection's name: 3-512 characters of letters, digits, '.', '_' and '-', "
                    "starting and ending with a letter or digit.")


class CollectionDeleted(BaseModel):
    id: str
    object: Literal["collection.deleted"] = "collection.deleted"
    deleted: Literal[True] = True
