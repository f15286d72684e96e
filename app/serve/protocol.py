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


class RetrieveRequest(BaseModel):
    """``/v1/retrieve``'s body, and the start of ``/ask``'s."""

    model_config = ConfigDict(extra="forbid", strict=True)  # "stream": 0 or "top_k": "5" are errors, not guesses
    question: Text = Field(description="The question, in natural language (some non-space text).",
                           json_schema_extra={"minLength": 1, "pattern": r"\S"})  # checked by the service
    top_k: TopK | None = Field(None, description="Chunks to retrieve (1..PREFIXRAG_LIMITS__MAX_TOP_K, "
                              "at most 100).")
    filters: AskFilters | None = None
    collection: Text | None = Field(None, description="The collection to search (default: the service's first, "
                                    "PREFIXRAG_CHROMA__COLLECTION); GET /v1/collections lists those of the key.")


class AskRequest(RetrieveRequest):
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
    admit: float = Field(description="Request received -> admitted: the wait for an in-flight place (ms).")
    retrieve: float = Field(description="Request received -> its question ranked: admit, then encoding the "
                            "question and searching the collection (ms).")
    assemble: float = Field(description="Order, render and fit the prompt to the token budget (ms).")
    prepare: float = Field(description="Prompt fitted -> request sent to vLLM: its token ids made here where they "
                           "are known (ms).")
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


# --- /v1/retrieve -----------------------------------------------------------------------------------------
class RetrievedChunk(Source):
    """A ranked chunk as a source of ``/ask`` shows it, with its whole text and the stable unit it belongs to."""

    id: str = Field(description="document::chunk, as a prompt shows a chunk on its own.")
    rank: int = Field(description="1 for the most relevant.")
    text: str = Field(description="The chunk's whole text.")
    unit: str = Field(description="The stable unit the chunk belongs to: the page of small documents it was "
                      "grouped into, its document, or the window of a big one (document@start:size); the unit "
                      "prefixrag's prompts show and pre-warm, byte-identical for every question that hits it.")


class RetrieveResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[RetrievedChunk]
    retrieve_ms: float = Field(description="Request received -> ranked, units found (ms).")


def retrieved_chunks(hits: list[ContextChunk], units: list[str]) -> list[RetrievedChunk]:
    return [RetrievedChunk(**source.model_dump(), rank=n, text=chunk.text, unit=unit)
            for n, (chunk, unit, source) in enumerate(zip(hits, units, sources_of(hits, {}), strict=True), start=1)]


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


class ResponseFormat(BaseModel):
    """Structured output, passed to vLLM (its guided decoding): ``json_object``, or ``json_schema`` with the
    schema under ``json_schema`` (``{"name", "schema", "strict"}``, as OpenAI has it)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class GenerationRequest(BaseModel):
    """What chat and text completions share. Fields a client may send that prefixrag cannot honour (several
    answers, log probabilities, tools) are declared, so that a request using them is refused by name
    (``app.serve.routers.openai_chat.refuse_unsupported``) instead of having them silently dropped."""

    model_config = ConfigDict(extra="ignore")  # frontends send many optional fields; unknown ones are ignored
    model: Text | None = None
    stream: StrictBool = False
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: Text | list[Text] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    stream_options: StreamOptions | None = None
    user: Text | None = None
    prompt_cache_key: Text | None = Field(None, max_length=256, description=(
        "OpenAI's cache hint, taken as a routing hint only: a request that retrieved no context goes to the vLLM "
        "replica its key names (one with context goes where its documents are cached); never sent to vLLM, never "
        "a cache salt."))
    response_format: ResponseFormat | None = None
    n: int | None = Field(None, ge=1, description="Answers per request: only 1 is supported.")

    def unsupported(self) -> list[str]:
        """The parameters this request sets that prefixrag cannot honour."""
        return ["n"] if (self.n or 1) > 1 else []


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = Field(None, description="Not supported: true is refused.")
    top_logprobs: int | None = Field(None, description="Not supported: refused.")
    tools: list[dict[str, Any]] | None = Field(None, description="Not supported: refused unless tool_choice is "
                                               "'none' (prefixrag answers from its documents, it calls no tools).")
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = Field(None, description="Not supported (the deprecated tools).")

    def unsupported(self) -> list[str]:
        tools = bool(self.functions) or (bool(self.tools) and self.tool_choice != "none")
        return super().unsupported() + [param for param, used in (
            ("tools", tools or any(m.role == "tool" for m in self.messages)),
            ("logprobs", bool(self.logprobs) or self.top_logprobs is not None)) if used]


class TextCompletionRequest(GenerationRequest):
    """``POST /v1/completions``: the prompt is the question (clients such as LlamaIndex's ``OpenAILike`` call
    this route by default)."""

    prompt: Text | list[Text] = Field(description="The question: one string (or a list holding one).")
    logprobs: int | None = Field(None, description="Not supported: refused.")
    echo: StrictBool = Field(False, description="Not supported: true is refused.")
    suffix: Text | None = Field(None, description="Not supported: refused.")
    best_of: int | None = Field(None, ge=1, description="Only 1 is supported.")

    def unsupported(self) -> list[str]:
        return super().unsupported() + [param for param, used in (
            ("n", (self.best_of or 1) > 1), ("logprobs", self.logprobs is not None), ("echo", self.echo),
            ("suffix", self.suffix is not None), ("prompt", isinstance(self.prompt, list) and len(self.prompt) != 1))
            if used]

    def question(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


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


class TextChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class TextCompletion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[TextChoice]
    usage: ChatUsage | None = None
    sources: list[Source] | None = Field(None, description="prefixrag extension: the chunks the answer could cite "
                                         "(streamed: on the final chunk).")
