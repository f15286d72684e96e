"""A corpus of any size for ``bench.scale``: a QA dataset's own passages (its gold, so recall is still measured)
mixed into a large body of distractor documents made from real text of the other datasets.

Distractors are sentences of the other folders (SciFact abstracts, TAT-QA paragraphs, the FastAPI and Python docs)
drawn at random into documents of one or two chunks each, so the chunk count follows the number of documents.
They are real prose and code-doc text, but mostly off the gold dataset's topics: recall on the mixed corpus
measures how the rankers hold up under volume, not against near-duplicates of the gold passages.
"""

from __future__ import annotations

import gzip
import json
import random
import re
import shutil
from pathlib import Path

SHARD = 20_000  # distractor documents per .jsonl file: an unchanged shard is skipped whole by a re-ingest
WORDS_PER_DOC = 110  # one or two chunks at the default chunk size (200 encoder tokens): 1.6 on average here
SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9`\"'(])")
TEXT_SUFFIXES = {".md", ".txt", ".rst"}


def sentences_of(text: str) -> list[str]:
    """The sentences of ``text`` worth reusing: 5 to 60 words, whitespace collapsed."""
    found = []
    for sentence in SENTENCE.split(" ".join(text.split())):
        if 5 <= len(sentence.split()) <= 60:
            found.append(sentence)
    return found


def _texts_of(root: Path) -> list[str]:
    """The prose a data folder holds: its records' text (jsonl), else its documents through ingest's loaders."""
    texts: list[str] = []
    for name in ("corpus.jsonl", "passages.jsonl"):
        if (root / name).exists():
            for line in (root / name).read_text(encoding="utf-8").splitlines():
                if line.strip():
                    texts.append(str(json.loads(line).get("text", "")))
            return texts
    from ingest.files import discover
    from ingest.loaders import load_file

    files, _, _ = discover([root])
    for path, rel in files:
        if path.suffix in TEXT_SUFFIXES or path.suffix in (".html", ".htm"):
            try:
                texts += [document.text for document in load_file(path, rel)]
            except Exception:  # a file the loaders refuse is simply not part of the pool
                continue
    return texts


def sentence_pool(roots: list[Path], cache: Path | None = None) -> list[str]:
    """Every reusable sentence of these folders, deduplicated, in a stable order; read from ``cache`` (a .json.gz)
    when it exists, else built and written there."""
    if cache is not None and cache.exists():
        return list(json.loads(gzip.decompress(cache.read_bytes())))
    pool = list(dict.fromkeys(s for root in roots for text in _texts_of(root) for s in sentences_of(text)))
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_bytes(gzip.compress(json.dumps(pool).encode()))
    return pool


def distractor(rng: random.Random, pool: list[str], number: int) -> dict[str, str]:
    words: list[str] = []
    while len(words) < WORDS_PER_DOC:
        words += rng.choice(pool).split()
    return {"id": f"noise-{number:07d}", "title": f"Note {number}", "text": " ".join(words)}


def build_corpus(gold: Path, pool: list[str], documents: int, folder: Path, seed: int = 0) -> dict[str, int]:
    """``folder`` holds ``gold``'s passages (copied as they are) and ``documents`` distractors in shards; built
    afresh only where what is there differs (a rerun of the same size and seed re-ingests nothing). Returns
    counts."""
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"gold{gold.suffix}"
    if not target.exists() or target.read_bytes() != gold.read_bytes():
        shutil.copyfile(gold, target)
    stamp = folder / "distractors.json"
    wanted = {"documents": documents, "seed": seed, "pool": len(pool), "words": WORDS_PER_DOC}
    if not (stamp.exists() and json.loads(stamp.read_text()) == wanted):
        for old in folder.glob("distractors-*.jsonl"):
            old.unlink()
        rng = random.Random(seed)
        for shard, start in enumerate(range(0, documents, SHARD)):
            rows = (distractor(rng, pool, n) for n in range(start, min(documents, start + SHARD)))
            (folder / f"distractors-{shard:04d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        stamp.write_text(json.dumps(wanted))
    gold_count = sum(1 for line in gold.read_text(encoding="utf-8").splitlines() if line.strip())
    return {"gold_documents": gold_count, "distractor_documents": documents}
