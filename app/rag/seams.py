"""What the request pipeline needs of the parts it does not own: the vLLM client (the real one is
``app.vllm.client.LLMClient``; the fast test tier's fake subclasses it), the question encoder (the kernel's
``Embedder`` protocol) and the ranker (``app.rag.retriever.Retriever`` in this process, or
``app.runtime.retrieval_pool.RetrievalPool`` in worker processes)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

from app.core.seams import Embedder
from app.vllm.prompt_pieces import TokenPrompt
from app.vllm.wire import Completion, Delta

if TYPE_CHECKING:
    from app.rag.retriever import Ranking

__all__ = ["LLM", "Embedder", "Ranker"]


class Ranker(Protocol):
    async def rank(self, question: str, k: int, source_prefix: str | None = None) -> Ranking:
        """The question's top ``k`` chunks (of sources starting with ``source_prefix``)."""

    async def prime(self) -> None:
        """Load what the first question would otherwise pay for (encoder, vector and BM25 indexes)."""


class LLM(Protocol):
    def chat_request(self, messages: list[dict[str, Any]], *, max_tokens: int, temperature: float, prefix_key: str,
                     stream: bool = True, repetition_penalty: float | None = None, priority: int | None = None,
                     sampling: dict[str, Any] | None = None, **options: Any) -> dict[str, Any]: ...

    def stream_chat(self, request: dict[str, Any], result: Completion,
                    prompt_ids: TokenPrompt | None = None) -> AsyncIterator[Delta]: ...

    async def complete(self, request: dict[str, Any]) -> Any: ...

    async def tokenize(self, messages: list[dict[str, Any]]) -> list[int]: ...
