"""The benchmark harness end to end on a tiny slice (real vLLM test server, real Chroma, real embedder)."""

from __future__ import annotations

from bench.ceiling import BlockCacheCeiling
from tests.support.env import ROOT


def test_ceiling_counts_only_leading_blocks_seen_before():
    ceiling = BlockCacheCeiling(4)
    assert ceiling.add(list(range(10))) == 0  # first sight: nothing cached
    assert ceiling.add(list(range(10))) == 8  # two full blocks; the last partial block is always computed
    assert ceiling.add([99] + list(range(1, 10))) == 0  # a different first token breaks the whole chain
    assert ceiling.add(list(range(8))) == 4  # at least one token is computed: (8 - 1) // 4 blocks
    assert ceiling.hit_tokens == 12 and ceiling.query_tokens == 38
    primed = BlockCacheCeiling(4)
    primed.prime(list(range(8)))  # pre-warmed: seen, but not a query
    assert primed.add(list(range(10))) == 8 and primed.query_tokens == 10


def test_a_copy_packed_from_a_commit_records_that_commit_and_the_tree_its_own(tmp_path):
    """``scripts/gpu-ab.sh pack`` copies a commit's code (not its results) beside the tree for A/B runs on a device;
    a benchmark run from the copy records the copy's commit, not the one of the .git above it."""
    import subprocess

    from bench.common import code_commit

    base = tmp_path / "base"
    done = subprocess.run(["bash", "scripts/gpu-ab.sh", "pack", "HEAD~1"], cwd=ROOT, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "BASE_DIR": str(base)}, timeout=120)
    assert done.returncode == 0, done.stderr
    parent = subprocess.run(["git", "rev-parse", "--short=7", "HEAD~1"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    assert code_commit(base) == parent != code_commit(ROOT).removesuffix("-dirty")
    assert (base / "app" / "__main__.py").is_file() and (base / "ingest").is_dir()
    assert not (base / "bench" / "results").exists()
    usage = subprocess.run(["bash", "scripts/gpu-ab.sh"], cwd=ROOT, capture_output=True, text=True)
    assert usage.returncode == 2 and "pack COMMIT" in usage.stdout


def test_every_committed_result_has_a_report_with_its_command():
    """The README sends readers to ``python -m bench.report FILE.json`` for any result file."""
    from bench.report import report

    results = sorted((ROOT / "bench" / "results").rglob("*.json"))
    assert len(results) > 50
    for path in results:
        text = report(path)
        assert text.startswith("**") and "| --- |" in text, path
    live = report(ROOT / "bench" / "results" / "live-traffic.json")
    assert "`python -m bench.live_traffic --data ../shared/data/python-3.11-docs-html/files`" in live
    assert "| load.statuses.429 | 2214 |" in live and "| during_warmup | 20 rows |" in live


def test_query_encoder_times_each_runtime_and_number_format_and_compares_what_it_retrieves(tmp_path):
    """bench.query_encoder over a collection ingested with the real encoder: torch in float32 against itself finds
    the same five chunks, and so does ONNX Runtime (the same vectors); bfloat16 and int8 are timed and ranked
    too, with a recall the gold can be checked against, dense and through the service's hybrid ranking."""
    import argparse
    import json

    from bench.datasets import load_dataset
    from bench.query_encoder import main
    from bench.throughput import ingest
    from tests.support.corpora import tiny_squad

    data = tiny_squad(tmp_path / "tiny")
    ingest(argparse.Namespace(chroma=tmp_path / "chroma"), load_dataset(data))
    out = tmp_path / "encoder.json"
    assert main(["--data", str(data), "--chroma", str(tmp_path / "chroma"), "--questions", "8", "--batches", "2",
                 "--out", str(out)]) == 0
    first, bf16, onnx, int8 = rows = json.loads(out.read_text())["results"]
    assert [(row["runtime"], row["dtype"]) for row in rows] == [
        ("torch", "float32"), ("torch", "bfloat16"), ("onnx", "float32"), ("onnx", "int8")]
    assert first["top5_chunks_in_common_with_first"] == onnx["top5_chunks_in_common_with_first"] == 5.0
    assert 4.0 <= bf16["top5_chunks_in_common_with_first"] and onnx["recall_at_5"] == first["recall_at_5"]
    assert 3.0 <= int8["top5_chunks_in_common_with_first"]
    assert first["recall_at_5"] > 0.5 and all(ms > 0 for ms in bf16["encode_ms_median"].values())
    assert onnx["hybrid_recall_at_5"] == first["hybrid_recall_at_5"] > 0.5 and int8["hybrid_recall_at_5"] > 0.5
    assert set(bf16["library_encode_ms_median"]) == set(bf16["encode_ms_median"]) == {"1", "2", "4"}
    assert {row["device"] for row in rows} == {"cpu"}  # each row says where it ran


def test_a_skewed_stream_asks_about_a_few_documents_most_and_the_split_names_the_busiest_replica():
    """bench.scale_out's skewed phase: Zipf-like over documents (seeded), and its figure for how unevenly the
    router spread the requests."""
    from collections import Counter

    from bench.datasets import Question, zipf_sample
    from bench.scale_out import split

    questions = [Question(f"q{d}-{i}", f"question {i} on {d}", frozenset({f"doc{d}#{i % 3}"}))
                 for d in range(20) for i in range(10)]
    stream = zipf_sample(questions, 2000, seed=3, s=1.1)
    assert stream == zipf_sample(questions, 2000, seed=3, s=1.1) and len(stream) == 2000
    by_document = Counter(min(q.gold).split("#")[0] for q in stream).most_common()
    assert by_document[0][1] > 4 * by_document[-1][1] and by_document[0][1] > 2000 / 20 * 2
    uniform = Counter(min(q.gold).split("#")[0] for q in zipf_sample(questions, 2000, seed=3, s=0.0))
    assert max(uniform.values()) < 2000 / 20 * 1.5
    phase = {"hit_rate": 0.9, "recall": 0.8, "replicas": {"a": {"request_share": 0.7, "token_share": 0.6},
                                                          "b": {"request_share": 0.3, "token_share": 0.4}}}
    figures = split({"hit_rate": 0.95, "recall": 0.8}, phase)
    assert figures["busiest_vs_mean"] == 1.4 and figures["routed_vs_single"] == round(0.9 / 0.95, 4)


def test_books_bind_whole_articles_in_order_under_the_budget_and_keep_every_passage(tmp_path):
    import json

    from bench.long_context import BOOK_FILL, make_books
    from tests.support.corpora import tiny_squad

    data = tiny_squad(tmp_path / "tiny")
    books = make_books(data, 128, tmp_path / "books")
    rows = [json.loads(line) for line in (tmp_path / "books" / "passages.jsonl").read_text().splitlines()]
    original = [json.loads(line) for line in (data / "passages.jsonl").read_text().splitlines()]
    assert [r["passage_id"] for r in rows] == [r["passage_id"] for r in original]  # every passage, its id, in order
    assert len(books) >= 2 and all(b["tokens"] <= BOOK_FILL * 128 or len(b["articles"]) == 1 for b in books)
    titles: dict[str, set[str]] = {}
    for row in rows:  # the parent ingest reads; an article is never split across books
        titles.setdefault(row["context_id"], set()).add(row["title"])
    assert titles == {book["name"]: set(book["articles"]) for book in books}
    assert (tmp_path / "books" / "questions.jsonl").read_text() == (data / "questions.jsonl").read_text()


def test_books_in_turn_asks_each_book_once_per_round_so_every_question_finds_its_book_least_recent(tmp_path):
    from bench.datasets import load_dataset, sample
    from bench.long_context import book_of_passage, books_in_turn, make_books
    from tests.support.corpora import tiny_squad

    books = make_books(tiny_squad(tmp_path / "tiny"), 128, tmp_path / "books")
    book_of = book_of_passage(tmp_path / "books")
    dataset = load_dataset(tmp_path / "books")
    stream = sample(dataset.questions, len(dataset.questions), seed=0)
    asked = [book_of[min(q.gold)] for q in books_in_turn(stream, book_of, 2 * len(books))]
    names = sorted(book["name"] for book in books)
    assert len(names) >= 2 and asked == names * 2  # one per book, in turn, twice round
    assert len(books_in_turn(stream, book_of, 10_000)) == sum(1 for q in stream if q.gold)  # then all that are left


def test_the_scale_corpus_is_the_gold_among_seeded_distractors_that_grow_without_changing(tmp_path):
    """bench.scale's corpus: the gold file as it is, distractors of real sentences, the same first documents at any
    size (a larger size only adds), and a rebuild of the same size rewrites nothing."""
    import json

    from bench.scale_corpus import build_corpus, sentences_of

    gold = tmp_path / "passages.jsonl"
    gold.write_text('{"passage_id": "A#0", "text": "Gold."}\n')
    pool = sentences_of("The first sentence is here. A second one follows it now! Too short. " * 3)
    assert pool[:2] == ["The first sentence is here.", "A second one follows it now!"] and "Too short." not in pool

    def rows(folder):
        return [json.loads(line) for path in sorted(folder.glob("distractors-*.jsonl"))
                for line in path.read_text().splitlines()]

    counts = build_corpus(gold, pool, 5, tmp_path / "small")
    assert counts == {"gold_documents": 1, "distractor_documents": 5}
    assert (tmp_path / "small" / "gold.jsonl").read_text() == gold.read_text()
    small = rows(tmp_path / "small")
    build_corpus(gold, pool, 8, tmp_path / "large")
    assert rows(tmp_path / "large")[:5] == small and len(rows(tmp_path / "large")) == 8
    assert all(len(row["text"].split()) >= 100 and row["id"].startswith("noise-") for row in small)
    shard = next((tmp_path / "small").glob("distractors-*.jsonl"))
    before = shard.stat().st_mtime_ns
    build_corpus(gold, pool, 5, tmp_path / "small")
    assert shard.stat().st_mtime_ns == before


def test_scale_runs_each_size_on_one_growing_store_with_the_real_app(tmp_path):
    """bench.scale end to end at a tiny size: the gold alone, then two corpus sizes on one store (the second adds
    only the new distractors), every ranking mode with recall, pre-warm's planning, the app started against the
    instant vLLM; a JSON after every size and the plot."""
    import json

    from bench.scale import MODES, main
    from tests.support.corpora import paragraphs, tiny_squad

    data = tiny_squad(tmp_path / "tiny")
    (tmp_path / "pool").mkdir()
    (tmp_path / "pool" / "notes.md").write_text("\n\n".join(paragraphs()))
    out = tmp_path / "scale.json"
    assert main(["--data", str(data), "--pool", str(tmp_path / "pool"), "--documents", "12,4", "--questions", "8",
                 "--concurrency", "1,2", "--work", str(tmp_path / "work"), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    small, large = result["steps"]
    assert (small["distractor_documents"], large["distractor_documents"]) == (4, 12)
    assert small["chunks"] < large["chunks"] and large["ingest"]["chunks_written"] == large["chunks"] - small["chunks"]
    assert large["ingest"]["reingest_writes"] == 0 and set(large["ingest"]["stages_s"]) >= {"embed", "store"}
    for step in (result["small_corpus"], small["retrieval"], large["retrieval"]):
        assert set(step) == set(MODES) and all(0 <= cell["recall@5"] <= 1 for cell in step.values())
    assert set(large["retrieval"]["hybrid"]) >= {"load_s", "c1_ms", "c2_ms"}
    assert large["planning_s"] > 0 and large["app"]["ready_s"] > 0 and large["app"]["rss_mib"] > 100
    assert result["bytes_per_chunk"] is not None and out.with_suffix(".png").exists()


def test_chroma_growth_copies_a_stores_rows_into_a_served_collection_and_measures_each_size(
        tmp_path, settings_factory, embedder):
    """bench.chroma_growth at a tiny size: an ingested store's rows copied (vectors jittered) into a collection of
    a real `chroma run` it starts, to each size in turn; queries timed at each concurrency; memory, disk, a plot;
    writes timed by part of the row first, each part set in a collection of its own, dropped after."""
    import json

    import chromadb
    import numpy as np

    from bench.chroma_growth import main
    from ingest.pipeline import run_ingest
    from tests.support.fixtures_docs import write_corpus

    settings = settings_factory(path=tmp_path / "source")
    run_ingest([write_corpus(tmp_path / "corpus")], settings, embedder)
    out = tmp_path / "growth.json"
    assert main(["--from-chroma", str(settings.chroma.path), "--from-collection", settings.chroma.collection,
                 "--sizes", "600,300", "--concurrency", "1,2", "--queries", "8", "--work", str(tmp_path / "work"),
                 "--write-parts", "300", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["store"] == "chroma run" and [step["rows"] for step in result["steps"]] == [300, 600]
    parts = result["write_parts"]
    assert parts["rows"] == 300 and len(parts["rows_per_s"]) == 6
    assert set(parts["metadata_read_s"]) == set(parts["rows_per_s"])
    assert all(rate > 0 for rate in parts["rows_per_s"].values())
    for step in result["steps"]:
        assert step["writes_per_s"] > 0 and step["resident_mib"] > 50 and step["disk_mib"] > 0
        assert set(step["queries"]) == {"c1", "c2"} and all(cell["p50"] > 0 for cell in step["queries"].values())
    store = chromadb.PersistentClient(str(tmp_path / "work" / "store"))
    assert [collection.name for collection in store.list_collections()] == ["growth"]  # the parts' dropped
    grown = store.get_collection("growth")
    rows = grown.get(ids=["grown-0", "grown-599"], include=["embeddings", "metadatas"])
    assert grown.count() == 600 and len(rows["ids"]) == 2 and rows["metadatas"][0]["doc_id"]
    assert rows["metadatas"][0]["text"].strip(), "grown as ingest writes: the text among the metadata"
    assert abs(float(np.linalg.norm(rows["embeddings"][0])) - 1) < 1e-3 and out.with_suffix(".png").exists()


def test_pages_group_times_the_grouping_of_grown_real_parents(tmp_path, settings_factory, embedder):
    """bench.pages_group at a tiny size: an ingested store's small parents copied (vectors jittered) to each size
    and grouped into pages, timed."""
    import json

    from bench.pages_group import main
    from ingest.pipeline import run_ingest
    from tests.support.fixtures_docs import write_corpus

    settings = settings_factory(path=tmp_path / "store")
    run_ingest([write_corpus(tmp_path / "corpus")], settings, embedder)
    out = tmp_path / "pages.json"
    assert main(["--chroma", str(settings.chroma.path), "--collection", settings.chroma.collection,
                 "--parents", "40,120", "--page-tokens", "64", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [step["parents"] for step in result["steps"]] == [40, 120] and result["store_parents"] > 0
    for step in result["steps"]:
        assert step["pages"] > 1 and step["seconds"] >= 0
    assert out.with_suffix(".png").stat().st_size > 0


def test_lexical_search_times_both_selections_and_finds_them_in_agreement(tmp_path):
    """bench.lexical_search at a tiny size: a dataset's passages among distractors from a sentence pool, indexed
    and searched both ways, with and without a source filter; the same scores for every question."""
    import gzip
    import json

    from bench.lexical_search import main
    from tests.support.corpora import paragraphs, tiny_squad

    data = tiny_squad(tmp_path / "squad")
    pool = tmp_path / "pool.json.gz"
    pool.write_bytes(gzip.compress(json.dumps(paragraphs()).encode()))
    out = tmp_path / "lexical.json"
    assert main(["--data", str(data), "--pool-cache", str(pool), "--documents", "50,400", "--questions", "8",
                 "--k", "3", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    gold = len((data / "passages.jsonl").read_text().splitlines())
    assert [step["chunks"] for step in result["steps"]] == [gold + 50, gold + 400] and result["questions"] == 8
    for step in result["steps"]:
        for cell in (step["all"], step["half of the sources"]):
            assert cell["bm25s_ms"]["p50"] > 0 and cell["service_ms"]["p50"] > 0
            assert cell["agreement"]["different"] == 0 and sum(cell["agreement"].values()) == 8
    assert out.with_suffix(".png").stat().st_size > 0
