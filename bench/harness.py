"""One benchmark run: the shared clients, the per-mode replay, and the vLLM counter deltas."""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from app.core.metrics import ServiceMetrics
from app.core.settings import Settings, VLLMSettings, overridden, setting_named
from app.rag.retriever import Retriever
from app.runtime.services import Services, build_services
from app.runtime.upstream import Upstream
from app.vllm.client import LLMClient
from bench.ceiling import BlockCacheCeiling
from bench.fleet import Fleet, difference
from bench.modes import Record, run_naive, run_naive_fill, run_prefixrag
from bench.stats import gold_found, summarise

if TYPE_CHECKING:  # torch: imported only where a harness is created
    from app.core.embedder import Embedder

MATCH_K_MAX = 100


class Harness:
    """Built by ``create``: the dataset ingested and the app's service graph over it, against one vLLM (or a
    router's replicas, ``fleet``)."""

    args: argparse.Namespace
    settings: Settings
    embedder: Embedder
    services: Services
    retriever: Retriever
    llm: LLMClient
    upstream: Upstream
    fleet: Fleet

    @classmethod
    async def create(cls, dataset, vllm_url: str, chroma: Path, args) -> Harness:
        from app.core.embedder import Embedder
        from ingest.pipeline import run_ingest

        self = cls()
        self.args = args
        self.settings = Settings(_env_file=None)
        self.settings.chroma.path, self.settings.chroma.collection = chroma, dataset.collection
        # Validated, so --vllm-url may be given with or without /v1:
        self.settings.vllm = VLLMSettings(**self.settings.vllm.model_dump() | {"url": vllm_url})
        self.embedder = Embedder(self.settings.embedding)
        started = time.perf_counter()
        report = run_ingest([dataset.passages], self.settings, self.embedder)
        print(f"ingest: {report.chunks_written} chunks written in {time.perf_counter() - started:.1f}s", flush=True)
        # The app's own graph, with the service's question encoder (its number format, not ingest's float32):
        questions = Embedder(self.settings.embedding, questions=True).load()
        self.services = await build_services(self.settings, embedder=questions)
        self.retriever, self.llm, self.upstream = self.services.retriever, self.services.llm, self.services.upstream
        await self.services.index.indexes_ready()  # BM25 and pages ready before any timed question
        await self.services.clients.ranker.prime()  # as the app's readiness does: every ranking worker loaded
        await self.upstream.refresh()
        self.fleet = await Fleet.discover(vllm_url, getattr(args, "replica_metrics", None))
        return self

    async def close(self) -> None:
        await self.services.aclose()
        await self.fleet.aclose()

    def service(self, mode: str) -> Services:
        """``mode`` is a strategy name, or ``prefixrag`` (the service default), optionally with settings after
        colons, each named by its field: ``document:unit_quorum=1``, ``document:warm_piece_tokens=2048``."""
        name, *overrides = mode.split(":")
        strategy = self.settings.context.strategy if name == "prefixrag" else name
        # The benchmark measures the pipeline at its own concurrency: admission control never refuses it.
        values = {"context.strategy": strategy, "context.hotness_dir": "", "limits.top_k": self.args.top_k,
                  "limits.max_tokens": self.args.max_tokens, "traffic.max_in_flight": self.args.concurrency,
                  "traffic.max_queued": self.args.concurrency}
        values |= {setting_named(key): value for key, value in (o.split("=", 1) for o in overrides)}
        return self.services.variant(overridden(self.settings, values), ServiceMetrics())

    async def run_mode(self, mode: str, stream, earlier: list[dict]) -> dict:
        await self.fleet.reset()  # no mode profits from another's cache (each replica's, behind a router)
        k, warmup_s, service = self.args.top_k, 0.0, None
        if mode == "naive-matched":
            k = await self._matched_k(stream, earlier)
        elif mode == "naive-fill":  # as many chunks as --fill-tokens holds (bench.long_context)
            k = 0
        elif mode != "naive":
            service = self.service(mode)
            started = time.perf_counter()
            progress = await service.warmer.warm(self.upstream.require())  # the benchmark measures warm traffic
            if service.planner.name == "corpus" and not service.planner.corpus.fits:
                service.planner.close()
                return {"mode": mode, "skipped": "the corpus does not fit the context window",
                        "corpus_tokens": progress.corpus_tokens}
            warmup_s = time.perf_counter() - started

        async def one(question) -> Record:
            if mode == "naive-fill":
                return await run_naive_fill(question, self.args.fill_tokens, self.retriever, self.llm,
                                            self.args.max_tokens)
            if service is None:
                return await run_naive(question, k, self.retriever, self.llm, self.args.max_tokens)
            return await run_prefixrag(question, k, service, self.args.max_tokens)

        before = await self.fleet.counters()
        started = time.perf_counter()
        records = await self._replay(stream, one)
        wall_s = time.perf_counter() - started
        counted = difference(before, await self.fleet.counters())
        warmed = service.warmer.warmed_prompts if service is not None else []
        ceiling = await self._ceiling(records, mode, warmed)
        result = {"mode": mode, "k": k, "warmup_s": round(warmup_s, 3)}
        result |= summarise(records, stream, counted["hits"], counted["queries"], wall_s, ceiling)
        if self.fleet.routed:  # each replica's share of the work, and its own hit rate
            result["replicas"] = counted["servers"]
            # Requests sent with a hot unit's extra routing key (app.rag.affinity.RouteKeys), and how many units.
            extra = [r.prefix_key for r in records if "." in r.prefix_key]
            result["spread"] = {"requests": len(extra), "units": len({key.split(".")[0] for key in extra})}
        if counted["host_queries"]:  # vLLM keeps a KV tier in host memory: what the GPU missed and it held
            result["host_tier"] = {"tokens_looked_up": int(counted["host_queries"]),
                                   "tokens_loaded": int(counted["host_hits"])}
        result["strategy"] = service.planner.name if service is not None else "naive"
        if service is not None:
            result["warmup"] = asdict(service.warmer.progress)
            # How its prompts went to vLLM: as token ids (app.vllm.prompt_ids) or as chats.
            result["prompt_forms"] = {form: int(service.metrics.registry.get_sample_value(
                "prefixrag_prompts_total", {"form": form}) or 0) for form in ("token_ids", "chat")}
            service.planner.close()
        return result

    async def _replay(self, stream, one) -> list[Record]:
        records: list[Record | None] = [None] * len(stream)
        queue: asyncio.Queue = asyncio.Queue()
        for item in enumerate(stream):
            queue.put_nowait(item)

        async def worker():
            while not queue.empty():
                index, question = queue.get_nowait()
                try:
                    records[index] = await one(question)
                except Exception as exc:  # counted and reported, never silently dropped
                    records[index] = Record(question.id, error=f"{type(exc).__name__}: {exc}")

        await asyncio.gather(*(worker() for _ in range(self.args.concurrency)))
        return [record for record in records if record is not None]  # every one was filled

    async def _ceiling(self, records: list[Record], mode: str,
                       warmed: list[tuple[list[dict], str]]) -> BlockCacheCeiling:
        ceiling = BlockCacheCeiling(self.upstream.require().block_size)
        dump = None
        if self.args.dump_prompts:
            self.args.dump_prompts.mkdir(parents=True, exist_ok=True)
            dump = gzip.open(self.args.dump_prompts / f"{mode}.jsonl.gz", "wt")  # token ids compress ~4x
        for messages, key in warmed:  # pre-warm prompts first, flagged, so a replay warms the cache the same way
            ids = await self.llm.tokenize(messages)
            ceiling.prime(ids)
            if dump:
                dump.write(json.dumps({"warmup": True, "prompt_token_ids": ids, "max_tokens": 1,
                                       "prefix_key": key}) + "\n")
        for record in records:
            if record.error is None:
                ids = await self.llm.tokenize(record.messages)
                ceiling.add(ids)
                if dump:
                    dump.write(json.dumps({"question_id": record.question_id, "prompt_token_ids": ids,
                                           "max_tokens": self.args.max_tokens, "prefix_key": record.prefix_key})
                               + "\n")
        if dump:
            dump.close()
        return ceiling

    async def retrieval_report(self, stream, depth: int = 20) -> dict:
        """Recall of the retriever itself per mode: the share of answerable questions whose gold document is in
        its top k (k = top_k and ``depth``), next to the prompt-level recall the modes report."""
        answerable = [q for q in stream if q.gold]
        report = {}
        for mode in ("dense", "lexical", "hybrid"):
            ranked = [await asyncio.to_thread(self.retriever.retrieve_sync, q.text, depth, None, mode)
                      for q in answerable]
            report[mode] = {f"recall@{k}": round(gold_found(([c.doc_id for c in r[:k]] for r in ranked), answerable), 4)
                            if answerable else None for k in sorted({self.args.top_k, depth})}
        return report

    async def _matched_k(self, stream, earlier: list[dict]) -> int:
        """Smallest k at which naive's recall reaches the best prefixrag recall on these questions."""
        target = max((r["recall"] or 0 for r in earlier if not r["mode"].startswith("naive")), default=0)
        answerable = [q for q in stream if q.gold]
        ranked = [await self.retriever.retrieve(q.text, MATCH_K_MAX, mode="dense") for q in answerable]
        for k in range(self.args.top_k, MATCH_K_MAX + 1):
            if answerable and gold_found(([c.doc_id for c in r[:k]] for r in ranked), answerable) >= target:
                return k
        return MATCH_K_MAX
