"""Wire schemas: the /ask API and the OpenAI shapes we mirror (errors, models, chat completions)."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, model_validator

from app.rag.context import ContextChunk


def _valid_unicode(text: str) -> str:
    """JSON can carry lone surrogates (``"\\ud800"``) that no tokenizer or UTF-8 encoder accepts: refuse them here."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"invalid Unicode: unpaired surrogate at character {exc.start}") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]


def _integral(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


# An integer as JSON Schema has it (2.0 is one) in an otherwise strict model ("2" and true are not); the bounds
# come before the validator so that they reach the schema as minimum/maximum.
TopK = Annotated[int, Field(ge=1, le=100), BeforeValidator(_integral)]
AnswerTokens = Annotated[int, Field(ge=1, le=32768), BeforeValidator(_integral)]


# --- errors: {"error": {"message", "type", "param", "code"}} everywhere -------------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# --- /ask --------------------------------------------------------------------------------------------------
class AskFilters(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    source_prefix: Text | None = Field(None, description="Only chunks whose source path starts with this.")


class AskRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # "stream": 0 or "top_k": "5" are errors, not guesses
    question: Text = Field(description="The question, in natural language (some non-space text).",
                           json_schema_extra={"minLength": 1, "pattern": r"\S"})  # checked by the service
    top_k: TopK | None = Field(None, description="Chunks to retrieve (1..RAG_LIMITS__MAX_TOP_K, "
                              "at most 100).")
    filters: AskFilters | None = None
    max_tokens: AnswerTokens | None = Field(None, description="Cap on answer tokens.")
    stream: bool = Field(False, description="Stream Server-Sent Events: deltas, then a final 'done' event.")


class Source(BaseModel):
    """A retrieved chunk in the prompt. ``id`` is exactly the id the prompt showed the model, so an answer's
    citation ``[id]`` names it: the document and chunk (``guide.md::3``), or the unit it was shown in."""

    id: str = Field(description="The id the prompt showed for this text and the model cites: document::chunk, or "
                    "the unit's id when the chunk was shown inside a whole document (or a window of one).")
    chunk_id: str = Field(description="The chunk's stable id in the store (document::chunk::content hash).")
    document: str = Field(description="Document id (path relative to the ingest root, or record id).")
    title: str
    headings: str = Field("", description="The section the chunk is in (headings joined by ' > ').")
    page: int | None = Field(None, description="1-based PDF page (null: not from a PDF).")
    snippet: str = Field(description="The start of the chunk's text, for showing next to a citation.")
    score: float = Field(description="Relevance, higher first: cosine similarity (dense retrieval), BM25 "
                         "(lexical) or the reciprocal-rank-fusion score (hybrid).")
    chunk_index: int


def sources_of(chunks: list[ContextChunk], cited: dict[str, str]) -> list[Source]:
    """The API form of the chunks an answer could cite (``app.rag.context.ContextChunk``), each under the id the
    prompt showed it as (``cited``: chunk id -> that id)."""
    return [Source(id=cited.get(c.id, c.cite_id), chunk_id=c.id, document=c.doc_id, title=c.title, headings=c.headings,
                   page=c.page if c.page > 0 else None, snippet=c.snippet(), score=c.score,
                   chunk_index=c.chunk_index) for c in chunks]


class AskUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = Field(description="Prompt tokens vLLM served from its prefix cache.")


class Timings(BaseModel):
    retrieve: float = Field(description="Embed the question + query Chroma (ms).")
    assemble: float = Field(description="Order, render and fit the prompt to the token budget (ms).")
    ttft: float = Field(description="Request received -> first answer token (ms).")
    upstream_ttft: float = Field(description="Request sent to vLLM -> its first answer token here (ms): vLLM's "
                                 "front end and engine; the rest of ttft is this service's own.")
    total: float = Field(description="Request received -> answer complete (ms).")


class AskResponse(BaseModel):
    answer: str
    sources: list[Source]
    usage: AskUsage
    timings_ms: Timings
    strategy: str = Field(description="Context strategy that built the prompt.")
    finish_reason: str | None = None


# --- OpenAI: models ---------------------------------------------------------------------------------------
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "prefixrag"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# The 200 of an endpoint that can stream: JSON, or Server-Sent Events with "stream": true.
STREAMED_200: dict[int | str, dict[str, Any]] = {200: {"content": {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"],
    "properties": {"event": {"type": "string"}, "data": {"type": "string"}}}}}}}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return ErrorResponse(error=ErrorDetail(message=message, type=type_, param=param, code=code)).model_dump()


INTERNAL_ERROR = error_body("internal error; see the service log", "server_error", None, "internal")


# --- OpenAI: chat completions ------------------------------------------------------------------------------
class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: Text | None = None  # not used, but validated like every text a client sends

    @model_validator(mode="after")
    def _text_is_valid_unicode(self) -> ChatMessage:
        _valid_unicode(self.text())  # once, on the text the prompt will carry (plain or content parts)
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text or "" for part in self.content if part.type == "text")
        return self.content or ""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # frontends send many optional fields; unknown ones are ignored
    messages: list[ChatMessage] = Field(min_length=1)
    model: Text | None = None
    stream: StrictBool = False
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: Text | list[Text] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    stream_options: StreamOptions | None = None
    user: Text | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class ChatUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: ChatUsage
    sources: list[Source] = Field(description="prefixrag extension: the chunks the answer could cite.")


class ChunkDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: ChunkDelta
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: ChatUsage | None = None
    sources: list[Source] | None = Field(None, description="prefixrag extension, on the final chunk.")
