"""Fixtures of the fast tier."""

from __future__ import annotations

import pytest

from app.core import pages
from ingest.pipeline import run_ingest
from tests.support.corpora import app_settings, write_notes


@pytest.fixture(scope="module")
def notes(tmp_path_factory, embedder):
    """Paragraphs as small jsonl documents, grouped into pages of ~512 tokens."""
    base = tmp_path_factory.mktemp("fast")
    texts = write_notes(base / "docs")
    settings = app_settings(base / "chroma", "http://unused/v1", collection="notes")
    settings.pages.tokens = 512
    run_ingest([base / "docs"], settings, embedder)
    return base / "chroma", texts, pages.load(pages.path_of(settings.chroma))
