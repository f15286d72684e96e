"""Fit the prompt to the model's window, counted with the server's own tokenizer (vLLM ``/tokenize``).

Over budget, the lowest-ranked chunks go first; the survivors keep their (canonical) order, so a trimmed
prompt is still a pure function of the set it contains. vLLM is never sent a prompt it would reject.
"""

from __future__ import annotations

from app.errors import BadRequest
from app.rag.context import ContextChunk, PromptBuilder

MAX_ROUNDS = 8


async def fit_to_budget(builder: PromptBuilder, llm, ordered: list[ContextChunk], question: str,
                        budget: int) -> tuple[list[dict], list[ContextChunk], int]:
    kept = list(ordered)
    for _ in range(MAX_ROUNDS):
        messages = builder.messages(kept, question)
        tokens = len(await llm.tokenize(messages))
        if tokens <= budget:
            return messages, kept, tokens
        if not kept:
            break
        kept = _drop_lowest_ranked(builder, kept, excess=tokens - budget, tokens=tokens, messages=messages)
    raise BadRequest(f"the question alone does not fit the model's context window ({budget} tokens for the "
                     "prompt); shorten it or lower max_tokens", param="question", code="context_length_exceeded")


def _drop_lowest_ranked(builder: PromptBuilder, kept: list[ContextChunk], *, excess: int, tokens: int,
                        messages: list[dict]) -> list[ContextChunk]:
    # Estimate each chunk's tokens from its share of the prompt's characters; the next round re-measures.
    chars_per_token = sum(len(m["content"]) for m in messages) / max(tokens, 1)
    dropped, freed = set(), 0.0
    for chunk in sorted(kept, key=lambda c: c.rank, reverse=True):
        dropped.add(chunk.id)
        freed += len(builder.render_chunk(chunk)) / chars_per_token
        if freed >= excess:
            break
    return [chunk for chunk in kept if chunk.id not in dropped]
