"""What the kernel, the service and ingest need of the parts they do not own: a Chroma collection and the encoder.
The real ones are chromadb's ``Collection`` and ``app.core.embedder.Embedder``."""

from __future__ import annotations

from typing import Any, Protocol


class Collection(Protocol):
    """The calls made on a Chroma collection (chromadb's own ``Collection`` is one)."""

    @property
    def name(self) -> str: ...

    @property
    def metadata(self) -> dict[str, Any] | None: ...

    def count(self) -> int: ...

    def get(self, *args: Any, **kwargs: Any) -> Any: ...

    def query(self, *args: Any, **kwargs: Any) -> Any: ...

    def upsert(self, *args: Any, **kwargs: Any) -> None: ...

    def delete(self, *args: Any, **kwargs: Any) -> None: ...

    def modify(self, *args: Any, **kwargs: Any) -> None: ...


class Embedder(Protocol):
    """Texts to unit vectors, by a named model of a fixed dimension."""

    name: str

    @property
    def dimension(self) -> int: ...

    def embed(self, texts: list[str]) -> list[list[float]]: ...
