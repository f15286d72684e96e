"""``python -m bench.query_encoder --data DIR --chroma PATH``: what the service's question encoder costs on this
machine's CPU in each runtime and number format (one thread, as a ranking worker runs it; ``--device cuda``: torch's
rows on the GPU, as with PREFIXRAG_EMBEDDING__DEVICE=cuda), and whether that
changes what is retrieved. Per ``--encoders`` value (runtime/dtype): the median time to encode a batch of 1, 2 and
4 of the dataset's questions, as the service does and, interleaved with it, through sentence-transformers'
``encode``; then its dense top-5 from the ingested collection (``python -m bench.throughput`` or
``bench.prefix_cache`` ingests it) against the first encoder's: the chunks in common, and recall@5 (a gold
document among them); and recall@5 of the service's own hybrid ranking (BM25 and dense fused) with it.
Documents are always encoded by torch in float32 (ingest)."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from bench.common import command_line, environment, write_json
from bench.datasets import load_dataset, sample
from bench.stats import gold_found


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.query_encoder", description=__doc__)
    parser.add_argument("--data", type=Path, required=True, help="a QA dataset folder (bench.datasets layout)")
    parser.add_argument("--chroma", type=Path, required=True, help="the on-disk Chroma holding its collection")
    parser.add_argument("--encoders", default="torch/float32,torch/bfloat16,onnx/float32,onnx/int8",
                        help="PREFIXRAG_EMBEDDING__QUERY_RUNTIME/QUERY_DTYPE pairs, comma-separated")
    parser.add_argument("--device", default="cpu",
                        help="where torch runs the encoder (PREFIXRAG_EMBEDDING__DEVICE; default cpu, whatever the "
                             "machine has: 'auto' would put torch's rows on a GPU and onnx's on the CPU)")
    parser.add_argument("--questions", type=int, default=1000, help="questions for the rankings (default 1000)")
    parser.add_argument("--batches", type=int, default=150, help="timed batches per batch size (default 150)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/query-encoder.json"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from app.core.embedder import Embedder, limit_threads
    from app.core.settings import ChromaSettings
    from app.core.settings_corpus import EmbeddingSettings
    from app.core.store import open_client

    args = parse_args(argv)
    dataset = load_dataset(args.data)
    questions = sample(dataset.questions, args.questions, seed=0)
    texts = [question.text for question in questions]
    chroma = ChromaSettings(path=args.chroma, collection=dataset.collection)
    collection = open_client(chroma, create=False).get_collection(dataset.collection)  # as the service opens it
    limit_threads(1)
    rows, reference = [], None
    for pair in args.encoders.split(","):
        runtime, dtype = pair.split("/")
        device = "cpu" if runtime == "onnx" else args.device  # ONNX Runtime runs it on the CPU only
        settings = EmbeddingSettings(device=device, query_runtime=runtime, query_dtype=dtype)
        encoder = Embedder(settings, questions=True).load()
        paths = {"encode_ms_median": encoder.embed,
                 "library_encode_ms_median": encoder.model.encode}
        row: dict = {"runtime": runtime, "dtype": dtype, "device": str(encoder.model.device)} | {
            name: {} for name in paths}
        for size in (1, 2, 4):
            times: dict[str, list[float]] = {name: [] for name in paths}
            for embed in paths.values():
                embed(texts[:size])  # first call: allocations, kernels chosen
            for n in range(args.batches):
                for name in sorted(paths, reverse=bool(n % 2)):  # alternately first: neither gets the warmer cache
                    started = time.perf_counter()
                    paths[name](texts[n * size:(n + 1) * size])
                    times[name].append(time.perf_counter() - started)
            for name, taken in times.items():
                row[name][str(size)] = round(statistics.median(taken) * 1000, 2)
        vectors: Any = encoder.embed(texts)  # Chroma's stubs want sequences; lists of floats are what it takes
        found: Any = collection.query(query_embeddings=vectors, n_results=5, include=["metadatas"])
        documents = [{meta["doc_id"] for meta in metas} for metas in found["metadatas"]]
        reference = reference or found["ids"]
        row["recall_at_5"] = round(gold_found(documents, questions), 4)
        row["top5_chunks_in_common_with_first"] = round(
            sum(len(set(a) & set(b)) for a, b in zip(found["ids"], reference, strict=True)) / len(questions), 3)
        row["hybrid_recall_at_5"] = hybrid_recall(encoder, dataset.collection, args.chroma, questions)
        rows.append(row)
        print(row, flush=True)
    write_json(args.out, {"dataset": dataset.name, "questions": len(questions), "results": rows,
                          "command": command_line("bench.query_encoder", argv), "environment": environment()})
    return 0


def hybrid_recall(encoder: Any, collection: str, chroma: Path, questions: list) -> float:
    """Recall@5 of the service's own ranking (BM25 and dense, fused: the default mode) with ``encoder`` for the
    questions, ranked in this process."""
    import asyncio

    from app.core.settings import Settings
    from app.runtime.services import build_services

    async def ranked() -> list[set[str]]:
        settings = Settings(_env_file=None)
        settings.chroma.path, settings.chroma.collection = chroma, collection
        settings.retrieval.workers = 0  # ranked here, by this encoder
        services = await build_services(settings, embedder=encoder)
        try:
            await services.index.indexes_ready()
            return [{chunk.doc_id for chunk in services.retriever.retrieve_sync(q.text, 5, None, "hybrid")}
                    for q in questions]
        finally:
            await services.aclose()

    found = asyncio.run(ranked())
    return round(gold_found(found, questions), 4)


if __name__ == "__main__":
    raise SystemExit(main())
