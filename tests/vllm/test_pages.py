"""Pages (``app.core.pages``): small documents grouped by meaning into stable units, and the document strategy
putting a question's page first. Real parts: the packaged embedder, on-disk Chroma, the CPU test model."""

from __future__ import annotations

import httpx
import pytest

from app.core import pages
from app.serve.app import create_app
from ingest.pipeline import run_ingest
from tests.support.corpora import app_settings, floor_block, write_notes
from tests.support.servers import AppServer, reset_prefix_cache

PAGE_TOKENS = 512  # ~2K characters: the 35 paragraphs of write_notes make half a dozen pages or so


def paged(settings):
    settings.pages.tokens = PAGE_TOKENS
    return settings


@pytest.mark.vllm
def test_two_questions_about_two_documents_of_one_page_share_its_cached_prefix(tmp_path, vllm_url, embedder):
    settings = paged(app_settings(tmp_path / "chroma", vllm_url, collection="notes", strategy="document", top_k=1,
                                  hotness_dir=None))
    notes = write_notes(tmp_path / "docs")
    run_ingest([tmp_path / "docs"], settings, embedder)
    index = pages.load(pages.path_of(settings.chroma))
    key, members = next((k, m) for k, m in index.pages.items() if len(m) >= 3)
    reset_prefix_cache(vllm_url)
    with AppServer(create_app(settings, embedder=embedder)) as server:
        server.wait_ready()
        server.wait_warmed(done=True, timeout=120)
        answers = [httpx.post(server.url + "/ask", json={"question": notes[member][:300], "max_tokens": 4},
                              timeout=60).json() for member in (members[0], members[-1])]
    for member, answer in zip((members[0], members[-1]), answers):
        assert answer["strategy"] == "document"
        assert [s["document"] for s in answer["sources"]] == [member]  # its own document found it
        assert answer["sources"][0]["id"] == member  # cited by the id the page shows it under
        # The page (pre-warmed, the whole prompt but the question) is read from the cache.
        usage = answer["usage"]
        assert usage["cached_tokens"] >= floor_block(usage["prompt_tokens"] - 120, 128) >= 256
    assert answers[0]["usage"]["prompt_tokens"] - answers[1]["usage"]["prompt_tokens"] < 100  # one page, two tails
