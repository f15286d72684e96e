"""The chat page in a real browser: Debian's chromium, driven headless by Playwright (no browser download)."""

from __future__ import annotations

import pytest

from app.serve.app import create_app
from tests.support.corpora import app_settings
from tests.support.servers import AppServer, browser_page
from tests.support.vllm_state import IGNORE_EOS, LONG, running, wait_until

pytestmark = pytest.mark.vllm


@pytest.fixture
def page():
    with browser_page() as opened:
        yield opened


def test_ask_on_the_page_streams_an_answer_with_sources(page, collections, vllm_url, embedder, tmp_path):
    settings = app_settings(collections, vllm_url, collection="project-docs", top_k=3, max_tokens=24)
    with AppServer(create_app(settings, embedder=embedder)) as server:
        server.wait_ready()
        page.goto(server.url + "/")
        page.fill("#question", "How does prefixrag order retrieved chunks?")
        page.click("#send")
        answer = page.locator(".turn.assistant").last
        answer.locator(".sources li").first.wait_for(timeout=60_000)
        assert answer.locator(".text").inner_text().strip()
        assert answer.locator(".sources li").count() == 3
        assert "cached tokens:" in answer.locator(".meta").inner_text()
        first_source = answer.locator(".sources li").first
        assert not first_source.locator(".snippet").is_visible()
        first_source.locator("summary").click()  # a source opens to show its text
        assert len(first_source.locator(".snippet").inner_text()) > 40
        # The test model's text is noise (no citations in it): a citation is linked the way the page does it.
        linked = page.evaluate("""() => {
            const text = document.createElement("div"), source = document.createElement("details");
            text.textContent = "See [docs/a.md::1] and [elsewhere].";
            document.body.append(text, source);
            linkCitations(text, new Map([["docs/a.md::1", source]]));
            text.querySelector("a.cite").click();
            return [text.querySelectorAll("a.cite").length, source.open, text.textContent];
        }""")
        assert linked == [1, True, "See [docs/a.md::1] and [elsewhere]."]
        # An answer is markdown, rendered and sanitised: what a document smuggles into it never runs.
        rendered = page.evaluate("""() => {
            const text = document.createElement("div"), source = document.createElement("details");
            document.body.append(text, source);
            renderAnswer(text, "**Anchors** hold [docs/a.md::1].\\n\\n- one\\n- two <img src=x onerror=window.pwned=1>"
                               + "<script>window.pwned=2</script>");
            linkCitations(text, new Map([["docs/a.md::1", source]]));
            return [text.querySelector("strong").textContent, text.querySelectorAll("li").length,
                    text.querySelector("strong + a.cite, a.cite") !== null,
                    text.querySelector("[onerror], script") === null];
        }""")
        page.wait_for_timeout(200)
        assert rendered == ["Anchors", 2, True, True] and page.evaluate("() => window.pwned") is None
        page.fill("#question", "And where does the question go?")
        page.click("#send")
        page.locator(".turn.assistant").nth(1).locator(".meta").wait_for(timeout=60_000)
        assert page.locator(".turn.user").count() == 2
        page.screenshot(path=str(tmp_path / "chat.png"), full_page=True)
        server_stopped_page = page
    # With the server gone the page shows the failure in the conversation instead of hanging.
    server_stopped_page.fill("#question", "Still there?")
    server_stopped_page.click("#send")
    page.locator(".turn.error").wait_for(timeout=30_000)
    assert "Error" in page.locator(".turn.error .text").inner_text()


def test_one_question_at_a_time_a_stop_that_aborts_and_a_conversation_that_survives_a_reload(page, collections,
                                                                                             vllm_url, embedder):
    settings = app_settings(collections, vllm_url, collection="project-docs", top_k=3, max_tokens=LONG)
    settings.sampling.extra_sampling = IGNORE_EOS
    with AppServer(create_app(settings, embedder=embedder)) as server:
        server.wait_ready()
        server.wait_warmed(timeout=120, done=True)
        page.goto(server.url + "/")
        assert page.get_by_label("Your question").is_visible()  # the textarea is labelled for a screen reader
        page.fill("#question", "How does prefixrag order retrieved chunks?")
        page.press("#question", "Enter")
        answer = page.locator(".turn.assistant").last
        page.wait_for_function("() => document.querySelector('.turn.assistant .text').textContent.length > 20",
                               timeout=60_000)
        page.fill("#question", "A second question while the first streams")
        page.press("#question", "Enter")  # ignored: one answer at a time
        assert page.locator(".turn.user").count() == 1 and page.locator("#send").is_disabled()
        wait_until(lambda: running(vllm_url) == 1, 30, "the answer decoding in vLLM")
        page.click("#stop")
        answer.and_(page.locator(".stopped")).wait_for(timeout=10_000)
        wait_until(lambda: running(vllm_url) == 0, 20, "vLLM aborting the stopped answer")
        assert page.locator("#send").is_enabled() and not page.locator("#stop").is_visible()
        partial = answer.locator(".text").inner_text()
        page.reload()
        page.locator(".turn.assistant").first.wait_for()
        assert page.locator(".turn.user").count() == 1  # kept in the browser, the partial answer with it
        assert page.locator(".turn.assistant .text").inner_text() == partial
        page.click("#new-chat")
        page.reload()
        page.wait_for_load_state()
        assert page.locator(".turn").count() == 0


def test_two_collections_are_two_models_in_the_picker_and_in_the_openai_client(page, collections, vllm_url,
                                                                                embedder):
    """Open WebUI's way to two knowledge bases: two models. The page's picker and the official client name
    ``prefixrag/facts``, and the answer's sources come from that collection alone."""
    from openai import OpenAI

    from tests.support.corpora import FACTS

    settings = app_settings(collections, vllm_url, collection="project-docs", top_k=2, max_tokens=8)
    settings.chroma.collections = ["facts"]
    with AppServer(create_app(settings, embedder=embedder)) as server:
        server.wait_ready()
        client = OpenAI(base_url=server.url + "/v1", api_key="none")
        models = [model.id for model in client.models.list().data]
        reply = client.chat.completions.create(model="prefixrag/facts", max_tokens=4, messages=[
            {"role": "user", "content": "Why do tides rise and fall?"}])
        page.goto(server.url + "/")
        page.locator("#collection").wait_for(state="visible", timeout=30_000)
        options = page.locator("#model option").all_inner_texts()
        page.select_option("#model", "prefixrag/facts")
        page.fill("#question", "Which way does a compass needle point?")
        page.click("#send")
        answer = page.locator(".turn.assistant").last
        answer.locator(".sources li").first.wait_for(timeout=60_000)
        shown = answer.locator(".sources li summary").all_inner_texts()
    assert models == options == ["prefixrag", "prefixrag/facts"]
    assert reply.model == "prefixrag/facts"
    assert {source["document"] for source in reply.model_extra["sources"]} <= set(FACTS)
    assert shown and all(any(name in text for name in FACTS) for text in shown), shown
