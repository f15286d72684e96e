"""The kernel that both the service (``app``) and ``ingest`` import: settings, Chroma access, the embedder, the chunk
record, and the indexes derived from a collection (BM25, pages). It imports nothing else of ``app`` and nothing of
``ingest`` (``lint-imports`` checks the contracts in ``pyproject.toml``), so neither side owns the other."""
