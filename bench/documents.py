"""``python -m bench.documents --data DIR``: documents over HTTP as users run them (``python -m app``, uploads over
HTTP): upload throughput against the raw encoder, how soon an uploaded document is answered from after its job
says done, and how long deleting a big document takes.

The app starts over a fresh on-disk collection (no vLLM needed: ``/v1/retrieve`` answers without one). DIR's
files are uploaded in one request; the job's wall time (upload, ingest in its child process, the service's
reload) against the same chunk texts encoded in-process by the same encoder and batches (the ceiling); then a
question from an uploaded document is ranked until it is found; then a generated document of ``--big-mb`` MB is
uploaded and deleted, the ``DELETE`` timed, its hits for one of its sentences counted before and just after it, and
the time until its rows are gone (the generation moves). Targets (issue 34): upload >= 0.9 x the raw encoder;
answerable <= 5 s after done; deleting a 7.5 MB document <= 1 s.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import command_line, environment, write_json


def big_document(megabytes: float) -> bytes:
    """Markdown of about ``megabytes`` MB: numbered sections of distinct sentences (every chunk its own text)."""
    parts, size, n = [], 0, 0
    while size < megabytes * 1e6:
        digest = hashlib.sha256(str(n).encode()).hexdigest()[:12]
        part = (f"## Section {n}\n\nRecord {n} of the ledger notes the shipment {digest}, weighed at {n % 97} "
                f"tonnes and landed on quay {n % 13}. " * 6 + "\n\n")
        parts.append(part)
        size, n = size + len(part), n + 1
    return "".join(parts).encode()


def finished(client: httpx.Client, response: httpx.Response, timeout_s: float = 3600) -> tuple[dict, float]:
    """The job a ``202`` queued, once ended, and when it was seen ended (``perf_counter``; polled every 0.1 s:
    the polls cost the app's process a little CPU, which the job's child ingest shares the cores with)."""
    response.raise_for_status()
    deadline = time.monotonic() + timeout_s
    while (job := client.get(response.headers["location"]).json())["status"] in ("queued", "running"):
        if time.monotonic() > deadline:
            raise SystemExit(f"the job did not end in {timeout_s:.0f}s: {job}")
        time.sleep(0.1)
    if job["status"] != "done":
        raise SystemExit(f"the job failed: {job}")
    return job, time.perf_counter()


def ranked_from(client: httpx.Client, lookup: dict[str, Any], document: str) -> int:
    """How many of ``/v1/retrieve``'s hits for ``lookup`` come from ``document``."""
    return sum(hit["document"] == document for hit in client.post("/v1/retrieve", json=lookup).json()["data"])


def raw_encoder_over(chroma: Path, collection: str) -> tuple[float, int]:
    """``bench.ingest``'s ceiling over the uploaded collection: the encoder alone, in ingest's batches."""
    from app.core.embedder import Embedder
    from app.core.settings import Settings
    from app.core.store import open_collection
    from bench.ingest import raw_encoder_rate, stored_texts

    settings = Settings(_env_file=None)
    settings.chroma.path, settings.chroma.collection = chroma, collection
    embedder = Embedder(settings.embedding)
    embedder.embed(["warm the encoder up"])
    texts = stored_texts(open_collection(settings.chroma, embedder, create=False))
    return raw_encoder_rate(embedder, texts, settings.ingest.write_batch), len(texts)


