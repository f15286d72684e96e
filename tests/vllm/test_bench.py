"""The benchmark harness end to end on a tiny slice (real vLLM test server, real Chroma, real embedder)."""

from __future__ import annotations

import json

import pytest

from tests.support.corpora import tiny_squad


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


@pytest.mark.vllm
def test_long_context_compares_naive_filling_a_books_budget_with_prefixrag_on_whole_books(tmp_path, vllm_url):
    from bench.long_context import main
    from bench.report import report

    data = tiny_squad(tmp_path / "tiny")
    out = tmp_path / "long.json"
    assert main(["--data", str(data), "--unit-tokens", "128", "--questions", "8", "--concurrency", "1,4",
                 "--top-k", "2", "--max-tokens", "4", "--vllm-url", vllm_url, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    cells = {(r["mode"], r["concurrency"]): r for r in result["results"]}
    assert set(cells) == {(mode, c) for mode in ("naive", "naive-fill", "prefixrag") for c in (1, 4)}
    assert len(result["books"]) >= 2 and out.with_suffix(".png").stat().st_size > 1000
    for c in (1, 4):
        naive, fill, prefixrag = cells["naive", c], cells["naive-fill", c], cells["prefixrag", c]
        assert naive["errors"] == fill["errors"] == prefixrag["errors"] == 0
        assert fill["mean_prompt_tokens"] > naive["mean_prompt_tokens"] and fill["recall"] >= naive["recall"]
        assert prefixrag["hit_rate"] > fill["hit_rate"]  # whole books, pre-warmed: the prompt's bulk hits
    assert "bench.long_context" in report(out)


@pytest.mark.vllm
def test_throughput_runs_the_app_naive_and_the_replay_of_the_apps_requests(tmp_path, vllm_url):
    """bench.throughput as users would run it: the app as a child over HTTP, its requests captured and replayed
    to vLLM alone, and naive RAG, on the same questions; every arm answered and was measured."""
    from bench.report import report
    from bench.throughput import main

    out = tmp_path / "throughput.json"
    assert main(["--data", str(tiny_squad(tmp_path / "tiny")), "--chroma", str(tmp_path / "chroma"),
                 "--vllm-url", vllm_url, "--concurrency", "2", "--max-tokens", "4", "--streamed", "yes,no",
                 "--requests", "3", "--duration-s", "60", "--warmup-s", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["cache_reset"] is True  # an earlier run's naive prompts (same seed) cannot hit in this one
    rows = {(r["arm"], r["streamed"]): r for r in result["results"]}
    assert set(rows) == {(arm, streamed) for arm in ("prefixrag", "replay", "naive") for streamed in (True, False)}
    for row in rows.values():
        assert row["answers"] == row["requests"] == 32 and row["statuses"] == {"200": 32}, row
        assert 0 < row["ttft_ms"]["p50"] <= row["e2e_ms"]["p99"] and row["vllm_requests"] >= 32
    app = rows[("prefixrag", True)]
    assert app["app_ms"]["retrieve"]["p50"] >= 0 and app["app_ms"]["upstream_ttft"]["p50"] > 0
    assert app["outside_vllm_ms"]["p50"] < app["ttft_ms"]["p50"] and app["app_cpu_s"] > 0
    assert app["app_histograms"]["admission_wait"]["count"] == 32 and app["app_ms"]["admit"]["p50"] >= 0
    # The replay sent vLLM exactly the app's prompts: the same prompt tokens, cached as they were for the app.
    assert rows[("replay", True)]["vllm_hit_rate"] >= app["vllm_hit_rate"] - 0.05
    assert out.with_suffix(".png").stat().st_size > 1000 and "bench.throughput" in report(out)
