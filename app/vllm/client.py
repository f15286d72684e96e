"""The one place that talks to vLLM. Every generation request is built by ``LLMClient.chat_request``, so
routing headers (prefix affinity for vllm-router), limits and retries slot in here and nowhere else."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import openai
import orjson
from aiohttp.helpers import get_env_proxy_for_url
from asgi_correlation_id import correlation_id
from openai import AsyncOpenAI, DefaultAsyncHttpxClient
from yarl import URL

from app.core.errors import BadRequest
from app.core.settings import VLLMSettings
from app.vllm.prompt_pieces import TokenPrompt
from app.vllm.wire import (
    Completion,
    Delta,
    Replica,
    event_batches,
    read_event,
    replicas_of,
    special_tokens_of,
    status_error,
    upstream_errors,
    upstream_message,
    wire,
)

REQUEST_ID_HEADER = "X-Request-Id"  # vLLM takes it as the request's id (its own is this plus a unique suffix)
# Idle connections to vLLM are dropped after 2 s, before vLLM's (uvicorn's) 5 s keep-alive closes them: with
# httpx's own 5 s, a request sent on a connection idle for ~5 s can meet vLLM closing it and fail as "not
# reachable" (the likely cause of one 503, with vLLM up, under load in bench.live_traffic).
POOL = httpx.Limits(max_connections=1000, max_keepalive_connections=100, keepalive_expiry=2.0)
# The same limits for the openai SDK, whose transport is its own httpx fork (its Limits type).
SDK_POOL = type(openai.DEFAULT_CONNECTION_LIMITS)(max_connections=POOL.max_connections,
                                                  max_keepalive_connections=POOL.max_keepalive_connections,
                                                  keepalive_expiry=POOL.keepalive_expiry)


class Capture:
    """An append-only JSONL file of the requests sent; one ``write`` per line, so the lines of several app
    processes appending to one file never interleave."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, line: bytes) -> None:
        os.write(self.fd, line)

    def close(self) -> None:
        os.close(self.fd)


def env_proxy(url: str) -> tuple[URL | None, aiohttp.BasicAuth | None]:
    """The proxy the environment names for ``url`` (``HTTP_PROXY``, ``NO_PROXY``, ...), with its credentials;
    (None, None) for none."""
    try:
        return get_env_proxy_for_url(URL(url))
    except LookupError:
        return None, None


