"""Context strategies: pure functions of their inputs, budget-safe, bounded; corpus/document hit the cache."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest

from app.serve.app import create_app
from tests.support.corpora import app_settings, floor_block
from tests.support.servers import AppServer, reset_prefix_cache


def strategy_app(articles_db, vllm_url, embedder, strategy, **generation):
    settings = app_settings(articles_db, vllm_url, collection="articles", strategy=strategy, hotness_dir=None,
                            **generation)
    return AppServer(create_app(settings, embedder=embedder))


@contextlib.contextmanager
def warm_document_app(articles_db, vllm_url, embedder):
    """The document strategy on a cold cache, once both articles are pre-warmed."""
    reset_prefix_cache(vllm_url)
    with strategy_app(articles_db, vllm_url, embedder, "document", top_k=2) as server:
        server.wait_ready()
        server.wait_warmed(units=2)
        yield server


@pytest.mark.vllm
@pytest.mark.parametrize("strategy", ["canonical", "document", "reuse", "corpus"])
def test_same_selection_gives_the_same_prompt_and_the_budget_holds(articles_db, vllm_url, embedder, strategy):
    from app.runtime.services import build_services

    settings = app_settings(articles_db, vllm_url, collection="articles", strategy=strategy, hotness_dir=None)

    async def prompts():
        services = await build_services(settings, embedder=embedder)  # the graph the app runs
        await services.upstream.refresh()
        await services.warmer.warm(services.upstream.info)
        ranked = await services.retriever.retrieve("When was the quay extended?", 3)
        planner, builder = services.planner, services.builder
        streams = [await services.llm.tokenize(builder.messages(await planner.arrange(ranked, 4000), "q"))
                   for _ in range(2)]
        await services.aclose()
        return streams

    first, second = asyncio.run(prompts())
    assert first == second and len(first) > 100
    with strategy_app(articles_db, vllm_url, embedder, strategy, top_k=3) as server:
        window = server.wait_ready()["vllm"]["max_model_len"]
        max_tokens = window - 300  # leaves room for the system prompt and little else
        big = httpx.post(server.url + "/ask", json={"question": "When did the ice retreat?", "top_k": 3,
                                                    "max_tokens": max_tokens}, timeout=120)
    assert big.status_code == 200, big.text
    assert big.json()["usage"]["prompt_tokens"] + max_tokens <= window
    if strategy == "corpus":  # the corpus cannot fit beside this answer budget: canonical, not an empty prompt
        assert big.json()["strategy"] == "canonical" and big.json()["sources"]


@pytest.mark.vllm
def test_document_strategy_serves_the_whole_unit_from_cache(articles_db, vllm_url, embedder):
    with warm_document_app(articles_db, vllm_url, embedder) as server:
        answers = [httpx.post(server.url + "/ask", json={"question": q, "max_tokens": 4}, timeout=60).json()
                   for q in ("When was the quay extended to hold 12 boats?", "How many boats in 1855?")]
    for answer in answers:
        assert answer["strategy"] == "document"
        # The whole article (pre-warmed) is the prefix: all but the tail of the prompt is cached.
        assert answer["usage"]["cached_tokens"] >= floor_block(answer["usage"]["prompt_tokens"] - 60, 128) > 128


@pytest.mark.vllm
def test_a_chat_starts_on_the_pre_warmed_unit_even_with_its_own_system_prompt(articles_db, vllm_url, embedder):
    from openai import OpenAI

    with warm_document_app(articles_db, vllm_url, embedder) as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused")
        messages = [{"role": "system", "content": "You are a terse harbour historian."},
                    {"role": "user", "content": "When was the quay extended to hold 12 boats?"}]
        first = client.chat.completions.create(model="prefixrag", messages=messages, max_tokens=4)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And how far did the glacier retreat in 1993?"}]
        second = client.chat.completions.create(model="prefixrag", messages=messages, max_tokens=4)
    # Turn 1 is the harbour article, pre-warmed before any chat: cached up to the client's instructions.
    assert first.usage.prompt_tokens_details.cached_tokens >= floor_block(first.usage.prompt_tokens - 80, 128) > 128
    # Turn 2 starts with all of turn 1's prompt (the unit, rebuilt identically), then the new context.
    assert second.usage.prompt_tokens_details.cached_tokens >= floor_block(first.usage.prompt_tokens, 128)


@pytest.mark.vllm
def test_corpus_mode_hits_the_whole_corpus_on_every_request(articles_db, vllm_url, embedder):
    reset_prefix_cache(vllm_url)
    with strategy_app(articles_db, vllm_url, embedder, "corpus") as server:
        status = server.wait_warmed(units=1)
        corpus_tokens = status["warmup"]["corpus_tokens"]
        assert status["warmup"]["corpus_fits"] and corpus_tokens > 256
        for question in ("When was the quay extended?", "How far did the ice retreat?", "Which valley?"):
            answer = httpx.post(server.url + "/ask", json={"question": question, "max_tokens": 4}, timeout=60).json()
            assert answer["strategy"] == "corpus"
            assert answer["usage"]["cached_tokens"] >= floor_block(corpus_tokens, 128)
            scores = [source["score"] for source in answer["sources"]]
            assert scores and scores == sorted(scores, reverse=True)  # sources in relevance order


@pytest.mark.vllm
def test_auto_picks_corpus_when_it_fits(articles_db, vllm_url, embedder):
    with strategy_app(articles_db, vllm_url, embedder, "auto") as server:
        server.wait_ready()
        answer = httpx.post(server.url + "/ask", json={"question": "Which valley?", "max_tokens": 4}, timeout=60)
    assert answer.json()["strategy"] == "corpus"


@pytest.mark.vllm
def test_one_affinity_key_per_unit_for_its_warm_up_its_questions_and_whole_conversations(
        articles_db, vllm_url, embedder, monkeypatch):
    """vllm-router's consistent hash sends equal keys to one replica: a unit's pre-warm, the questions about it
    and every turn of a conversation that started on it must carry the same key; two units, two keys."""
    from openai import OpenAI

    from app.vllm.client import LLMClient

    sent, build = [], LLMClient.chat_request

    def recording(self, messages, **options):  # a spy: the real request is built and sent
        request = build(self, messages, **options)
        sent.append((request["extra_headers"]["X-Session-ID"], request["stream"]))
        return request

    monkeypatch.setattr(LLMClient, "chat_request", recording)
    with warm_document_app(articles_db, vllm_url, embedder) as server:
        warm_keys = [key for key, streamed in sent if not streamed]
        sent.clear()
        httpx.post(server.url + "/ask", json={"question": "When was the quay extended?", "max_tokens": 2},
                   timeout=60).raise_for_status()
        client = OpenAI(base_url=server.url + "/v1", api_key="unused")
        messages = []
        for question in ("When was the quay extended to hold 12 boats?", "How far did the glacier retreat?",
                         "And in 1993?"):
            messages.append({"role": "user", "content": question})
            reply = client.chat.completions.create(model="prefixrag", messages=messages, max_tokens=2)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    assert len(warm_keys) == len(set(warm_keys)) == 3  # the system prompt and each article: three keys
    ask_key, *chat_keys = [key for key, _ in sent]
    assert ask_key in warm_keys  # the harbour question goes where the harbour article was warmed
    assert chat_keys == [ask_key] * 3  # the conversation stays there, even when turn 2 is about the glacier
