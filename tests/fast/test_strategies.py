"""Context strategies: pure functions of their inputs, budget-safe, bounded; corpus/document hit the cache."""

from __future__ import annotations

import asyncio
import threading

import pytest

from app.rag.trie import ServedTrie
from app.rag.units import Hotness
from tests.support.corpora import app_settings


def test_trie_orders_along_the_longest_served_path_and_stays_bounded():
    trie = ServedTrie(max_nodes=50)
    trie.insert(["a", "b", "c"])
    trie.insert(["a", "d"])
    assert trie.order({"c", "b", "a", "z"}) == ["a", "b", "c"]
    assert trie.order({"d", "a"}) == ["a", "d"]
    assert trie.order({"q"}) == []
    for n in range(200):
        trie.insert([f"x{n}", f"y{n}", f"z{n}"])
    assert trie.nodes <= 50
    assert trie.order({"x199", "y199", "z199"}) == ["x199", "y199", "z199"]  # recent paths survive pruning


def test_hotness_decays_old_use_and_persists(tmp_path):
    path = tmp_path / "hot.json"
    hot = Hotness(path, half_life=10, save_every=1)
    for _ in range(5):
        hot.use(["old"])
    for _ in range(60):
        hot.use(["new"])
    hot.use(["recent-once"])
    assert hot.score("new") > hot.score("recent-once") > hot.score("old")
    hot.close()
    reloaded = Hotness(path)
    assert reloaded.score("new") == pytest.approx(hot.score("new"))


def test_hotness_writes_its_file_off_the_requests_thread(tmp_path):
    """``use`` runs on the event loop: its periodic save is written on the saver thread; ``close`` saves last."""
    writers = []

    class Recorded(Hotness):
        def save(self) -> None:
            writers.append(threading.current_thread().name)
            super().save()

    hot = Recorded(tmp_path / "hot.json", save_every=2)
    hot.use(["a"])
    hot.use(["a", "b"])
    hot.close()
    hot.use(["b"])  # after close: no save, no error
    assert writers[0].startswith("hotness-save") and writers[1:] == [threading.current_thread().name]
    assert Hotness(tmp_path / "hot.json").score("a") > Hotness(tmp_path / "hot.json").score("b") > 0


def test_a_big_unit_holding_most_hits_is_the_context_else_the_plain_top_k_is(articles_db, embedder):
    from concurrent.futures import ThreadPoolExecutor

    from app.rag.context import canonical
    from app.rag.retriever import Retriever
    from app.rag.strategies import Document
    from app.rag.units import UnitIndex

    settings = app_settings(articles_db, "http://unused/v1", collection="articles")
    retriever = Retriever.over(embedder, settings.chroma, ThreadPoolExecutor(1))
    mixed = "What happened in 1853 and 1993?"  # retrieves from both articles, mostly the glacier

    async def arranged(question, top_k, quorum=0.5, extras=0):
        strategy = Document(UnitIndex(retriever.index, 12288), Hotness(None), quorum=quorum, unit_extras=extras)
        ranked = await retriever.retrieve(question, top_k)
        return ranked, await strategy.arrange(ranked, 100_000)

    # 3 hits are smaller than one 8-sentence article: it is "big", holds the hits, and comes alone, whole.
    ranked, context = asyncio.run(arranged("When was the quay extended to hold 12 boats?", 3))
    assert [c.unit for c in context] == ["Harbour"] * 8 and {c.id for c in ranked} <= {c.id for c in context}
    # 16 hits outweigh an article: units are small here, so the other article comes along as a unit.
    ranked, context = asyncio.run(arranged("When was the quay extended to hold 12 boats?", 16))
    assert sorted({c.unit for c in context}) == ["Glacier", "Harbour"] and len(context) == 16
    # Hits spread over both articles: holding 3 of 4 the top article is the context; short of the quorum (here
    # set to all hits) there is no unit to bet on, and the plain top-k in canonical order is.
    ranked, context = asyncio.run(arranged(mixed, 4))
    top = ranked[0].doc_id.split("#")[0]
    assert any(not c.doc_id.startswith(top) for c in ranked), "the question must retrieve from both articles"
    assert [c.unit for c in context] == [top] * 8
    # With unit_extras the hits outside the unit follow it, at most that many, the best-ranked first.
    outside = [c for c in ranked if not c.doc_id.startswith(top)]
    for extras in (1, 4):
        ranked, context = asyncio.run(arranged(mixed, 4, extras=extras))
        assert [c.unit for c in context[:8]] == [top] * 8 and context[8:] == canonical(outside[:extras])
    ranked, context = asyncio.run(arranged(mixed, 4, quorum=1.0))
    assert context == canonical(ranked)


def test_a_hot_unit_takes_turns_among_several_routing_keys_and_the_others_keep_their_one():
    """Behind two replicas a unit asked in 40 % of requests gets two keys (its own first), used in turn; a unit
    asked in 4 % keeps its own; with one replica, before enough requests, or with spreading off, every unit has
    one key."""
    from app.rag.affinity import SPREAD_AFTER, RouteKeys, affinity_key
    from app.rag.context import ContextChunk

    def unit(name: str) -> list[ContextChunk]:
        return [ContextChunk(id=f"{name}#0", doc_id=name, chunk_index=0, text="...", unit=name)]

    hot, cold = unit("hot"), unit("cold")
    stream = [hot if n % 5 < 2 else (cold if n % 25 == 2 else unit(f"u{n % 17}")) for n in range(3 * SPREAD_AFTER)]
    keys, plain, off = RouteKeys(), RouteKeys(), RouteKeys(spreading=False)
    given = [(context, keys.key(context, replicas=2), plain.key(context, replicas=1)) for context in stream]
    assert all(single == affinity_key(context) == off.key(context, replicas=2) for context, _, single in given)
    early, late = given[:SPREAD_AFTER // 2], given[2 * SPREAD_AFTER:]
    assert {key for context, key, _ in early} == {affinity_key(context) for context, _, _ in early}
    hot_keys = [key for context, key, _ in late if context is hot]
    assert set(hot_keys) == {affinity_key(hot), affinity_key(hot) + ".1"}
    assert hot_keys[:4] in ([affinity_key(hot), affinity_key(hot) + ".1"] * 2,
                            [affinity_key(hot) + ".1", affinity_key(hot)] * 2)
    assert {key for context, key, _ in late if context is cold} == {affinity_key(cold)}


def test_a_client_s_prompt_cache_key_routes_only_a_request_without_context():
    from app.rag.affinity import RouteKeys, affinity_key
    from app.rag.context import ContextChunk

    context = [ContextChunk(id="a#0", doc_id="a", chunk_index=0, text="...", unit="a")]
    keys = RouteKeys()
    assert keys.key(context, 2, hint="conversation-7") == affinity_key(context)  # its documents' replica
    assert keys.key([], 2, hint="conversation-7") == keys.key([], 2, hint="conversation-7") != affinity_key([])
    assert keys.key([], 2, hint="conversation-8") != keys.key([], 2, hint="conversation-7")
    assert keys.key([], 2) == affinity_key([])
