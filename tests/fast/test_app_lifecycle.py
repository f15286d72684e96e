"""The fast tier, the service over time against the fake vLLM: readiness waits for the search indexes, a reload
answers meanwhile without remembering what it arranged unpaged, pre-warm covers every window of a big document,
start-up objects leave the garbage collector's sight. These involve no vLLM and are tested here only."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import httpx

from app.core import pages
from app.rag.units import window_of
from app.serve.app import create_app
from ingest.pipeline import run_ingest
from tests.support.corpora import app_settings, floor_block, paragraphs, write_notes
from tests.support.env import ROOT
from tests.support.fake_app import ask, serve
from tests.support.fakes import BLOCK, FakeVLLM
from tests.support.servers import PROBE_TIMEOUT, AppServer


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
    from app.vllm.prometheus import metric_total
    from tests.support.env import run_cli

    docs, chroma = tmp_path / "docs", tmp_path / "chroma"
    texts = write_notes(docs)
    settings = app_settings(chroma, "http://unused/v1", collection="reload", strategy="document", top_k=1,
                            hotness_dir=None)
    settings.pages.tokens, settings.chroma.poll_s = 512, 0.2
    run_ingest([docs], settings, embedder)
    members = next(m for m in pages.load(pages.path_of(settings.chroma)).pages.values() if len(m) >= 3)
    loaded, fake = pages.current, FakeVLLM()

    def slow_to_load(collection, cfg, paging):  # the service's load takes a big corpus's time: longer than an
        time.sleep(6)  # ingest takes from its first stamp to its exit, so both reloads see it
        return loaded(collection, cfg, paging)

    with AppServer(create_app(settings, embedder=embedder, llm=fake)) as server:
        server.wait_ready()
        monkeypatch.setattr(pages, "current", slow_to_load)
        (docs / "extra.md").write_text("A lighthouse keeper's log, a new note.\n")
        assert run_cli(str(docs), "--chroma-path", str(chroma), "--collection", "reload",
                       env={"PREFIXRAG_PAGES__TOKENS": "512"}).returncode == 0
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


def windows_in(prompt: str) -> set[str]:
    """The window units a prompt holds (their ``<document id="...">`` headers)."""
    return set(re.findall(r'<document id="(manual\.md@\d+:\d+)"', prompt))


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


def test_start_up_objects_are_frozen_out_of_the_gc_and_its_pauses_are_published(notes, embedder):
    """A full collection over the ~0.5M objects torch, transformers and Chroma leave behind stopped the process for
    0.3-0.5 s under load; the app freezes them before its first request and publishes every pause."""
    import gc

    from app.vllm.prometheus import metric_total

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


def test_what_loading_the_served_tokenizer_leaves_is_frozen_too(tmp_path):
    """Where ranking workers hold the encoder, the serving process first imports transformers when vLLM is seen
    and its tokenizer loads, after start-up's freeze: ~230K objects every full collection then scanned again (a
    ~270 ms pause, three a minute on the H200's host under a retry storm; bench/results/gc-pause-workers*.json).
    The composition root freezes them once the load ends."""
    script = """
import asyncio, gc, json, sys
from pathlib import Path
from types import SimpleNamespace
from app.core.settings import Settings
from app.runtime.pauses import freeze_start_up
from app.runtime.services import build_services
from app.vllm.testmodel import write_test_model

async def main():
    settings = Settings(_env_file=None)
    settings.chroma.path, settings.context.hotness_dir = Path(sys.argv[1]) / "chroma", None
    settings.retrieval.workers = 2  # the encoder in workers (none started here), not in this process
    model = write_test_model(Path(sys.argv[1]) / "model")
    services = await build_services(settings)
    freeze_start_up()
    before, imported = gc.get_freeze_count(), "transformers" in sys.modules
    services.clients.prompt_ids.adopt(SimpleNamespace(root=str(model)))  # as vLLM is first seen
    await services.clients.prompt_ids.learn([], "")  # returns once the load has ended
    print(json.dumps([imported, services.clients.prompt_ids.active, before, gc.get_freeze_count()]))
    await services.aclose()

