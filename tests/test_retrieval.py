"""Dense, lexical and hybrid retrieval over a real collection (the project's docs, ingested with the real
embedder into on-disk Chroma, the BM25 index saved beside it by ingest)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from app.rag.retriever import Retriever
from tests.corpora import app_settings

IDENTIFIER = "prefix_cache_hits_total"  # a vLLM counter named once in docs/operations.md


@pytest.fixture
def retriever(collections, embedder):
    settings = app_settings(collections, "http://unused/v1", collection="project-docs")
    found = Retriever(embedder, settings.chroma, ThreadPoolExecutor(2), settings.retrieval)
    found.lexical_index(wait=True)
    yield found
    found.close()


def test_lexical_and_hybrid_find_an_exact_identifier_that_dense_misses(retriever):
    def first(mode: str):
        return retriever.retrieve_sync(IDENTIFIER, 1, mode=mode)[0]

    assert IDENTIFIER not in first("dense").text, "the premise: embeddings rank another chunk first"
    assert IDENTIFIER in first("lexical").text
    assert IDENTIFIER in first("hybrid").text


def test_hybrid_ranking_is_the_same_every_time_and_from_a_rebuilt_index(retriever, collections, embedder, tmp_path):
    questions = ["How does pre-warm avoid delaying users?", "What does /readyz report?", IDENTIFIER]
    first = [[c.id for c in retriever.retrieve_sync(q, 5, mode="hybrid")] for q in questions]
    again = [[c.id for c in retriever.retrieve_sync(q, 5, mode="hybrid")] for q in questions]
    settings = app_settings(collections, "http://unused/v1", collection="project-docs")
    settings.chroma.lexical_dir = tmp_path / "none-saved"  # no saved index here: built from Chroma's rows
    rebuilt = Retriever(embedder, settings.chroma, ThreadPoolExecutor(1), settings.retrieval)
    assert rebuilt.lexical_index(wait=True).ids, "built in memory"
    assert first == again == [[c.id for c in rebuilt.retrieve_sync(q, 5, mode="hybrid")] for q in questions]
    rebuilt.close()


def test_a_source_filter_applies_to_both_rankings(retriever):
    for mode in ("dense", "lexical", "hybrid"):
        found = retriever.retrieve_sync("How is the prompt kept stable for the prefix cache?", 5,
                                        source_prefix="architecture", mode=mode)
        assert found and all(c.doc_id.startswith("architecture") for c in found), mode
        assert not retriever.retrieve_sync(IDENTIFIER, 5, source_prefix="architecture", mode="lexical")


def test_a_chunk_deleted_after_the_index_was_built_is_left_out_not_an_error(tmp_path, embedder):
    from ingest.pipeline import run_ingest
    from tests.conftest import ROOT
    from tests.corpora import collection_of

    settings = app_settings(tmp_path / "chroma", "http://unused/v1", collection="docs")
    run_ingest([ROOT / "docs"], settings, embedder)
    retriever = Retriever(embedder, settings.chroma, ThreadPoolExecutor(1), settings.retrieval)
    target = next(c for c in retriever.retrieve_sync(IDENTIFIER, 3, mode="lexical") if IDENTIFIER in c.text)
    retriever.lexical_index(wait=True)  # the index now holds the target
    collection_of(settings, embedder).delete(ids=[target.id])  # behind the service's back, no new stamp yet
    found = retriever.retrieve_sync(IDENTIFIER, 5, mode="hybrid")
    assert found and target.id not in {c.id for c in found}
    assert [c.rank for c in found] == list(range(len(found)))
    retriever.close()
