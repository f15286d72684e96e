"""Settings of the corpus: where it is stored, how it is embedded, chunked, paged, retrieved and ingested.
Sections of the one ``Settings`` object (``app.core.settings``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator

PACKAGED_EMBEDDER = "packaged:all-MiniLM-L6-v2"


class ChromaSettings(BaseModel):
    path: Path = Field(Path("./data/chroma"), description="On-disk Chroma directory (embedded mode).")
    url: str | None = Field(None, description="Chroma server URL (e.g. http://127.0.0.1:8001); wins over path.")
    collection: str = Field("docs", min_length=3, max_length=512, description="Collection name (3-512 chars).")
    collections: list[str] = Field(
        [], description="Further collections the service serves beside `collection` (a JSON list of names), each "
        "its own model prefixrag/<name> and the `collection` of /ask, /v1/retrieve and the documents endpoints.")
    poll_s: float = Field(5.0, gt=0, description="How often the service checks whether an ingest changed the "
                          "collection (then it reloads it, drops cached units and re-warms).")
    lexical_dir: Path | None = Field(
        None, description="Where ingest keeps the indexes it derives from the collection, BM25 and pages "
        "(default: beside the on-disk Chroma; data/lexical/<server> for a Chroma server).")

    def serving(self, name: str) -> ChromaSettings:
        """These settings for collection ``name`` alone (the same store)."""
        return self.model_copy(update={"collection": name, "collections": []})

    @model_validator(mode="after")
    def _collections_named_once(self) -> ChromaSettings:
        names = [self.collection, *self.collections]
        if len(set(names)) != len(names):
            raise ValueError(f"chroma collections name one twice (or `collection` again): {names}")
        if bad := [name for name in self.collections if not 3 <= len(name) <= 512]:
            raise ValueError(f"chroma collection names must be 3-512 characters: {bad}")
        return self

    @field_validator("url")
    @classmethod
    def _url_has_scheme(cls, url: str | None) -> str | None:
        if url and not url.startswith(("http://", "https://")):
            raise ValueError(f"chroma url must start with http:// or https://, got {url!r}")
        return url or None


class EmbeddingSettings(BaseModel):
    model: str = Field(PACKAGED_EMBEDDER,
                       description="Sentence-transformers model path, or 'packaged:all-MiniLM-L6-v2'.")
    batch_size: int = Field(64, ge=1, le=1024, description="Texts per encoder forward pass.")
    device: str = Field(
        "auto", description="Torch device for the encoder ('cpu', 'cuda', 'cuda:1', ...); 'auto': the first CUDA GPU "
        "where torch sees one (beside vLLM it takes well under 1 GiB per process), else the CPU.")
    query_threads: int = Field(
        1, ge=1, description="CPU threads the service's encoder uses per question (ingest uses them all): one short "
        "text gains nothing from more, and beside a CPU vLLM each extra thread stalls at every barrier")
    query_dtype: Literal["float32", "bfloat16", "int8"] = Field(
        "float32", description="Number format of the service's question encoder. int8 (ONNX Runtime on the CPU: "
        "weights per channel, activations quantized as each question runs) encodes in about half float32's time, "
        "hybrid recall@5 0.2-0.3 points lower on the data measured (bench.query_encoder); bfloat16 is torch's "
        "(nearly float32's rankings, on some CPUs faster). Documents are always float32.")
    query_runtime: Literal["auto", "torch", "onnx"] = Field(
        "auto", description="What runs the service's question encoder: 'onnx' exports the model at load into one "
        "ONNX Runtime graph (CPU only; in float32 the same vectors as torch); 'torch' runs it eagerly (any device, "
        "float32 or bfloat16); 'auto': ONNX Runtime for int8; for float32 on the CPU whichever of the two encodes "
        "faster on this CPU, timed at load (neither wins everywhere); else torch.")

    @model_validator(mode="after")
    def _onnx_runs_float32(self) -> EmbeddingSettings:
        if self.query_runtime == "onnx" and self.query_dtype == "bfloat16":
            raise ValueError("query_runtime 'onnx' runs the encoder in float32 or int8: set query_dtype to one of "
                             "those, or query_runtime to torch for bfloat16")
        if self.query_runtime == "torch" and self.query_dtype == "int8":
            raise ValueError("query_dtype 'int8' is ONNX Runtime's: set query_runtime to onnx or auto")
        if (self.query_runtime == "onnx" or self.query_dtype == "int8") and self.device not in ("auto", "cpu"):
            raise ValueError(f"ONNX Runtime runs the question encoder on the CPU, not on {self.device!r}: "
                             "set device to cpu or auto, or query_runtime to torch (float32 or bfloat16)")
        return self


class RetrievalSettings(BaseModel):
    mode: Literal["dense", "lexical", "hybrid"] = Field(
        "hybrid", description="dense: embeddings only; lexical: BM25 only; hybrid: both, fused by reciprocal rank "
        "(finds exact names, numbers and identifiers that embeddings miss).")
    candidates: int = Field(
        20, ge=1, le=200, description="hybrid: how deep each ranking is read before fusion (at least top_k).")
    rrf_k: int = Field(60, ge=1, description="hybrid: reciprocal-rank-fusion constant (score = sum 1/(rrf_k+rank)).")
    threads: int = Field(0, ge=0, description="Worker threads of the service for question embeddings and store "
                         "reads (0: one per CPU core, at most 8).")
    workers: int | Literal["auto"] = Field(
        "auto", description="Processes that rank questions (encoder, Chroma query, BM25) beside the serving "
        "process, each with its own encoder and indexes (0: rank in the serving process). 'auto': where there are "
        "at least 8 CPU cores (a GPU host), one per two cores, at most 8, or with the encoder on a GPU (each then "
        "holds ~0.8 GiB of it) one per four cores, at most 4; else 0.")

    @field_validator("workers")
    @classmethod
    def _workers_in_range(cls, value: int | str) -> int | str:
        if value != "auto" and not 0 <= int(value) <= 64:
            raise ValueError("workers must be 'auto' or 0 to 64")
        return value

    def worker_processes(self, encoder_on_gpu: bool) -> int:
        """How many ranking processes run: ``workers``, with 'auto' decided by the cores this process may use and
        where the encoder runs (on a GPU a question costs a worker little CPU, and each worker its own context)."""
        if self.workers != "auto":
            return self.workers
        cores = len(os.sched_getaffinity(0))
        if cores < 8:
            return 0
        return min(4, cores // 4) if encoder_on_gpu else min(8, cores // 2)


class PageSettings(BaseModel):
    tokens: int = Field(
        4096, ge=0, description="Pages: documents smaller than half this many tokens (abstracts, FAQ entries, short "
        "files) are grouped by meaning into pages of about this size, and a page is the cached unit the document "
        "strategy puts first in a prompt (0: off). Ingest builds them; change it, re-ingest.")


class ChunkSettings(BaseModel):
    size: int = Field(200, ge=16, description="Target chunk size in embedder tokens (capped to the encoder window).")
    overlap: int = Field(24, ge=0, description="Overlap between neighbouring chunks, in embedder tokens.")
    parent_field: str | None = Field(None, description="JSONL field naming a record's parent document.")

    @model_validator(mode="after")
    def _overlap_below_size(self) -> ChunkSettings:
        if self.overlap >= self.size:
            raise ValueError(f"chunk overlap ({self.overlap}) must be smaller than chunk size ({self.size})")
        return self


class IngestSettings(BaseModel):
    lock_timeout_s: float = Field(30.0, ge=0, description="How long a second ingest waits for the lock before failing.")
    write_batch: int = Field(256, ge=1, description="Chunks embedded and upserted per write batch.")
    max_file_mb: float = Field(50.0, gt=0, description="Files larger than this are skipped and reported.")
    prefetch_files: int = Field(4, ge=1, description="Files loaded and chunked ahead while the encoder runs.")
    progress_s: float = Field(10.0, gt=0, description="Seconds between progress lines when stderr is no terminal.")
    chunk_workers: int | Literal["auto"] = Field(
        "auto", description="Processes that load and chunk files beside the encoder (0: one thread of this process; "
        "auto: none below 8 cores, else a quarter of them, at most 8).")

    @field_validator("chunk_workers")
    @classmethod
    def _workers_not_negative(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 0:
            raise ValueError("chunk_workers must be 0 or more (or 'auto')")
        return value

    def chunk_processes(self) -> int:
        """How many chunking processes run: ``chunk_workers``, with 'auto' decided by the cores this process may
        use (chunking counts tokens a dozen times per chunk: on a GPU host one thread cannot keep the encoder
        busy; on a small machine the encoder is the limit and processes would only compete with it)."""
        if self.chunk_workers != "auto":
            return self.chunk_workers
        cores = len(os.sched_getaffinity(0))
        return 0 if cores < 8 else min(8, cores // 4)
