"""Fixtures of the fast tier."""

from __future__ import annotations

import pytest

from app.core import pages
from app.vllm.smollm2 import packaged_gguf
from app.vllm.testmodel import write_test_model
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


@pytest.fixture(scope="module", params=["test-model", "smollm2"])
def tokenizer(request, tmp_path_factory):
    """A chat model's tokenizer with its chat template: the test model's (BERT WordPiece, which normalises
    zero-width characters away) and SmolLM2's (byte-level BPE, special tokens)."""
    from transformers import AutoTokenizer

    if request.param == "test-model":
        return AutoTokenizer.from_pretrained(write_test_model(tmp_path_factory.mktemp("model") / "tiny"))
    gguf = packaged_gguf()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
