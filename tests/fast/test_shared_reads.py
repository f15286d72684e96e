"""Reads that would repeat across requests or grow with the collection: one load of a value that several callers
need at once (``AsyncLRU``), never shared between users and pre-warm; questions about one big document right after
the service forgot it read it once; deciding whether the corpus fits stops reading once it cannot."""

from __future__ import annotations

import asyncio
import contextvars
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from app.rag import strategies
from app.rag.index import CollectionIndex
from app.rag.lru import AsyncLRU
from app.rag.units import UnitIndex, window_of
from app.serve.app import create_app
from ingest.pipeline import run_ingest
from tests.support.corpora import app_settings
from tests.support.fakes import FakeVLLM
from tests.support.servers import AppServer

LANE: contextvars.ContextVar[str] = contextvars.ContextVar("lane", default="user")


class Loads:
    """A loader that counts its calls and finishes when told."""

    def __init__(self) -> None:
        self.calls, self.release = 0, asyncio.Event()

    async def __call__(self) -> str:
        self.calls += 1
        call = self.calls
        await self.release.wait()
        return f"value {call}"


async def started(*coroutines):
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    await asyncio.sleep(0.01)  # each has asked
    return tasks


def test_callers_of_one_key_at_once_share_one_load_and_one_cancelled_leaves_it_to_the_others():
    async def scenario():
        cache, load = AsyncLRU[str](4), Loads()
        first, second, third = await started(cache.get("a", load), cache.get("a", load), cache.get("a", load))
        first.cancel()
        load.release.set()
        assert await second == await third == "value 1" and load.calls == 1
        assert await cache.get("a", load) == "value 1" and load.calls == 1  # kept
        with pytest.raises(asyncio.CancelledError):
            await first

    asyncio.run(scenario())


def test_a_load_is_not_shared_across_lanes_nor_after_a_clear_and_its_error_reaches_every_caller():
    async def scenario():
        cache, load = AsyncLRU[str](4, lane=LANE.get), Loads()
        user = asyncio.ensure_future(cache.get("a", load))
        background = asyncio.get_running_loop().create_task(cache.get("a", load), context=background_context())
        await asyncio.sleep(0.01)
        assert load.calls == 2  # pre-warm's load (which may wait for users to go) is not a user's to wait on
        cache.clear()  # the collection changed: what is loading now may predate the change
        after = asyncio.ensure_future(cache.get("a", load))
        await asyncio.sleep(0.01)
        assert load.calls == 3  # not joined
        load.release.set()
        assert await asyncio.gather(user, background, after) == ["value 1", "value 2", "value 3"]
        assert await cache.get("a", fresh) == "value 3"  # only the load started after the clear was kept

        early = Loads()
        before = asyncio.ensure_future(cache.get("c", early))
        await asyncio.sleep(0.01)
        cache.clear()
        early.release.set()
        assert await before == "value 1"
        assert await cache.get("c", fresh) == "fresh"  # loaded before the clear: not kept

        async def failing() -> str:
            await asyncio.sleep(0.01)
            raise ValueError("unreadable")

        outcomes = await asyncio.gather(cache.get("b", failing), cache.get("b", failing), return_exceptions=True)
        assert [type(o) for o in outcomes] == [ValueError, ValueError]
        assert await cache.get("b", fresh) == "fresh"  # a failed load is not kept: tried again

    asyncio.run(scenario())


def background_context() -> contextvars.Context:
    context = contextvars.copy_context()
    context.run(LANE.set, "background")
    return context


async def fresh() -> str:
    return "fresh"


def test_questions_needing_one_big_document_at_once_read_it_once(notes, embedder, monkeypatch):
    chroma, texts, _ = notes
    settings = app_settings(chroma, "http://unused/v1", collection="notes")
    reads: list[object] = []
    original = CollectionIndex.chunks_where

    async def counted(self, where, texts=True):
        reads.append(where)
        return await original(self, where, texts)

    monkeypatch.setattr(CollectionIndex, "chunks_where", counted)

    async def scenario():
        index = CollectionIndex(embedder, settings.chroma, ThreadPoolExecutor(4))
        units = UnitIndex(index, max_unit_tokens=None)
        hit = (await index.chunks_where(None))[0]
        reads.clear()
        found = await asyncio.gather(*(units.unit_for(hit, paged=False) for _ in range(8)))
        assert len({tuple(c.id for c in chunks) for _, chunks in found}) == 1
        assert reads == [{"parent_id": hit.parent}]  # one read for the eight

    asyncio.run(scenario())


