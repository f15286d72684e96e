"""QA datasets for the benchmarks, from any folder in one of the layouts of ``../shared/data``:

- SQuAD / TAT-QA: ``passages.jsonl`` + ``questions.jsonl``; a question's gold passages are ``passage_id`` or
  ``gold_passage_ids``; unanswerable ones (``is_impossible``) are replayed but not counted in recall.
- BEIR (SciFact): ``corpus.jsonl`` + ``queries.jsonl`` + ``qrels/test.tsv`` (gold = corpus ids).
"""

from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Question:
    id: str
    text: str
    gold: frozenset[str] = field(default_factory=frozenset)  # document ids that answer it (empty: none)


@dataclass
class Dataset:
    name: str
    passages: Path
    questions: list[Question]

    @property
    def collection(self) -> str:
        """The Chroma collection the benchmarks ingest it into (Chroma caps names at 63 characters)."""
        return f"bench-{self.name}"[:60]


def load_dataset(root: Path) -> Dataset:
    root = Path(root)
    if (root / "passages.jsonl").exists() and (root / "questions.jsonl").exists():
        return Dataset(root.name, root / "passages.jsonl", list(_qa_questions(root / "questions.jsonl")))
    if (root / "corpus.jsonl").exists() and (root / "queries.jsonl").exists():
        return Dataset(root.name, root / "corpus.jsonl", _beir_questions(root))
    raise SystemExit(f"error: {root} has neither passages.jsonl+questions.jsonl nor corpus.jsonl+queries.jsonl")


def _qa_questions(path: Path):
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        gold = row.get("gold_passage_ids") or ([row["passage_id"]] if row.get("passage_id") else [])
        if row.get("is_impossible"):
            gold = []
        yield Question(str(row["id"]), row["question"], frozenset(map(str, gold)))


def _beir_questions(root: Path) -> list[Question]:
    gold: dict[str, set[str]] = {}
    qrels = root / "qrels" / "test.tsv"
    with qrels.open(encoding="utf-8") as handle:
        for row in csv.DictReader(handle, delimiter="\t"):
            if float(row.get("score", 1)) > 0:
                gold.setdefault(row["query-id"], set()).add(row["corpus-id"])
    questions = []
    for line in (root / "queries.jsonl").read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        if row["_id"] in gold:  # only queries with judged documents can measure recall
            questions.append(Question(str(row["_id"]), row["text"], frozenset(gold[row["_id"]])))
    return questions


def sample(questions: list[Question], count: int, seed: int) -> list[Question]:
    """A shuffled stream (many users interleaved): seeded, so every mode and rerun sees the same order."""
    shuffled = list(questions)
    random.Random(seed).shuffle(shuffled)
    return shuffled[:count]


def zipf_sample(questions: list[Question], count: int, seed: int, s: float) -> list[Question]:
    """A skewed stream: a few documents asked about far more than the rest, as real traffic is. Documents (a gold
    id's part before ``#``: SQuAD's article, else the gold document itself) are put in a seeded order and the one
    ranked r is drawn with weight 1/r**s; then one of its questions, uniformly. Drawn with replacement."""
    groups: dict[str, list[Question]] = {}
    for question in questions:
        if question.gold:
            groups.setdefault(min(question.gold).split("#")[0], []).append(question)
    order = sorted(groups)
    rng = random.Random(seed)
    rng.shuffle(order)
    weights = [1 / rank ** s for rank in range(1, len(order) + 1)]
    return [rng.choice(groups[group]) for group in rng.choices(order, weights, k=count)]
