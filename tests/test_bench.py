"""The benchmark harness end to end on a tiny slice (real vLLM test server, real Chroma, real embedder)."""

from __future__ import annotations

import json

import pytest

from bench.ceiling import BlockCacheCeiling
from tests.conftest import ROOT
from tests.corpora import tiny_squad


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


@pytest.mark.vllm
def test_harness_end_to_end_on_a_tiny_slice(tmp_path, vllm_url):
    from bench.prefix_cache import main

    data = tiny_squad(tmp_path / "tiny")
    out = tmp_path / "result.json"
    assert main(["--data", str(data), "--questions", "10", "--top-k", "2", "--vllm-url", vllm_url,
                 "--max-tokens", "4", "--modes", "naive,prefixrag,naive-matched", "--out", str(out),
                 "--dump-prompts", str(tmp_path / "prompts")]) == 0
    result = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 1000
    modes = {r["mode"]: r for r in result["results"]}
    assert set(modes) == {"naive", "prefixrag", "naive-matched"} and len(result["question_ids"]) == 10
    for r in modes.values():
        assert r["questions"] == 10 and r["errors"] == 0
        assert 0 <= r["hits"] <= r["queries"] and r["queries"] > 0
        assert r["ceiling"] >= r["hit_rate"] - 0.05, r  # vLLM can't beat an infinite cache
        assert r["mean_uncached_prompt_tokens"] <= r["mean_prompt_tokens"]
        assert r["ttft_ms"]["p50"] <= r["ttft_ms"]["p95"] <= r["ttft_ms"]["p99"]
        assert 0 <= r["recall"] <= 1
    assert modes["naive-matched"]["recall"] >= modes["prefixrag"]["recall"] or modes["naive-matched"]["k"] == 100
    # prefixrag's fixed system prompt alone is over one 128-token block: it must hit where naive cannot.
    assert modes["prefixrag"]["hit_rate"] > modes["naive"]["hit_rate"]
    from bench.replay import load_rows
    from bench.replay import main as replay

    dumped = load_rows(tmp_path / "prompts" / "prefixrag.jsonl.gz")
    assert len([row for row in dumped if not row.get("warmup")]) == 10 and dumped[-1]["prompt_token_ids"]
    assert any(row.get("warmup") for row in dumped)  # the pre-warm travels with the stream

    assert replay(["--prompts", str(tmp_path / "prompts"), "--vllm-url", vllm_url, "--concurrency", "1,3",
                   "--modes", "prefixrag,naive", "--label", "tiny"]) == 0
    replayed = json.loads((tmp_path / "prompts" / "replay.json").read_text())
    runs = {(r["mode"], r["concurrency"]): r for r in replayed["results"]}
    assert list(runs) == [("prefixrag", 1), ("prefixrag", 3), ("naive", 1), ("naive", 3)]
    for (mode, _), r in runs.items():
        assert r["errors"] == 0 and r["questions"] == 10 and r["ceiling"] == modes[mode]["ceiling"]
        assert r["server_ms"]["ttft_mean_ms"] > 0  # vLLM's own histogram moved: the replay reached the engine
    assert runs[("prefixrag", 3)]["hit_rate"] > runs[("naive", 3)]["hit_rate"]
    assert replayed["server"]["block_size"] == 128 and replayed["server"]["vllm_version"]

    from bench.report import report

    table = report(tmp_path / "prompts" / "replay.json")
    assert "bench.replay" in table and table.count("\n| `") == 4
