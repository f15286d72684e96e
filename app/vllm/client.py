"""The one place that talks to vLLM. Every generation request is built by ``LLMClient.chat_request``, so
routing headers (prefix affinity for vllm-router), limits and retries slot in here and nowhere else."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
from openai import AsyncOpenAI, DefaultAsyncHttpxClient
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from app.core.errors import BadRequest, ContextTooLong, UpstreamError, UpstreamTimeout, UpstreamUnavailable
from app.core.settings import VLLMSettings


@dataclass
class Completion:
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass(frozen=True)
class Replica:
    url: str
    healthy: bool


@dataclass(frozen=True)
class Delta:
    text: str


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

    def write(self, line: str) -> None:
        os.write(self.fd, line.encode())

    def close(self) -> None:
        os.close(self.fd)


class LLMClient:
    def __init__(self, settings: VLLMSettings) -> None:
        self.settings = settings
        self.model: str | None = settings.model  # the configured one, then what vLLM serves (``use_model``)
        self.openai = AsyncOpenAI(base_url=settings.url, api_key=settings.api_key, timeout=settings.timeout_s,
                                  max_retries=0,  # retry policy is ours (readiness monitor), not the SDK's
                                  http_client=DefaultAsyncHttpxClient(limits=SDK_POOL))
        root = settings.url.rstrip("/").removesuffix("/v1")
        self.http = httpx.AsyncClient(base_url=root, timeout=settings.timeout_s, limits=POOL,
                                      headers={"Authorization": f"Bearer {settings.api_key}"})
        self.capture = Capture(settings.capture_path) if settings.capture_path else None

    def use_model(self, model: str) -> None:
        """Name ``model`` in every request from now on (the readiness monitor publishes what vLLM serves)."""
        self.model = model

    async def aclose(self) -> None:
        if self.capture is not None:
            self.capture.close()
        await self.openai.close()
        await self.http.aclose()

    def chat_request(self, messages: list[dict], *, max_tokens: int, temperature: float, prefix_key: str,
                     stream: bool = True, repetition_penalty: float | None = None, priority: int | None = None,
                     sampling: dict | None = None, **options) -> dict:
        """Keyword arguments for ``chat.completions.create``: the single definition of a vLLM request.
        ``priority``: vLLM's scheduling priority (lower first; users 0), for background work; ``sampling``:
        further vLLM sampling parameters (``RAG_SAMPLING__EXTRA_SAMPLING``)."""
        request: dict[str, Any] = {
            "model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
            "stream": stream, "extra_headers": {self.settings.affinity_header: prefix_key},
        }
        if stream:
            request["stream_options"] = {"include_usage": True}
        extensions = {"repetition_penalty": repetition_penalty, "priority": priority, **(sampling or {})}
        if any(v is not None for v in extensions.values()):
            request["extra_body"] = {k: v for k, v in extensions.items() if v is not None}
        request.update({k: v for k, v in options.items() if v is not None})
        return request

    async def stream_chat(self, request: dict, result: Completion,
                          prompt_ids: list[int] | None = None) -> AsyncIterator[Delta]:
        """Yield answer deltas; fill ``result`` with finish reason and usage (incl. cached tokens) as they come.
        ``prompt_ids``: the request's prompt as token ids (``app.vllm.prompt_ids``), sent to ``/v1/completions``
        instead of its messages; the same sampling, headers and answer. The stream is read as it arrives: each
        event is one ``json.loads``, no typed model per chunk (the relay runs on the event loop, for every token
        of every answer in flight)."""
        body, headers = wire(request)
        path = "/v1/chat/completions"
        if prompt_ids is not None:
            del body["messages"]
            body["prompt"], path = prompt_ids, "/v1/completions"
        if self.capture is not None:
            self.capture.write(json.dumps({"path": path, "headers": headers, "body": body}) + "\n")
        with upstream_errors():
            async with self.http.stream("POST", path, json=body, headers=headers) as response:
                if response.status_code != 200:
                    await response.aread()
                    raise status_error(response)
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    for text in read_event(json.loads(data), result, completion=prompt_ids is not None):
                        yield Delta(text)

    async def complete(self, request: dict):
        """A non-streaming request (warm-up): the response, with errors translated like every other call."""
        with upstream_errors():
            return await self.openai.chat.completions.create(**request)

    async def tokenize(self, messages: list[dict]) -> list[int]:
        """Token ids of the prompt exactly as vLLM will build it (chat template + generation prompt)."""
        body = {"model": self.model, "messages": messages, "add_generation_prompt": True}
        return (await self._post("/tokenize", body))["tokens"]

    async def list_models(self) -> list[dict]:
        with upstream_errors():
            response = await self.http.get("/v1/models")
            response.raise_for_status()
            return response.json()["data"]

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

    async def _post(self, path: str, body: dict | None) -> dict:
        with upstream_errors():
            response = await self.http.post(path, json=body)
            if response.status_code == 400:
                raise BadRequest(_upstream_message(response))
            response.raise_for_status()
            return response.json() if response.content else {}


class upstream_errors:
    """Translate SDK/HTTP failures into the service's named errors (a context manager for sync + async use)."""

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is None or not isinstance(exc, (openai.OpenAIError, httpx.HTTPError)):
            return False
        if isinstance(exc, (openai.APITimeoutError, httpx.TimeoutException)):
            raise UpstreamTimeout(f"vLLM did not answer in time: {exc}") from exc
        if isinstance(exc, (openai.APIConnectionError, httpx.TransportError)):
            raise UpstreamUnavailable(f"vLLM is not reachable: {exc}") from exc
        if isinstance(exc, openai.BadRequestError):
            if "maximum context length" in exc.message:
                raise ContextTooLong(f"vLLM rejected the request: {exc.message}", param="messages") from exc
            raise BadRequest(f"vLLM rejected the request: {exc.message}") from exc
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status in (502, 503, 504):
            raise UpstreamUnavailable(f"vLLM answered {status}") from exc
        if status == 500 and "error sending request" in str(exc):
            # vllm-router's words when the replica it chose (after its retries) cannot be reached: a replica is
            # down, which is "try again shortly" (the router drops it within its health-check interval).
            raise UpstreamUnavailable(f"a vLLM replica behind the router is unreachable: {exc}") from exc
        raise UpstreamError(f"vLLM error ({status}): {exc}") from exc


