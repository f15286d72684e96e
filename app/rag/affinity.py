"""Which vLLM replica a request should reach: the one that already holds its prompt's prefix."""

from __future__ import annotations

import hashlib

from app.rag.context import ContextChunk


def affinity_key(context: list[ContextChunk]) -> str:
    """Routing key for prefix affinity (vllm-router's consistent hash): the prompt's first stable unit -- the
    unit (document strategy) or first parent (corpus) its first chunk was placed in, else that chunk; with no
    context, the system prompt alone. Requests that can share a cached prefix go to the same replica, and so
    does the pre-warm of that unit."""
    first = (context[0].unit or context[0].id) if context else ""
    return hashlib.sha256(first.encode()).hexdigest()[:16]
