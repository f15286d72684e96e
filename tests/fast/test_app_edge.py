"""The fast tier, the HTTP surface against the fake vLLM: settings that fail at start, the API key in the schema
and at the door, a question beyond capacity refused there, server-sent events for /ask and the openai client,
CORS from a real browser."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from pydantic import ValidationError

from app.core.settings import Settings
from app.serve.app import create_app
from tests.support.corpora import app_settings
from tests.support.fake_app import ask, hold_the_place, serve
from tests.support.fakes import FakeVLLM, GatedVLLM
from tests.support.servers import AppServer, browser_page, http_requests, static_site


def test_an_empty_hotness_dir_turns_persistence_off(monkeypatch):
    monkeypatch.setenv("PREFIXRAG_CONTEXT__HOTNESS_DIR", "")  # was Path(""): hotness files written into the cwd
    assert Settings(_env_file=None).context.hotness_dir is None


def test_the_vllm_url_may_be_given_with_or_without_v1(monkeypatch):
    for given in ("http://vllm:8000", "http://vllm:8000/", "http://vllm:8000/v1", "http://vllm:8000/v1/"):
        monkeypatch.setenv("PREFIXRAG_VLLM_URL", given)
        assert Settings(_env_file=None).vllm.url == "http://vllm:8000/v1"
    monkeypatch.setenv("PREFIXRAG_VLLM_URL", "vllm:8000")
    with pytest.raises(ValidationError, match="http://"):
        Settings(_env_file=None)


def test_cors_origins_are_a_comma_list_or_json_and_a_bad_one_fails_at_start(monkeypatch):
    for given in ("https://chat.example, http://localhost:3000/", '["https://chat.example", "http://localhost:3000"]'):
        monkeypatch.setenv("PREFIXRAG_SERVICE__CORS_ORIGINS", given)
        assert Settings(_env_file=None).service.cors_origins == ["https://chat.example", "http://localhost:3000"]
    for bad in ("chat.example", "https://chat.example/app", '["https://chat.example"'):
        monkeypatch.setenv("PREFIXRAG_SERVICE__CORS_ORIGINS", bad)
        with pytest.raises(ValidationError):  # it would never match what a browser sends: say so at start-up
            Settings(_env_file=None)


def test_the_api_key_is_a_bearer_scheme_in_the_openapi_schema_and_is_enforced(notes, embedder):
    chroma, _, _ = notes
    settings = app_settings(chroma, "http://unused/v1", collection="notes", hotness_dir=None)
    settings.service.api_key = "s3cret"
    key = {"authorization": "Bearer s3cret"}
    with AppServer(create_app(settings, embedder=embedder, llm=FakeVLLM())) as server:
        server.wait_ready()
        schema = httpx.get(server.url + "/openapi.json").json()
        statuses = [httpx.get(server.url + "/v1/models", headers=h).status_code
                    for h in ({}, {"authorization": "Bearer nope"}, {"authorization": "Basic s3cret"}, key)]
        posted = [ask(server, question="What?").status_code,
                  httpx.post(server.url + "/ask", json={"question": "What?", "max_tokens": 8}, headers=key,
                             timeout=30).status_code]
        ready_open, ready_keyed = httpx.get(server.url + "/readyz").json(), httpx.get(server.url + "/readyz",
                                                                                        headers=key).json()
    assert schema["components"]["securitySchemes"]["HTTPBearer"] == {
        "type": "http", "scheme": "bearer",
        "description": "PREFIXRAG_API_KEY, or a tenant's key (PREFIXRAG_SERVICE__KEYS_FILE), when the service has "
                       "keys."}
    for path, method in (("/ask", "post"), ("/v1/retrieve", "post"), ("/v1/chat/completions", "post"),
                         ("/v1/documents", "post"), ("/v1/documents", "get"), ("/v1/models", "get"),
                         ("/metrics", "get")):
        assert schema["paths"][path][method]["security"] == [{"HTTPBearer": []}], path
        assert "401" in schema["paths"][path][method]["responses"], path  # documented where it can happen
    assert "security" not in schema["paths"]["/healthz"]["get"]
    assert statuses == [401, 401, 401, 200] and posted == [401, 200]
    assert set(ready_open) == {"ready", "reason"} and "warmup" in ready_keyed


@pytest.mark.parametrize("http", [None, "httptools"])
def test_a_question_beyond_capacity_is_refused_at_the_edge_before_its_body_is_read(notes, embedder, http):
    """... in the HTTP parser as ``python -m app`` serves (never reaching the app), else by the app's outermost
    layer; either way with a request id, counted in the HTTP metrics."""
    chroma, _, _ = notes
    llm = GatedVLLM()
    settings = app_settings(chroma, "http://unused/v1", collection="notes", hotness_dir=None)
    settings.traffic.max_in_flight = 1
    broken = {"content": b'{"question": "What?", ', "headers": {"content-type": "application/json"}, "timeout": 30}
    traced = {"content-type": "application/json", "X-Request-ID": "storm-7"}
    app, reached = create_app(settings, embedder=embedder, llm=llm), []

    async def counted_app(scope, receive, send):  # what uvicorn hands to the app
        reached.append(scope.get("path"))
        await app(scope, receive, send)

    with AppServer(app, http=http, asgi=counted_app) as server, ThreadPoolExecutor(1) as pool:
        server.wait_ready()
        traffic = server.app.state.services.traffic
        held = hold_the_place(server, pool)  # takes the one place, and keeps it while gated
        before = http_requests(httpx.get(server.url + "/metrics", timeout=10).text)
        refused = [httpx.post(server.url + "/ask", **broken),
                   httpx.post(server.url + "/v1/chat/completions", **broken | {"headers": traced})]
        counted = http_requests(httpx.get(server.url + "/metrics", timeout=10).text)
        reached_when_refused = len(reached)
        llm.gate.set()
        answered = held.result(timeout=30)
        unparsed = httpx.post(server.url + "/ask", **broken)  # with room: the same body is read, and is bad JSON
    assert [r.status_code for r in refused] == [429, 429] and answered.status_code == 200
    assert all(int(r.headers["retry-after"]) >= 1 and r.json()["error"]["code"] == "overloaded" for r in refused)
    assert unparsed.status_code == 400 and unparsed.json()["error"]["code"] == "invalid_json"
    assert traffic.refused == 2
    assert len(refused[0].headers["x-request-id"]) == 32 and refused[1].headers["x-request-id"] == "storm-7"
    assert [counted.get(key, 0) - before.get(key, 0) for key in [("/ask", "POST", "429"),
                                                                 ("/v1/chat/completions", "POST", "429")]] == [1, 1]
    refused_in_app = reached[:reached_when_refused].count("/ask") - 1  # less the one answered
    assert refused_in_app + reached[:reached_when_refused].count("/v1/chat/completions") == (0 if http is None else 2)


def test_streams_are_server_sent_events_for_ask_and_for_the_openai_client(notes, embedder):
    from httpx_sse import connect_sse

    server, fake = serve(notes, embedder, top_k=2)
    with server:
        server.wait_ready()
        body = {"question": "What does ingest do?", "stream": True, "max_tokens": 8}
        with httpx.Client(timeout=30) as client, connect_sse(client, "POST", server.url + "/ask", json=body) as source:
            events = list(source.iter_sse())
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        chunks = list(client.chat.completions.create(model="prefixrag", max_tokens=8, stream=True,
                                                     messages=[{"role": "user", "content": "What does ingest do?"}],
                                                     stream_options={"include_usage": True}))
    assert [e.event for e in events] == ["delta"] * (len(events) - 1) + ["done"]
    done = events[-1].json()
    assert "".join(e.json()["text"] for e in events[:-1]) == done["answer"]
    assert done["answer"].strip() == fake.answer
    assert set(done["timings_ms"]) == {"admit", "retrieve", "assemble", "prepare", "ttft", "upstream_ttft",
                                       "total"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip() == fake.answer
    assert chunks[-1].usage.prompt_tokens > 0 and chunks[-2].choices[0].finish_reason


CROSS_ORIGIN_CHAT = """async ([url, key]) => {
  try {
    const response = await fetch(url + "/v1/chat/completions", {method: "POST",
      headers: {"authorization": "Bearer " + key, "content-type": "application/json"},
      body: JSON.stringify({messages: [{role: "user", content: "What do the notes say?"}], max_tokens: 8})});
    const body = await response.json();
    return {status: response.status, requestId: response.headers.get("x-request-id"),
            answer: response.ok ? body.choices[0].message.content : body.error.code};
  } catch (error) {
    return "blocked";
  }
}"""


def test_a_page_of_an_allowed_origin_calls_the_api_from_the_browser_and_others_are_blocked(notes, embedder,
                                                                                            tmp_path):
    chroma, _, _ = notes
    (tmp_path / "index.html").write_text("<!doctype html><title>a team's own frontend</title>")
    seen = {}
    with static_site(tmp_path) as frontend, browser_page() as page:
        page.goto(frontend + "/")
        for allowed in ([], [frontend]):
            settings = app_settings(chroma, "http://unused/v1", collection="notes", hotness_dir=None)
            settings.service.api_key, settings.service.cors_origins = "s3cret", allowed
            with AppServer(create_app(settings, embedder=embedder, llm=FakeVLLM())) as server:
                server.wait_ready()
                calls = [page.evaluate(CROSS_ORIGIN_CHAT, [server.url, key]) for key in ("s3cret", "nope")]
            seen[bool(allowed)] = calls
    assert seen[False] == ["blocked", "blocked"]  # the default: no CORS headers, the browser hides the answer
    answered, refused = seen[True]
    assert answered["status"] == 200 and answered["answer"] and answered["requestId"]
    assert refused["status"] == 401 and refused["answer"] == "invalid_api_key" and refused["requestId"]
