"""``python -m bench.ingest --data DIR``: ingest throughput vs the raw encoder, and the unchanged re-run.

Ingests DIR into a fresh collection (temporary on-disk Chroma), then encodes the very same chunk texts with the
same encoder and batch size in the same process (the ceiling: ingest is encoder-bound), then re-ingests the
unchanged corpus, in process and as a user does: ``python -m ingest DIR`` (wall time of the whole command,
interpreter start and imports included). Targets: ingest >= 0.9 x raw encoder throughput; unchanged re-ingest
<= 2% of the first in process, <= 10% as a CLI run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import command_line, environment, write_json


def corpus_bytes(root: Path) -> int:
    from ingest.files import discover

    files, _, _ = discover([root])
    return sum(path.stat().st_size for path, _ in files)


def stored_texts(collection: Any, limit: int | None = None) -> list[str]:
    """The collection's distinct texts (ingest embeds each once), read a page at a time; the first ``limit``."""
    from app.core.records import row_text
    from app.core.store import all_rows

    texts: dict[str, None] = {}
    for page in all_rows(collection, ["documents", "metadatas"]):
        texts.update(dict.fromkeys(map(row_text, page["metadatas"], page["documents"])))
        if limit is not None and len(texts) >= limit:
            break
    return list(texts)[:limit]


def raw_encoder_rate(embedder: Any, texts: list[str], batch: int) -> float:
    """Chunks a second the encoder alone embeds over ``texts``, in the writer's batches: the ceiling, ingest
    being encoder-bound."""
    started = time.perf_counter()
    for start in range(0, len(texts), batch):
        embedder.embed(texts[start:start + batch])
    return len(texts) / (time.perf_counter() - started)


def cli_reingest_seconds(data: Path, chroma: Path, collection: str) -> float:
    """Wall time of ``python -m ingest DATA`` on the already-ingested store (it must write nothing)."""
    env = os.environ | {"PREFIXRAG_CHROMA_PATH": str(chroma), "PREFIXRAG_COLLECTION": collection}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "ingest", str(data), "--json"], env=env, capture_output=True,
                          text=True, check=True)
    seconds = round(time.perf_counter() - started, 3)
    report = json.loads(done.stdout.splitlines()[-1])
    if report["chunks_written"] or report["chunks_deleted"] or report["chunks_relabeled"]:
        raise SystemExit("the unchanged re-ingest wrote chunks: not a re-ingest")
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ingest", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="folder (or file) to ingest")
    parser.add_argument("--out", type=Path, help="JSON output (default bench/results/ingest-<name>.json)")
    args = parser.parse_args(argv)

    from app.core.embedder import Embedder
    from app.core.settings import Settings
    from app.core.store import open_collection
    from ingest.pipeline import run_ingest

    settings = Settings(_env_file=None)
    embedder = Embedder(settings.embedding)
    embedder.embed(["warm the encoder up"])  # first-call overhead belongs to neither side
    with tempfile.TemporaryDirectory(prefix="bench-ingest-") as tmp:
        settings.chroma.path, settings.chroma.collection = Path(tmp) / "chroma", "bench-ingest"
        first = run_ingest([args.data], settings, embedder)
        collection = open_collection(settings.chroma, embedder, create=False)
        encoder_rate = raw_encoder_rate(embedder, stored_texts(collection), settings.ingest.write_batch)
        again = run_ingest([args.data], settings, embedder)
        cli_s = cli_reingest_seconds(args.data, settings.chroma.path, settings.chroma.collection)
    size = corpus_bytes(args.data)
    ingest_rate = first.chunks_embedded / first.seconds
    result: dict[str, Any] = {
        "data": str(args.data), "files": first.files_seen, "failed": len(first.failed), "chunks": first.chunks_written,
        "chunks_embedded": first.chunks_embedded, "bytes": size, "seconds": first.seconds,
        "chunks_per_s": round(first.chunks_written / first.seconds, 2),
        "mb_per_s": round(size / 1e6 / first.seconds, 3),
        "embedded_per_s": round(ingest_rate, 2), "raw_encoder_chunks_per_s": round(encoder_rate, 2),
        "ratio_to_encoder": round(ingest_rate / encoder_rate, 3), "encoder_batch_size": settings.embedding.batch_size,
        "reingest_seconds": again.seconds, "reingest_writes": again.writes,
        "reingest_share": round(again.seconds / first.seconds, 4), "reingest_cli_seconds": cli_s,
        "reingest_cli_share": round(cli_s / first.seconds, 4),
        "command": command_line("bench.ingest", argv), "environment": environment(),
    }
    name = args.data.resolve().name
    name = args.data.resolve().parent.name if name == "files" else name  # shared/data/<set>/files
    out = args.out or Path("bench/results") / f"ingest-{name}.json"
    write_json(out, result)
    print(f"{result['files']} files, {result['chunks']} chunks in {result['seconds']:.1f}s "
          f"({result['embedded_per_s']} embedded/s vs raw encoder {result['raw_encoder_chunks_per_s']}/s: "
          f"ratio {result['ratio_to_encoder']}); unchanged re-ingest {again.seconds:.2f}s "
          f"({100 * result['reingest_share']:.2f}%); as a CLI run {cli_s:.2f}s "
          f"({100 * result['reingest_cli_share']:.2f}%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
