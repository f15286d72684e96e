"""Pages (``app.core.pages``): small documents grouped by meaning into stable units, and the document strategy
putting a question's page first. Real parts: the packaged embedder, on-disk Chroma, the CPU test model."""

from __future__ import annotations

from app.core import pages
from app.core.store import stamp_of
from ingest.pipeline import run_ingest
from tests.support.corpora import collection_of, write_notes

PAGE_TOKENS = 512  # ~2K characters: the 35 paragraphs of write_notes make half a dozen pages or so


def paged(settings):
    settings.pages.tokens = PAGE_TOKENS
    return settings


def stored_parents(settings, embedder) -> set[str]:
    return {m["parent_id"] for m in collection_of(settings, embedder).get(include=["metadatas"])["metadatas"]}


def test_the_same_corpus_gives_the_same_pages_and_a_re_ingest_moves_no_document(tmp_path, settings_factory,
                                                                               embedder):
    notes = write_notes(tmp_path / "docs", skip={5, 6, 7})
    first = paged(settings_factory(path=tmp_path / "one"))
    second = paged(settings_factory(path=tmp_path / "two"))
    for settings in (first, second):
        run_ingest([tmp_path / "docs"], settings, embedder)
    before, again = (pages.load(pages.path_of(s.chroma)) for s in (first, second))
    assert before.pages == again.pages and len(before.pages) > 3  # two fresh ingests, one grouping
    assert {p for members in before.pages.values() for p in members} == set(notes) == stored_parents(first, embedder)
    for members in before.pages.values():
        assert sum(len(notes[p]) for p in members) / pages.CHARS_PER_TOKEN <= PAGE_TOKENS

    write_notes(tmp_path / "docs", skip={9})  # three documents come (back), one goes
    run_ingest([tmp_path / "docs"], first, embedder)
    after = pages.load(pages.path_of(first.chroma))
    for key, members in before.pages.items():  # nobody moved: each page kept its documents, in order
        kept = [p for p in members if p != "para-009"]
        assert after.pages[key][:len(kept)] == kept
    placed = {p for members in after.pages.values() for p in members}
    assert placed == stored_parents(first, embedder) and "para-009" not in placed
    assert {"para-005", "para-006", "para-007"} <= placed


class CountedReads:
    """A collection whose ``get`` calls are counted (every other call passes through)."""

    def __init__(self, collection) -> None:
        self.collection, self.reads = collection, 0

    def get(self, **kwargs):
        self.reads += 1
        return self.collection.get(**kwargs)

    def __getattr__(self, name):
        return getattr(self.collection, name)


def test_a_writer_saves_bm25_and_pages_from_one_read_of_the_rows_each_as_built_alone(tmp_path, settings_factory,
                                                                                    embedder):
    from app.core import derived, lexical

    write_notes(tmp_path / "docs")
    settings = paged(settings_factory(path=tmp_path / "chroma"))
    run_ingest([tmp_path / "docs"], settings, embedder)  # saves both, through derived.save_current
    collection = CountedReads(collection_of(settings, embedder))
    folder, path = lexical.index_dir(settings.chroma), pages.path_of(settings.chroma)
    saved, alone = lexical.load(folder), lexical.build(collection)
    assert (saved.ids, saved.sources) == (alone.ids, alone.sources) and len(saved.ids) > 30
    for question in ("prefix cache", "pages grouped by meaning", "vLLM"):
        assert saved.search(question, 5) == alone.search(question, 5)
    assert pages.load(path).pages == pages.build(collection, PAGE_TOKENS).pages

    path.unlink()
    modified = (folder / lexical.META).stat().st_mtime_ns
    collection.reads = 0
    derived.save_current(collection, settings.chroma, settings.pages)  # the pages alone are stale
    assert (folder / lexical.META).stat().st_mtime_ns == modified and pages.load(path).pages
    assert collection.reads == 1  # one page of rows
    import shutil
    shutil.rmtree(folder)
    path.unlink()
    collection.reads = 0
    derived.save_current(collection, settings.chroma, settings.pages)
    assert collection.reads == 1, "both indexes from one read"
    assert lexical.load(folder).ids == saved.ids and pages.load(path).pages


def test_a_run_on_an_empty_collection_reads_no_row_back_and_saves_what_a_read_would_build(
        tmp_path, settings_factory, embedder, monkeypatch):
    """The first run feeds BM25, the pages and the inventory with its own writes as they land; a later run that
    changes rows reads them (what it wrote is not the whole collection)."""
    from app.core import derived, inventory, lexical

    reads = []
    real = derived.all_rows
    monkeypatch.setattr(derived, "all_rows", lambda *args, **kwargs: reads.append(1) or real(*args, **kwargs))
    notes = write_notes(tmp_path / "docs")
    settings = paged(settings_factory(path=tmp_path / "chroma"))
    run_ingest([tmp_path / "docs"], settings, embedder)
    assert reads == []
    collection = collection_of(settings, embedder)
    saved, read = lexical.load(lexical.index_dir(settings.chroma)), lexical.build(collection)
    assert (saved.ids, saved.sources) == (read.ids, read.sources) and len(saved.ids) > 30
    for question in ("prefix cache", "pages grouped by meaning", "vLLM"):
        assert saved.search(question, 5) == read.search(question, 5)
    assert pages.load(pages.path_of(settings.chroma)).pages == pages.build(collection, PAGE_TOKENS).pages
    listed = inventory.load(inventory.path_of(settings.chroma), stamp_of(collection))
    assert listed == inventory.stored_documents(collection) and len(listed) == len(notes)

    write_notes(tmp_path / "docs", skip={9})
    run_ingest([tmp_path / "docs"], settings, embedder)
    assert reads == [1]
    assert set(lexical.load(lexical.index_dir(settings.chroma)).ids) == set(
        collection_of(settings, embedder).get(include=[])["ids"])


def test_a_stale_saved_bm25_index_is_judged_by_its_stamp_alone_never_loaded(tmp_path, settings_factory, embedder,
                                                                           monkeypatch):
    from app.core import lexical
    from app.core.store import mark_changed

    write_notes(tmp_path / "docs")
    settings = settings_factory(path=tmp_path / "chroma")
    run_ingest([tmp_path / "docs"], settings, embedder)
    collection, folder = collection_of(settings, embedder), lexical.index_dir(settings.chroma)
    saved = lexical.load(folder)
    assert lexical.saved_stamp(folder) == saved.stamp == stamp_of(collection)
    assert lexical.current(collection, settings.chroma).ids == saved.ids  # current: the saved one, loaded
    mark_changed(collection)  # a write outside ingest: the saved index is stale
    loads = []
    monkeypatch.setattr(lexical, "load", lambda *a: loads.append(a))
    assert sorted(lexical.current(collection, settings.chroma).ids) == sorted(saved.ids)  # built afresh
    assert loads == [], "a stale index was loaded only to be thrown away"
