"""The OpenAI-compatible API, driven by the official ``openai`` client, against the real vLLM test server."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from app.serve.app import create_app
from tests.support.corpora import app_settings, floor_block
from tests.support.servers import AppServer, proxy_in_front_of, reset_prefix_cache

pytestmark = pytest.mark.vllm


def client_for(server: AppServer, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


def test_models_lists_the_rag_model(server):
    assert [m.id for m in client_for(server).models.list()] == ["prefixrag"]


def test_non_streaming_completion_with_sources_and_cached_tokens(server):
    completion = client_for(server).chat.completions.create(
        model="prefixrag", messages=[{"role": "user", "content": "What does the ingest command do?"}], max_tokens=8)
    assert completion.object == "chat.completion" and completion.choices[0].message.role == "assistant"
    assert completion.choices[0].finish_reason in ("stop", "length")
    assert completion.usage.prompt_tokens > 0 and completion.usage.prompt_tokens_details.cached_tokens >= 128
    sources = completion.model_extra["sources"]
    assert sources and {"id", "chunk_id", "document", "title", "score", "snippet"} <= set(sources[0])
    assert sources[0]["chunk_id"].startswith(sources[0]["id"] + "::")  # canonical: cited as document::chunk


def test_streaming_with_usage_is_what_the_openai_client_expects(server):
    stream = client_for(server).chat.completions.create(
        model="prefixrag", messages=[{"role": "user", "content": "What is prefill?"}], max_tokens=8, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].model_extra["sources"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0


def test_three_turns_each_reuse_the_previous_prompt(server, vllm_url):
    reset_prefix_cache(vllm_url)
    client, messages, previous = client_for(server), [], None
    for question in ("How does ingest chunk documents?", "What does the query service return?",
                     "Which block size does vLLM use on the CPU?"):
        messages.append({"role": "user", "content": question})
        completion = client.chat.completions.create(model="prefixrag", messages=messages, max_tokens=8)
        usage = completion.usage
        if previous is not None:
            assert usage.prompt_tokens > previous
            assert usage.prompt_tokens_details.cached_tokens >= floor_block(previous, 128), (question, usage)
        previous = usage.prompt_tokens
        messages.append({"role": "assistant", "content": completion.choices[0].message.content})


@pytest.mark.parametrize("body", [
    {"model": "prefixrag"},
    {"model": "prefixrag", "messages": []},
    {"model": "prefixrag", "messages": "hello"},
    {"model": "prefixrag", "messages": [{"role": "user", "content": 42}]},
    {"model": "prefixrag", "messages": [{"role": "user", "content": "  "}]},
    {"model": "prefixrag", "messages": [{"role": "wizard", "content": "hi"}]},
    {"model": "prefixrag", "messages": [{"role": "assistant", "content": "hi"}]},
    {"model": "prefixrag", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"},
    {"model": "prefixrag", "messages": [{"role": "user", "content": "hi"}], "presence_penalty": 3},
])
def test_bad_requests_are_400_in_openai_shape(server, body):
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    if "messages" in body:  # without messages the client refuses before sending anything
        with pytest.raises(openai.BadRequestError):
            client_for(server).chat.completions.create(**body)


def test_unknown_fields_are_ignored(server):
    response = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "prefixrag", "messages": [{"role": "user", "content": "What is prefill?"}], "max_tokens": 4,
        "frequency_penalty": 0, "logit_bias": {}, "n": 1, "seed": 3, "some_frontend_field": True})
    assert response.status_code == 200, response.text


def test_penalties_reach_vllm(server):
    def answer(**penalty: float) -> str:
        return client_for(server).chat.completions.create(
            model="prefixrag", messages=[{"role": "user", "content": "What is prefill?"}], max_tokens=16,
            temperature=0.0, **penalty).choices[0].message.content

    plain = answer()  # greedy: the dummy model repeats itself, which a penalty changes
    assert answer(frequency_penalty=2.0) != plain and answer(presence_penalty=2.0) != plain


def test_api_key_when_set(collections, vllm_url, embedder):
    settings = app_settings(collections, vllm_url, collection="project-docs")
    settings.service.api_key = "s3cret"
    with AppServer(create_app(settings, embedder=embedder)) as server:
        server.wait_ready()
        with pytest.raises(openai.AuthenticationError):
            client_for(server, "wrong").models.list()
        missing = httpx.post(server.url + "/ask", json={"question": "hi"})
        assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
        assert httpx.get(server.url + "/healthz").status_code == 200
        assert httpx.get(server.url + "/metrics").status_code == 401
        assert [m.id for m in client_for(server, "s3cret").models.list()] == ["prefixrag"]


def test_stream_cut_by_vllm_going_away_ends_with_an_error(collections, vllm_url, embedder, caplog):
    proxy, proxied = proxy_in_front_of(vllm_url)
    settings = app_settings(collections, proxied, collection="project-docs")
    with AppServer(create_app(settings, embedder=embedder)) as server:
        server.wait_ready()
        stream = client_for(server).chat.completions.create(
            model="prefixrag", messages=[{"role": "user", "content": "Tell me everything."}], max_tokens=3000,
            stream=True)
        started = time.monotonic()
        received = 0
        with pytest.raises(openai.APIError):
            for _ in stream:
                received += 1
                if received == 3:
                    threading.Thread(target=proxy.down).start()
        assert received >= 3 and time.monotonic() - started < 60
    reasons = [r.getMessage() for r in caplog.records if r.name == "prefixrag.http" and r.levelname == "WARNING"]
    assert len(reasons) == 1 and reasons[0].startswith("5"), reasons  # the error event's reason, logged once


def test_a_50_message_chat_retrieves_once_per_new_turn(collections, vllm_url, embedder):
    settings = app_settings(collections, vllm_url, collection="project-docs", top_k=3)
    app = create_app(settings, embedder=embedder)
    with AppServer(app) as server:
        server.wait_ready()
        ranker, calls = app.state.services.clients.ranker, []
        rank = ranker.rank

        async def counted(question, *args, **kwargs):
            calls.append(question)
            return await rank(question, *args, **kwargs)

        ranker.rank = counted
        messages = []
        for turn in range(25):  # 25 user turns + 24 answers sent back: 49 messages in the last request
            messages.append({"role": "user", "content": f"Question {turn}: how does prefixrag order chunks?"})
            reply = client_for(server).chat.completions.create(model="prefixrag", messages=messages, max_tokens=2)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content or "-"})
    assert len(calls) == 25 and len(set(calls)) == 25, calls  # each question retrieved once, on its own turn
