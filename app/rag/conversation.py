"""Multi-turn prompts that extend the previous turn's prompt, so vLLM re-uses its cached prefix.

Each user turn carries the context that was NEW at that turn, right before its question:

    system | ctx(turn 1) Q1 | A1 | ctx new at turn 2, Q2 | A2 | ctx new at turn 3, Q3

Context already shown stays where it was; chunks retrieved again are not repeated. Because retrieval is
deterministic, the context of earlier turns is recomputed from the conversation itself (no server state):
any replica rebuilds exactly the prompt the previous turn sent, and turn n+1's prompt starts with all of it.
Retrieval uses each turn's own user message.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.rag.context import ContextChunk, PromptBuilder, canonical


@dataclass(frozen=True)
class Turn:
    role: str  # "user" or "assistant"
    content: str


def new_context_per_turn(retrieved: list[list[ContextChunk]]) -> list[list[ContextChunk]]:
    """For each user turn, the retrieved chunks not shown in an earlier turn, in canonical order."""
    shown: set[str] = set()
    per_turn = []
    for ranked in retrieved:
        fresh = [chunk for chunk in ranked if chunk.id not in shown]
        shown |= {chunk.id for chunk in fresh}
        per_turn.append(canonical(fresh))
    return per_turn


def conversation_messages(builder: PromptBuilder, turns: list[Turn], contexts: list[list[ContextChunk]],
                          client_system: str = "") -> list[dict[str, str]]:
    """Render the conversation; ``contexts[i]`` is the new context of the i-th user turn."""
    system = builder.system_prompt + (f"\n\n{client_system}" if client_system else "")
    messages = [{"role": "system", "content": system}]
    user_index = 0
    for turn in turns:
        if turn.role != "user":
            messages.append({"role": turn.role, "content": turn.content})
            continue
        context = contexts[user_index]
        # The first turn always has a context block (as /ask does, so both share one cached prefix).
        block = builder.context_block(context) if context or user_index == 0 else ""
        messages.append({"role": "user", "content": block + builder.question(turn.content)})
        user_index += 1
    return messages
