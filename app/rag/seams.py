"""What the request pipeline needs of the parts it does not own: the question encoder and the vLLM client.
The real ones are ``app.core.embedder.Embedder`` and ``app.vllm.client.LLMClient``; the fast test tier puts a
fake vLLM behind the client, never a fake here."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from app.vllm.wire import Completion, Delta


class Embedder(Protocol):
    name: str

    @property
    def dimension(self) -> int: ...

    def embed(self, texts: list[str]) -> list[list[float]]: ...


class LLM(Protocol):
    def chat_request(self, messages: list[dict], *, max_tokens: int, temperature: float, prefix_key: str,
                     stream: bool = True, repetition_penalty: float | None = None, priority: int | None = None,
                     sampling: dict | None = None, **options: Any) -> dict: ...

    def stream_chat(self, request: dict, result: Completion,
                    prompt_ids: list[int] | None = None) -> AsyncIterator[Delta]: ...

    async def complete(self, request: dict) -> Any: ...

    async def tokenize(self, messages: list[dict]) -> list[int]: ...