def wire(request: dict) -> tuple[dict, dict[str, str]]:
    """A request from ``chat_request`` as it goes over the wire: its JSON body (the SDK-style ``extra_body``
    merged in) and its headers."""
    body = {key: value for key, value in request.items() if key not in ("extra_headers", "extra_body")}
    return body | request.get("extra_body", {}), dict(request.get("extra_headers", {}))


def read_event(event: dict, result: Completion, completion: bool) -> Iterator[str]:
    """The answer text one streamed event carries (chat deltas, or a completion's text); usage and the finish
    reason go into ``result``. An error event (vLLM failed mid-stream) raises."""
    if "error" in event:
        raise UpstreamError(f"vLLM failed mid-answer: {event['error'].get('message', event['error'])}")
    if usage := event.get("usage"):
        result.prompt_tokens, result.completion_tokens = usage["prompt_tokens"], usage["completion_tokens"]
        result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    for choice in event.get("choices") or ():
        result.finish_reason = choice.get("finish_reason") or result.finish_reason
        text = choice.get("text") if completion else (choice.get("delta") or {}).get("content")
        if text:
            result.text += text
            yield text


def status_error(response: httpx.Response) -> Exception:
    """The service's error for a refused streaming request, as the SDK's status errors are translated."""
    message, status = _upstream_message(response), response.status_code
    if status == 400:
        if "maximum context length" in message:
            return ContextTooLong(f"vLLM rejected the request: {message}", param="messages")
        return BadRequest(f"vLLM rejected the request: {message}")
    if status in (502, 503, 504):
        return UpstreamUnavailable(f"vLLM answered {status}")
    if status == 500 and "error sending request" in message:
        return UpstreamUnavailable(f"a vLLM replica behind the router is unreachable: {message}")
    return UpstreamError(f"vLLM error ({status}): {message}")


def _upstream_message(response: httpx.Response) -> str:
    try:
        return response.json()["error"]["message"]
    except Exception:
        return response.text[:500]


def _samples(metrics_text: str, name: str) -> Iterator[Sample]:
    """Every sample named ``name`` (``vllm:prompt_tokens_total``, ``..._count``), as prometheus_client parses it.
    Only those lines go to the parser: all of vLLM's /metrics takes it ~10 ms, and the monitor runs on the loop."""
    wanted = "".join(line + "\n" for line in metrics_text.splitlines() if line.startswith((name + "{", name + " ")))
    try:
        for family in text_string_to_metric_families(wanted):
            yield from (sample for sample in family.samples if sample.name == name)
    except ValueError as exc:  # not Prometheus text (a proxy's error page): vLLM is not what answered
        raise UpstreamError(f"unreadable /metrics: {exc}") from exc


def parse_metric_labels(metrics_text: str, name: str) -> dict[str, str] | None:
    """Labels of the first sample of an info-style gauge, e.g. ``vllm:cache_config_info``."""
    return next((dict(sample.labels) for sample in _samples(metrics_text, name)), None)


def metric_total(metrics_text: str, name: str) -> float:
    """Sum of all samples of a counter (all engines/models)."""
    return sum(sample.value for sample in _samples(metrics_text, name))


def replicas_of(response: httpx.Response) -> list[Replica] | None:
    """vllm-router's ``GET /workers`` body as replicas; None where the body is not one."""
    try:
        return [Replica(w["url"], bool(w["is_healthy"])) for w in response.json()["workers"]]
    except (ValueError, KeyError, TypeError):
        return None


def special_tokens_of(info: dict) -> list[str]:
    """Special-token strings in a tokenizer's config: ``*_token`` fields, ``additional_special_tokens`` and the
    added tokens (each a string, or a dict with ``content``)."""
    def text(value) -> str | None:
        value = value.get("content") if isinstance(value, dict) else value
        return value if isinstance(value, str) and value else None

    found = [info[key] for key in info if key.endswith("_token")]
    found += list(info.get("additional_special_tokens") or [])
    found += list((info.get("added_tokens_decoder") or {}).values())
    return sorted({t for t in map(text, found) if t})


@dataclass
class UpstreamInfo:
    """What vLLM serves, as the monitor (``app.runtime.upstream``) last read it."""

    model: str
    max_model_len: int
    block_size: int
    prefix_caching: bool
    kv_cache_tokens: int
    special_tokens: tuple[str, ...] = ()  # the served tokenizer's, kept out of untrusted text
    root: str = ""  # where vLLM loads the model from (/v1/models), a local folder or a hub id
