"""Ingest against a real on-disk Chroma (and a real `chroma run` server) with the real embedder."""

from __future__ import annotations

import json
import shutil

import pytest

from app.core import withdrawals
from ingest.pipeline import run_ingest
from tests.support.corpora import collection_of, lexical_ids, snapshot
from tests.support.env import run_cli
from tests.support.fixtures_docs import write_corpus, write_pdf


def test_each_file_type_is_loaded_with_its_structure(tmp_path, settings_factory, embedder):
    corpus = write_corpus(tmp_path / "corpus")
    settings = settings_factory()
    report = run_ingest([corpus], settings, embedder)
    assert report.failed == [] and report.skipped_unknown == 1 and report.files_added == 5
    rows = snapshot(settings, embedder).values()
    by_doc = {}
    for text, meta in rows:
        by_doc.setdefault(meta["doc_id"], []).append((text, meta))
    assert set(by_doc) == {"guide/lighthouses.md", "tides.html", "notes.txt", "manual.pdf",
                           "Otters#0", "Otters#1", "Bees#0"}
    lenses = [m for t, m in by_doc["guide/lighthouses.md"] if "Fresnel" in t]
    assert lenses and lenses[0]["headings"] == "Lighthouses > Lenses" and lenses[0]["title"] == "Lighthouses"
    html_text = " ".join(t for t, _ in by_doc["tides.html"])
    assert "new and full moon" in html_text
    for noise in ("SCRIPT_NOISE", "NAV_NOISE", "FOOTER_NOISE", "color:red"):
        assert noise not in html_text
    assert {m["headings"] for _, m in by_doc["tides.html"]} >= {"Tide Tables > Neap tides"}
    pages = {m["page"]: t for t, m in by_doc["manual.pdf"]}
    assert "anchors" in pages[1] and "sails" in pages[2]
    otters = sorted((m["parent_pos"], m["parent_id"]) for d in ("Otters#0", "Otters#1") for _, m in by_doc[d])
    assert otters == [(0, "Otters"), (1, "Otters")]
    for text, meta in rows:
        assert meta["end"] - meta["start"] == len(text) and meta["content_hash"]


def test_rerun_on_unchanged_corpus_writes_nothing(tmp_path, settings_factory, embedder):
    corpus = write_corpus(tmp_path / "corpus")
    settings = settings_factory()
    first = run_ingest([corpus], settings, embedder)
    before = snapshot(settings, embedder)
    second = run_ingest([corpus], settings, embedder)
    assert first.chunks_written > 0
    assert second.writes == 0 and second.chunks_embedded == 0 and second.files_unchanged == 5
    assert snapshot(settings, embedder) == before
    assert lexical_ids(settings) == set(before)  # the BM25 index beside it holds exactly the same ids


def test_a_rerun_takes_what_is_stored_from_the_last_runs_record_and_never_a_stale_one(tmp_path, settings_factory,
                                                                                       embedder, monkeypatch):
    """The inventory a run starts from is the one the last run recorded beside the collection (no row read); a
    change made since outside a run moved the collection's stamp, and the rows are read again."""
    from app.core import inventory
    from app.core.store import mark_changed

    corpus = write_corpus(tmp_path / "corpus")
    settings = settings_factory()
    run_ingest([corpus], settings, embedder)
    collection = collection_of(settings, embedder)
    from_rows = inventory.stored_documents(collection)
    assert inventory.stored_documents(collection, settings.chroma) == from_rows and len(from_rows) > 4
    reads = []
    real = inventory.all_rows
    monkeypatch.setattr(inventory, "all_rows", lambda *args, **kwargs: reads.append(args) or real(*args, **kwargs))
    assert run_ingest([corpus], settings, embedder).files_unchanged == 5 and reads == []
    collection.delete(ids=from_rows["notes.txt"].ids[:1])  # one chunk gone behind the last run's back
    mark_changed(collection)
    again = run_ingest([corpus], settings, embedder)
    assert reads and again.files_unchanged == 4 and again.writes > 0  # read from the rows: its chunk missing
    assert inventory.stored_documents(collection_of(settings, embedder), settings.chroma) == from_rows


