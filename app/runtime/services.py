"""``build_services(settings)``: the one composition root. It builds every long-lived object once, for the app's
lifespan, the benchmarks and the tests alike, so all three run the same retrieval threads, clients, pipeline
and monitors, and none of them reaches inside another to find one."""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from app.core.metrics import ServiceMetrics
from app.core.settings import Settings, TrafficSettings
from app.core.tracing import AnswerTraces
from app.rag.affinity import RouteKeys
from app.rag.budget import TokenEstimator
from app.rag.context import PromptBuilder
from app.rag.index import CollectionIndex
from app.rag.pipeline import Pipeline
from app.rag.planner import ContextPlanner
from app.rag.prompts import PromptTemplates
from app.rag.retriever import Retriever
from app.rag.seams import Embedder, Ranker
from app.runtime.capacity import EngineQueue
from app.runtime.collection import CollectionWatcher
from app.runtime.documents import Documents
from app.runtime.pauses import freeze_late_load
from app.runtime.retrieval_pool import CollectionRanker, RetrievalPool, WorkerConfig
from app.runtime.service import Service
from app.runtime.traffic import AutoLimit, LiveTraffic
from app.runtime.upstream import Upstream
from app.runtime.warmup import Warmer
from app.vllm.client import LLMClient
from app.vllm.prompt_ids import PromptIds


@dataclass
class Clients:
    """What one process holds once, whatever pipelines run over it (and, for each collection served, its index,
    retriever and ranker)."""

    settings: Settings
    executor: ThreadPoolExecutor  # the retrieve threads: question embeddings and Chroma queries
    embedder: Embedder
    llm: LLMClient
    upstream: Upstream
    index: CollectionIndex
    retriever: Retriever  # in this process (benchmarks' naive RAG; requests, unless workers rank them)
    ranker: Ranker  # what ranks the requests' questions: ``retriever``, or a pool of worker processes
    templates: PromptTemplates
    prompt_ids: PromptIds  # prompts whose head was seen before go to vLLM as token ids
    traces: AnswerTraces  # a trace per answer to an OTLP endpoint, where one is set


@dataclass
class Services:
    """The whole graph: the clients and one configured pipeline with its planner, admission and monitors."""

    clients: Clients
    metrics: ServiceMetrics
    builder: PromptBuilder
    estimator: TokenEstimator
    planner: ContextPlanner
    traffic: LiveTraffic
    pipeline: Pipeline
    warmer: Warmer
    watcher: CollectionWatcher
    service: Service
    engine_queue: EngineQueue | None  # reads vLLM's queue for max_in_flight=auto
    documents: Documents  # uploads (ingest jobs) and deletions over HTTP
    # Every collection the process serves, by name, this one first (``PREFIXRAG_CHROMA__COLLECTIONS``); one dict,
    # shared by all of their graphs: each its own index, planner, pipeline, pre-warm, watcher and documents over
    # the same clients, behind the same admission.
    collections: dict[str, Services] = field(default_factory=dict)

    @property
    def settings(self) -> Settings:
        return self.clients.settings

    @property
    def upstream(self) -> Upstream:
        return self.clients.upstream

    @property
    def llm(self) -> LLMClient:
        return self.clients.llm

    @property
    def index(self) -> CollectionIndex:
        return self.clients.index

    @property
    def retriever(self) -> Retriever:
        return self.clients.retriever

    @property
    def name(self) -> str:
        return self.settings.chroma.collection

    def variant(self, settings: Settings, metrics: ServiceMetrics) -> Services:
        """Another pipeline over the same clients, configured by ``settings``' request, context, pre-warm,
        sampling and traffic sections (benchmarks compare strategies and limits this way)."""
        return assemble(self.clients, settings, metrics)

    async def close_collection(self) -> None:
        """What this graph holds of its collection alone: its documents' work, planner and index."""
        await self.documents.aclose()
        self.planner.close()
        self.index.close()

    async def aclose(self) -> None:
        """Every collection's graph, then what the process holds once."""
        for graph in self.collections.values() or [self]:
            await graph.close_collection()
        clients = self.clients
        clients.prompt_ids.close()
        clients.traces.close()
        if isinstance(clients.ranker, RetrievalPool):
            await clients.ranker.aclose()
        await clients.llm.aclose()
        clients.executor.shutdown(wait=False, cancel_futures=True)


