"""Dense, lexical and hybrid retrieval over a real collection (the project's docs, ingested with the real
embedder into on-disk Chroma, the BM25 index saved beside it by ingest); and BM25 kept off the GPU where jax is
installed."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from app.rag.retriever import Retriever
from tests.support.corpora import app_settings

IDENTIFIER = "prefix_cache_hits_total"  # a vLLM counter named once in examples/docs/operations.md


@pytest.fixture
def retriever(collections, embedder):
    settings = app_settings(collections, "http://unused/v1", collection="project-docs")
    found = Retriever.over(embedder, settings.chroma, ThreadPoolExecutor(2), settings.retrieval)
    found.index.lexical_index(wait=True)
    yield found
    found.index.close()


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
    rebuilt = Retriever.over(embedder, settings.chroma, ThreadPoolExecutor(1), settings.retrieval)
    assert rebuilt.index.lexical_index(wait=True).ids, "built in memory"
    assert first == again == [[c.id for c in rebuilt.retrieve_sync(q, 5, mode="hybrid")] for q in questions]
    rebuilt.index.close()


def test_a_source_filter_applies_to_both_rankings(retriever):
    for mode in ("dense", "lexical", "hybrid"):
        found = retriever.retrieve_sync("How is the prompt kept stable for the prefix cache?", 5,
                                        source_prefix="architecture", mode=mode)
        assert found and all(c.doc_id.startswith("architecture") for c in found), mode
        assert not retriever.retrieve_sync(IDENTIFIER, 5, source_prefix="architecture", mode="lexical")


def test_questions_ranked_together_rank_as_each_alone(retriever, embedder):
    """A worker's batch: one Chroma query per depth and filter, one read of the texts; the same rankings."""
    questions = [("How does pre-warm avoid delaying users?", 5, None), (IDENTIFIER, 3, None),
                 ("What does /readyz report?", 25, None), ("How is the prompt kept stable?", 5, "architecture"),
                 ("What does /readyz report?", 5, "no-such-source/"),
                 ("How does pre-warm avoid delaying users?", 5, None)]
    vectors = embedder.embed([question for question, _, _ in questions])
    together = retriever.rank_batch_sync(questions, vectors)
    alone = [retriever.rank_sync(q, k, p, vector=v) for (q, k, p), v in zip(questions, vectors, strict=True)]
    assert together == alone
    assert [len(ranking.chunks) for ranking in together][:2] == [5, 3] and len(together[2].chunks) > 5
    assert not together[4].chunks  # the filter matches no source


def test_a_chunk_deleted_after_the_index_was_built_is_left_out_not_an_error(tmp_path, embedder):
    from ingest.pipeline import run_ingest
    from tests.support.corpora import collection_of
    from tests.support.env import ROOT

    settings = app_settings(tmp_path / "chroma", "http://unused/v1", collection="docs")
    run_ingest([ROOT / "examples" / "docs"], settings, embedder)
    retriever = Retriever.over(embedder, settings.chroma, ThreadPoolExecutor(1), settings.retrieval)
    target = next(c for c in retriever.retrieve_sync(IDENTIFIER, 3, mode="lexical") if IDENTIFIER in c.text)
    retriever.index.lexical_index(wait=True)  # the index now holds the target
    collection_of(settings, embedder).delete(ids=[target.id])  # behind the service's back, no new stamp yet
    found = retriever.retrieve_sync(IDENTIFIER, 5, mode="hybrid")
    assert found and target.id not in {c.id for c in found}
    assert [c.rank for c in found] == list(range(len(found)))
    retriever.index.close()


