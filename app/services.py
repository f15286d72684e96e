"""``build_services(settings)``: the one place the service graph is assembled, for the app's lifespan, the
benchmarks and the tests alike, so all three run the same retrieval threads, clients and monitors."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from app.core.settings import GenerationSettings, Settings, TrafficSettings
from app.llm import LLMClient
from app.metrics import ServiceMetrics
from app.prompt_ids import PromptIds
from app.rag.context import PromptBuilder
from app.rag.prompts import PromptTemplates
from app.rag.retriever import Retriever
from app.rag.service import RAGService
from app.rag.upstream import Upstream


@dataclass
class Services:
    settings: Settings
    executor: ThreadPoolExecutor  # the retrieve threads: question embeddings and Chroma queries
    embedder: object
    llm: LLMClient
    upstream: Upstream
    retriever: Retriever
    templates: PromptTemplates
    metrics: ServiceMetrics
    prompt_ids: PromptIds  # prompts whose head was seen before go to vLLM as token ids

    def rag(self, generation: GenerationSettings | None = None, traffic: TrafficSettings | None = None,
            metrics: ServiceMetrics | None = None) -> RAGService:
        """A request pipeline over these clients: the configured one, or (benchmarks) other generation settings
        and limits."""
        return RAGService(generation or self.settings.generation, self.retriever, self.llm,
                          PromptBuilder(self.templates), self.upstream, metrics or self.metrics,
                          traffic or self.settings.traffic, self.prompt_ids)

    async def aclose(self) -> None:
        self.prompt_ids.close()
        self.retriever.close()
        await self.llm.aclose()
        self.executor.shutdown(wait=False, cancel_futures=True)


async def build_services(settings: Settings, *, embedder=None, metrics: ServiceMetrics | None = None,
                         llm: LLMClient | None = None) -> Services:
    """Templates first (a broken one fails fast), then the retrieve threads, the encoder (loaded now, not by the
    first question; or ``embedder``, shared by tests and benchmarks), the vLLM client (or ``llm``: the one seam
    where the fast test tier puts its fake vLLM) and monitor, the retriever."""
    from app.core.embedder import Embedder, limit_threads

    templates = PromptTemplates.load(settings.service.prompts_dir)
    # Torch fixes a thread's pool size on first use, hence the initializer (RAG_EMBEDDING__QUERY_THREADS).
    executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="retrieve", initializer=limit_threads,
                                  initargs=(settings.embedding.query_threads,))
    encoder = embedder or await asyncio.get_running_loop().run_in_executor(
        executor, lambda: Embedder(settings.embedding).load())
    llm = llm or LLMClient(settings.vllm)
    retriever = Retriever(encoder, settings.chroma, executor, settings.retrieval, settings.pages)
    upstream = Upstream(llm, settings.vllm)
    upstream.subscribe(lambda info: llm.use_model(info.model))
    prompt_ids = PromptIds(settings.vllm, llm)
    upstream.subscribe(prompt_ids.adopt)
    return Services(settings, executor, encoder, llm, upstream, retriever, templates, metrics or ServiceMetrics(),
                    prompt_ids)