def chroma_delete_seconds(rows: int, others: int, tmp: Path) -> float:
    """Chroma's own time to delete ``rows`` rows of one document beside ``others``, as the service does (one
    read of the ids by metadata, one delete), over random vectors: what a deletion costs before the service."""
    import chromadb
    import numpy as np
    from chromadb.config import Settings as ChromaConfig

    from app.core.records import TEXT_KEY
    from app.core.store import CONFIGURATION

    client = chromadb.PersistentClient(str(tmp / "alone"), settings=ChromaConfig(anonymized_telemetry=False))
    collection = client.create_collection("delete-alone", configuration=CONFIGURATION)
    vectors = np.random.default_rng(0).standard_normal((rows + others, 384)).astype(np.float32)
    for start in range(0, rows + others, 5000):
        span = range(start, min(start + 5000, rows + others))
        collection.add(ids=[f"row-{i}" for i in span], embeddings=vectors[span.start:span.stop],
                       metadatas=[{"doc_id": "big" if i < rows else f"doc-{i}", TEXT_KEY: "a chunk of text " * 40}
                                  for i in span])
    started = time.perf_counter()
    collection.delete(ids=collection.get(where={"doc_id": "big"}, include=[])["ids"])
    return time.perf_counter() - started


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from app.vllm.process import app_child, free_port

    port, collection = free_port(), "bench-documents"
    env = {"PREFIXRAG_VLLM_URL": "http://127.0.0.1:9/v1", "PREFIXRAG_CHROMA_PATH": str(tmp / "chroma"),
           "PREFIXRAG_COLLECTION": collection, "PREFIXRAG_CONTEXT__HOTNESS_DIR": "",
           "PREFIXRAG_SERVICE__MAX_UPLOAD_BYTES": str(1 << 30)}
    files = sorted(p for p in args.data.rglob("*") if p.is_file())
    app = app_child(tmp / "app.log", env, port).start()
    try:
        app.wait_for(f"http://127.0.0.1:{port}/healthz", 120)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=3600) as client:
            started = time.perf_counter()
            upload = [("files", (str(p.relative_to(args.data)), p.read_bytes())) for p in files]
            job, done_at = finished(client, client.post("/v1/documents", files=upload))
            upload_s = done_at - started
            probe, question = next((path.relative_to(args.data).as_posix(), line[:200])
                                   for path in files[len(files) // 2:] + files
                                   for line in path.read_text(errors="replace").splitlines()
                                   if len(line.split()) > 8)  # a sentence of a file in the middle
            while probe not in [h["document"] for h in client.post("/v1/retrieve", json={
                    "question": question, "top_k": 10}).json().get("data", [])]:
                time.sleep(0.05)
            answerable_s = time.perf_counter() - done_at
            big = big_document(args.big_mb)
            big_job, _ = finished(client, client.post("/v1/documents", files=[("files", ("ledger.md", big))]))
            ledger = {"question": big.decode().split("\n\n")[1].split(". ")[0], "top_k": 10}
            cited_before = ranked_from(client, ledger, "ledger.md")
            generation = client.get(f"/v1/collections/{collection}").json()["generation"]
            started = time.perf_counter()
            deleted = client.delete("/v1/documents/ledger.md")
            delete_s = time.perf_counter() - started
            deleted.raise_for_status()
            cited_after = ranked_from(client, ledger, "ledger.md")
            deadline = time.monotonic() + 600
            while client.get(f"/v1/collections/{collection}").json()["generation"] == generation:
                if time.monotonic() > deadline:
                    raise SystemExit("the deleted document's rows were still stored 600 s after its DELETE")
                time.sleep(0.05)
            rows_gone_s = time.perf_counter() - started
    finally:
        app.stop()
        if args.app_log:
            shutil.copyfile(tmp / "app.log", args.app_log)
    encoder_rate, distinct = raw_encoder_over(tmp / "chroma", collection)
    embedded = job["report"]["chunks_embedded"]
    alone_s = chroma_delete_seconds(deleted.json()["chunks"], embedded, tmp)
    return {
        "data": str(args.data), "files": len(files), "failed": job["report"]["files_failed"],
        "chunks_embedded": embedded, "upload_s": round(upload_s, 3),
        "ingest_in_job_s": job["report"]["seconds"], "upload_embedded_per_s": round(embedded / upload_s, 2),
        "raw_encoder_chunks_per_s": round(encoder_rate, 2), "raw_encoder_texts": distinct,
        "ratio_to_encoder": round(embedded / upload_s / encoder_rate, 3),
        "answerable_after_done_s": round(answerable_s, 3),
        "big_document_mb": round(len(big) / 1e6, 2), "big_document_chunks": deleted.json()["chunks"],
        "big_upload_job_s": big_job["report"]["seconds"], "delete_s": round(delete_s, 3),
        "big_hits_before_delete": cited_before, "big_hits_after_delete": cited_after,
        "rows_gone_after_delete_s": round(rows_gone_s, 3),
        "chroma_delete_alone_s": round(alone_s, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.documents", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="folder whose files are uploaded")
    parser.add_argument("--big-mb", type=float, default=7.5, help="size of the document uploaded, then deleted")
    parser.add_argument("--out", type=Path, default=Path("bench/results/documents.json"), help="JSON output")
    parser.add_argument("--app-log", type=Path, help="keep the app's log here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-documents-") as tmp:
        result = run(args, Path(tmp))
    result |= {"command": command_line("bench.documents", argv), "environment": environment()}
    write_json(args.out, result)
    print(f"upload: {result['chunks_embedded']} chunks in {result['upload_s']:.1f}s, "
          f"{result['ratio_to_encoder']} x the raw encoder; answerable {result['answerable_after_done_s']:.3f}s "
          f"after done; a {result['big_document_mb']} MB document deleted in {result['delete_s']:.3f}s "
          f"(hits {result['big_hits_before_delete']} -> {result['big_hits_after_delete']}; rows gone after "
          f"{result['rows_gone_after_delete_s']:.3f}s; Chroma alone {result['chroma_delete_alone_s']:.3f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
