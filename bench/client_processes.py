"""``bench.throughput``'s clients spread over processes: one Python event loop reading 128 answer streams is
itself saturated (its CPU time nears the arm's wall time) and then measures its own lag, not the app's. Each
process runs ``closed_loop`` over every n-th item with its share of the clients and arms of its own (naive's
retrieval included); all start together (a barrier), and the arm's wall time runs from the first start to the
last answer."""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.closed_loop import Arms, Sample, closed_loop

CLIENTS_PER_PROCESS = 32


@dataclass(frozen=True)
class ArmSpec:
    """What a client process needs to send one arm's requests."""

    arm: str  # prefixrag, naive or replay
    app_url: str
    vllm_url: str
    model: str
    chroma_path: Path
    collection: str
    top_k: int
    max_tokens: int
    streamed: bool


@dataclass
class Share:
    """One client process's part of an arm: its samples, when it started and ended, its loop's CPU seconds."""

    samples: list[Sample]
    started: float
    ended: float
    cpu_s: float


def processes_for(concurrency: int) -> int:
    return max(1, math.ceil(concurrency / CLIENTS_PER_PROCESS))


async def spread_loop(spec: ArmSpec, concurrency: int, items: list[Any],
                      duration_s: float) -> tuple[list[Sample], float, list[Share]]:
    """The arm's samples over every process, its wall time, and each process's share."""
    count = processes_for(concurrency)
    clients = [concurrency // count + (i < concurrency % count) for i in range(count)]
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(count, mp_context=context, initializer=_start,
                             initargs=(context.Barrier(count),)) as pool:
        loop = asyncio.get_running_loop()
        shares: list[Share] = await asyncio.gather(*(
            loop.run_in_executor(pool, _run_share, spec, clients[i], items[i::count], duration_s)
            for i in range(count)))
    wall_s = max(s.ended for s in shares) - min(s.started for s in shares)
    return [sample for share in shares for sample in share.samples], wall_s, shares


_barrier: threading.Barrier | None = None


def _start(barrier: threading.Barrier) -> None:
    global _barrier
    _barrier = barrier


def _run_share(spec: ArmSpec, concurrency: int, items: list[Any], duration_s: float) -> Share:
    arms = _arms(spec)
    assert _barrier is not None
    _barrier.wait(600)  # every process built its arms (naive: loaded its encoder) before any sends
    return asyncio.run(_loop(arms, spec, concurrency, items, duration_s))


async def _loop(arms: Arms, spec: ArmSpec, concurrency: int, items: list[Any], duration_s: float) -> Share:
    if spec.arm == "replay":
        def one(item: Any) -> Any:
            return arms.replay(item, spec.streamed)
    else:
        send = arms.prefixrag if spec.arm == "prefixrag" else arms.naive

        def one(item: Any) -> Any:
            return send(item, spec.max_tokens, spec.streamed)
    cpu_before, started = time.thread_time(), time.perf_counter()
    try:
        samples, _ = await closed_loop(concurrency, items, one, duration_s)
    finally:
        await arms.aclose()
        await arms.llm.aclose()
        if arms.retriever is not None:
            arms.retriever.index.close()
    return Share(samples, started, time.perf_counter(), time.thread_time() - cpu_before)


def _arms(spec: ArmSpec) -> Arms:
    from app.core.settings import VLLMSettings
    from app.vllm.client import LLMClient

    llm = LLMClient(VLLMSettings(url=spec.vllm_url))
    llm.use_model(spec.model)
    retriever = None
    if spec.arm == "naive":  # its own retrieval, in this process, as a LangChain app's
        from concurrent.futures import ThreadPoolExecutor

        from app.core.embedder import Embedder
        from app.core.settings import Settings
        from app.rag.retriever import Retriever

        settings = Settings(_env_file=None)
        settings.chroma.path, settings.chroma.collection = spec.chroma_path, spec.collection
        retriever = Retriever.over(Embedder(settings.embedding).load(), settings.chroma, ThreadPoolExecutor(4))
    return Arms(spec.app_url, spec.vllm_url, llm, retriever, spec.top_k)
