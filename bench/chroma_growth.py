"""Where one Chroma stops: a collection grown past what this machine can embed, measured at each size.

The rows come from a store that ingest made (``--from-chroma``, e.g. ``bench.scale``'s work store): their texts and
metadata as they are, their vectors jittered (seeded Gaussian noise, renormalised), under new ids, copied again
until each ``--sizes`` is reached. So the rows are what the service stores (15 metadata keys, real chunk texts as
one more metadata value) and the vectors keep the real ones' clusters, without an encoder's hours. Into a
collection made as ingest makes it, of a ``chroma run`` server started here (or on disk with ``--on-disk``), it
measures at each size:

- **writes**: rows/s of the upserts that grew it, in ingest's write batches;
- **queries**: the service's dense query (k results with texts, metadata and distances), vectors of stored rows
  jittered, at each ``--concurrency`` (threads, a client each): p50/p95/p99 ms and queries/s;
- **memory and disk**: the server's resident memory (this process's with ``--on-disk``) and the store's bytes.

With ``--write-parts N``, first: rows/s of N such rows written into fresh collections with less of each row (the
vectors alone; with their metadata; with their texts too, as documents, as ingest wrote them before), once more with
a schema that turns the texts' full-text index off (the service never searches Chroma's full text), with each
text a metadata value instead of a document, as ingest writes them now, and with the metadata packed into five keys
(``PACKED``, a layout not built): what a write costs, by part, and what a read of every row's metadata costs.

    python -m bench.chroma_growth --from-chroma /tmp/bs-work/chroma --from-collection scale \\
        --sizes 50000,100000,200000 --out bench/results/chroma-growth-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import command_line, environment, stored_collection, write_json
from bench.stats import ms_summary

WRITE_BATCH = 256  # ingest's default write batch
PARTS = {"vectors": ("embeddings",), "vectors, metadata": ("embeddings", "metadatas"),
         "vectors, metadata, texts": ("embeddings", "metadatas", "documents")}
NO_FULL_TEXT = "vectors, metadata, texts; full-text index off in the schema"
TEXT_AS_METADATA = "vectors, metadata with the text as one more key, no texts"  # as ingest writes since
PACKED = "vectors, metadata as 5 keys: the 3 filtered on, the text, the rest as one JSON value"  # not built
FILTERED_KEYS = ("doc_id", "parent_id", "source")  # the keys the service's `where` filters name
JITTER = 0.05  # noise per dimension before renormalising: copies stay near their source, not on it


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.chroma_growth", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--from-chroma", type=Path, required=True, help="an on-disk store ingest made: the rows")
    parser.add_argument("--from-collection", default="docs", help="its collection (default %(default)s)")
    parser.add_argument("--sizes", default="20000,50000", help="rows per step, comma-separated (default %(default)s)")
    parser.add_argument("--concurrency", default="1,4,16", help="queries in flight, comma-separated "
                                                                "(default %(default)s)")
    parser.add_argument("--queries", type=int, default=400, help="queries per concurrency and size")
    parser.add_argument("--k", type=int, default=5, help="results per query (default %(default)s)")
    parser.add_argument("--write-parts", type=int, default=0, metavar="N",
                        help="first time writes of N rows by part of the row (0: not measured; default %(default)s)")
    parser.add_argument("--on-disk", action="store_true", help="grow an on-disk store instead of a `chroma run` server")
    parser.add_argument("--work", type=Path, default=Path("data/bench-chroma-growth"),
                        help="the grown store (emptied first; default %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/chroma-growth.json"), help="JSON output")
    return parser.parse_args(argv)


def source_rows(path: Path, collection: str) -> dict[str, Any]:
    """Every row of the source store: vectors (float32), texts, metadata less the text (a store written before the
    texts moved into the metadata holds them as documents)."""
    from app.core.records import row_text, without_text
    from app.core.store import all_rows

    source = stored_collection(path, collection)
    rows: dict[str, list[Any]] = {"embeddings": [], "documents": [], "metadatas": []}
    for page in all_rows(source, list(rows)):
        for key in rows:
            rows[key].extend(page[key])
    return {"vectors": np.asarray(rows["embeddings"], dtype=np.float32),
            "documents": list(map(row_text, rows["metadatas"], rows["documents"])),
            "metadatas": [without_text(meta) for meta in rows["metadatas"]]}


def jittered(vectors: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    noisy = vectors + rng.normal(0.0, JITTER, vectors.shape).astype(np.float32)
    return noisy / np.linalg.norm(noisy, axis=1, keepdims=True)


def copies(source: dict[str, Any], start: int, stop: int, rng: np.random.Generator) -> Iterator[dict[str, Any]]:
    """Rows ``start``..``stop`` of the grown collection, a write batch at a time: row n is source row n mod size;
    each with its text as a document and, apart, its metadata with the text in it (``metadatas_with_text``) and
    packed (``metadatas_packed``)."""
    from app.core.records import TEXT_KEY

    size = len(source["documents"])
    for first in range(start, stop, WRITE_BATCH):
        picks = [n % size for n in range(first, min(first + WRITE_BATCH, stop))]
        yield {"ids": [f"grown-{first + i}" for i in range(len(picks))],
               "embeddings": jittered(source["vectors"][picks], rng),
               "documents": [source["documents"][p] for p in picks],
               "metadatas": [source["metadatas"][p] for p in picks],
               "metadatas_with_text": [source["metadatas"][p] | {TEXT_KEY: source["documents"][p]} for p in picks],
               "metadatas_packed": [packed(source["metadatas"][p], source["documents"][p]) for p in picks]}


def packed(meta: dict[str, Any], text: str) -> dict[str, Any]:
    """A row's metadata as ``PACKED`` lays it out: fewer keys, each one more row of Chroma's metadata table."""
    from app.core.records import TEXT_KEY

    rest = {key: value for key, value in meta.items() if key not in FILTERED_KEYS}
    return {key: meta[key] for key in FILTERED_KEYS if key in meta} | {
        TEXT_KEY: text, "record": json.dumps(rest, separators=(",", ":"))}


def grow(collection: Any, source: dict[str, Any], start: int, stop: int, rng: np.random.Generator) -> float:
    """Rows/s of the upserts from ``start`` to ``stop``, written as ingest writes them."""
    began = time.perf_counter()
    for batch in copies(source, start, stop, rng):
        collection.upsert(ids=batch["ids"], embeddings=batch["embeddings"], metadatas=batch["metadatas_with_text"])
    return (stop - start) / (time.perf_counter() - began)


def write_parts(client: Any, source: dict[str, Any], rows: int, rng: np.random.Generator) -> dict[str, Any]:
    """Rows/s of ``rows`` rows upserted into a fresh collection for each of ``PARTS`` (the fields written), and
    with every field under a schema whose full-text index on the texts is off (``NO_FULL_TEXT``), and with each
    text a metadata value instead (``TEXT_AS_METADATA``: a layout that never fills the full-text index), and
    packed (``PACKED``). Then the seconds a read of every row's metadata takes in each (what the inventory, the
    pages and the sources list read)."""
    from chromadb.api.types import FtsIndexConfig, Schema, VectorIndexConfig

    from app.core.store import CONFIGURATION, SPACE, all_rows

    batches = list(copies(source, 0, rows, rng))  # made before the clock starts: only the writes are timed
    no_full_text = Schema().delete_index(FtsIndexConfig(), key="#document").create_index(
        VectorIndexConfig(space=SPACE))
    plans: list[tuple[str, tuple[str, ...], dict[str, Any]]] = [
        (name, fields, {"configuration": CONFIGURATION}) for name, fields in PARTS.items()]
    plans.append((NO_FULL_TEXT, PARTS["vectors, metadata, texts"], {"schema": no_full_text}))
    plans.append((TEXT_AS_METADATA, ("embeddings", "metadatas_with_text"), {"configuration": CONFIGURATION}))
    plans.append((PACKED, ("embeddings", "metadatas_packed"), {"configuration": CONFIGURATION}))
    rates: dict[str, float] = {}
    metadata_read_s: dict[str, float] = {}
    for number, (name, fields, made_with) in enumerate(plans):
        collection = client.create_collection(f"parts-{number}", embedding_function=None, **made_with)
        began = time.perf_counter()
        for batch in batches:
            collection.upsert(ids=batch["ids"], **{field.split("_")[0]: batch[field] for field in fields})
        rates[name] = round(rows / (time.perf_counter() - began), 1)
        began = time.perf_counter()
        sum(len(page["ids"]) for page in all_rows(collection, ["metadatas"]))
        metadata_read_s[name] = round(time.perf_counter() - began, 3)
        client.delete_collection(f"parts-{number}")
    return {"rows_per_s": rates, "metadata_read_s": metadata_read_s}


def query_latency(open_collection: Any, source: dict[str, Any], concurrency: int, queries: int, k: int,
                  rng: np.random.Generator) -> dict[str, Any]:
    """The service's dense query, ``queries`` of them ``concurrency`` at a time, a client per thread."""
    asked = jittered(source["vectors"][rng.integers(0, len(source["vectors"]), queries)], rng)
    handles = [open_collection() for _ in range(concurrency)]

    def ask(n: int, handle: Any = None) -> float:
        began = time.perf_counter()
        (handle or handles[n % concurrency]).query(query_embeddings=[asked[n].tolist()], n_results=k,
                                                   include=["documents", "metadatas", "distances"])
        return time.perf_counter() - began

    for handle in handles:  # each client's first query (its connection, the index's load) is not timed
        ask(0, handle)
    began = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        times = list(pool.map(ask, range(queries)))
    return ms_summary(times) | {"queries_per_s": round(queries / (time.perf_counter() - began), 1)}


