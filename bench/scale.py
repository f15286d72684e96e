"""``python -m bench.scale --data DIR --documents 20000,100000``: prefixrag as the corpus grows.

A QA dataset's passages are mixed into distractor documents (``bench.scale_corpus``) and, for each size in turn
(smallest first, each one extending the store the one before built), it measures:

- **ingest**: chunks/s of ``run_ingest`` against the raw encoder's chunks/s on a sample of the same texts in the
  writer's batches (the ceiling: ingest is encoder-bound), and an unchanged re-ingest's time;
- **retrieval**: the service's own ranker (``build_services``: worker processes where the app would start them)
  in dense, lexical and hybrid modes, latency p50/p95 in closed loops at each ``--concurrency``, gold recall@k on
  the mixed corpus, and beside it on the gold passages alone; the derived indexes' load time (BM25, pages);
- **pre-warm's planning**: from asking for the plan to its first unit (the plan scans every chunk's metadata);
- **the app as users start it** (``python -m app`` against ``bench.instant_vllm``): seconds to ``/readyz`` 200
  and its resident memory with its ranking workers, at ready.

JSON (``--out``) + plot beside it. The encoder's device is the service's setting (``PREFIXRAG_EMBEDDING__DEVICE``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import command_line, environment, write_json
from bench.datasets import Question, load_dataset, sample
from bench.ingest import raw_encoder_rate, stored_texts
from bench.scale_corpus import build_corpus, sentence_pool
from bench.scale_stack import app_startup
from bench.stats import gold_found, ms_summary

MODES = ("dense", "lexical", "hybrid")
POOL = ("scifact", "tatqa", "fastapi-docs-md", "python-3.11-docs-html")  # the other folders of ../shared/data
ENCODER_SAMPLE = 20_000  # texts the raw encoder's rate is measured on


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="QA dataset folder: its passages are the gold")
    parser.add_argument("--documents", default="2000,10000",
                        help="distractor documents (one or two chunks each) per size, comma-separated "
                             "(default %(default)s)")
    parser.add_argument("--pool", type=Path, nargs="*",
                        help="folders whose sentences make the distractors (default: the other data folders beside "
                             "--data: " + ", ".join(POOL) + ")")
    parser.add_argument("--pool-cache", type=Path, help="the sentence pool as .json.gz: read if present, else written")
    parser.add_argument("--work", type=Path, default=Path("data/bench-scale"),
                        help="corpus and Chroma store, kept between runs (default %(default)s)")
    parser.add_argument("--questions", type=int, default=200, help="questions drawn (seeded shuffle)")
    parser.add_argument("--concurrency", default="1,32",
                        help="rankings in flight, comma-separated (default %(default)s)")
    parser.add_argument("--top-k", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-app", action="store_true", help="skip the app's start-up and memory")
    parser.add_argument("--chroma-server", action="store_true",
                        help="store in a `chroma run` server started here (under --work) instead of on-disk Chroma")
    parser.add_argument("--out", type=Path, help="JSON output (default bench/results/scale-<dataset>.json)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.chroma_url = None
    if not args.chroma_server:
        return measure(args, argv)
    from app.vllm.process import chroma_child, free_port

    port = free_port()
    args.work.mkdir(parents=True, exist_ok=True)
    server = chroma_child(args.work / "chroma-server", port, args.work / "chroma-server.log").start()
    try:
        server.wait_for(f"http://127.0.0.1:{port}/api/v2/heartbeat", 60)
        args.chroma_url = f"http://127.0.0.1:{port}"
        return measure(args, argv)
    finally:
        server.stop(20)


def measure(args: argparse.Namespace, argv: list[str] | None) -> int:
    dataset = load_dataset(args.data)
    roots = args.pool if args.pool is not None else [args.data.parent / name for name in POOL]
    pool = sentence_pool(roots, args.pool_cache)
    questions = [q for q in sample(dataset.questions, args.questions, args.seed) if q.gold]
    sizes = sorted(int(n) for n in args.documents.split(","))
    concurrency = [int(c) for c in args.concurrency.split(",")]
    small = asyncio.run(retrieval_report(gold_alone(args, dataset.passages), questions, args.top_k, [1]))
    out = args.out or Path("bench/results") / f"scale-{dataset.name}.json"
    result = {"dataset": dataset.name, "questions": len(questions), "top_k": args.top_k, "pool_sentences": len(pool),
              "store": "chroma run" if args.chroma_url else "on disk", "small_corpus": small, "steps": [],
              "bytes_per_chunk": None,
              "command": command_line("bench.scale", argv), "environment": environment()}
    for documents in sizes:
        corpus = build_corpus(dataset.passages, pool, documents, args.work / "corpus", args.seed)
        settings, ingest = ingested(args, [args.work / "corpus"], "scale")
        step: dict[str, Any] = {**corpus, "chunks": ingest.pop("chunks_total"), "ingest": ingest}
        print(f"{documents} distractors: {json.dumps(step)}", flush=True)
        step["retrieval"] = asyncio.run(retrieval_report(settings, questions, args.top_k, concurrency))
        step["planning_s"] = asyncio.run(planning_seconds(settings))
        if not args.no_app:
            step["app"] = app_startup(settings, Path(tempfile.mkdtemp(prefix="bench-scale-app-")))
        result["steps"].append(step)
        result["bytes_per_chunk"] = bytes_per_chunk(result["steps"])
        write_json(out, result)  # after every size: a run stopped at the next one keeps this one's figures
        print(summary_line(step), flush=True)
    plot(result, out.with_suffix(".png"))
    return 0


def store_settings(args: argparse.Namespace, collection: str) -> Any:
    """The service's settings (environment included), naming ``collection`` of the work store."""
    from app.core.settings import Settings

    settings = Settings(_env_file=None)
    settings.chroma.path, settings.chroma.collection = args.work / "chroma", collection
    if args.chroma_url:  # the derived indexes then live under lexical_dir
        settings.chroma.url, settings.chroma.lexical_dir = args.chroma_url, args.work / "lexical"
    return settings