class LLMClient:
    """vLLM's API for the service. Answers stream through aiohttp: its connector hands out a pooled connection
    in constant time, where httpx's pool walks (and polls) every connection on each request and each release, which
    under a few dozen answers in flight cost the event loop more than all the rest of the relay. The rest (warm-up,
    tokenize, models, metrics) goes through httpx and the openai SDK."""

    def __init__(self, settings: VLLMSettings) -> None:
        self.settings = settings
        self.model: str | None = settings.model  # the configured one, then what vLLM serves (``use_model``)
        self.openai = AsyncOpenAI(base_url=settings.url, api_key=settings.api_key, timeout=settings.timeout_s,
                                  max_retries=0,  # retry policy is ours (readiness monitor), not the SDK's
                                  http_client=DefaultAsyncHttpxClient(limits=SDK_POOL))
        self.root = settings.url.rstrip("/").removesuffix("/v1")
        self.auth = {"Authorization": f"Bearer {settings.api_key}"}
        self.http = httpx.AsyncClient(base_url=self.root, timeout=settings.timeout_s, limits=POOL, headers=self.auth)
        self._answers: aiohttp.ClientSession | None = None  # made on first use, on the serving loop
        self.capture = Capture(settings.capture_path) if settings.capture_path else None

    def use_model(self, model: str) -> None:
        """Name ``model`` in every request from now on (the readiness monitor publishes what vLLM serves)."""
        self.model = model

    async def aclose(self) -> None:
        if self.capture is not None:
            self.capture.close()
        await self.openai.close()
        await self.http.aclose()
        if self._answers is not None:
            await self._answers.close()

    def answers(self) -> aiohttp.ClientSession:
        """The session answers stream through: ``POOL``'s limits, and a read or connect over ``timeout_s`` fails
        (as httpx's timeout does), not a whole answer that takes longer."""
        if self._answers is None:
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.settings.timeout_s,
                                            sock_read=self.settings.timeout_s)
            connector = aiohttp.TCPConnector(limit=POOL.max_connections or 0, keepalive_timeout=POOL.keepalive_expiry)
            # The environment's proxy for vLLM (as httpx would use), read once: with ``trust_env`` aiohttp reads the
            # environment and ~/.netrc again for every request, on a thread of the loop's default pool.
            proxy, proxy_auth = env_proxy(self.root)
            self._answers = aiohttp.ClientSession(headers=self.auth, timeout=timeout, connector=connector,
                                                  proxy=proxy, proxy_auth=proxy_auth)
        return self._answers

    def chat_request(self, messages: list[dict[str, Any]], *, max_tokens: int, temperature: float, prefix_key: str,
                     stream: bool = True, repetition_penalty: float | None = None, priority: int | None = None,
                     sampling: dict[str, Any] | None = None, cache_salt: str | None = None,
                     **options: Any) -> dict[str, Any]:
        """Keyword arguments for ``chat.completions.create``: the single definition of a vLLM request.
        ``priority``: vLLM's scheduling priority (lower first; users 0), for background work; ``sampling``:
        further vLLM sampling parameters (``PREFIXRAG_SAMPLING__EXTRA_SAMPLING``); ``cache_salt``: the tenant's
        own prefix cache (vLLM hashes the request's KV blocks with it)."""
        headers = {self.settings.affinity_header: prefix_key}
        if (request_id := correlation_id.get()) is not None:  # the user's request: vLLM logs and aborts it by this
            headers[REQUEST_ID_HEADER] = request_id
        request: dict[str, Any] = {
            "model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
            "stream": stream, "extra_headers": headers,
        }
        if stream:
            request["stream_options"] = {"include_usage": True}
        extensions = {"repetition_penalty": repetition_penalty, "priority": priority, **(sampling or {}),
                      "cache_salt": cache_salt}  # last: the server's, whatever the sampling settings hold
        if any(v is not None for v in extensions.values()):
            request["extra_body"] = {k: v for k, v in extensions.items() if v is not None}
        request.update({k: v for k, v in options.items() if v is not None})
        return request

    async def stream_chat(self, request: dict[str, Any], result: Completion,
                          prompt_ids: TokenPrompt | None = None) -> AsyncIterator[Delta]:
        """Yield answer deltas; fill ``result`` with finish reason and usage (incl. cached tokens) as they come.
        ``prompt_ids``: the request's prompt as token ids (``app.vllm.prompt_ids``, its JSON made there), sent to
        ``/v1/completions`` instead of its messages; the same sampling, headers and answer. The stream is read as
        it arrives, a delta per network read (``event_batches``): each event is one ``orjson.loads``, no typed
        model per chunk, and the body one ``orjson.dumps`` (the relay and the request's encoding run on the event
        loop, for every token of every answer in flight)."""
        body, headers = wire(request)
        path = "/v1/chat/completions"
        if prompt_ids is not None:
            del body["messages"]
            body["prompt"], path = orjson.Fragment(prompt_ids.json), "/v1/completions"
        payload = orjson.dumps(body)  # once: the capture line carries the very bytes sent
        if self.capture is not None:
            self.capture.write(b'{"path":%b,"headers":%b,"body":%b}\n' % (orjson.dumps(path), orjson.dumps(headers),
                                                                           payload))
        headers = headers | {"content-type": "application/json"}
        with upstream_errors():
            async with self.answers().post(self.root + path, data=payload, headers=headers) as response:
                if response.status != 200:
                    raise status_error(response.status, await response.read())
                async for batch in event_batches(response.content.iter_any()):
                    text = "".join(piece for event in batch
                                   for piece in read_event(event, result, completion=prompt_ids is not None))
                    if text:
                        yield Delta(text)

    async def complete(self, request: dict[str, Any]) -> Any:
        """A non-streaming request (warm-up): the response, with errors translated like every other call."""
        with upstream_errors():
            return await self.openai.chat.completions.create(**request)

    async def tokenize(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of the prompt exactly as vLLM will build it (chat template + generation prompt)."""
        body = {"model": self.model, "messages": messages, "add_generation_prompt": True}
        return list((await self._post("/tokenize", body))["tokens"])

    async def list_models(self) -> list[dict[str, Any]]:
        with upstream_errors():
            response = await self.http.get("/v1/models")
            response.raise_for_status()
            return list(response.json()["data"])

    async def special_tokens(self) -> list[str]:
        """The served tokenizer's special tokens, from vLLM's ``/tokenizer_info`` (started with
        ``--enable-tokenizer-info-endpoint``, as ``python -m app.vllm_server`` does); [] where it is off."""
        with upstream_errors():
            response = await self.http.get("/tokenizer_info")
        if response.status_code != 200:
            return []
        return special_tokens_of(response.json())

    async def metrics_text(self, replica: str | None = None) -> str:
        """vLLM's Prometheus text; ``replica``: one replica's own (its root URL), not whichever the router picks."""
        with upstream_errors():
            response = await self.http.get(f"{replica.rstrip('/')}/metrics" if replica else "/metrics")
            response.raise_for_status()
            return response.text

    async def replicas(self) -> list[Replica] | None:
        """The replicas behind vllm-router (its ``GET /workers``), each with the router's health verdict; None
        when the URL is a vLLM server itself (it has no such route)."""
        with upstream_errors():
            response = await self.http.get("/workers")
        return replicas_of(response) if response.status_code == 200 else None

    async def reset_prefix_cache(self) -> None:
        """Needs vLLM started with VLLM_SERVER_DEV_MODE=1 (benchmarks only)."""
        await self._post("/reset_prefix_cache", None)

    async def _post(self, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        with upstream_errors():
            response = await self.http.post(path, json=body)
            if response.status_code == 400:
                raise BadRequest(upstream_message(response))
            response.raise_for_status()
            return response.json() if response.content else {}


