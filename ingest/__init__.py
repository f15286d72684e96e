"""prefixrag ingest: files -> chunks -> embeddings -> Chroma. See ``ingest.pipeline``."""
