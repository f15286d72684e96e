"""Fit the prompt to the model's window, counted with the server's own tokenizer (vLLM ``/tokenize``).

Over budget, the lowest-ranked chunks go first; the survivors keep their (canonical) order, so a trimmed
prompt is still a pure function of the set it contains.

Counting a 10K-token prompt costs a round trip and a tokenisation on the server's cores, per request. So a
``TokenEstimator`` calibrated on prompts vLLM has already counted answers first: a prompt whose pessimistic
estimate is well inside the budget is sent without counting. Only prompts near the limit are counted exactly;
if vLLM still refuses one (an estimate can be wrong), the service counts it exactly and sends it again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

from app.core.errors import ContextTooLong
from app.rag.context import ContextChunk

MAX_ROUNDS = 8
Render = Callable[[list[ContextChunk]], list[dict[str, Any]]]


class OverBudget(ContextTooLong):
    pass


class TokenEstimator:
    """A pessimistic token count from characters: the densest chars-per-token ratio seen so far, less a margin.

    Uncalibrated (nothing counted yet) it declines to guess, and every prompt is counted exactly."""

    def __init__(self, margin: float = 0.15, slack_tokens: int = 64) -> None:
        self.margin, self.slack_tokens = margin, slack_tokens
        self.chars_per_token: float | None = None  # None until vLLM has counted one of our prompts
        self._lock = threading.Lock()

    def observe(self, messages: list[dict[str, Any]], prompt_tokens: int) -> None:
        """Learn from a prompt vLLM counted (warm-ups, answered requests)."""
        if prompt_tokens <= 0:
            return
        ratio = prompt_chars(messages) / prompt_tokens
        with self._lock:
            self.chars_per_token = min(ratio, self.chars_per_token or ratio)

    def estimate(self, messages: list[dict[str, Any]]) -> int | None:
        return self.estimate_chars(prompt_chars(messages))

    def estimate_chars(self, chars: int) -> int | None:
        """Tokens of a prompt of ``chars`` characters (None: not calibrated yet)."""
        if self.chars_per_token is None:
            return None
        return int(chars / self.chars_per_token * (1 + self.margin)) + self.slack_tokens


class Tokenizer(Protocol):
    """Counts a prompt's tokens exactly as vLLM will (the vLLM client's ``/tokenize``)."""

    async def tokenize(self, messages: list[dict[str, Any]]) -> list[int]: ...


def prompt_chars(messages: list[dict[str, Any]]) -> int:
    return sum(len(m["content"]) for m in messages)


async def fit_to_budget(render: Render, llm: Tokenizer, chunks: list[ContextChunk], budget: int,
                        chunk_chars: Callable[[ContextChunk], int], estimator: TokenEstimator | None = None,
                        ) -> tuple[list[dict[str, Any]], list[ContextChunk], int]:
    """Render with as many of ``chunks`` as fit; ``chunk_chars`` tells how much text one chunk adds.

    Returns (messages, chunks kept, token count: exact, or the estimate when the estimate sufficed)."""
    kept = list(chunks)
    if estimator is not None:
        messages = render(kept)
        estimate = estimator.estimate(messages)
        if estimate is not None and estimate <= budget:
            return messages, kept, estimate
    for _ in range(MAX_ROUNDS):
        messages = render(kept)
        tokens = len(await llm.tokenize(messages))
        if tokens <= budget:
            return messages, kept, tokens
        if not kept:
            break
        chars_per_token = sum(len(m["content"]) for m in messages) / max(tokens, 1)
        kept = _drop_lowest_ranked(kept, (tokens - budget) * chars_per_token, chunk_chars)
    raise OverBudget(f"the prompt does not fit the model's context window ({budget} tokens for the prompt) even "
                     "without retrieved context; shorten the question or conversation, or lower max_tokens",
                     param="messages")


def _drop_lowest_ranked(kept: list[ContextChunk], excess_chars: float,
                        chunk_chars: Callable[[ContextChunk], int]) -> list[ContextChunk]:
    """Drop whole rank groups, lowest first (a unit's chunks share its rank, so units go whole).

    Sizes are estimated from each chunk's share of the prompt's characters; the next round re-measures exactly.
    """
    dropped_ranks, freed = set(), 0
    for rank in sorted({c.rank for c in kept}, reverse=True):
        dropped_ranks.add(rank)
        freed += sum(chunk_chars(c) for c in kept if c.rank == rank)
        if freed >= excess_chars:
            break
    return [chunk for chunk in kept if chunk.rank not in dropped_ranks]