asyncio.run(main())
"""
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, cwd=ROOT,
                          check=True)
    imported, active, before, after = json.loads(done.stdout.strip().splitlines()[-1])
    assert not imported and active
    assert after >= before + 100_000


def test_after_an_ingest_pre_warm_sends_only_the_units_that_changed(tmp_path, embedder):
    """Pre-warm starts again after an ingest; a unit it warmed before, unchanged and with vLLM still up, is
    counted warm without being sent again: only the edited document's unit goes to vLLM."""
    from app.vllm.prometheus import metric_total
    from tests.support.env import run_cli

    docs, chroma = tmp_path / "docs", tmp_path / "chroma"
    notes = write_notes(docs)
    settings = app_settings(chroma, "http://unused/v1", collection="rewarm", strategy="document", hotness_dir=None)
    settings.pages.tokens, settings.chroma.poll_s = 0, 0.2  # every note is a unit of its own
    run_ingest([docs], settings, embedder)
    fake = FakeVLLM()
    with AppServer(create_app(settings, embedder=embedder, llm=fake)) as server:
        first = server.wait_warmed(done=True, timeout=60)["warmup"]
        sent_before = len(fake.prompts)
        edited = dict(notes, **{"para-001": notes["para-001"] + " Edited later."})
        (docs / "notes.jsonl").write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in edited.items()))
        assert run_cli(str(docs), "--chroma-path", str(chroma), "--collection", "rewarm",
                       env={"PREFIXRAG_PAGES__TOKENS": "0"}).returncode == 0
        while metric_total(httpx.get(server.url + "/metrics", timeout=PROBE_TIMEOUT).text,
                           "prefixrag_collection_reloads_total") < 1:
            time.sleep(0.1)
        again = server.wait_warmed(done=True, timeout=60)["warmup"]
    assert first["units_warmed"] == again["units_warmed"] == len(notes) > 3 and first["units_kept"] == 0
    assert again["units_kept"] == len(notes) - 1 and again["tokens"] >= first["tokens"]
    units_sent = [m for m in fake.prompts[sent_before:] if '<document id="' in m[-1]["content"]]
    assert units_sent and all("Edited later." in json.dumps(m) for m in units_sent), "only the edited one"


def test_a_unit_longer_than_the_window_is_skipped_and_pre_warm_goes_on(tmp_path, embedder):
    """A unit is sized from its characters; text with fewer characters per token than that assumes (code, markup)
    can make a page longer than vLLM's window. vLLM refuses that one; pre-warm skips it and warms the rest."""
    docs, chroma = tmp_path / "docs", tmp_path / "chroma"
    write_notes(docs)
    settings = app_settings(chroma, "http://unused/v1", collection="pages", strategy="document", hotness_dir=None)
    settings.pages.tokens = 512
    run_ingest([docs], settings, embedder)
    roomy = FakeVLLM(max_model_len=32_768)
    with AppServer(create_app(settings, embedder=embedder, llm=roomy)) as server:
        server.wait_warmed(done=True, timeout=60)
        prefix, *units = server.app.state.services.warmer.warmed_prompts  # the system prompt goes first
        sizes = sorted(len(roomy.tokens(messages)) for messages, _ in units)
    window = sizes[len(sizes) // 2] + settings.limits.max_tokens  # the bigger pages no longer fit
    with AppServer(create_app(settings, embedder=embedder, llm=FakeVLLM(max_model_len=window))) as server:
        warmup = server.wait_warmed(timeout=60, done=True)["warmup"]
    assert warmup["state"] == "done" and warmup["units_too_long"] >= 1 and warmup["units_warmed"] >= 1
    assert warmup["units_warmed"] + warmup["units_too_long"] == warmup["units_planned"]


def test_no_answer_comes_from_a_collection_its_first_ingest_is_still_writing(tmp_path, embedder):
    """The first ingest creates the collection, then writes it: until that run ends the service is not ready
    (before, it became ready on the half-written collection and answered from it, with a context of what had
    been written so far: nothing, in the compose smoke test). Ready, and answering from all of it, once it ends."""
    from app.core.store import open_collection

    docs, chroma = tmp_path / "docs", tmp_path / "chroma"
    write_notes(docs)
    settings = app_settings(chroma, "http://unused/v1", collection="first", hotness_dir=None)
    settings.chroma.poll_s = 0.2
    open_collection(settings.chroma, embedder, create=True)  # what ingest does before its first write
    with AppServer(create_app(settings, embedder=embedder, llm=FakeVLLM())) as server:
        time.sleep(1)  # several looks at the collection
        during = httpx.get(server.url + "/readyz", timeout=PROBE_TIMEOUT)
        run_ingest([docs], settings, embedder)
        server.wait_ready(30)
        answer = ask(server, question="What is in the notes?")
    assert during.status_code == 503 and "being ingested for the first time" in during.json()["reason"]
    assert answer.status_code == 200 and answer.json()["sources"]
