"""What a request asks for, checked once at the edge into one typed value: ``/ask`` is a one-turn conversation,
so both endpoints go through the same pipeline (``app.rag.pipeline``) with the same limits."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from app.core.errors import BadRequest
from app.core.settings import RequestLimits
from app.rag.conversation import Turn


@dataclass(frozen=True)
class Sampling:
    """A client's own sampling choices, passed to vLLM as given (None: the service's default, or vLLM's)."""

    temperature: float | None = None
    top_p: float | None = None
    stop: list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    response_format: dict[str, Any] | None = None  # structured output, as OpenAI spells it (vLLM decodes to it)

    def options(self) -> dict[str, Any]:
        """The parameters a client set, but temperature (the service has a default of its own for it)."""
        chosen = {"top_p": self.top_p, "stop": self.stop, "presence_penalty": self.presence_penalty,
                  "frequency_penalty": self.frequency_penalty, "response_format": self.response_format}
        return {name: value for name, value in chosen.items() if value is not None}


@dataclass
class Query:
    """``POST /ask`` as received."""

    question: str
    top_k: int | None = None
    source_prefix: str | None = None
    max_tokens: int | None = None
    cache_salt: str | None = None  # the tenant's own prefix cache (``app.serve.tenants``); None: the shared one
    received_at: float = field(default_factory=time.perf_counter)


@dataclass
class Lookup:
    """``POST /v1/retrieve`` as received: a question to rank, nothing to generate."""

    question: str
    top_k: int | None = None
    source_prefix: str | None = None
    cache_salt: str | None = None  # the tenant's own prefix cache (``app.serve.tenants``); None: the shared one
    received_at: float = field(default_factory=time.perf_counter)


@dataclass
class ChatQuery:
    """``POST /v1/chat/completions`` as received (the client's system prompt apart from the turns)."""

    turns: list[Turn]
    system: str = ""
    max_tokens: int | None = None
    sampling: Sampling = Sampling()
    cache_salt: str | None = None  # the tenant's own prefix cache (``app.serve.tenants``); None: the shared one
    received_at: float = field(default_factory=time.perf_counter)
    route_hint: str | None = None  # the client's ``prompt_cache_key``: routes a request without context


@dataclass(frozen=True)
class Conversation:
    """A checked request: every limit applied, every default resolved."""

    turns: tuple[Turn, ...]
    top_k: int
    max_tokens: int
    system: str = ""
    source_prefix: str | None = None
    sampling: Sampling = Sampling()
    cache_salt: str | None = None  # the tenant's own prefix cache (``app.serve.tenants``); None: the shared one
    received_at: float = field(default_factory=time.perf_counter)
    route_hint: str | None = None  # the client's ``prompt_cache_key``: routes a request without context

    @property
    def questions(self) -> list[str]:
        return [turn.content for turn in self.turns if turn.role == "user"]


class RequestRules:
    """The limits of ``RequestLimits``; a request that breaks one is a 400 before any work starts."""

    def __init__(self, settings: RequestLimits) -> None:
        self.settings = settings

    def ask(self, query: Query) -> Conversation:
        question = self._question(query.question, "question")
        return Conversation((Turn("user", question),), self._top_k(query.top_k), self._max_tokens(query.max_tokens),
                            source_prefix=query.source_prefix, cache_salt=query.cache_salt,
                            received_at=query.received_at)

    def lookup(self, lookup: Lookup) -> Lookup:
        """The same checks as ``/ask``'s question and ``top_k``, the default resolved."""
        return Lookup(self._question(lookup.question, "question"), self._top_k(lookup.top_k), lookup.source_prefix,
                      lookup.cache_salt, lookup.received_at)

    def chat(self, chat: ChatQuery) -> Conversation:
        limits = self.settings
        if not chat.turns or chat.turns[-1].role != "user":
            raise BadRequest("the last message must be a user message", param="messages", code="invalid_messages")
        if len(chat.turns) > limits.max_chat_messages:
            raise BadRequest(f"{len(chat.turns)} messages; the limit is {limits.max_chat_messages}",
                             param="messages", code="too_many_messages")
        size = len(chat.system) + sum(len(turn.content) for turn in chat.turns)
        if size > limits.max_chat_chars:
            raise BadRequest(f"the messages hold {size} characters; the limit is {limits.max_chat_chars}",
                             param="messages", code="conversation_too_long")
        turns = []
        for number, turn in enumerate(chat.turns):  # every question is retrieved for: each one is checked
            content = self._question(turn.content, f"messages[{number}]") if turn.role == "user" else turn.content
            turns.append(Turn(turn.role, content))
        return Conversation(tuple(turns), self._top_k(None), self._max_tokens(chat.max_tokens), chat.system,
                            None, chat.sampling, chat.cache_salt, chat.received_at, chat.route_hint)

    def _question(self, text: object, where: str) -> str:
        question = text.strip() if isinstance(text, str) else ""
        param, prefix = ("question", "") if where == "question" else ("messages", f"{where}: ")
        if not question:
            raise BadRequest(f"{prefix}question must be a non-empty string", param=param, code="empty_question")
        if len(question) > self.settings.max_question_chars:
            raise BadRequest(f"{prefix}question is {len(question)} characters; the limit is "
                             f"{self.settings.max_question_chars}", param=param, code="question_too_long")
        return question

    def _top_k(self, top_k: int | None) -> int:
        top_k = self.settings.top_k if top_k is None else top_k
        if not 1 <= top_k <= self.settings.max_top_k:
            raise BadRequest(f"top_k must be between 1 and {self.settings.max_top_k}", param="top_k",
                             code="top_k_out_of_range")
        return top_k

    def _max_tokens(self, max_tokens: int | None) -> int:
        return max_tokens or self.settings.max_tokens