def test_deciding_whether_the_corpus_fits_stops_reading_once_it_cannot(notes, embedder, monkeypatch):
    """A corpus too large for the window is not read whole (that read would grow with the collection); one that
    fits is read whole and counted exactly."""
    chroma, texts, _ = notes
    monkeypatch.setattr(strategies, "LOAD_PAGE", 8)  # the notes are 35 short paragraphs: pages of a few
    verdicts = {}
    for window in (2048, 32768):
        settings = app_settings(chroma, "http://unused/v1", collection="notes", strategy="auto", hotness_dir=None)
        with AppServer(create_app(settings, embedder=embedder, llm=FakeVLLM(max_model_len=window))) as server:
            verdicts[window] = server.wait_warmed(done=True)["warmup"]
    small, large = verdicts[2048], verdicts[32768]
    assert small["corpus_chunks"] == large["corpus_chunks"] == len(texts)
    assert small["corpus_fits"] is False and small["corpus_tokens"] is None
    assert 8 <= small["corpus_read"] < len(texts)  # stopped once the text read could not fit twice over
    assert large["corpus_fits"] is True and large["corpus_read"] == len(texts) and large["corpus_tokens"] > 0


def test_a_window_of_a_big_file_is_read_alone_and_is_the_window_the_whole_read_cuts(tmp_path, embedder,
                                                                                   monkeypatch):
    """A question about one window of a big file reads that window's rows (its row records the file's size), not
    the whole file, which after every forget held answers for a second; the window and its chunks are the ones
    the whole file's read cuts, so prompts and hotness keys stay as they were; rows without the size (written
    before it was kept) are cut from the whole file as before, and so is a window missing a row; a hot window's
    first chunk is one row's read."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "big.md").write_text("\n\n".join(
        f"Paragraph {i} says " + " ".join(f"w{i}x{j}" for j in range(50)) + "." for i in range(60)))
    settings = app_settings(tmp_path / "chroma", "http://unused/v1", collection="big")
    run_ingest([docs], settings, embedder)
    rows_read: list[int] = []
    original = CollectionIndex.chunks_where

    async def counted(self, where, texts=True):
        found = await original(self, where, texts)
        rows_read.append(len(found))
        return found

    monkeypatch.setattr(CollectionIndex, "chunks_where", counted)

    async def scenario():
        index = CollectionIndex(embedder, settings.chroma, ThreadPoolExecutor(2))
        whole = await index.chunks_where(None)
        assert len(whole) > 20 and {(c.n_chunks, c.parent_chars > 0) for c in whole} == {(len(whole), True)}
        windowed, legacy = UnitIndex(index, max_unit_tokens=400), UnitIndex(index, max_unit_tokens=400)
        keys = set()
        for hit in whole[::5]:
            rows_read.clear()
            key, chunks = await windowed.unit_for(hit, paged=False)
            # A window read once, its rows alone; a later hit in it reads nothing.
            assert rows_read == ([] if key in keys else [len(chunks)]) and len(chunks) < len(whole) // 3, rows_read
            assert (key, chunks) == await legacy.unit_for(replace(hit, parent_chars=-1), paged=False)
            window = window_of(key)  # aligned: every hit in a window maps to the same one
            assert window.start % window.size == 0 and window.start <= hit.chunk_index < window.start + window.size
            keys.add(key)
            rows_read.clear()
            assert (await windowed.window_start(key)).id == chunks[0].id and rows_read == [1]
            rows_read.clear()  # where the whole file was read (the legacy index): nothing is read again
            assert (await legacy.window_start(key)).id == chunks[0].id and rows_read == []
        assert len(keys) >= 3  # several windows were cut
        gone = whole[len(whole) // 2]  # withdrawn (its document deleted over HTTP): its window is not all there
        index.withdraw(frozenset({gone.id}))
        rows_read.clear()
        key, chunks = await UnitIndex(index, max_unit_tokens=400).unit_for(gone, paged=False)
        assert rows_read[-1] == len(whole) - 1 and gone.id not in {c.id for c in chunks}  # the whole file decided
        legacy = UnitIndex(index, max_unit_tokens=400)
        assert (key, chunks) == await legacy.unit_for(replace(gone, parent_chars=-1), paged=False)

    asyncio.run(scenario())
