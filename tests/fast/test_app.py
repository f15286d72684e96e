"""The fast tier: the service's own logic end to end -- HTTP, retrieval over a real on-disk Chroma with the real
embedder, strategies and pages, pre-warm, the token budget, citations -- against the fake vLLM of
``tests/support/fakes.py``, put in at the one seam (``create_app(llm=)``). Seconds, no vLLM. Every behaviour here that
depends on what vLLM does (caching, pre-warm, the token budget, chat) is also tested against a real vLLM CPU server
(marked ``vllm``); those about the search indexes loading (readiness, a reload) and about which hits follow a
page (``page_extras``) involve no vLLM and are tested here only. Run this tier alone: ``pytest -m "not vllm"``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import httpx
import openai
import pytest
from pydantic import ValidationError

from app.core import pages
from app.core.settings import Settings
from app.rag.units import window_of
from app.serve.app import create_app
from ingest.pipeline import run_ingest
from tests.support.corpora import app_settings, floor_block, paragraphs, write_notes
from tests.support.env import ROOT
from tests.support.fakes import BLOCK, FakeVLLM
from tests.support.servers import PROBE_TIMEOUT, AppServer, browser_page, static_site


@pytest.fixture(scope="module")
def notes(tmp_path_factory, embedder):
    """Paragraphs as small jsonl documents, grouped into pages of ~512 tokens."""
    base = tmp_path_factory.mktemp("fast")
    texts = write_notes(base / "docs")
    settings = app_settings(base / "chroma", "http://unused/v1", collection="notes")
    settings.pages.tokens = 512
    run_ingest([base / "docs"], settings, embedder)
    return base / "chroma", texts, pages.load(pages.path_of(settings.chroma))


def serve(notes, embedder, **generation):
    chroma, _, _ = notes
    fake = FakeVLLM()
    settings = app_settings(chroma, "http://unused/v1", collection="notes", hotness_dir=None, **generation)
    return AppServer(create_app(settings, embedder=embedder, llm=fake)), fake


def ask(server, **body) -> httpx.Response:
    return httpx.post(server.url + "/ask", json={"max_tokens": 8, **body}, timeout=30)


def test_questions_about_two_documents_of_one_page_share_its_prefix_and_cite_them(notes, embedder):
    _, texts, index = notes
    page, members = next((k, m) for k, m in index.pages.items() if len(m) >= 3)
    server, fake = serve(notes, embedder, strategy="document", top_k=1)
    with server:
        server.wait_ready()
        warmed = server.wait_warmed(done=True)["warmup"]
        hotness = server.app.state.services.planner.hotness
        assert hotness.score(page) == 0
        answers = [ask(server, question=texts[member][:300]).json() for member in (members[0], members[-1])]
        assert hotness.score(page) > 0  # what was served, as one unit: the page
    assert warmed["units_warmed"] == warmed["units_planned"] == len(index.pages)
    for member, answer in zip((members[0], members[-1]), answers):
        assert [s["id"] for s in answer["sources"]] == [member] and answer["sources"][0]["snippet"]
        usage = answer["usage"]  # the page was pre-warmed: all but the question's tail is cached
        assert usage["cached_tokens"] >= floor_block(usage["prompt_tokens"] - 100, BLOCK) > 0
    prompts = [fake.prompts[-2][1]["content"], fake.prompts[-1][1]["content"]]
    assert all(f'id="{m}"' in p for m in members for p in prompts)  # the whole page, each document by its id


def scattered_question(texts: dict[str, str], page_of: dict[str, str], retriever) -> tuple[str, str, list[str]]:
    """A question whose five hits leave at least two documents outside the page that leads its prompt: the
    question, that page, and those documents best-ranked first."""
    for text in texts.values():
        ranked = retriever.retrieve_sync(text[:200], 5)
        held = [page_of[hit.parent] for hit in ranked]  # the page holding most hits, ties: the better-ranked
        best = min(held, key=lambda page: (-held.count(page), held.index(page)))
        outside = list(dict.fromkeys(hit.parent for hit in ranked if page_of[hit.parent] != best))
        if len(outside) >= 2:
            return text[:200], best, outside
    raise AssertionError("no question with scattered hits in the notes")


@pytest.mark.parametrize("page_extras", [None, 1])
def test_at_most_page_extras_hits_follow_a_page_the_best_ranked_first(notes, embedder, page_extras):
    _, texts, index = notes
    page_of = {parent: key for key, members in index.pages.items() for parent in members}
    server, fake = serve(notes, embedder, strategy="document", top_k=5, page_extras=page_extras)
    with server:
        server.wait_ready()
        question, page, outside = scattered_question(texts, page_of, server.app.state.services.retriever)
        ask(server, question=question).raise_for_status()
    shown = {cited.split("::")[0] for cited in re.findall(r'id="([^"]+)"', fake.prompts[-1][1]["content"])}
    assert set(index.pages[page]) <= shown  # the page leads, whole
    assert shown - set(index.pages[page]) == set(outside[:page_extras])  # None: every hit outside it


def test_ready_only_once_the_search_indexes_are_loaded(notes, embedder, monkeypatch):
    """A question right after /readyz says 200 finds BM25 and the pages loaded: it gets the hybrid ranking and its
    page, the prompt every later question about that page gets (before, ready came while they still loaded)."""
    loaded = pages.current

    def slow_to_load(*args, **kwargs):  # a bigger corpus's load, in time only: the index itself is the real one
        time.sleep(1.5)
        return loaded(*args, **kwargs)

    monkeypatch.setattr(pages, "current", slow_to_load)
    server, _ = serve(notes, embedder)
    with server:
        reasons = set()
        while (status := httpx.get(server.url + "/readyz", timeout=PROBE_TIMEOUT)).status_code != 200:
            reasons.add(status.json()["reason"])
            time.sleep(0.05)
        retriever = server.app.state.services.retriever
        assert retriever.index.page_index() is not None and retriever.index.lexical_index() is not None
    assert "loading the search indexes" in reasons


def test_a_question_answered_while_a_reload_loads_the_pages_is_not_remembered_unpaged(tmp_path, embedder,
                                                                                       monkeypatch):
    """After an ingest the service answers while it reloads its indexes; what it arranged meanwhile (a paged
    document on its own) is used once, and the same question asked later gets its page."""
    from app.vllm.client import metric_total
    from tests.support.env import run_cli

    docs, chroma = tmp_path / "docs", tmp_path / "chroma"
    texts = write_notes(docs)
    settings = app_settings(chroma, "http://unused/v1", collection="reload", strategy="document", top_k=1,
                            hotness_dir=None)
    settings.pages.tokens, settings.chroma.poll_s = 512, 0.2
    run_ingest([docs], settings, embedder)
    members = next(m for m in pages.load(pages.path_of(settings.chroma)).pages.values() if len(m) >= 3)
    loaded, fake = pages.current, FakeVLLM()

    def slow_to_load(collection, cfg, paging, *, write):  # the service's load takes a big corpus's time
        if not write:  # longer than an ingest takes from its first stamp to its exit: both reloads see it
            time.sleep(6)
        return loaded(collection, cfg, paging, write=write)

    with AppServer(create_app(settings, embedder=embedder, llm=fake)) as server:
        server.wait_ready()
        monkeypatch.setattr(pages, "current", slow_to_load)
        (docs / "extra.md").write_text("A lighthouse keeper's log, a new note.\n")
        assert run_cli(str(docs), "--chroma-path", str(chroma), "--collection", "reload",
                       env={"RAG_PAGES__TOKENS": "512"}).returncode == 0
        while metric_total(httpx.get(server.url + "/metrics", timeout=PROBE_TIMEOUT).text,
                           "prefixrag_collection_reloads_total") < 1:
            time.sleep(0.1)
        retriever = server.app.state.services.retriever
        assert retriever.index.page_index() is None, "the pages are still loading"
        question = "Asked twice: " + texts[members[0]][:300]  # re-warm prompts hold the text, not this
        during = ask(server, question=question)
        while retriever.index.page_index() is None:
            time.sleep(0.1)
        later = ask(server, question=question)
    assert during.status_code == later.status_code == 200
    prompts = [messages[-1]["content"] for messages in fake.prompts if "Asked twice: " in messages[-1]["content"]]
    assert len(prompts) == 2
    assert f'id="{members[-1]}"' not in prompts[0], "answered meanwhile with the document alone"
    assert all(f'id="{m}"' in prompts[1] for m in members), "then with its whole page"


def test_pre_warm_warms_every_window_of_a_big_document_the_used_one_first_after_a_restart(tmp_path, embedder):
    """A document too big for one unit is cut into windows. Pre-warm warms all of them, first windows first (a
    question about any part finds it cached; before, only each document's first window was warmed), and hotness
    counts the window a question used: after a restart that window is warmed first."""
    docs, chroma = tmp_path / "docs", tmp_path / "chroma"
    docs.mkdir()
    texts = paragraphs()
    (docs / "manual.md").write_text("# Manual\n\n" + "\n\n".join(texts) + "\n")  # ~3K tokens: 3-4 windows
    settings = app_settings(chroma, "http://unused/v1", collection="manual", strategy="document", top_k=1,
                            hotness_dir=tmp_path / "hotness")
    run_ingest([docs], settings, embedder)
    runs = []
    for _ in range(2):
        fake = FakeVLLM(max_model_len=2048)
        with AppServer(create_app(settings, embedder=embedder, llm=fake)) as server:
            warmup = server.wait_warmed(done=True)["warmup"]
            answer = ask(server, question=texts[-3][:200]).json()
        runs.append((warmup, [windows_in(messages[-1]["content"]) for messages in fake.prompts], answer))
    (first_run, sent, answer), (second_run, resent, _) = runs
    used = answer["sources"][0]["id"]
    assert used.startswith("manual.md@") and not used.startswith("manual.md@0:"), used
    every = sorted({w for found in sent for w in found}, key=window_of)  # by position in the document
    assert len(every) >= 3 and every[0].startswith("manual.md@0:") and used in every
    assert first_run["units_warmed"] == first_run["units_planned"] == len(every)
    assert answer["usage"]["cached_tokens"] >= floor_block(answer["usage"]["prompt_tokens"] - 80, BLOCK)
    order = [next(n for n, found in enumerate(resent) if unit in found) for unit in (used, every[0])]
    assert order[0] < order[1], "after a restart the used window goes before the document's first window"
    assert second_run["units_warmed"] == second_run["units_planned"] == len(every)


def windows_in(prompt: str) -> set[str]:
    """The window units a prompt holds (their ``<document id="...">`` headers)."""
    return set(re.findall(r'<document id="(manual\.md@\d+:\d+)"', prompt))


def test_the_same_set_twice_reuses_the_prompt_up_to_the_question(notes, embedder):
    server, _ = serve(notes, embedder, top_k=3)  # canonical
    with server:
        ready = server.wait_ready()
        first, second = (ask(server, question=q).json() for q in
                         ("How are chunks ordered in the prompt?", "How are chunks ordered in the prompt, again?"))
    assert ready["traffic"] == {"present": 0, "max_in_flight": 8, "max_queued": 0, "refused": 0, "warmup_yields": 0,
                                "auto": True}
    assert {s["id"] for s in first["sources"]} == {s["id"] for s in second["sources"]}
    assert all(s["chunk_id"].startswith(s["id"] + "::") for s in first["sources"])
    assert second["usage"]["cached_tokens"] >= floor_block(second["usage"]["prompt_tokens"] - 40, BLOCK)


def test_bad_input_is_an_openai_shaped_400_and_a_huge_answer_budget_is_trimmed(notes, embedder):
    server, fake = serve(notes, embedder, top_k=12)
    with server:
        server.wait_ready()
        empty, zero = ask(server, question=" "), ask(server, question="What?", top_k=0)
        tight = ask(server, question="How does prefix caching work?", max_tokens=fake.max_model_len - 500)
    for response in (empty, zero):
        assert response.status_code == 400 and set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert tight.status_code == 200, tight.text
    body = tight.json()
    assert 0 < len(body["sources"]) < 12 and body["usage"]["prompt_tokens"] + fake.max_model_len - 500 <= 4096


def test_each_chat_turn_extends_the_previous_prompt(notes, embedder):
    server, _ = serve(notes, embedder, top_k=2)
    with server:
        server.wait_ready()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        messages, previous = [], None
        for question in ("What does ingest do?", "And the service?", "How is it tested?"):
            messages.append({"role": "user", "content": question})
            reply = client.chat.completions.create(model="prefixrag", messages=messages, max_tokens=4)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
            if previous is not None:
                assert reply.usage.prompt_tokens_details.cached_tokens >= floor_block(previous, BLOCK) - BLOCK
            previous = reply.usage.prompt_tokens
        assert reply.model_extra["sources"]


def test_an_empty_hotness_dir_turns_persistence_off(monkeypatch):
    monkeypatch.setenv("RAG_CONTEXT__HOTNESS_DIR", "")  # was Path(""): hotness files written into the cwd
    assert Settings(_env_file=None).context.hotness_dir is None


def test_the_vllm_url_may_be_given_with_or_without_v1(monkeypatch):
    for given in ("http://vllm:8000", "http://vllm:8000/", "http://vllm:8000/v1", "http://vllm:8000/v1/"):
        monkeypatch.setenv("RAG_VLLM_URL", given)
        assert Settings(_env_file=None).vllm.url == "http://vllm:8000/v1"
    monkeypatch.setenv("RAG_VLLM_URL", "vllm:8000")
    with pytest.raises(ValidationError, match="http://"):
        Settings(_env_file=None)


def test_cors_origins_are_a_comma_list_or_json_and_a_bad_one_fails_at_start(monkeypatch):
    for given in ("https://chat.example, http://localhost:3000/", '["https://chat.example", "http://localhost:3000"]'):
        monkeypatch.setenv("RAG_SERVICE__CORS_ORIGINS", given)
        assert Settings(_env_file=None).service.cors_origins == ["https://chat.example", "http://localhost:3000"]
    for bad in ("chat.example", "https://chat.example/app", '["https://chat.example"'):
        monkeypatch.setenv("RAG_SERVICE__CORS_ORIGINS", bad)
        with pytest.raises(ValidationError):  # it would never match what a browser sends: say so at start-up
            Settings(_env_file=None)


def test_a_source_filter_shows_no_document_from_another_source(tmp_path, embedder):
    """Pages (and the corpus) group documents across sources; a request filtered to one source must not see the
    others: its hit's own document is the unit then."""
    import json

    docs, texts = tmp_path / "docs", write_notes(tmp_path / "docs")
    (docs / "copies.jsonl").write_text("".join(json.dumps({"id": f"copy-{i:03d}", "text": texts[f"para-{i:03d}"]})
                                               + "\n" for i in range(3)))  # same text: same page as the original
    settings = app_settings(tmp_path / "chroma", "http://unused/v1", collection="two-sources", hotness_dir=None,
                            strategy="document", top_k=1)
    settings.pages.tokens = 512
    run_ingest([docs], settings, embedder)
    fake = FakeVLLM()
    with AppServer(create_app(settings, embedder=embedder, llm=fake)) as server:
        server.wait_ready()
        question = texts["para-000"][:300]
        everywhere = ask(server, question=question).json()
        unfiltered = fake.prompts[-1][1]["content"]
        scoped = ask(server, question=question, filters={"source_prefix": "notes"}).json()
        filtered = fake.prompts[-1][1]["content"]
    assert 'id="copy-000"' in unfiltered and 'id="para-000"' in unfiltered  # one page, two sources
    assert [s["document"] for s in everywhere["sources"]] == ["copy-000"]  # the tie goes to the lower id
    assert [s["document"] for s in scoped["sources"]] == ["para-000"]
    assert 'id="para-000"' in filtered and "copy-" not in filtered


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
        "type": "http", "scheme": "bearer", "description": "RAG_API_KEY, when the service is started with one."}
    for path, method in (("/ask", "post"), ("/v1/chat/completions", "post"), ("/v1/models", "get"),
                         ("/metrics", "get")):
        assert schema["paths"][path][method]["security"] == [{"HTTPBearer": []}], path
    assert "security" not in schema["paths"]["/healthz"]["get"]
    assert statuses == [401, 401, 401, 200] and posted == [401, 200]
    assert set(ready_open) == {"ready", "reason"} and "warmup" in ready_keyed


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
    assert set(done["timings_ms"]) == {"retrieve", "assemble", "ttft", "upstream_ttft", "total"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip() == fake.answer
    assert chunks[-1].usage.prompt_tokens > 0 and chunks[-2].choices[0].finish_reason


def test_start_up_objects_are_frozen_out_of_the_gc_and_its_pauses_are_published(notes, embedder):
    """A full collection over the ~0.5M objects torch, transformers and Chroma leave behind stopped the process for
    0.3-0.5 s under load; the app freezes them before its first request and publishes every pause."""
    import gc

    from app.vllm.client import metric_total

    server, _ = serve(notes, embedder)
    with server:
        server.wait_ready()
        frozen = gc.get_freeze_count()
        before = metric_total(httpx.get(server.url + "/metrics").text, "prefixrag_gc_pause_seconds_count")
        gc.collect(0)
        after = metric_total(httpx.get(server.url + "/metrics").text, "prefixrag_gc_pause_seconds_count")
    assert frozen > 100_000
    assert after >= before + 1


def test_start_up_objects_are_frozen_even_when_a_library_froze_some_first():
    """The GPU machine's Python starts with 375 objects frozen; the app, taking any frozen object for its own
    freeze, skipped it there: full collections rescanned ~0.5M start-up objects (~360 ms each)."""
    script = """
import gc, json
gc.freeze()  # as that interpreter starts (or a library at import)
before = gc.get_freeze_count()
keep = [[n] for n in range(200_000)]  # start-up objects that live as long as the process
from app.runtime.pauses import freeze_start_up
freeze_start_up()
print(json.dumps([before, gc.get_freeze_count()]))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, check=True)
    before, after = json.loads(done.stdout)
    assert after >= before + 200_000


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
