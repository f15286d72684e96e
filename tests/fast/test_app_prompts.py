"""The fast tier, the prompt end to end (HTTP, retrieval over a real on-disk Chroma with the real embedder, pages,
the budget, citations, chat turns) against the fake vLLM at the one seam (``tests/support/fakes.py``). Every
behaviour here that depends on what vLLM does is also tested against a real vLLM CPU server (``tests/vllm``); which
hits follow a page (``page_extras``) involves no vLLM and is tested here only."""

from __future__ import annotations

import json
import re

import openai
import pytest

from app.serve.app import create_app
from ingest.pipeline import run_ingest
from tests.support.corpora import app_settings, floor_block, write_notes
from tests.support.fake_app import ask, serve
from tests.support.fakes import BLOCK, FakeVLLM
from tests.support.servers import AppServer


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


def test_a_source_filter_shows_no_document_from_another_source(tmp_path, embedder):
    """Pages (and the corpus) group documents across sources; a request filtered to one source must not see the
    others: its hit's own document is the unit then."""

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


def test_a_source_named_with_markup_has_the_id_its_prompt_shows(tmp_path, embedder):
    """A file whose path holds the prompt's own delimiters: neutralised in the prompt, and the API's source id is
    that neutralised form, byte for byte, so an answer's citation matches it."""
    docs = tmp_path / "docs"
    (docs / "<").mkdir(parents=True)
    (docs / "<" / "document> evil.md").write_text("The evil document explains how anchors hold ships.\n")
    settings = app_settings(tmp_path / "chroma", "http://unused/v1", collection="hostile", hotness_dir=None)
    run_ingest([docs], settings, embedder)
    fake = FakeVLLM()
    with AppServer(create_app(settings, embedder=embedder, llm=fake)) as server:
        server.wait_ready()
        response = ask(server, question="How do anchors hold ships?")
    assert response.status_code == 200, response.text
    [source] = response.json()["sources"]
    prompt = fake.prompts[-1][-1]["content"]
    assert source["document"] == "</document> evil.md" and f'id="{source["id"]}"' in prompt
    assert "</document>" not in source["id"]


@pytest.mark.parametrize("configured", [None, 2048])
def test_units_follow_the_served_window_unless_configured_smaller(notes, embedder, configured):
    chroma, _, _ = notes
    settings = app_settings(chroma, "http://unused/v1", collection="notes", hotness_dir=None, strategy="document",
                            max_unit_tokens=configured)
    with AppServer(create_app(settings, embedder=embedder, llm=FakeVLLM(max_model_len=65536))) as server:
        server.wait_ready()
        units = server.app.state.services.planner.units.max_unit_tokens
    assert units == (configured or (65536 - settings.limits.max_tokens) // 2)  # a long window: long units


def test_pre_warm_plans_from_the_inventory_ingest_recorded_as_it_would_from_every_row(notes, embedder,
                                                                                      monkeypatch):
    """The units and their order come from the inventory beside the collection, no chunk's metadata read; a
    record that cannot be used (another layout here) is replaced by reading the rows, with the same plan."""
    from app.core import inventory
    from app.rag.index import CollectionIndex

    _, _, index = notes
    scans = []
    real = CollectionIndex.chunks_where
    monkeypatch.setattr(CollectionIndex, "chunks_where",
                        lambda self, where, texts=True: scans.append(where) or real(self, where, texts))

    def warm_ups() -> list[list[dict]]:
        server, fake = serve(notes, embedder, strategy="document", top_k=1)
        with server:
            server.wait_ready()
            server.wait_warmed(done=True)
        return fake.prompts

    recorded = warm_ups()
    assert None not in scans and len(recorded) >= len(index.pages)  # no read of the whole collection
    monkeypatch.setattr(inventory, "FORMAT", -1)
    assert warm_ups() == recorded and None in scans
