"""Fit the prompt to the model's window, counted with the server's own tokenizer (vLLM ``/tokenize``).

Over budget, the lowest-ranked chunks go first; the survivors keep their (canonical) order, so a trimmed
prompt is still a pure function of the set it contains. vLLM is never sent a prompt it would reject.
"""

from __future__ import annotations

from collections.abc import Callable

from app.errors import BadRequest
from app.rag.context import ContextChunk

MAX_ROUNDS = 8
Render = Callable[[list[ContextChunk]], list[dict]]


class OverBudget(BadRequest):
    code = "context_length_exceeded"


async def fit_to_budget(render: Render, llm, chunks: list[ContextChunk], budget: int,
                        chunk_chars: Callable[[ContextChunk], int]) -> tuple[list[dict], list[ContextChunk], int]:
    """Render with as many of ``chunks`` as fit; ``chunk_chars`` tells how much text one chunk adds."""
    kept = list(chunks)
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