def gold_alone(args: argparse.Namespace, passages: Path) -> Any:
    """The gold passages ingested into a collection of their own (recall's reference); its settings."""
    from app.core.embedder import Embedder
    from ingest.pipeline import run_ingest

    settings = store_settings(args, "scale-gold")
    run_ingest([passages], settings, Embedder(settings.embedding))
    return settings


def ingested(args: argparse.Namespace, roots: list[Path], collection: str) -> tuple[Any, dict[str, Any]]:
    """Ingest ``roots`` into ``collection`` of the work store (what is there already is kept), then re-ingest
    them unchanged; the settings that name the store, and the figures."""
    from app.core.devices import torch_device
    from app.core.embedder import Embedder
    from app.core.store import open_collection
    from ingest.pipeline import run_ingest

    settings = store_settings(args, collection)
    embedder = Embedder(settings.embedding)
    embedder.embed(["warm the encoder up"])  # its first call's overhead belongs to neither side
    first = run_ingest(roots, settings, embedder)
    again = run_ingest(roots, settings, embedder)
    stored = open_collection(settings.chroma, embedder, create=False)
    encoder = raw_encoder_rate(embedder, stored_texts(stored, ENCODER_SAMPLE), settings.ingest.write_batch)
    rate = first.chunks_embedded / first.seconds if first.seconds else 0.0
    return settings, {
        "chunks_total": stored.count(), "chunks_written": first.chunks_written,
        "chunks_embedded": first.chunks_embedded, "seconds": first.seconds, "embedded_per_s": round(rate, 1),
        "raw_encoder_chunks_per_s": round(encoder, 1), "ratio_to_encoder": round(rate / encoder, 3) if rate else None,
        "stages_s": first.stages_s, "reingest_seconds": again.seconds, "reingest_writes": again.writes,
        "reingest_stages_s": again.stages_s,
        "reingest_share": round(again.seconds / first.seconds, 4) if first.chunks_written else None,
        "device": torch_device(settings.embedding.device)}


async def retrieval_report(settings: Any, questions: list[Question], k: int, concurrency: list[int]) -> dict:
    """Per mode: the derived indexes' load time, latency at each concurrency, recall@k (from the first loop)."""
    from app.core.settings import overridden
    from app.runtime.services import build_services

    report: dict[str, Any] = {}
    for mode in MODES:
        services = await build_services(overridden(settings, {"retrieval.mode": mode}))
        try:
            started = time.perf_counter()
            await services.index.indexes_ready(services.index.indexes_in_use())
            await services.clients.ranker.prime()  # the workers' own BM25 and encoder, as readiness waits for
            cell: dict[str, Any] = {"load_s": round(time.perf_counter() - started, 3)}
            for n, c in enumerate(concurrency):
                latencies, ranked = await closed_loop(services.clients.ranker, questions, k, c)
                cell[f"c{c}_ms"] = ms_summary(latencies, (50, 95, 99))
                if n == 0:
                    found = ([chunk.doc_id for chunk in r[:k]] for r in ranked)
                    cell[f"recall@{k}"] = round(gold_found(found, questions), 4) if questions else None
            report[mode] = cell
        finally:
            await services.aclose()
    return report


