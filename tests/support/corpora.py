"""Corpora and settings shared by the service tests (the ``collections`` fixture in conftest builds them)."""

from __future__ import annotations

import json
import random

from app.core.records import split_row
from app.core.store import open_collection
from ingest.pipeline import run_ingest
from tests.support.env import ROOT

# Four one-chunk documents: with top_k=4 every question retrieves the same SET, in its own relevance order.
FACTS = {
    "anchors.md": "Anchors hold a ship in place by digging into the seabed with their flukes.",
    "compass.md": "A magnetic compass needle points toward magnetic north, not the geographic pole.",
    "sails.md": "Square sails push a ship downwind while fore-and-aft sails can sail close to the wind.",
    "tides.md": "Tides rise and fall twice a day because of the gravitational pull of the moon.",
}


def app_settings(chroma_path, vllm_url, collection="facts", **fields):
    """These tests are about the prompt mechanics, so they pin the canonical strategy and short answers unless
    told otherwise; ``fields`` are settings by their bare names (``top_k``, ``strategy``, ``hotness_dir``)."""
    from app.core.settings import Settings, overridden, setting_named

    settings = Settings(_env_file=None)
    settings.chroma.path, settings.chroma.collection = chroma_path, collection
    settings.vllm.url, settings.vllm.retry_interval_s = vllm_url, 0.2
    values = {"strategy": "canonical", "max_tokens": 8} | fields
    # hotness_dir=None means "not persisted", which the settings spell as an empty value.
    return overridden(settings, {setting_named(k): "" if v is None and k == "hotness_dir" else v
                                 for k, v in values.items()})


def floor_block(tokens: int, block: int) -> int:
    return tokens // block * block


def write_service_collections(base, embedder):
    """facts (four one-chunk documents), project-docs (examples/docs/) and long (24 documents of 250 words, not paged),
    ingested."""
    from app.core.settings import PageSettings, Settings

    facts = base / "facts"
    facts.mkdir()
    for name, text in FACTS.items():
        (facts / name).write_text(text + "\n")
    settings = Settings(_env_file=None)
    settings.chroma.path = base / "chroma"
    long = base / "long"  # more text than the test server's 4096-token window
    long.mkdir()
    words = " ".join(FACTS.values()).split()  # a fixed vocabulary: the sizes never depend on other files
    rng = random.Random(7)
    for number in range(24):
        (long / f"log-{number:02d}.md").write_text(" ".join(rng.choice(words) for _ in range(250)) + "\n")
    for name, root in (("facts", facts), ("project-docs", ROOT / "examples" / "docs"), ("long", long)):
        settings.chroma.collection = name
        settings.pages = PageSettings(tokens=0) if name == "long" else PageSettings()  # long: 24 units, no pages
        run_ingest([root], settings, embedder)
    return base / "chroma"


def collection_of(settings, embedder):
    return open_collection(settings.chroma, embedder, create=False)


def snapshot(settings, embedder) -> dict[str, tuple[str, dict]]:
    """Every stored row: its text and its metadata less the text."""
    data = collection_of(settings, embedder).get(include=["documents", "metadatas"])
    return {i: split_row(m, d) for i, d, m in zip(data["ids"], data["documents"], data["metadatas"])}


# Two SQuAD-shaped articles of three passages, with a question per passage and four rephrased (bench tests).
ARTICLES = {
    "Harbour": ["The harbour was dredged in 1850 to admit larger ships.",
                "A lighthouse at the harbour mouth was lit in 1862.",
                "Fishing fleets moved to the new quay in 1901."],
    "Glacier": ["The glacier retreated two kilometres over the last century.",
                "Meltwater from the glacier feeds the river through the valley.",
                "Moraines mark where the glacier's snout once stood."],
}


def tiny_squad(root):
    passages, questions = [], []
    for title, texts in ARTICLES.items():
        for index, text in enumerate(texts):
            pid = f"{title}#{index}"
            passages.append({"passage_id": pid, "title": title, "text": text})
            questions.append({"id": f"q-{pid}", "question": f"What happened: {text[:30]}?", "passage_id": pid})
    questions += [dict(q, id=q["id"] + "-again", question=q["question"].replace("What happened", "Tell me"))
                  for q in questions[:4]]
    root.mkdir()
    (root / "passages.jsonl").write_text("\n".join(map(json.dumps, passages)) + "\n")
    (root / "questions.jsonl").write_text("\n".join(map(json.dumps, questions)) + "\n")
    return root


def lexical_ids(settings) -> set[str]:
    """The chunk ids in the BM25 index ingest saved beside the collection (empty where there is none)."""
    from app.core import lexical

    index = lexical.load(lexical.index_dir(settings.chroma))
    return set(index.ids) if index else set()


def paragraphs() -> list[str]:
    """Real prose of every size up to ~1K characters that does not change with the README: the paragraphs of the
    project's sample docs and of its LICENSE (Apache-2.0)."""
    files = [*sorted((ROOT / "examples" / "docs").glob("*.md")), ROOT / "LICENSE"]
    return [p for f in files for p in f.read_text(encoding="utf-8").split("\n\n") if 120 < len(p) < 1000]


def write_notes(folder, skip=()) -> dict[str, str]:
    """One jsonl record (its own parent document) per paragraph, but those in ``skip``; returns id -> text."""
    notes = {f"para-{i:03d}": text for i, text in enumerate(paragraphs()) if i not in skip}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "notes.jsonl").write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in notes.items()))
    return notes


# Two "articles" of several paragraphs each (the ``articles_db`` fixture ingests them).
ARTICLES = {
    "Harbour": [f"Harbour fact {i}: the quay was extended in {1850 + i} to hold {10 + i} fishing boats."
                for i in range(8)],
    "Glacier": [f"Glacier fact {i}: the ice retreated {20 + i} metres in {1990 + i} near the valley."
                for i in range(8)],
}
