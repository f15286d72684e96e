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
