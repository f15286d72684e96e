"""The query service against a real vLLM CPU server, a real on-disk Chroma and the real embedder."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from httpx_sse import connect_sse

from app.serve.app import create_app
from app.vllm.prometheus import metric_total
from ingest.pipeline import run_ingest
from tests.support.corpora import FACTS, app_settings, floor_block
from tests.support.env import ROOT
from tests.support.servers import PROBE_TIMEOUT, AppServer, proxy_in_front_of, reset_prefix_cache

pytestmark = pytest.mark.vllm

def ask(server: AppServer, **body) -> httpx.Response:
    return httpx.post(server.url + "/ask", json=body, timeout=120)


def test_prewarm_puts_the_system_prompt_in_cache_before_the_first_request(collections, vllm_url, embedder):
    reset_prefix_cache(vllm_url)
    with AppServer(create_app(app_settings(collections, vllm_url), embedder=embedder)) as server:
        status = server.wait_warmed()
        block, warmed = status["vllm"]["block_size"], status["warmup"]["prefix_tokens"]
        assert status["vllm"]["prefix_caching"] is True and block == 128
        assert warmed >= block, "the stable prefix must span at least one KV block, or warm-up cannot hit"
        first = ask(server, question="Why do tides rise and fall?")
    assert first.status_code == 200, first.text
    assert first.json()["usage"]["cached_tokens"] >= floor_block(warmed, block) > 0


def test_same_set_in_other_relevance_order_gives_identical_prefix_and_hits(collections, vllm_url, embedder):
    from app.rag.context import ContextChunk, PromptBuilder, canonical
    from app.rag.prompts import PromptTemplates
    from app.vllm.client import LLMClient

    reset_prefix_cache(vllm_url)
    questions = ("Which way does a compass needle point?", "How do sails move a ship?")
    with AppServer(create_app(app_settings(collections, vllm_url, top_k=4), embedder=embedder)) as server:
        server.wait_ready()
        first, second = (ask(server, question=q).json() for q in questions)
    orders = [[s["id"] for s in answer["sources"]] for answer in (first, second)]
    assert set(orders[0]) == set(orders[1]) and orders[0] != orders[1], "need the same set, ranked differently"

    builder = PromptBuilder(PromptTemplates.load(ROOT / "prompts"))

    async def token_ids():  # the prompts exactly as vLLM tokenises them, rebuilt from the cited sources
        llm = LLMClient(app_settings(collections, vllm_url).vllm)
        llm.model = "prefixrag-test-model"
        streams = []
        for question, answer in zip(questions, (first, second)):
            chunks = [ContextChunk(id=s["chunk_id"], doc_id=s["document"], chunk_index=s["chunk_index"],
                                   text=FACTS[s["document"]], title=s["title"]) for s in answer["sources"]]
            streams.append(await llm.tokenize(builder.messages(canonical(chunks), question)))
        await llm.aclose()
        return streams

    one, two = asyncio.run(token_ids())
    assert len(one) == first["usage"]["prompt_tokens"] and len(two) == second["usage"]["prompt_tokens"]
    shared = next(i for i, (a, b) in enumerate(zip(one, two)) if a != b)
    question_tokens = len(two) - shared
    assert question_tokens < 40, "prompts must differ only in the question at the end"
    assert second["usage"]["cached_tokens"] >= floor_block(shared, 128) >= 256


def test_over_budget_retrieval_is_trimmed_never_rejected(collections, vllm_url, embedder):
    settings = app_settings(collections, vllm_url, collection="project-docs")
    with AppServer(create_app(settings, embedder=embedder)) as server:
        info = server.wait_ready()["vllm"]
        max_tokens = info["max_model_len"] - 700  # room for the system prompt and ~2 chunks only
        response = ask(server, question="How does prefix caching work?", top_k=12, max_tokens=max_tokens)
        untrimmed = ask(server, question="How does prefix caching work?", top_k=12, max_tokens=8)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"]["prompt_tokens"] + max_tokens <= info["max_model_len"]
    assert 0 < len(body["sources"]) < 12
    assert untrimmed.json()["usage"]["prompt_tokens"] + max_tokens > info["max_model_len"], "trim was needed"
    kept_ranks = [s["id"] for s in untrimmed.json()["sources"]][: len(body["sources"])]
    assert [s["id"] for s in body["sources"]] == kept_ranks  # the lowest-ranked chunks were the ones dropped


def test_a_wrong_token_estimate_is_caught_by_vllm_and_the_prompt_refitted(collections, vllm_url, embedder):
    app = create_app(app_settings(collections, vllm_url, collection="long"), embedder=embedder)
    with AppServer(app) as server:
        info = server.wait_ready()["vllm"]
        # Calibrate the estimator absurdly (a million characters per token): every prompt now looks tiny and is
        # sent uncounted, so the 24-chunk prompt reaches vLLM, which refuses it; the service must count, trim
        # and send again rather than fail the request.
        estimator = app.state.services.estimator
        estimator.chars_per_token = 1_000_000.0
        response = ask(server, question="What does the log say about anchors?", top_k=24)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"]["prompt_tokens"] + 8 <= info["max_model_len"]
    assert 0 < len(body["sources"]) < 24, "the refit must have dropped the lowest-ranked chunks"


def test_an_ingest_while_serving_is_picked_up_without_a_restart(tmp_path, vllm_url, embedder):
    from tests.support.env import run_cli

    docs, chroma = tmp_path / "docs", tmp_path / "chroma"
    docs.mkdir()
    (docs / "anchors.md").write_text(FACTS["anchors.md"] + "\n")
    settings = app_settings(chroma, vllm_url, collection="live", strategy="document")
    settings.chroma.poll_s = 0.2
    run_ingest([docs], settings, embedder)
    question = {"question": "Why do tides rise and fall twice a day?", "top_k": 1}
    with AppServer(create_app(settings, embedder=embedder)) as server:
        server.wait_ready()
        before = ask(server, **question).json()
        # An operator ingests a new file from another process while the service runs: embedded Chroma only
        # sees that process's vectors once reopened, and the document strategy's cached units must go too.
        (docs / "tides.md").write_text(FACTS["tides.md"] + "\n")
        result = run_cli(str(docs), "--chroma-path", str(chroma), "--collection", "live")
        assert result.returncode == 0, result.stderr
        deadline = time.monotonic() + 30
        # At least one reload: an ingest stamps the collection before its first write and again at its end, and
        # the service may see both stamps (2 reloads) or only the last.
        reloads = "prefixrag_collection_reloads_total"
        while metric_total(httpx.get(server.url + "/metrics", timeout=PROBE_TIMEOUT).text, reloads) < 1:
            assert time.monotonic() < deadline, "the service did not notice the ingest"
            time.sleep(0.2)
        after = ask(server, **question).json()
    assert [s["document"] for s in before["sources"]] == ["anchors.md"]
    assert [s["document"] for s in after["sources"]] == ["tides.md"]
    assert after["strategy"] == "document"


def test_vllm_down_gives_503_then_recovers_without_restart(collections, vllm_url, embedder):
    proxy, proxied = proxy_in_front_of(vllm_url)
    settings = app_settings(collections, proxied)
    with AppServer(create_app(settings, embedder=embedder)) as server:
        server.wait_ready()
        assert ask(server, question="What do anchors do?").status_code == 200
        proxy.down()
        down = ask(server, question="What do anchors do?")
        assert down.status_code == 503 and down.headers["Retry-After"]
        assert set(down.json()["error"]) == {"message", "type", "param", "code"}
        assert httpx.get(server.url + "/readyz").status_code == 503
        proxy.up()
        server.wait_ready(30)
        assert server.wait_warmed(done=True)["warmup"]["state"] == "done"  # re-warmed once vLLM was back
        assert ask(server, question="What do anchors do?").status_code == 200


def test_app_starts_while_vllm_is_down_and_says_why(collections, embedder):
    from app.vllm.process import free_port

    settings = app_settings(collections, f"http://127.0.0.1:{free_port()}/v1")
    with AppServer(create_app(settings, embedder=embedder)) as server:
        assert httpx.get(server.url + "/healthz").status_code == 200
        deadline = time.monotonic() + 20
        while "not reachable" not in (ready := httpx.get(server.url + "/readyz")).json()["reason"]:
            assert time.monotonic() < deadline, ready.json()
            time.sleep(0.2)
        assert ready.status_code == 503 and ready.json()["ready"] is False
        response = ask(server, question="anything")
        assert response.status_code == 503 and response.json()["error"]["type"] == "service_unavailable"


@pytest.mark.parametrize("body, param", [
    ({"question": ""}, "question"),
    ({"question": "   "}, "question"),
    ({"question": "x" * 5000}, "question"),
    ({"question": "ok", "top_k": 0}, "top_k"),
    ({"question": "ok", "top_k": 1000}, "top_k"),
    ({"question": 42}, "question"),
    ({}, "question"),
    ({"question": "ok", "surprise": 1}, "surprise"),
    ({"question": "ok", "max_tokens": -1}, "max_tokens"),
])
def test_bad_input_is_400_in_openai_error_shape(collections, vllm_url, embedder, body, param):
    with AppServer(create_app(app_settings(collections, vllm_url), embedder=embedder)) as server:
        response = ask(server, **body)
        streamed = httpx.post(server.url + "/ask", json=body | {"stream": True}, timeout=60)
    for reply in (response, streamed):
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_streaming_ask_sends_deltas_then_sources_and_usage(collections, vllm_url, embedder):
    with AppServer(create_app(app_settings(collections, vllm_url), embedder=embedder)) as server:
        server.wait_ready()
        body = {"question": "What do anchors do?", "stream": True}
        with httpx.Client(timeout=60) as client, connect_sse(client, "POST", server.url + "/ask", json=body) as source:
            assert source.response.headers["content-type"].startswith("text/event-stream")
            events = list(source.iter_sse())
    kinds = [event.event for event in events]
    assert kinds[0] == "delta" and kinds[-1] == "done" and "error" not in kinds
    done = events[-1].json()
    deltas = "".join(event.json()["text"] for event in events if event.event == "delta")
    assert done["answer"] == deltas and done["sources"] and done["usage"]["prompt_tokens"] > 0