def test_a_large_file_on_one_thread_is_planned_in_blocks_and_stored_as_planned_whole(
        tmp_path, settings_factory, embedder, monkeypatch):
    """On a small machine (one loading thread) a large jsonl file is loaded once and planned a block of its
    records at a time, so writing starts before it is all chunked: the rows are those of the file planned whole."""
    import ingest.pipeline
    import ingest.preparing

    corpus = write_corpus(tmp_path / "corpus")
    whole, blocks = settings_factory(path=tmp_path / "whole"), settings_factory(path=tmp_path / "blocks")
    assert blocks.ingest.chunk_processes() == 0  # auto: one thread on this machine
    run_ingest([corpus], whole, embedder)
    planned: list[tuple[str, int]] = []
    real_plan = ingest.pipeline.plan
    monkeypatch.setattr(ingest.pipeline, "plan", lambda result, *a: planned.append(
        (result.rel, len(result.documents))) or real_plan(result, *a))
    monkeypatch.setattr(ingest.preparing, "SLICE_FROM_BYTES", (corpus / "animals.jsonl").stat().st_size)
    monkeypatch.setattr(ingest.preparing, "BLOCK_BYTES", -(-(corpus / "animals.jsonl").stat().st_size // 2))
    report = run_ingest([corpus], blocks, embedder)
    assert report.files_added == 5 and snapshot(blocks, embedder) == snapshot(whole, embedder)
    records = len((corpus / "animals.jsonl").read_text().splitlines())
    assert [count for rel, count in planned if rel == "animals.jsonl"] == [records // 2, records - records // 2]


def test_records_of_a_changed_file_are_relabelled_in_batched_writes(tmp_path, settings_factory, embedder,
                                                                    monkeypatch):
    """A record added to a jsonl file changes its hash on every stored record of it: their rows get the new hash
    as metadata-only writes, a batch of rows a call (Chroma's cost is mostly per call), not one per record."""
    from chromadb.api.models.Collection import Collection

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    lines = [json.dumps({"id": f"r{i}", "text": f"Record {i} is about lighthouse number {i}."}) for i in range(40)]
    (corpus / "records.jsonl").write_text("\n".join(lines) + "\n")
    settings = settings_factory()
    run_ingest([corpus], settings, embedder)
    (corpus / "records.jsonl").write_text("\n".join(lines) + "\n" + json.dumps({"id": "r40", "text": "One more."}))
    updates: list[int] = []
    real_update = Collection.update
    monkeypatch.setattr(Collection, "update", lambda self, ids, **k: updates.append(len(ids)) or real_update(
        self, ids=ids, **k))
    report = run_ingest([corpus], settings, embedder)
    assert report.chunks_relabeled == 40 and report.chunks_embedded == 1 and updates == [40]
    hashes = {meta["file_hash"] for _, meta in snapshot(settings, embedder).values()}
    assert len(hashes) == 1  # every row carries the file's new hash


def test_an_unchanged_file_stored_before_its_size_was_recorded_gets_it_once(tmp_path, settings_factory, embedder):
    """Rows written before ingest recorded a file's size (``parent_chars``, what lets the service read a window of
    a big file alone) get it from the next run, as a metadata-only write: nothing re-embedded, the rows then as a
    fresh ingest writes them, and the run after that writes nothing."""
    from app.core.store import mark_changed

    corpus = write_corpus(tmp_path / "corpus")
    settings = settings_factory()
    run_ingest([corpus], settings, embedder)
    written = snapshot(settings, embedder)
    files = {i for i, (_, meta) in written.items() if meta["kind"] != "jsonl"}
    assert files and all(meta["parent_chars"] > 0 for i, (_, meta) in written.items() if i in files)
    collection = collection_of(settings, embedder)  # as an older ingest left them: the size unknown (-1)
    collection.update(ids=list(written), metadatas=[meta | {"parent_chars": -1} for _, meta in written.values()])
    mark_changed(collection)
    upgraded = run_ingest([corpus], settings, embedder)
    assert upgraded.chunks_relabeled == len(files) and upgraded.chunks_embedded == 0 and upgraded.chunks_written == 0
    assert upgraded.files_unchanged == 5 and snapshot(settings, embedder) == written
    assert run_ingest([corpus], settings, embedder).writes == 0


def test_a_runs_indexes_are_saved_under_its_final_stamp_before_services_can_see_that_stamp(
        tmp_path, settings_factory, embedder, monkeypatch):
    """A service reloads when the stamp moves; at that moment BM25, the pages and the inventory beside the
    collection already match it, so no service (nor each of its ranking workers) builds its own from every row."""
    from app.core import inventory, lexical, pages
    from ingest import pipeline

    corpus = write_corpus(tmp_path / "corpus")
    settings = settings_factory()
    run_ingest([corpus], settings, embedder)
    (corpus / "notes.txt").write_text("The harbour pilot boards ships at the outer buoy, day and night.\n")
    seen_at_stamp = []
    real = pipeline.mark_changed

    def stamped(collection, run_ended=False, generation=None, writing=False):
        real(collection, run_ended=run_ended, writing=writing, **({"generation": generation} if generation else {}))
        if run_ended:
            stamp = (collection.metadata["prefixrag_generation"], collection.count())
            seen_at_stamp.append((stamp, lexical.load(lexical.index_dir(settings.chroma)).stamp,
                                  pages.load(pages.path_of(settings.chroma)).stamp[:2],
                                  inventory.recorded_stamp(inventory.path_of(settings.chroma))))

    monkeypatch.setattr(pipeline, "mark_changed", stamped)
    assert run_ingest([corpus], settings, embedder).writes > 0
    [(stamp, *saved)] = seen_at_stamp
    assert saved == [stamp, stamp, stamp]


def test_modified_file_replaces_its_chunks_and_reuses_unchanged_embeddings(tmp_path, settings_factory, embedder):
    corpus = write_corpus(tmp_path / "corpus")
    settings = settings_factory()
    run_ingest([corpus], settings, embedder)
    doc = corpus / "guide" / "lighthouses.md"
    doc.write_text(doc.read_text() + "\n## Fog\n\nFoghorns sound when the beam cannot be seen.\n")
    report = run_ingest([corpus], settings, embedder)
    assert report.files_updated == 1 and report.files_unchanged == 4
    assert 0 < report.chunks_embedded < report.chunks_written + 1  # only new content embedded
    texts = [t for t, m in snapshot(settings, embedder).values() if m["doc_id"] == "guide/lighthouses.md"]
    assert any("Foghorns" in t for t in texts)
    assert len(texts) == len(set(texts))  # no duplicate generations left behind
    assert lexical_ids(settings) == set(snapshot(settings, embedder))


def test_deleted_file_stays_until_prune_then_goes(tmp_path, settings_factory, embedder):
    corpus = write_corpus(tmp_path / "corpus")
    settings = settings_factory()
    run_ingest([corpus], settings, embedder)
    (corpus / "notes.txt").unlink()
    kept = run_ingest([corpus], settings, embedder)
    assert kept.chunks_deleted == 0
    assert any(m["doc_id"] == "notes.txt" for _, m in snapshot(settings, embedder).values())
    pruned = run_ingest([corpus], settings, embedder, prune=True)
    assert pruned.files_removed == 1 and pruned.chunks_deleted >= 1
    assert not any(m["doc_id"] == "notes.txt" for _, m in snapshot(settings, embedder).values())
    assert lexical_ids(settings) == set(snapshot(settings, embedder))


def test_a_run_first_deletes_the_rows_of_documents_the_service_withdrew(tmp_path, settings_factory, embedder):
    corpus = write_corpus(tmp_path / "corpus")
    settings = settings_factory()
    run_ingest([corpus], settings, embedder)
    ids = [i for i, (_, meta) in snapshot(settings, embedder).items() if meta["doc_id"] == "notes.txt"]
    withdrawals.record(settings.chroma, "notes.txt", ids)  # deleted over HTTP, the service stopped before its rows
    (corpus / "notes.txt").unlink()
    report = run_ingest([corpus], settings, embedder)  # no prune: a file merely gone would be kept
    assert report.chunks_deleted == len(ids) > 0 and withdrawals.pending(settings.chroma) == {}
    assert not any(m["doc_id"] == "notes.txt" for _, m in snapshot(settings, embedder).values())
    assert lexical_ids(settings) == set(snapshot(settings, embedder))  # the indexes saved without them


def test_removed_jsonl_record_is_deleted_without_prune(tmp_path, settings_factory, embedder):
    corpus = write_corpus(tmp_path / "corpus")
    settings = settings_factory()
    run_ingest([corpus], settings, embedder)
    lines = (corpus / "animals.jsonl").read_text().splitlines()
    (corpus / "animals.jsonl").write_text("\n".join(lines[:2]) + "\n")
    report = run_ingest([corpus], settings, embedder)
    assert report.documents_removed == 1
    assert "Bees#0" not in {m["doc_id"] for _, m in snapshot(settings, embedder).values()}
    assert run_ingest([corpus], settings, embedder).writes == 0  # settles: the next run writes nothing


def test_unchanged_files_are_not_even_parsed(tmp_path, settings_factory, embedder, monkeypatch):
    import ingest.files

    corpus = write_corpus(tmp_path / "corpus")
    settings = settings_factory()
    run_ingest([corpus], settings, embedder)
    (corpus / "notes.txt").write_text("Barnacles glue themselves to rocks for life, and moult.\n")
    parsed = []
    real_load = ingest.files.load_file
    monkeypatch.setattr(ingest.files, "load_file", lambda path, *a: parsed.append(path.name) or real_load(path, *a))
    report = run_ingest([corpus], settings, embedder)
    assert parsed == ["notes.txt"] and report.files_updated == 1 and report.files_unchanged == 4


def test_a_document_larger_than_chromas_max_batch_is_written_whole_and_the_next_file_too(
        tmp_path, settings_factory, embedder):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    # One sentence over and over: thousands of chunks, but one unique text, so the encoder does little work.
    (corpus / "a_manual.txt").write_text("The anchor chain is checked every morning.\n" * 12000)
    (corpus / "z_good.md").write_text("# Buoys\n\nRed buoys mark the port side of the channel.\n")
    settings = settings_factory()
    settings.chunking = settings.chunking.model_copy(update={"size": 16, "overlap": 0})
    settings.ingest = settings.ingest.model_copy(update={"write_batch": 100_000})  # over Chroma's limit
    report = run_ingest([corpus], settings, embedder)
    assert report.failed == [] and report.files_added == 2
    rows = [meta for _, meta in snapshot(settings, embedder).values()]
    manual = [meta for meta in rows if meta["doc_id"] == "a_manual.txt"]
    limit = collection_of(settings, embedder)._client.get_max_batch_size()
    assert len(manual) == manual[0]["n_chunks"] > limit, (len(manual), limit)
    assert sorted(m["chunk_index"] for m in manual) == list(range(len(manual)))
    assert any(meta["doc_id"] == "z_good.md" for meta in rows)
    assert report.chunks_written == len(rows)
    assert run_ingest([corpus], settings, embedder).writes == 0


def test_ids_are_deterministic_across_fresh_ingests_anywhere(tmp_path, settings_factory, embedder):
    first_corpus = write_corpus(tmp_path / "a" / "corpus")
    second_corpus = tmp_path / "elsewhere" / "copy"
    shutil.copytree(first_corpus, second_corpus)
    one, two = settings_factory(path=tmp_path / "db1"), settings_factory(path=tmp_path / "db2")
    run_ingest([first_corpus], one, embedder)
    run_ingest([second_corpus], two, embedder)
    assert snapshot(one, embedder) == snapshot(two, embedder)


def test_bad_files_are_reported_and_skipped_and_good_ones_ingested(tmp_path, settings_factory):
    corpus = write_corpus(tmp_path / "corpus")
    (corpus / "binary.txt").write_bytes(b"\x00\x01\x02binary")
    (corpus / "latin1.md").write_bytes("caf\xe9 au lait".encode("latin-1"))
    (corpus / "corrupt.pdf").write_bytes(b"%PDF-1.4 this is not really a pdf")
    write_pdf(corpus / "locked.pdf", ["secret"], password="hunter2")
    (corpus / "empty.md").write_text("   \n")
    (corpus / "huge.txt").write_text("word " * 300_000)  # 1.5 MB, over the limit set below
    (corpus / "mixed.jsonl").write_text('{"id": "ok1", "text": "A good record."}\nnot json\n{"id": "x"}\n')
    settings = settings_factory()
    result = run_cli(str(corpus), "--chroma-path", str(settings.chroma.path), "--json",
                     env={"PREFIXRAG_INGEST__MAX_FILE_MB": "1"})
    assert result.returncode == 1, result.stderr
    summary = json.loads(result.stdout)
    reasons = {f["path"]: f["reason"] for f in summary["failed"]}
    assert "binary" in reasons["binary.txt"]
    assert "UTF-8" in reasons["latin1.md"]
    assert "PDF" in reasons["corrupt.pdf"]
    assert "encrypted" in reasons["locked.pdf"].lower()
    assert "empty" in reasons["empty.md"]
    assert "too large" in reasons["huge.txt"]
    assert any("line 2" in w for w in summary["warnings"]) and any("line 3" in w for w in summary["warnings"])
    assert summary["files_added"] == 6  # the five good fixtures + mixed.jsonl's good record
    # stderr is a pipe: progress lines, the last one printed after the last write, so it counts every chunk stored.
    last = [line for line in result.stderr.splitlines() if line.startswith("ingest: ")][-1]
    files = summary["files_seen"]
    assert last.startswith(f"ingest: {files}/{files} files, {summary['chunks_written']} chunks written"), last


def test_cli_usage_errors_exit_2_and_fatal_errors_exit_3(tmp_path):
    assert run_cli().returncode == 2
    missing = run_cli(str(tmp_path / "nope"), "--chroma-path", str(tmp_path / "db"))
    assert missing.returncode == 3 and "no such file" in missing.stderr
    assert missing.stderr.count("\n") == 1  # one clear line, no traceback


def test_second_writer_waits_then_fails_clearly(tmp_path, settings_factory):
    from filelock import FileLock

    corpus = write_corpus(tmp_path / "corpus")
    settings = settings_factory()
    settings.chroma.path.mkdir(parents=True)
    with FileLock(str(settings.chroma.path / ".prefixrag-ingest.lock")):
        result = run_cli(str(corpus), "--chroma-path", str(settings.chroma.path),
                         env={"PREFIXRAG_INGEST__LOCK_TIMEOUT_S": "1"})
    assert result.returncode == 3
    assert "another ingest is writing" in result.stderr


def test_dry_run_writes_nothing(tmp_path, settings_factory, embedder):
    corpus = write_corpus(tmp_path / "corpus")
    settings = settings_factory()
    report = run_ingest([corpus], settings, embedder, dry_run=True)
    assert report.chunks_written > 0 and report.dry_run
    run_ingest([corpus], settings, embedder)  # the real one still has everything to do
    assert len(snapshot(settings, embedder)) == report.chunks_written


@pytest.mark.chroma_server
def test_chroma_server_mode(tmp_path, chroma_server, embedder, settings_factory):
    corpus = write_corpus(tmp_path / "corpus")
    result = run_cli(str(corpus), "--chroma-url", chroma_server, "--collection", "server-docs", "--json")
    assert result.returncode == 0, result.stderr
    first = json.loads(result.stdout)
    again = json.loads(run_cli(str(corpus), "--chroma-url", chroma_server, "--collection", "server-docs",
                               "--json").stdout)
    assert again["chunks_written"] == 0 and again["files_unchanged"] == first["files_added"]
    settings = settings_factory(collection="server-docs")
    settings.chroma.url = chroma_server
    assert collection_of(settings, embedder).count() == first["chunks_written"]
    assert lexical_ids(settings) == set(snapshot(settings, embedder))  # kept locally (data/lexical/<server>)


def test_a_bad_jsonl_line_costs_that_record_only(tmp_path, settings_factory, embedder):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    lines = [b'{"id": "good1", "text": "Lighthouses guide ships at night."}',
             b'{"id": "bad-utf8", "text": "caf\xe9"}',                       # not UTF-8
             b"[" * 100_000,                                                  # nested past the recursion limit
             b'{"id": {"nested": 1}, "text": "an id that is an object"}',    # not a usable id
             b'{"id": "surrogate", "text": "broken \\ud800 text"}',           # valid JSON, invalid Unicode
             b'{"id": "good2", "text": "Buoys mark the channel."}']
    (corpus / "records.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    settings = settings_factory()
    report = run_ingest([corpus], settings, embedder)
    assert report.failed == [] and report.files_added == 1
    assert {meta["doc_id"] for _, meta in snapshot(settings, embedder).values()} == {"good1", "good2"}
    problems = " | ".join(report.warnings)
    for number, reason in ((2, "UTF-8"), (3, "RecursionError"), (4, "string or an integer"), (5, "Unicode")):
        assert f"line {number}: " in problems and reason in problems, problems


def test_entries_that_are_no_file_are_reported_not_silently_skipped(tmp_path, settings_factory, embedder):
    import os

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "good.md").write_text("# Tides\n\nTides follow the moon.\n")
    (corpus / "dangling.md").symlink_to(corpus / "missing.md")
    (corpus / "loop.md").symlink_to(corpus / "loop.md")
    os.mkfifo(corpus / "pipe.txt")
    settings = settings_factory()
    report = run_ingest([corpus], settings, embedder)
    reasons = {entry["path"]: entry["reason"] for entry in report.skipped_unreadable}
    assert reasons == {"dangling.md": "dangling symbolic link", "loop.md": "symbolic link loop",
                       "pipe.txt": "FIFO (named pipe), not a regular file"}
    assert report.files_added == 1 and "skipped: pipe.txt: FIFO" in report.summary()


def test_two_threads_opening_a_store_first_in_a_process_both_succeed(tmp_path, settings_factory, embedder):
    import subprocess
    import sys

    from tests.support.env import ROOT

    corpus = write_corpus(tmp_path / "corpus")
    settings = settings_factory()
    run_ingest([corpus], settings, embedder)
    # A fresh process, as the service at start-up: its collection watcher and warm-up open Chroma together.
    script = f"""
import threading
from pathlib import Path
from app.core.settings import ChromaSettings
from types import SimpleNamespace
from app.core.store import open_collection
cfg = ChromaSettings(path=Path({str(settings.chroma.path)!r}), collection={settings.chroma.collection!r})
errors = []
def open_it():
    try:
        open_collection(cfg, SimpleNamespace(name={embedder.name!r}, dimension={embedder.dimension}), create=False)
    except Exception as exc:
        errors.append(repr(exc))
threads = [threading.Thread(target=open_it) for _ in range(2)]
[t.start() for t in threads]
[t.join() for t in threads]
print(errors)
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1] == "[]", done.stdout + done.stderr


def test_chunking_processes_store_what_one_thread_stores(tmp_path, settings_factory, embedder, monkeypatch):
    """``chunk_workers`` (a GPU host's default): the same chunks, ids and metadata as one thread; a record moved to
    another file is still known unchanged, although a process sees only its own file's stored documents; a run
    that changes nothing starts no process. What each process is started with is small: a spawned child reads it
    from a pipe while it imports, and the parent's write of anything bigger than the pipe (64 KiB) waits for that,
    one process after another (the tokenizer itself, ~1 MB, cost seconds a process)."""
    import pickle
    from concurrent.futures import ProcessPoolExecutor

    corpus = write_corpus(tmp_path / "corpus")
    one, apart = settings_factory(path=tmp_path / "one"), settings_factory(path=tmp_path / "apart")
    apart.ingest.chunk_workers = 2
    monkeypatch.setattr("ingest.preparing.PROCESSES_FROM_BYTES", 0)  # this small corpus too
    monkeypatch.setattr("ingest.preparing.SLICE_FROM_BYTES", 0)  # and its jsonl file chunked in slices
    assert apart.ingest.chunk_processes() == 2 and one.ingest.chunk_processes() == 0  # auto: none on 2 cores
    run_ingest([corpus], one, embedder)
    started_with = []
    real_init = ProcessPoolExecutor.__init__
    monkeypatch.setattr(ProcessPoolExecutor, "__init__", lambda pool, *a, **k: started_with.append(
        k.get("initargs", ())) or real_init(pool, *a, **k))
    first = run_ingest([corpus], apart, embedder)
    assert first.files_added == 5 and snapshot(one, embedder) == snapshot(apart, embedder)
    assert len(started_with) == 1 and len(pickle.dumps(started_with[0])) < 4096, started_with
    submitted = []
    real_submit = ProcessPoolExecutor.submit
    monkeypatch.setattr(ProcessPoolExecutor, "submit", lambda pool, *a, **k: submitted.append(a) or real_submit(
        pool, *a, **k))
    assert run_ingest([corpus], apart, embedder).files_unchanged == 5 and not submitted  # no process started
    records = [json.loads(line) for line in (corpus / "animals.jsonl").read_text().splitlines()]
    (corpus / "animals.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:2]))
    (corpus / "bees.jsonl").write_text(json.dumps(records[2]) + "\n")  # Bees#0 moved to a file of its own
    reports = [run_ingest([corpus], settings, embedder) for settings in (one, apart)]
    assert reports[1].chunks_embedded == reports[1].chunks_written == 0
    timeless = [vars(r) | {"seconds": 0, "stages_s": {}} for r in reports]
    assert timeless[1] == timeless[0]
    assert snapshot(one, embedder) == snapshot(apart, embedder)
    moved = [meta["source"] for _, meta in snapshot(apart, embedder).values() if meta["doc_id"] == "Bees#0"]
    assert moved and set(moved) == {"bees.jsonl"}  # cited from the file it is in now
    submitted.clear()
    assert run_ingest([corpus], apart, embedder).files_unchanged == 6 and not submitted  # settled


def test_a_section_that_fits_one_chunk_is_cut_as_the_splitter_would_cut_it(settings_factory, embedder):
    """The chunker's short cut (one token count for a section that fits) stores exactly what langchain's splitter
    makes of it: the same text, stripped, at the same offset."""
    from ingest.documents import SourceDocument, sections_from_blocks
    from ingest.preparing import chunker_for

    chunker = chunker_for(settings_factory(), embedder)
    for text in ["Padded short text.", "One paragraph.\n\n\n\nAnother, after blank lines.", "x " * 150]:
        # a second section starts with the blank line that separates it: stripped, its offset moves past it
        document = SourceDocument("d", "d.txt", "", sections_from_blocks([((), "First.", None), ((), text, None)]), "d")
        expected = [(p.page_content, section.start + p.metadata["start_index"]) for section in document.sections
                    for p in chunker.splitter.create_documents([section.text])]
        assert [(c.text, c.start) for c in chunker.chunk(document)] == expected


def test_a_write_chroma_refuses_ends_the_run_with_one_clear_error(tmp_path, settings_factory, embedder):
    """Writes run on a thread of their own: Chroma's refusal there (here: vectors of another size than the
    collection's) still ends the run in its caller, as one StoreError naming the write, and nothing hangs."""
    import chromadb

    from app.core.store import StoreError, open_client

    settings = settings_factory()
    client: chromadb.ClientAPI = open_client(settings.chroma)
    odd = client.create_collection(settings.chroma.collection, embedding_function=None,
                                   metadata={"embedder": embedder.name})
    record = {"doc_id": "odd", "source": "elsewhere.txt", "chunk_index": 0, "n_chunks": 1, "doc_hash": "h"}
    odd.add(ids=["odd"], embeddings=[[0.5] * 8], metadatas=[record])  # the collection now holds 8-dimensional vectors
    with pytest.raises(StoreError, match=r"Chroma refused a write of \d+ chunks"):
        run_ingest([write_corpus(tmp_path / "corpus")], settings, embedder)
