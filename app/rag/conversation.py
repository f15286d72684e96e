"""Multi-turn prompts that extend the previous turn's prompt, so vLLM re-uses its cached prefix.

Each user turn carries the context that was NEW at that turn, right before its question:

    system | ctx(turn 1) [client instructions] Q1 | A1 | ctx new at turn 2, Q2 | A2 | ctx new at turn 3, Q3

The first turn's context is arranged by the configured strategy (a whole unit, a page, the corpus), so a
conversation starts on the same pre-warmed prefix as ``/ask`` (which is a one-turn conversation); later turns
add only the hits not shown yet, in canonical order. A client's own system prompt goes after the first
context, not into the system message, so it does not break that shared prefix. Earlier turns are recomputed
from the conversation itself: retrieval is deterministic and the first turn's arrangement is remembered (or,
when forgotten, rebuilt as a pure function of its hits), so turn n+1's prompt starts with all of turn n's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.rag.budget import OverBudget, TokenEstimator, Tokenizer, fit_to_budget
from app.rag.context import ContextChunk, PromptBuilder, canonical


@dataclass(frozen=True)
class Turn:
    role: str  # "user" or "assistant"
    content: str


@dataclass
class Plan:
    """A conversation's turns and the context new at each user turn (the oldest exchange may be dropped)."""

    turns: list[Turn]
    contexts: list[list[ContextChunk]]


def new_context_per_turn(first: list[ContextChunk], later: list[list[ContextChunk]]) -> list[list[ContextChunk]]:
    """The first turn's (arranged) context, then for each later user turn the retrieved chunks not shown in
    an earlier turn, in canonical order."""
    shown = {chunk.id for chunk in first}
    per_turn = [first]
    for ranked in later:
        fresh = [chunk for chunk in ranked if chunk.id not in shown]
        shown |= {chunk.id for chunk in fresh}
        per_turn.append(canonical(fresh))
    return per_turn


def conversation_messages(builder: PromptBuilder, turns: list[Turn], contexts: list[list[ContextChunk]],
                          client_system: str = "") -> list[dict[str, str]]:
    """Render the conversation; ``contexts[i]`` is the new context of the i-th user turn."""
    messages = [{"role": "system", "content": builder.system_prompt}]
    user_index = 0
    for turn in turns:
        if turn.role != "user":  # client-supplied too: neutralised like documents and questions
            messages.append({"role": turn.role, "content": builder.assistant(turn.content)})
            continue
        context = contexts[user_index]
        # The first turn always has a context block (as /ask does, so both share one cached prefix).
        block = builder.context_block(context) if context or user_index == 0 else ""
        if user_index == 0 and client_system:
            block += builder.client_instructions(client_system)
        messages.append({"role": "user", "content": block + builder.question(turn.content)})
        user_index += 1
    return messages


async def fit_conversation(plan: Plan, builder: PromptBuilder, llm: Tokenizer, system: str, budget: int,
                           estimator: TokenEstimator | None) -> tuple[list[dict[str, Any]], list[ContextChunk]]:
    """The prompt within ``budget``: the newest context trimmed by rank; if even none fits, the oldest
    exchange goes (that request then misses the cache, its prefix changed) and it tries again."""
    while True:
        turns, contexts = plan.turns, plan.contexts

        def render(last: list[ContextChunk]) -> list[dict[str, Any]]:
            return conversation_messages(builder, turns, contexts[:-1] + [last], system)  # noqa: B023

        try:
            messages, kept, _ = await fit_to_budget(render, llm, contexts[-1], budget,
                                                    lambda chunk: len(builder.render_chunk(chunk)), estimator)
            return messages, kept
        except OverBudget:
            if len(contexts) == 1:
                raise
            plan.turns, plan.contexts = _drop_oldest_exchange(turns), contexts[1:]


def _drop_oldest_exchange(turns: list[Turn]) -> list[Turn]:
    """Remove the first user turn and everything up to the next user turn."""
    first_user = next(i for i, t in enumerate(turns) if t.role == "user")
    rest = turns[first_user + 1:]
    next_user = next(i for i, t in enumerate(rest) if t.role == "user")
    return turns[:first_user] + rest[next_user:]
