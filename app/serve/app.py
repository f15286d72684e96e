"""``create_app(settings)``: the FastAPI factory. Clients are built once, in ``lifespan``; nothing at import."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from app.core.seams import Embedder
from app.core.settings import Settings
from app.serve.edge import RequestEdge
from app.serve.http_errors import install_error_handlers
from app.serve.observability import observe
from app.serve.refusals import RefusalDesk, Refusals
from app.serve.tenants import Tenants
from app.vllm.client import LLMClient

log = logging.getLogger("prefixrag")


def create_app(settings: Settings | None = None, *, embedder: Embedder | None = None,
               llm: LLMClient | None = None) -> FastAPI:
    """Build the app. ``embedder`` may be passed in to share one loaded encoder (tests, benchmarks); ``llm``
    replaces the vLLM client (the fast test tier's fake, ``tests/support/fakes.py``)."""
    settings = settings or Settings()
    from app.core.metrics import ServiceMetrics
    from app.runtime.pauses import GCPauses, LoopLag, freeze_start_up

    metrics = ServiceMetrics()  # built with the app: the HTTP instrumentation below records into it
    gc_pauses, loop_lag = GCPauses(metrics.registry), LoopLag(metrics.registry)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        from app.runtime.readiness import publish
        from app.runtime.services import build_services
        from app.runtime.shelf import Shelf

        services = await build_services(settings, embedder=embedder, metrics=metrics, llm=llm)
        freeze_start_up()  # before the first request: the collector no longer rescans what lives as long as we do
        gc_pauses.start()
        app.state.settings, app.state.upstream, app.state.metrics = settings, services.upstream, metrics
        app.state.services, app.state.service = services, services.service
        publish(metrics.registry, services.service.readiness)
        app.state.shelf = shelf = Shelf(services)
        shelf.serve_recorded()
        shelf.start()
        tasks = [asyncio.create_task(services.upstream.run_forever(), name="vllm-monitor"),
                 asyncio.create_task(loop_lag.run_forever(), name="loop-lag")]
        if services.engine_queue is not None:
            tasks.append(asyncio.create_task(services.engine_queue.run_forever(), name="engine-queue"))
        log.info("prefixrag serving %s %s from %s; vLLM at %s", "collections" if len(services.collections) > 1
                 else "collection", ", ".join(map(repr, services.collections)),
                 settings.chroma.url or settings.chroma.path, settings.vllm.url)
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await shelf.aclose()
            await services.aclose()
            gc_pauses.stop()

    app = FastAPI(title="prefixrag", version="0.1.0", lifespan=lifespan,
                  description="Retrieval-augmented answers from vLLM, with prompts built for prefix-cache hits.")
    install_error_handlers(app)
    tenants = Tenants(settings.service.api_key, settings.service.keys_file)  # a bad keys file fails here
    app.state.tenants = tenants
    app.add_middleware(RequestEdge, max_body_bytes=settings.service.max_body_bytes,
                       max_upload_bytes=settings.service.max_upload_bytes, tenants=tenants)
    record = observe(app, metrics)
    # Also for ``app.serve.refusal_protocol``, unless CORS headers must be added to a refusal.
    app.state.refusals = RefusalDesk(tenants, record, app.state, in_parser=not settings.service.cors_origins)
    app.add_middleware(Refusals, desk=app.state.refusals)  # outside the request id and metrics layers
    if settings.service.cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        # Outermost: a browser's preflight carries no key, and every answer (a 401 or a 429 too) needs the CORS
        # headers for the calling page to read it, Retry-After and the request id included.
        app.add_middleware(CORSMiddleware, allow_origins=settings.service.cors_origins, allow_methods=["GET", "POST"],
                           allow_headers=["*"], expose_headers=["X-Request-ID", "Retry-After"], max_age=600)
    from app.serve.routers import ask, collections, documents, health, openai_chat, openai_completions, page, retrieve

    app.include_router(health.router)
    app.include_router(ask.router)
    app.include_router(openai_chat.router)
    app.include_router(openai_completions.router)
    app.include_router(retrieve.router)
    app.include_router(documents.router)
    app.include_router(collections.router)
    app.include_router(page.router)
    return app