def test_rows_hold_their_text_in_metadata_and_a_store_with_texts_as_documents_reads_the_same(tmp_path, embedder):
    """Ingest writes each chunk's text as a metadata value, not as Chroma's document (single-node Chroma indexes
    every document for a full-text search the service never makes). A store written before, its texts as
    documents, ranks and reads the same: the texts, BM25 built from its rows, the pages' parents."""
    from app.core import pages
    from app.core.records import TEXT_KEY
    from ingest.pipeline import run_ingest
    from tests.support.corpora import collection_of
    from tests.support.env import ROOT

    settings = app_settings(tmp_path / "chroma", "http://unused/v1", collection="docs")
    run_ingest([ROOT / "examples" / "docs"], settings, embedder)
    collection = collection_of(settings, embedder)
    rows = collection.get(include=["documents", "metadatas", "embeddings"])
    assert rows["ids"] and all(document is None for document in rows["documents"])
    assert all(meta[TEXT_KEY].strip() for meta in rows["metadatas"])
    questions = [IDENTIFIER, "How does pre-warm avoid delaying users?", "What does /readyz report?"]

    def read(layout: str) -> tuple[list, list, list]:
        settings.chroma.lexical_dir = tmp_path / f"bm25-{layout}"  # none saved there: built from the rows
        retriever = Retriever.over(embedder, settings.chroma, ThreadPoolExecutor(1), settings.retrieval)
        retriever.index.lexical_index(wait=True)
        found = [[(c.id, c.text) for c in retriever.retrieve_sync(q, 5, mode=mode)]
                 for q in questions for mode in ("dense", "lexical", "hybrid")]
        retriever.index.close()
        parents = pages.read_parents(collection_of(settings, embedder))
        return found, list(parents.keys), parents.tokens.tolist()

    written = read("text-in-metadata")
    texts = [meta[TEXT_KEY] for meta in rows["metadatas"]]
    collection.update(ids=rows["ids"], embeddings=rows["embeddings"], documents=texts,
                      metadatas=[{TEXT_KEY: None}] * len(texts))  # None: the key goes
    before = collection.get(include=["documents", "metadatas"])
    assert before["documents"] == texts and not any(TEXT_KEY in meta for meta in before["metadatas"])
    assert read("text-as-document") == written and all(text for ranking in written[0] for _, text in ranking)


# A stand-in for jax (not installed on CPU machines; on GPU machines it often is, and bm25s then uses it): it logs
# the platform it was given and every top-k it is asked for.
JAX_STUB = """import os
open(os.environ['JAX_STUB_LOG'], 'w').write(f"platforms={os.environ.get('JAX_PLATFORMS')}\\n")
"""
LAX_STUB = """import os
import numpy as np
def top_k(scores, k):
    open(os.environ['JAX_STUB_LOG'], 'a').write('top_k\\n')
    order = np.argsort(-np.asarray(scores))[:k]
    return np.asarray(scores)[order], order
"""
BM25_SCRIPT = """from app.core import lexical
bm25 = lexical._bm25s().BM25()
bm25.index(lexical.tokenize(["sys_path_init sets the search path", "the collector frees cycles", "asyncio"]),
           show_progress=False)
print(lexical.LexicalIndex("g", ["a", "b", "c"], ["s"] * 3, bm25).search("configure sys_path_init", 2))
"""