def resident_mib(pid: int) -> float:
    """A process's resident memory with its children's (``chroma run`` may serve from a child)."""
    import psutil

    from bench.scale_stack import rss_mib

    return rss_mib(psutil.Process(pid))


def disk_mib(path: Path) -> float:
    return round(sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20, 1)


def measure(args: argparse.Namespace, argv: list[str] | None, settings: Any, server_pid: int,
            store: Path) -> dict[str, Any]:
    from app.core.store import CONFIGURATION, open_client

    rng = np.random.default_rng(args.seed)
    source = source_rows(args.from_chroma, args.from_collection)
    client = open_client(settings)
    collection = client.create_collection(settings.collection, configuration=CONFIGURATION,
                                          embedding_function=None)

    def handle() -> Any:
        return open_client(settings).get_collection(settings.collection, embedding_function=None)

    result: dict[str, Any] = {"source_rows": len(source["documents"]), "store": "on disk" if args.on_disk
                              else "chroma run", "k": args.k, "steps": [],
                              "command": command_line("bench.chroma_growth", argv), "environment": environment()}
    if args.write_parts:
        result["write_parts"] = {"rows": args.write_parts} | write_parts(client, source, args.write_parts, rng)
        print(f"writes by part: {result['write_parts']}", flush=True)
    grown = 0
    for size in sorted(int(n) for n in args.sizes.split(",")):
        step: dict[str, Any] = {"rows": size, "writes_per_s": round(grow(collection, source, grown, size, rng), 1)}
        grown = size
        step["queries"] = {f"c{c}": query_latency(handle, source, c, args.queries, args.k, rng)
                           for c in (int(n) for n in args.concurrency.split(","))}
        step |= {"resident_mib": resident_mib(server_pid), "disk_mib": disk_mib(store)}
        result["steps"].append(step)
        write_json(args.out, result)  # after every size: a run stopped later keeps what it measured
        print(f"{size} rows: {step}", flush=True)
    return result


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [step["rows"] for step in result["steps"]]
    figure, (latency, memory) = plt.subplots(1, 2, figsize=(11, 4))
    for key in result["steps"][0]["queries"]:
        latency.plot(rows, [step["queries"][key]["p95"] for step in result["steps"]], "o-", label=f"p95, {key}")
    latency.set(xlabel="rows", ylabel="dense query ms", title=f"one Chroma ({result['store']})")
    latency.legend()
    memory.plot(rows, [step["resident_mib"] for step in result["steps"]], "o-", label="resident MiB")
    memory.plot(rows, [step["disk_mib"] for step in result["steps"]], "s--", label="disk MiB")
    memory.set(xlabel="rows", title="memory and disk")
    memory.legend()
    figure.tight_layout()
    figure.savefig(path)


def main(argv: list[str] | None = None) -> int:
    from app.core.settings import ChromaSettings
    from app.vllm.process import chroma_child, free_port

    args = parse_args(argv)
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    store = args.work / "store"
    if args.on_disk:
        result = measure(args, argv, ChromaSettings(path=store, collection="growth"), os.getpid(), store)
    else:
        port = free_port()
        server = chroma_child(store, port, args.work / "server.log").start()
        try:
            server.wait_for(f"http://127.0.0.1:{port}/api/v2/heartbeat", 60)
            settings = ChromaSettings(url=f"http://127.0.0.1:{port}", collection="growth")
            result = measure(args, argv, settings, server.pid, store)
        finally:
            server.stop(20)
    plot(result, args.out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