async def closed_loop(ranker: Any, questions: list[Question], k: int, concurrency: int) -> tuple[list[float], list]:
    """Each question ranked once, ``concurrency`` at a time; latencies (s) and rankings in question order."""
    latencies: list[float] = [0.0] * len(questions)
    ranked: list[Any] = [None] * len(questions)
    order = iter(range(len(questions)))

    async def client() -> None:
        for n in order:
            started = time.perf_counter()
            ranked[n] = (await ranker.rank(questions[n].text, k)).chunks
            latencies[n] = time.perf_counter() - started

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return latencies, ranked


async def planning_seconds(settings: Any) -> float:
    """From asking pre-warm's planner for the document strategy's plan to its first unit."""
    from app.core.settings import overridden
    from app.runtime.services import build_services
    from app.vllm.wire import UpstreamInfo

    services = await build_services(overridden(settings, {"context.strategy": "document", "retrieval.workers": 0}))
    try:
        info = UpstreamInfo(model="scale", max_model_len=8192, block_size=16, prefix_caching=True,
                            kv_cache_tokens=1_000_000)
        services.planner.fit_units(info)
        started = time.perf_counter()
        plan = await services.planner.warm_plan(info, 0)
        await anext(plan.units, None)
        return round(time.perf_counter() - started, 3)
    finally:
        await services.aclose()


def bytes_per_chunk(steps: list[dict]) -> float | None:
    """The app's resident memory growth per chunk between the smallest and the largest size."""
    with_app = [s for s in steps if "app" in s]
    if len(with_app) < 2 or with_app[-1]["chunks"] == with_app[0]["chunks"]:
        return None
    grown = with_app[-1]["app"]["rss_mib"] - with_app[0]["app"]["rss_mib"]
    return round(grown * 2**20 / (with_app[-1]["chunks"] - with_app[0]["chunks"]), 1)


def summary_line(step: dict) -> str:
    ingest, hybrid = step["ingest"], step["retrieval"]["hybrid"]
    app = step.get("app", {})
    return (f"{step['chunks']} chunks: ingest {ingest['embedded_per_s']}/s vs encoder "
            f"{ingest['raw_encoder_chunks_per_s']}/s, re-ingest {ingest['reingest_seconds']}s; hybrid "
            + ", ".join(f"{key} p95 {value['p95']} ms" for key, value in hybrid.items() if key.endswith("_ms"))
            + f"; planning {step['planning_s']}s; ready {app.get('ready_s')}s, RSS {app.get('rss_mib')} MiB")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = result["steps"]
    chunks = [s["chunks"] for s in steps]
    fig, (speed, latency, memory) = plt.subplots(1, 3, figsize=(14, 4))
    speed.plot(chunks, [s["ingest"]["embedded_per_s"] for s in steps], "o-", label="ingest")
    speed.plot(chunks, [s["ingest"]["raw_encoder_chunks_per_s"] for s in steps], "s--", label="raw encoder")
    speed.set_ylabel("chunks/s")
    for mode in MODES:
        cells = [s["retrieval"][mode] for s in steps]
        for key in [k for k in cells[0] if k.endswith("_ms")]:
            latency.plot(chunks, [c[key]["p95"] for c in cells], "o-", label=f"{mode} {key[:-3]} p95")
    latency.set_ylabel("ranking latency (ms)")
    latency.set_yscale("log")
    memory.plot(chunks, [s.get("app", {}).get("rss_mib") for s in steps], "o-", label="app RSS (MiB)")
    memory.plot(chunks, [s.get("app", {}).get("ready_s") for s in steps], "s--", label="to /readyz (s)")
    for axis in (speed, latency, memory):
        axis.set_xlabel("chunks")
        axis.set_xscale("log")
        axis.legend(fontsize=7)
    fig.suptitle(f"bench.scale: {result['dataset']} gold in distractors ({result['environment'].get('gpu') or 'CPU'})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
