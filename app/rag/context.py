"""Prompt assembly: fixed system prompt -> context block -> question.

The context block is a pure function of the SET of chunks: they are rendered in canonical order (document id,
chunk index), never in relevance order, so two questions that retrieve the same set share every token up to
the question, and vLLM's prefix cache serves that shared part.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from app.rag.prompts import PromptTemplates, attribute, inert


@dataclass(frozen=True)
class ContextChunk:
    id: str
    doc_id: str
    chunk_index: int
    text: str
    title: str = ""
    headings: str = ""
    score: float = 0.0  # cosine similarity to the question; never rendered into the prompt
    rank: int = 0  # 0 = most relevant; used only to decide what to drop when over budget
    parent_id: str = ""
    parent_pos: int = 0
    retrieved: bool = True  # False for chunks a strategy added around the hits (rest of a unit, corpus)

    @property
    def canonical_key(self) -> tuple[str, int, str]:
        return (self.doc_id, self.chunk_index, self.id)


def canonical(chunks: list[ContextChunk]) -> list[ContextChunk]:
    return sorted(chunks, key=lambda chunk: chunk.canonical_key)


class PromptBuilder:
    def __init__(self, templates: PromptTemplates) -> None:
        self.templates = templates

    @cached_property
    def system_prompt(self) -> str:
        return self.templates.render("system", "text")

    def render_chunk(self, chunk: ContextChunk) -> str:
        return self.templates.render("context", "document", id=attribute(chunk.id), title=attribute(chunk.title),
                                     headings=attribute(chunk.headings), text=inert(chunk.text))

    def context_block(self, ordered: list[ContextChunk]) -> str:
        """Render chunks in the order given (callers pass canonical or strategy order, never relevance)."""
        if not ordered:
            return self.templates.render("context", "empty")
        return self.templates.render("context", "block", documents="".join(map(self.render_chunk, ordered)))

    def question(self, question: str) -> str:
        return self.templates.render("question", "text", question=inert(question))

    def messages(self, ordered: list[ContextChunk], question: str) -> list[dict[str, str]]:
        return [
            {"role": "system", "content": self.system_prompt},
            {"role": "user", "content": self.context_block(ordered) + self.question(question)},
        ]

    def warmup_messages(self) -> list[dict[str, str]]:
        """The stable prefix: system prompt and the fixed start of the user turn."""
        return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": ""}]
