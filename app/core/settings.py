"""The one settings object of prefixrag (env prefix ``RAG_``, nested with ``__``, ``.env`` supported).

Flat aliases the README documents (``RAG_CHROMA_PATH``, ``RAG_VLLM_URL``, ``RAG_MODEL`` ...) are read too,
so the common knobs need no double underscores.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import AliasChoices, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from app.core.settings_corpus import (
    PACKAGED_EMBEDDER,
    ChromaSettings,
    ChunkSettings,
    EmbeddingSettings,
    IngestSettings,
    PageSettings,
    RetrievalSettings,
)
from app.core.settings_serving import (
    GenerationSettings,
    ServiceSettings,
    TrafficSettings,
    VLLMServerSettings,
    VLLMSettings,
)

__all__ = [
    "PACKAGED_EMBEDDER", "ChromaSettings", "ChunkSettings", "EmbeddingSettings", "GenerationSettings",
    "IngestSettings", "PageSettings", "RetrievalSettings", "ServiceSettings", "Settings", "TrafficSettings",
    "VLLMServerSettings", "VLLMSettings",
]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="RAG_", env_nested_delimiter="__", env_file=".env", extra="ignore", populate_by_name=True
    )

    chroma: ChromaSettings = Field(default_factory=ChromaSettings, description="Vector store.")
    embedding: EmbeddingSettings = Field(default_factory=EmbeddingSettings, description="Encoder.")
    chunking: ChunkSettings = Field(default_factory=ChunkSettings, description="Chunker.")
    retrieval: RetrievalSettings = Field(default_factory=RetrievalSettings, description="Dense, lexical or hybrid.")
    pages: PageSettings = Field(default_factory=PageSettings, description="Small documents grouped into pages.")
    ingest: IngestSettings = Field(default_factory=IngestSettings, description="Ingest pipeline.")
    vllm: VLLMSettings = Field(default_factory=VLLMSettings, description="Upstream vLLM server.")
    vllm_server: VLLMServerSettings = Field(default_factory=VLLMServerSettings, description="vLLM launcher.")
    generation: GenerationSettings = Field(default_factory=GenerationSettings, description="Retrieval + generation.")
    service: ServiceSettings = Field(default_factory=ServiceSettings, description="HTTP service.")
    traffic: TrafficSettings = Field(default_factory=TrafficSettings, description="Admission control, shutdown.")

    # Flat aliases for the everyday knobs; applied over the nested values when set.
    chroma_path: Path | None = Field(None, validation_alias=AliasChoices("RAG_CHROMA_PATH"),
                                     description="= chroma.path")
    chroma_url: str | None = Field(None, validation_alias=AliasChoices("RAG_CHROMA_URL"), description="= chroma.url")
    collection: str | None = Field(None, validation_alias=AliasChoices("RAG_COLLECTION"),
                                   description="= chroma.collection")
    vllm_url: str | None = Field(None, validation_alias=AliasChoices("RAG_VLLM_URL"), description="= vllm.url")
    model: str | None = Field(None, validation_alias=AliasChoices("RAG_MODEL"), description="= vllm.model")
    top_k: int | None = Field(None, validation_alias=AliasChoices("RAG_TOP_K"), description="= generation.top_k")
    api_key: str | None = Field(None, validation_alias=AliasChoices("RAG_API_KEY"), description="= service.api_key")

    @model_validator(mode="after")
    def _apply_flat_aliases(self) -> Settings:
        pairs = [
            ("chroma_path", self.chroma, "path"), ("chroma_url", self.chroma, "url"),
            ("collection", self.chroma, "collection"), ("vllm_url", self.vllm, "url"),
            ("model", self.vllm, "model"), ("top_k", self.generation, "top_k"),
            ("api_key", self.service, "api_key"),
        ]
        for flat, section, field in pairs:
            value = getattr(self, flat)
            if value is not None:
                setattr(section, field, value)
                setattr(self, flat, None)
        # Re-validate sections the aliases touched so bad values fail fast here, not at first use.
        self.chroma = ChromaSettings.model_validate(self.chroma.model_dump())
        self.vllm = VLLMSettings.model_validate(self.vllm.model_dump())
        self.generation = GenerationSettings.model_validate(self.generation.model_dump())
        return self
