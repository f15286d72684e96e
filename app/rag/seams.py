"""What the request pipeline needs of the parts it does not own: the vLLM client (the real one is
``app.vllm.client.LLMClient``; the fast test tier's fake subclasses it) and the question encoder (the kernel's
``Embedder`` protocol)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from app.core.seams import Embedder
from app.vllm.wire import Completion, Delta

__all__ = ["LLM", "Embedder"]


class LLM(Protocol):
    def chat_request(self, messages: list[dict[str, Any]], *, max_tokens: int, temperature: float, prefix_key: str,
                     stream: bool = True, repetition_penalty: float | None = None, priority: int | None = None,
                     sampling: dict[str, Any] | None = None, **options: Any) -> dict[str, Any]: ...

    def stream_chat(self, request: dict[str, Any], result: Completion,
                    prompt_ids: list[int] | None = None) -> AsyncIterator[Delta]: ...

    async def complete(self, request: dict[str, Any]) -> Any: ...

    async def tokenize(self, messages: list[dict[str, Any]]) -> list[int]: ...
