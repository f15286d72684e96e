"""What crosses the wire between the service and vLLM: the answer as it streams (``Completion``, ``Delta``), a
request as sent (``wire``), a streamed event read (``read_event``), vLLM's refusals and failures as the service's
named errors, and what vLLM says it serves (``UpstreamInfo``, its replicas behind a router, its special tokens)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
import httpx
import openai
import orjson

from app.core.errors import BadRequest, ContextTooLong, UpstreamError, UpstreamTimeout, UpstreamUnavailable


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


class upstream_errors:
    """Translate SDK/HTTP failures into the service's named errors (a context manager for sync + async use)."""

    def __enter__(self) -> upstream_errors:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> Literal[False]:
        if exc is None or not isinstance(exc, (openai.OpenAIError, httpx.HTTPError, aiohttp.ClientError)):
            return False
        if isinstance(exc, (openai.APITimeoutError, httpx.TimeoutException, aiohttp.ServerTimeoutError)):
            raise UpstreamTimeout(f"vLLM did not answer in time: {exc}") from exc
        if isinstance(exc, (openai.APIConnectionError, httpx.TransportError, aiohttp.ClientError)):
            # aiohttp's (the answers' stream): refused, reset, or the body cut off mid-answer
            raise UpstreamUnavailable(f"vLLM is not reachable: {exc or type(exc).__name__}") from exc
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


def wire(request: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """A request from ``chat_request`` as it goes over the wire: its JSON body (the SDK-style ``extra_body``
    merged in) and its headers."""
    body = {key: value for key, value in request.items() if key not in ("extra_headers", "extra_body")}
    return body | request.get("extra_body", {}), dict(request.get("extra_headers", {}))


async def event_batches(reads: AsyncIterator[bytes]) -> AsyncIterator[list[dict[str, Any]]]:
    """The JSON events of an OpenAI-style server-sent stream (its body, as each network read hands it over), up to
    its ``[DONE]``, a batch per read: under load several tokens of an answer are waiting by the time the event loop
    reads its socket, and each hop after this one (the pipeline, the SSE encoding, the ASGI stack, the socket
    write) is then paid once per batch rather than once per token; a token that arrives alone goes on alone."""
    pending, done = b"", False
    async for received in reads:
        if done:  # read to the body's end, else the connection is closed rather than pooled for the next request
            continue
        complete, _, pending = (pending + received).rpartition(b"\n")
        batch = []
        for line in complete.splitlines():
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            batch.append(orjson.loads(data))
        if batch:
            yield batch


def read_event(event: dict[str, Any], result: Completion, completion: bool) -> Iterator[str]:
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


def status_error(status: int, body: bytes) -> Exception:
    """The service's error for a refused streaming request (its status and body), as the SDK's status errors
    are translated."""
    message = message_of(body)
    if status == 400:
        if "maximum context length" in message:
            return ContextTooLong(f"vLLM rejected the request: {message}", param="messages")
        return BadRequest(f"vLLM rejected the request: {message}")
    if status in (502, 503, 504):
        return UpstreamUnavailable(f"vLLM answered {status}")
    if status == 500 and "error sending request" in message:
        return UpstreamUnavailable(f"a vLLM replica behind the router is unreachable: {message}")
    return UpstreamError(f"vLLM error ({status}): {message}")


def upstream_message(response: httpx.Response) -> str:
    return message_of(response.content)


def message_of(body: bytes) -> str:
    """An error body's OpenAI-shaped message, else its first 500 characters."""
    try:
        return str(orjson.loads(body)["error"]["message"])
    except Exception:
        return body[:500].decode(errors="replace")


def replicas_of(response: httpx.Response) -> list[Replica] | None:
    """vllm-router's ``GET /workers`` body as replicas; None where the body is not one."""
    try:
        return [Replica(w["url"], bool(w["is_healthy"])) for w in response.json()["workers"]]
    except (ValueError, KeyError, TypeError):
        return None


def special_tokens_of(info: dict[str, Any]) -> list[str]:
    """Special-token strings in a tokenizer's config: ``*_token`` fields, ``additional_special_tokens`` and the
    added tokens (each a string, or a dict with ``content``)."""
    def text(value: object) -> str | None:
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
    kv_cache_tokens: int  # the GPU's (or CPU backend's) KV cache, summed over the replicas read directly
    special_tokens: tuple[str, ...] = ()  # the served tokenizer's, kept out of untrusted text
    root: str = ""  # where vLLM loads the model from (/v1/models), a local folder or a hub id
    replicas: int = 1  # the healthy replicas behind vllm-router read directly (1: vLLM itself)
    host_kv_tokens: int = 0  # its KV tier in host memory (vLLM's KV offloading, app.vllm.kv_tiers); 0: none
