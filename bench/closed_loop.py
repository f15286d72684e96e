"""The clients of ``bench.throughput``: closed loops (each client sends its next request when its last one
ended) of three arms over the same questions -- the app over HTTP (``/ask``), naive RAG (its own dense top-5
retrieval in this process, the LangChain layout, straight to vLLM) and vLLM alone replaying the exact requests
the app sent (captured at the app's client seam, ``PREFIXRAG_VLLM__CAPTURE_PATH``) -- and what each answer cost."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from app.vllm.client import LLMClient
from app.vllm.wire import Completion, event_batches, read_event, wire
from bench.modes import NAIVE_SYSTEM

MAX_RETRIES = 30  # a question refused this often is counted as refused


@dataclass
class Sample:
    """One request as its client saw it (seconds), and the app's own timings of it (ms) where it has them."""

    status: int
    ttft_s: float = 0.0  # first answer text (a request that streams nothing: its end)
    e2e_s: float = 0.0
    server_ms: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    refused: int = 0  # 429s before it was admitted (the client waited each one's Retry-After)
    waited_s: float = 0.0


async def closed_loop(concurrency: int, items: Sequence[Any], one: Callable[[Any], Awaitable[Sample]],
                      duration_s: float) -> tuple[list[Sample], float]:
    """``concurrency`` clients take the items in order until they run out or ``duration_s`` has passed;
    returns the samples and the wall time from the first request to the last answer."""
    pending, samples = iter(items), []
    started = time.perf_counter()
    deadline = started + duration_s

    async def client() -> None:
        for item in pending:  # shared: each item is sent once
            samples.append(await one(item))
            if time.perf_counter() >= deadline:
                return

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return samples, time.perf_counter() - started


async def stream_times(response: httpx.Response, started: float, completion: bool = False) -> float:
    """Read an OpenAI-style event stream to its end; the time its first answer text arrived (or its end)."""
    first, result = 0.0, Completion()
    async for batch in event_batches(response.aiter_raw()):
        if any([text for event in batch for text in read_event(event, result, completion)]):
            first = first or time.perf_counter() - started
    return first


class Arms:
    """The three ways of answering a question, each one request from start to answer."""

    def __init__(self, app_url: str, vllm_url: str, llm: LLMClient, retriever: Any, top_k: int) -> None:
        self.app = httpx.AsyncClient(base_url=app_url, timeout=600, limits=httpx.Limits(max_connections=1024))
        self.vllm = httpx.AsyncClient(base_url=vllm_url.rstrip("/").removesuffix("/v1"), timeout=600,
                                      limits=httpx.Limits(max_connections=1024))
        self.llm, self.retriever, self.top_k = llm, retriever, top_k
        self.captured = 0  # requests the app sent in the last prefixrag arm: the next replay sends them

    async def aclose(self) -> None:
        await self.app.aclose()
        await self.vllm.aclose()

    async def prefixrag(self, question: str, max_tokens: int, streamed: bool) -> Sample:
        """One question to the app; a 429 is waited out (its Retry-After) and sent again, as a client would."""
        refused, waited = 0, 0.0
        while True:
            sample = await self._ask(question, max_tokens, streamed)
            if sample.status != 429 or refused >= MAX_RETRIES:
                sample.refused, sample.waited_s = refused, waited
                return sample
            refused, pause = refused + 1, sample.ttft_s
            await asyncio.sleep(pause)
            waited += pause

    async def _ask(self, question: str, max_tokens: int, streamed: bool) -> Sample:
        started = time.perf_counter()
        body = {"question": question, "max_tokens": max_tokens, "stream": streamed}
        try:
            if not streamed:
                response = await self.app.post("/ask", json=body)
                if response.status_code == 429:  # how long to wait goes where the time would
                    return Sample(429, float(response.headers.get("retry-after", 1)))
                done = time.perf_counter() - started
                timings = response.json().get("timings_ms", {}) if response.status_code == 200 else {}
                return Sample(response.status_code, done, done, timings)
            async with self.app.stream("POST", "/ask", json=body) as response:
                if response.status_code == 429:
                    return Sample(429, float(response.headers.get("retry-after", 1)))
                if response.status_code != 200:
                    await response.aread()
                    return Sample(response.status_code, error=response.text[:200])
                first, kind, timings, error = 0.0, "", {}, None
                async for line in response.aiter_lines():  # event: delta ... event: done (or error)
                    if line.startswith("event:"):
                        kind = line[6:].strip()
                    elif line.startswith("data:") and kind == "delta":
                        first = first or time.perf_counter() - started
                    elif line.startswith("data:") and kind == "done":
                        timings = json.loads(line[5:])["timings_ms"]
                    elif line.startswith("data:") and kind == "error":
                        error = line[5:].strip()[:200]
                done = time.perf_counter() - started
                return Sample(200 if error is None else 500, first or done, done, timings, error)
        except httpx.HTTPError as exc:
            return Sample(0, error=f"{type(exc).__name__}: {exc}")

    async def naive(self, question: str, max_tokens: int, streamed: bool) -> Sample:
        """LangChain's RAG tutorial layout: dense top-k in relevance order in the system message, the question
        as the user message; retrieval in this process (its own threads), then vLLM directly."""
        started = time.perf_counter()
        ranked = await self.retriever.retrieve(question, self.top_k, mode="dense")
        context = "\n\n".join(chunk.text for chunk in ranked)
        messages = [{"role": "system", "content": NAIVE_SYSTEM.format(context=context)},
                    {"role": "user", "content": question}]
        request = self.llm.chat_request(messages, max_tokens=max_tokens, temperature=0.0, prefix_key="naive",
                                        stream=streamed)
        body, headers = wire(request)
        return await self._send("/v1/chat/completions", body, headers, started)

    async def replay(self, captured: dict, streamed: bool) -> Sample:
        """One request exactly as the app sent it (its path, headers and body), streamed or not as the arm is."""
        body = captured["body"] | {"stream": streamed}
        if not streamed:
            body.pop("stream_options", None)
        return await self._send(captured["path"], body, captured["headers"], time.perf_counter())

    async def _send(self, path: str, body: dict, headers: dict, started: float) -> Sample:
        try:
            if not body.get("stream"):
                response = await self.vllm.post(path, json=body, headers=headers)
                done = time.perf_counter() - started
                return Sample(response.status_code, done, done, error=None if response.is_success else response.text)
            async with self.vllm.stream("POST", path, json=body, headers=headers) as response:
                if response.status_code != 200:
                    await response.aread()
                    return Sample(response.status_code, error=response.text[:200])
                first = await stream_times(response, started, completion=path == "/v1/completions")
                done = time.perf_counter() - started
                return Sample(200, first or done, done)
        except httpx.HTTPError as exc:
            return Sample(0, error=f"{type(exc).__name__}: {exc}")