async def build_services(settings: Settings, *, embedder: Embedder | None = None,
                         metrics: ServiceMetrics | None = None, llm: LLMClient | None = None) -> Services:
    """Templates first (a broken one fails fast), then the retrieve threads, the encoder (loaded now, not by the
    first question, unless worker processes rank; or ``embedder``, shared by tests and benchmarks), the vLLM
    client (or ``llm``: the one seam where the fast test tier puts its fake vLLM) and monitor, the index and
    ranker; then the pipeline."""
    from app.core.devices import query_encoder
    from app.core.embedder import Embedder as Encoder
    from app.core.embedder import limit_threads

    templates = PromptTemplates.load(settings.service.prompts_dir)
    metrics = metrics or ServiceMetrics()
    # Torch fixes a thread's pool size on first use, hence the initializer (PREFIXRAG_EMBEDDING__QUERY_THREADS).
    threads = retrieve_threads(settings)
    executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="retrieve", initializer=limit_threads,
                                  initargs=(settings.embedding.query_threads,))
    workers = settings.retrieval.worker_processes(query_encoder(settings.embedding)[2] != "cpu")
    encoder = embedder
    if encoder is None:  # loaded here only where questions are ranked here (else on first use, if ever)
        own = Encoder(settings.embedding, questions=True)
        encoder = own if workers else await asyncio.get_running_loop().run_in_executor(executor, own.load)
    llm = llm or LLMClient(settings.vllm)
    index = CollectionIndex(encoder, settings.chroma, executor, settings.retrieval, settings.pages,
                            ranks=not workers)
    upstream = Upstream(llm, settings.vllm)
    upstream.subscribe(lambda info: llm.use_model(info.model))
    prompt_ids = PromptIds(settings.vllm, llm, loaded=lambda: freeze_late_load("the served model's tokenizer"))
    upstream.subscribe(prompt_ids.adopt)
    retriever = Retriever(index, encoder, settings.retrieval, encoders=max(1, threads // 2))
    ranker: Ranker = retriever
    if workers:
        ranker = RetrievalPool(WorkerConfig(settings.chroma, settings.embedding, settings.retrieval, settings.pages,
                                            settings.service.log_level, settings.service.log_format),
                               workers, metrics.retrieval_stages)
    clients = Clients(settings, executor, encoder, llm, upstream, index, retriever, ranker, templates, prompt_ids,
                      AnswerTraces(settings.service.otlp_traces_url))
    services = assemble(clients, warm_share(settings), metrics)
    services.collections[services.name] = services
    for name in settings.chroma.collections:
        services.collections[name] = another_collection(services, name)
    services.service.watchers = lambda: [graph.watcher for graph in services.collections.values()]
    return services


def another_collection(first: Services, name: str) -> Services:
    """Collection ``name``'s graph over ``first``'s clients, behind its admission and within its pre-warm's
    bounds: an index, retriever and ranker of its own (the same ranking workers, told which collection each
    question searches)."""
    settings = first.settings.model_copy(update={"chroma": first.settings.chroma.serving(name)})
    clients = first.clients
    pool = clients.ranker if isinstance(clients.ranker, RetrievalPool) else None
    index = CollectionIndex(clients.embedder, settings.chroma, clients.executor, settings.retrieval, settings.pages,
                            ranks=pool is None)
    retriever = Retriever(index, clients.embedder, settings.retrieval, encoders=max(1, retrieve_threads(settings) // 2))
    own = replace(clients, settings=settings, index=index, retriever=retriever,
                  ranker=pool.serving(name) if pool else retriever)
    graph = assemble(own, warm_share(settings, len(first.settings.chroma.collections) + 1), first.metrics, first)
    graph.collections = first.collections
    return graph


def assemble(clients: Clients, settings: Settings, metrics: ServiceMetrics,
             shared: Services | None = None) -> Services:
    """One configured pipeline over ``clients``, with its planner, pre-warm, collection watcher and admission
    (``shared``: another collection's graph, whose admission and pre-warm's bounds this one shares)."""
    builder = PromptBuilder(clients.templates)
    # Untrusted text never carries the served tokenizer's special tokens, whatever vLLM serves now.
    clients.upstream.subscribe(lambda info: builder.inert.use(info.special_tokens))
    estimator = TokenEstimator()
    planner = ContextPlanner(settings.context, settings.limits.max_tokens, clients.index, builder, clients.llm,
                             clients.settings.chroma.collection, estimator)
    clients.upstream.subscribe(planner.fit_units)
    clients.upstream.subscribe(metrics.observe_kv_tiers)
    traffic = shared.traffic if shared is not None else admission(settings.traffic)
    pipeline = Pipeline(settings.limits, settings.sampling, clients.index, clients.ranker, clients.llm, builder,
                        planner, estimator, metrics, clients.prompt_ids, clients.traces,
                        RouteKeys(settings.vllm.spread_hot_units))
    warmer = Warmer(settings.warmup, planner, clients.llm, estimator, clients.upstream, traffic, clients.prompt_ids,
                    shared.warmer.background if shared is not None else None)
    queue = None
    if traffic.auto and shared is None:
        queue = EngineQueue(traffic, clients.upstream, settings.traffic.load_interval_s)
    watcher = CollectionWatcher(clients.index, clients.ranker)
    if isinstance(clients.ranker, RetrievalPool | CollectionRanker):
        watcher.subscribe(clients.ranker.collection_changed)
        watcher.subscribe_writing(clients.ranker.rows_changing)
    service = Service(pipeline, planner, traffic, clients.upstream, warmer, watcher, metrics,
                      settings.traffic.max_retrievals)
    documents = Documents(settings, clients.index, watcher.check_now, service.forget_arranged)
    return Services(clients, metrics, builder, estimator, planner, traffic, pipeline, warmer, watcher, service, queue,
                    documents)


def warm_share(settings: Settings, collections: int | None = None) -> Settings:
    """``settings`` with pre-warm's bounds (its share of vLLM's KV cache, its tokens) split evenly among the
    ``collections`` served (default: as many as ``settings`` names), so that all of them together keep to them."""
    count = collections or len(settings.chroma.collections) + 1
    if count == 1:
        return settings
    bounds = settings.warmup
    return settings.model_copy(update={"warmup": bounds.model_copy(update={
        "kv_share": bounds.kv_share / count, "max_tokens": bounds.max_tokens // count})})


def retrieve_threads(settings: Settings) -> int:
    return settings.retrieval.threads or min(8, os.cpu_count() or 2)


def admission(limits: TrafficSettings) -> LiveTraffic:
    """The configured admission: a fixed limit, or ``auto`` (from its floor, following vLLM's queue)."""
    if limits.max_in_flight != "auto":
        return LiveTraffic(limits.max_in_flight, limits.max_queued)
    auto = AutoLimit(limits.auto_min_in_flight, limits.auto_max_in_flight, fresh_s=4 * limits.load_interval_s,
                     wait_s=2 * limits.load_interval_s, full_s=10 * limits.load_interval_s)
    return LiveTraffic(auto.low, limits.max_queued, auto)