def test_bm25_keeps_an_installed_jax_off_the_gpu_and_selects_with_numpy(tmp_path):
    from tests.support.env import ROOT

    (tmp_path / "jax").mkdir()
    (tmp_path / "jax" / "__init__.py").write_text(JAX_STUB)
    (tmp_path / "jax" / "lax.py").write_text(LAX_STUB)
    log = tmp_path / "jax.log"
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"} | {
        "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "JAX_STUB_LOG": str(log)}
    found = subprocess.run([sys.executable, "-c", BM25_SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout
    assert found.startswith("[('a', ")
    # bm25s's own top-k at import (on the CPU platform), none per query
    assert log.read_text().splitlines() == ["platforms=cpu", "top_k"]


def test_a_bm25_search_finds_what_bm25s_retrieve_finds_best_first_ties_in_index_order_within_the_filter():
    from app.core import lexical

    texts = ["tide tables for the harbour", "the lighthouse keeper logs the tide", "tide tables for the harbour",
             "harbour pilots board at the buoy", "tide tables for the harbour", "otters eat urchins"]
    rows = lexical.LexicalRows()
    rows.add({"ids": [f"c{n}" for n in range(len(texts))], "documents": texts,
              "metadatas": [{"doc_id": f"d{n}", "source": "ab"[n % 2], "chunk_index": 0, "n_chunks": 1,
                             "doc_hash": ""} for n in range(len(texts))]})
    index = rows.index("g")
    for question in ("tide tables", "harbour buoy", "keeper of otters"):
        found, scores = index.bm25.retrieve(lexical.tokenize([question]), k=len(texts), show_progress=False)
        expected = sorted(((float(s), f"c{i}") for i, s in zip(found[0], scores[0]) if s > 0),
                          key=lambda hit: (-hit[0], int(hit[1][1:])))
        assert index.search(question, len(texts)) == [(i, s) for s, i in expected]
    assert [i for i, _ in index.search("tide tables for the harbour", 2)] == ["c0", "c2"]  # a tie cut at k
    assert [i for i, _ in index.search("tide tables", 6, {"b"})] == ["c1"]
    assert index.search("harbour", 6, {"nowhere"}) == [] and index.search("of the and", 6) == []


def test_the_encoder_goes_to_the_gpu_where_torch_sees_one_unless_told(monkeypatch, embedder):
    import torch

    from app.core.devices import torch_device

    assert embedder.model.device.type == "cpu", "no GPU here: 'auto' (the default) loads on the CPU"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert torch_device("auto") == "cuda"
    assert torch_device("cpu") == "cpu" and torch_device("cuda:1") == "cuda:1"


def test_the_question_encoder_in_bfloat16_ranks_as_float32_does(embedder):
    """Documents are encoded in float32 (ingest, the shared ``embedder``); a question encoder in bfloat16 gives
    vectors that point the same way, so the same chunks come first."""
    from app.core.embedder import Embedder
    from app.core.settings_corpus import EmbeddingSettings

    questions = ["How does the chunker split a page?", "Which port does the service listen on?"]
    fast = Embedder(EmbeddingSettings(query_dtype="bfloat16"), questions=True)
    assert str(fast.model[0].auto_model.dtype) == "torch.bfloat16" and fast._onnx is None
    assert str(Embedder(EmbeddingSettings(query_dtype="bfloat16")).model[0].auto_model.dtype) == "torch.float32"
    for full, half in zip(embedder.embed(questions), fast.embed(questions), strict=True):
        assert sum(a * b for a, b in zip(full, half, strict=True)) > 0.99
    # Questions skip ``encode``'s per-call work, not its result: in float32, the very vectors documents get.
    exact = Embedder(EmbeddingSettings(query_runtime="torch"), questions=True)
    assert exact.embed(questions) == _close_to(embedder.embed(questions), 1e-6)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU (there: pytest tests/fast -k without_waiting)")
def test_on_a_gpu_questions_are_encoded_without_waiting_for_the_device_before_the_result(embedder):
    """Beside vLLM each synchronisation waits for this process's turn on the GPU: a batch of questions of
    different lengths (padding) goes in and through the model without one; the model's own pass, with its inputs
    copied the usual way and its 2D mask (which transformers reads back), would wait; the vectors are float32's."""
    import torch

    from app.core.embedder import Embedder, question_vectors
    from app.core.settings_corpus import EmbeddingSettings

    model = Embedder(EmbeddingSettings(query_runtime="torch", device="cuda"), questions=True).model
    questions = ["x", "Which port does the service listen on, and how is it changed in the settings file?", "ok"]
    question_vectors(model, questions)  # the first pass allocates
    torch.cuda.set_sync_debug_mode("error")
    try:
        vectors = question_vectors(model, questions)
        with pytest.raises(RuntimeError, match="synchroniz"):
            model({name: value.to("cuda") for name, value in model.preprocess(questions).items()})
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert vectors.tolist() == _close_to(embedder.embed(questions), 1e-5)


def test_the_question_encoder_runs_on_onnx_runtime_on_the_cpu_with_the_vectors_documents_get(caplog, embedder):
    """The export traces a padded batch: questions of different lengths together (padding masked out) and
    alone give float32's vectors; the torch model it was traced from stays in eval mode (no dropout). 'auto'
    times both runtimes at load and says which it kept."""
    import logging

    import pytest
    from pydantic import ValidationError

    from app.core.devices import query_encoder
    from app.core.embedder import Embedder
    from app.core.settings_corpus import EmbeddingSettings

    def settled(**fields: str) -> tuple[str, str, str]:
        return query_encoder(EmbeddingSettings(**fields))

    assert settled() == ("either", "float32", "cpu")
    assert settled(query_dtype="bfloat16") == ("torch", "bfloat16", "cpu")
    assert settled(query_runtime="torch") == ("torch", "float32", "cpu")
    assert settled(query_runtime="onnx", query_dtype="float32") == ("onnx", "float32", "cpu")
    onnx = Embedder(EmbeddingSettings(query_runtime="onnx"), questions=True).load()
    assert onnx._onnx is not None and not onnx.model.training
    questions = ["x", "Which port does the service listen on, and how is it changed in the settings file?", "ok"]
    assert onnx.embed(questions) == _close_to(embedder.embed(questions), 1e-5)
    assert onnx.embed(questions[1:2]) == _close_to(embedder.embed(questions[1:2]), 1e-5)
    for wrong, said in (({"query_dtype": "bfloat16"}, "query_runtime 'onnx'"), ({"device": "cuda"}, "on the CPU")):
        with pytest.raises(ValidationError, match=said):
            EmbeddingSettings(query_runtime="onnx", **wrong)
    with caplog.at_level(logging.INFO, logger="prefixrag.embedder"):
        chosen = Embedder(EmbeddingSettings(), questions=True).load()
    kept = "onnx" if chosen._onnx is not None else "torch"
    assert [record.getMessage().split(" (")[0] for record in caplog.records] == [f"question encoder: {kept}"]


def test_the_question_encoder_in_int8_points_where_float32_does(caplog, embedder):
    """int8 is ONNX Runtime's graph quantized at load, on the CPU even where documents go to the GPU; its vectors
    are a few degrees off float32's (the quantized graph is what runs); the log says which encoder runs, and the
    quantizer's own lines stay out of it."""
    import logging

    import pytest
    import torch
    from pydantic import ValidationError

    from app.core.devices import query_encoder
    from app.core.embedder import Embedder
    from app.core.settings_corpus import EmbeddingSettings

    assert query_encoder(EmbeddingSettings(query_dtype="int8")) == ("onnx", "int8", "cpu")
    with pytest.MonkeyPatch.context() as gpu:
        gpu.setattr(torch.cuda, "is_available", lambda: True)
        assert query_encoder(EmbeddingSettings(query_dtype="int8")) == ("onnx", "int8", "cpu")
        assert query_encoder(EmbeddingSettings()) == ("torch", "float32", "cuda")
    with caplog.at_level(logging.INFO):
        int8 = Embedder(EmbeddingSettings(query_dtype="int8"), questions=True).load()
    assert int8._onnx is not None
    said = [(record.name, record.getMessage()) for record in caplog.records
            if record.name in ("root", "prefixrag.embedder")]
    assert said == [("prefixrag.embedder", "question encoder: onnx int8")]
    questions = ["How does the chunker split a page?", "What was the first female recipient of the prize given?",
                 "Which port does the service listen on, and how is it changed in the settings file?"]
    for full, small in zip(embedder.embed(questions), int8.embed(questions), strict=True):
        assert 0.98 < sum(a * b for a, b in zip(full, small, strict=True)) < 0.99999
    for wrong, said in (({"query_runtime": "torch"}, "ONNX Runtime's"), ({"device": "cuda"}, "on the CPU")):
        with pytest.raises(ValidationError, match=said):
            EmbeddingSettings(query_dtype="int8", **wrong)


def _close_to(vectors: list[list[float]], tolerance: float) -> object:
    import pytest

    return [pytest.approx(vector, abs=tolerance) for vector in vectors]


def test_a_question_asked_as_the_encoder_finishes_its_last_batch_is_encoded(embedder):
    """The encoder task ends when nothing is pending; a question asked in the same loop turn (the first
    question's caller resumes before the finished task's done callbacks run) must start another, not wait for
    one that has already returned: a request hung until the next question arrived."""
    import asyncio

    from app.rag.vectors import QuestionVectors

    async def one_after_another():
        pool = ThreadPoolExecutor(1)
        vectors = QuestionVectors(embedder, lambda work, *args: asyncio.get_running_loop().run_in_executor(
            pool, work, *args))
        first = await vectors.embed("What do anchors do?")
        second = await vectors.embed("What do tides do?")  # awaited directly: asked in the turn it resumes
        pool.shutdown()
        return first, second

    first, second = asyncio.run(asyncio.wait_for(one_after_another(), 10))
    assert len(first) == len(second) == embedder.dimension and first != second


def test_a_chunk_chroma_just_returned_is_read_from_it_once_until_the_collection_is_reopened(tmp_path, embedder,
                                                                                          monkeypatch):
    """The hot path reads no text it read before: rows of ids the dense query has just returned come from memory;
    an id BM25 alone found is read each time, and a reopen (an ingest changed the collection) forgets them all."""
    from ingest.pipeline import run_ingest
    from tests.support.env import ROOT

    settings = app_settings(tmp_path / "chroma", "http://unused/v1", collection="docs")
    settings.retrieval.candidates = 3  # each ranking's top 3 only: the fused top 3 holds one BM25 alone found
    run_ingest([ROOT / "examples" / "docs"], settings, embedder)
    retriever = Retriever.over(embedder, settings.chroma, ThreadPoolExecutor(1), settings.retrieval)
    retriever.index.lexical_index(wait=True)
    read: list[list[str]] = []

    def counted(collection):
        get = collection.get
        monkeypatch.setattr(collection, "get", lambda ids, **kw: read.append(sorted(ids)) or get(ids=ids, **kw))

    counted(retriever.index.collection)
    question = "What is vLLM?"
    first = [c.id for c in retriever.retrieve_sync(question, 3, mode="hybrid")]
    again = [c.id for c in retriever.retrieve_sync(question, 3, mode="hybrid")]
    dense = {c.id for c in retriever.retrieve_sync(question, 3, mode="dense")}
    assert set(first) - dense, "the premise: BM25 alone found one of them"
    assert first == again and read == [sorted(first), sorted(set(first) - dense)]  # BM25's alone: read again
    retriever.index.reopen()
    retriever.index.lexical_index(wait=True)
    counted(retriever.index.collection)
    assert [c.id for c in retriever.retrieve_sync(question, 3, mode="hybrid")] == first
    assert read[2:] == [sorted(first)]
    retriever.index.close()


def test_a_source_filter_takes_the_sources_from_the_loaded_bm25_index_without_reading_chroma(retriever,
                                                                                            monkeypatch):
    index = retriever.index
    stored = sorted({meta["source"] for meta in index.collection.get(include=["metadatas"])["metadatas"]})
    reads = []
    get = index.collection.get
    monkeypatch.setattr(index.collection, "get", lambda **kw: reads.append(kw) or get(**kw))
    assert index.sources() == stored and len(stored) > 1
    assert reads == []


def test_a_reload_opens_the_store_beside_the_questions_which_search_the_open_handle_meanwhile(tmp_path, embedder,
                                                                                            monkeypatch):
    import threading
    import time

    import app.rag.index
    from app.core.store import forget_clients, open_collection
    from ingest.pipeline import run_ingest
    from tests.support.env import ROOT

    settings = app_settings(tmp_path / "chroma", "http://unused/v1", collection="docs")
    run_ingest([ROOT / "examples" / "docs"], settings, embedder)
    retriever = Retriever.over(embedder, settings.chroma, ThreadPoolExecutor(1), settings.retrieval)
    index, question = retriever.index, "What is vLLM?"
    index.lexical_index(wait=True)
    before, gate = index.collection, threading.Event()
    top = retriever.rank_sync(question, 3, mode="dense").chunks[0].id
    monkeypatch.setattr(app.rag.index, "open_collection",  # the fresh open (and its vector index) takes a while
                        lambda *args, **kwargs: gate.wait(30) and open_collection(*args, **kwargs))
    index.reopen()
    forget_clients()  # another process deletes the top chunk: the open handle's vector index still holds it
    open_collection(settings.chroma, embedder, create=False).delete(ids=[top])
    started = time.perf_counter()
    dense, hybrid = retriever.rank_sync(question, 3, mode="dense"), retriever.rank_sync(question, 3, mode="hybrid")
    waited = time.perf_counter() - started
    assert waited < 5 and index.reopening and index.collection is before  # answered from the handle open
    assert dense.chunks and hybrid.chunks and not dense.complete and not hybrid.complete  # not remembered
    assert top not in {c.id for c in dense.chunks + hybrid.chunks}  # its row gone: left out, not an error
    gate.set()
    index.lexical_index(wait=True)  # BM25 reloads after the fresh handle, on the same thread
    assert not index.reopening and index.collection is not before
    assert retriever.rank_sync(question, 3, mode="dense").complete
    assert retriever.rank_sync(question, 3, mode="hybrid").complete
    index.close()


def test_a_handle_opened_on_the_empty_collection_finds_what_another_process_writes_before_its_reload(tmp_path,
                                                                                                       embedder):
    """A collection made empty (``POST /v1/collections``) is opened by a ranking worker, then an upload writes into
    it: embedded Chroma's handle opened empty fails every vector search while the rows' vector index is not on disk
    (until the writer's first flush, 1,000 rows), so a question asked during the upload got a 503."""
    from app.core.store import forget_clients, open_collection
    from ingest.pipeline import run_ingest
    from tests.support.env import ROOT

    settings = app_settings(tmp_path / "chroma", "http://unused/v1", collection="made-empty")
    open_collection(settings.chroma, embedder, create=True)
    retriever = Retriever.over(embedder, settings.chroma, ThreadPoolExecutor(1), settings.retrieval)
    assert retriever.rank_sync("What is vLLM?", 3, mode="dense").chunks == []  # opened on the empty collection
    forget_clients()  # the upload's writer, as another process: the open handle keeps the state it saw
    run_ingest([ROOT / "examples" / "docs"], settings, embedder)
    found = retriever.rank_sync("What is vLLM?", 3, mode="dense").chunks
    assert len(found) == 3 and all(chunk.text for chunk in found)
    retriever.index.close()


def test_forgetting_clients_while_another_thread_opens_one_never_breaks_the_open(tmp_path):
    """A reload drops Chroma's cached clients on its thread while a question's thread may be opening one: Chroma
    registers the new client and reads it back, and a clear in between failed that open (KeyError, a 503)."""
    import threading

    from app.core.settings import ChromaSettings
    from app.core.store import forget_clients, open_client

    cfg = ChromaSettings(path=tmp_path / "chroma", collection="race")
    open_client(cfg)
    stop = threading.Event()

    def reloads() -> None:
        while not stop.is_set():
            forget_clients()

    clearing = threading.Thread(target=reloads)
    clearing.start()
    try:
        failures = []
        for _ in range(300):  # without the lock about one open in fifteen failed here
            try:
                open_client(cfg)
            except Exception as exc:
                failures.append(exc)
    finally:
        stop.set()
        clearing.join()
    assert not failures, failures[:3]
