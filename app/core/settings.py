"""The one settings object of prefixrag (env prefix ``PREFIXRAG_``, nested with ``__``, ``.env`` supported;
unknown names refused and the old ``PREFIXRAG_`` prefix read for this release: ``app.core.settings_names``).

Flat aliases (docs/configuration.md: ``PREFIXRAG_CHROMA_PATH``, ``PREFIXRAG_VLLM_URL``, ``PREFIXRAG_MODEL`` ...)
are read too, so the common knobs need no double underscores.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from pydantic import AliasChoices, BaseModel, Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from app.core.settings_corpus import (
    PACKAGED_EMBEDDER,
    ChromaSettings,
    ChunkSettings,
    EmbeddingSettings,
    IngestSettings,
    PageSettings,
    RetrievalSettings,
)
from app.core.settings_names import PREFIX, UnknownSetting, adopted, known_names
from app.core.settings_serving import (
    ContextSettings,
    RequestLimits,
    SamplingSettings,
    ServiceSettings,
    TrafficSettings,
    VLLMServerSettings,
    VLLMSettings,
    WarmupSettings,
)

__all__ = [
    "PACKAGED_EMBEDDER", "ChromaSettings", "ChunkSettings", "ContextSettings", "EmbeddingSettings", "IngestSettings",
    "PageSettings", "RequestLimits", "RetrievalSettings", "SamplingSettings", "ServiceSettings", "Settings",
    "TrafficSettings", "VLLMServerSettings", "VLLMSettings", "WarmupSettings", "environment_of", "invalid_setting",
    "overridden", "setting_named", "UnknownSetting",
]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=PREFIX, env_nested_delimiter="__", env_file=".env", extra="ignore", populate_by_name=True
    )

    chroma: ChromaSettings = Field(default_factory=ChromaSettings, description="Vector store.")
    embedding: EmbeddingSettings = Field(default_factory=EmbeddingSettings, description="Encoder.")
    chunking: ChunkSettings = Field(default_factory=ChunkSettings, description="Chunker.")
    retrieval: RetrievalSettings = Field(default_factory=RetrievalSettings, description="Dense, lexical or hybrid.")
    pages: PageSettings = Field(default_factory=PageSettings, description="Small documents grouped into pages.")
    ingest: IngestSettings = Field(default_factory=IngestSettings, description="Ingest pipeline.")
    vllm: VLLMSettings = Field(default_factory=VLLMSettings, description="Upstream vLLM server.")
    vllm_server: VLLMServerSettings = Field(default_factory=VLLMServerSettings, description="vLLM launcher.")
    limits: RequestLimits = Field(default_factory=RequestLimits, description="Request limits and defaults.")
    context: ContextSettings = Field(default_factory=ContextSettings, description="Context strategy and units.")
    warmup: WarmupSettings = Field(default_factory=WarmupSettings, description="Pre-warm.")
    sampling: SamplingSettings = Field(default_factory=SamplingSettings, description="Answer sampling.")
    service: ServiceSettings = Field(default_factory=ServiceSettings, description="HTTP service.")
    traffic: TrafficSettings = Field(default_factory=TrafficSettings, description="Admission control, shutdown.")

    # Flat aliases for the everyday knobs; applied over the nested values when set.
    chroma_path: Path | None = Field(None, validation_alias=AliasChoices(f"{PREFIX}CHROMA_PATH"),
                                     description="= chroma.path")
    chroma_url: str | None = Field(None, validation_alias=AliasChoices(f"{PREFIX}CHROMA_URL"),
                                   description="= chroma.url")
    collection: str | None = Field(None, validation_alias=AliasChoices(f"{PREFIX}COLLECTION"),
                                   description="= chroma.collection")
    vllm_url: str | None = Field(None, validation_alias=AliasChoices(f"{PREFIX}VLLM_URL"), description="= vllm.url")
    model: str | None = Field(None, validation_alias=AliasChoices(f"{PREFIX}MODEL"), description="= vllm.model")
    top_k: int | None = Field(None, validation_alias=AliasChoices(f"{PREFIX}TOP_K"), description="= limits.top_k")
    api_key: str | None = Field(None, validation_alias=AliasChoices(f"{PREFIX}API_KEY"),
                                description="= service.api_key")

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        """The environment and ``.env`` as read, checked and with the old prefix adopted (``settings_names``)."""
        known = known_names(settings_cls)
        for source, where in ((env_settings, "environment"), (dotenv_settings, ".env")):
            source.env_vars = adopted(source.env_vars, known, where)  # type: ignore[attr-defined]
        return init_settings, env_settings, dotenv_settings, file_secret_settings

    @model_validator(mode="after")
    def _apply_flat_aliases(self) -> Settings:
        pairs = [
            ("chroma_path", self.chroma, "path"), ("chroma_url", self.chroma, "url"),
            ("collection", self.chroma, "collection"), ("vllm_url", self.vllm, "url"),
            ("model", self.vllm, "model"), ("top_k", self.limits, "top_k"),
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
        self.limits = RequestLimits.model_validate(self.limits.model_dump())
        return self


def overridden(settings: Settings, values: Mapping[str, object]) -> Settings:
    """A copy of ``settings`` with the fields named ``section.field`` set (a None value changes nothing); each
    section changed is validated again, so a bad value fails here. Every entry point turns its flags into
    settings through this."""
    updates: dict[str, dict[str, object]] = {}
    for name, value in values.items():
        section, _, field = name.partition(".")
        if section not in Settings.model_fields or not field:
            raise ValueError(f"no setting {name!r}")
        if value is not None:
            updates.setdefault(section, {})[field] = value
    copy = settings.model_copy()
    for section, fields in updates.items():
        current = getattr(settings, section)
        unknown = set(fields) - set(type(current).model_fields)
        if unknown:
            raise ValueError(f"no setting {section}.{sorted(unknown)[0]}")
        setattr(copy, section, type(current).model_validate(current.model_dump() | fields))
    return copy


def environment_of(values: Mapping[str, object]) -> dict[str, str]:
    """The same overrides as ``PREFIXRAG_*`` variables (for a child process, or a --reload worker, to read)."""
    return {f"{PREFIX}{name.replace('.', '__').upper()}": str(value) for name, value in values.items()
            if value is not None}


def setting_named(field: str) -> str:
    """``section.field`` for a bare name of a setting that shapes answers (``unit_quorum``, ``top_k``,
    ``warm_piece_tokens`` for ``warmup.piece_tokens``): how benchmark modes and tests name them."""
    for section in ("context", "limits", "warmup", "sampling"):
        model = Settings.model_fields[section].annotation
        name = field.removeprefix("warm_") if section == "warmup" else field
        if isinstance(model, type) and issubclass(model, BaseModel) and name in model.model_fields:
            return f"{section}.{name}"
    raise ValueError(f"no setting named {field!r}")


def invalid_setting(exc: ValidationError | UnknownSetting) -> str:
    """A settings error as the one line every entry point prints: which setting, what is wrong with it."""
    if isinstance(exc, UnknownSetting):
        return str(exc)
    first = exc.errors()[0]
    return f"invalid setting {'.'.join(map(str, first['loc']))}: {first['msg']}"
