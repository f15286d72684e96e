"""``python -m bench.lexical_search --data DIR``: what one BM25 search costs as the corpus grows
(``app.core.lexical``), the service's lexical half of every hybrid ranking.

The corpus is the dataset's passages among distractor documents made as ``bench.scale`` makes them (sentences of
the other data folders, ``bench.scale_corpus``), one chunk each, in 100 sources. Each size is tokenized and
indexed as ingest does (``LexicalRows``), saved and loaded memory-mapped as the service loads it. The dataset's
questions are then searched one at a time for k results, with and without a source filter (half of the sources):

- **bm25s**: bm25s's own ``retrieve`` with its numpy selection and a mask made by testing each chunk's source, as
  the service searched before;
- **service**: ``LexicalIndex.search`` as it is.

Reported per size: p50/p95 ms of each, and how many questions got the same (id, score) lists from both (where
they differ, whether only the order of equal scores or which of them was cut at k). Run it alone on the machine.

    python -m bench.lexical_search --data ../shared/data/squad-v1.1 --documents 10000,100000,1000000
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import command_line, environment, write_json
from bench.stats import percentile

SOURCES = 100  # files the chunks are spread over; the filter keeps half of them


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.lexical_search", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="a dataset folder (passages.jsonl, questions.jsonl)")
    parser.add_argument("--pool-cache", type=Path, default=None,
                        help="the distractors' sentence pool (.json.gz), as bench.scale's --pool-cache")
    parser.add_argument("--documents", default="10000,100000,1000000", help="distractor documents, comma-separated")
    parser.add_argument("--questions", type=int, default=300, help="questions searched per size and way")
    parser.add_argument("--k", type=int, default=20, help="results per search (the hybrid ranking's depth)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/lexical-search-cpu.json"))
    return parser.parse_args(argv)


def corpus(args: argparse.Namespace, documents: int, pool: list[str]) -> tuple[list[str], list[str]]:
    """The chunks' texts and sources: the gold passages, then ``documents`` distractors drawn from ``pool``."""
    from bench.scale_corpus import distractor

    rng = random.Random(args.seed)
    texts = [json.loads(line)["text"] for line in (args.data / "passages.jsonl").open(encoding="utf-8")]
    texts += [distractor(rng, pool, n)["text"] for n in range(documents)]
    return texts, [f"file-{n % SOURCES:03d}" for n in range(len(texts))]


def indexed(texts: list[str], sources: list[str], folder: Path) -> Any:
    """The index as ingest builds it and the service loads it (memory-mapped)."""
    from app.core import lexical

    rows = lexical.LexicalRows()
    rows.add({"ids": [f"c{n}" for n in range(len(texts))], "documents": texts,
              "metadatas": [{"doc_id": f"d{n}", "source": source, "chunk_index": 0, "n_chunks": 1, "doc_hash": ""}
                            for n, source in enumerate(sources)]})
    lexical.save(rows.index("bench"), folder)
    loaded = lexical.load(folder)
    assert loaded is not None
    return loaded


def bm25s_search(index: Any, question: str, k: int, sources: set[str] | None) -> list[tuple[str, float]]:
    """The service's search before: bm25s's retrieve, its numpy selection, a mask tested chunk by chunk."""
    from app.core.lexical import tokenize

    mask = None if sources is None else np.array([s in sources for s in index.sources], dtype=np.float32)
    found, scores = index.bm25.retrieve(tokenize([question]), k=min(k, len(index.ids)), weight_mask=mask,
                                        show_progress=False, n_threads=0, backend_selection="numpy")
    return [(index.ids[i], float(s)) for i, s in zip(found[0], scores[0]) if s > 0]


def timed(search: Any, questions: list[str]) -> tuple[dict[str, float], list[list[tuple[str, float]]]]:
    found, seconds = [], []
    for question in questions:
        started = time.perf_counter()
        found.append(search(question))
        seconds.append(time.perf_counter() - started)
    return {f"p{q}": round(percentile(seconds, q) * 1000, 3) for q in (50, 95, 99)}, found


def agreement(before: list[list[tuple[str, float]]], now: list[list[tuple[str, float]]]) -> dict[str, int]:
    same = sum(a == b for a, b in zip(before, now))
    same_scores = sum(a != b and [s for _, s in a] == [s for _, s in b] for a, b in zip(before, now))
    return {"same": same, "same_scores_other_ties": same_scores, "different": len(now) - same - same_scores}


def measure(args: argparse.Namespace, documents: int, questions: list[str], pool: list[str]) -> dict[str, Any]:
    texts, sources = corpus(args, documents, pool)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        index = indexed(texts, sources, Path(folder))
        built_s = time.perf_counter() - started
        step: dict[str, Any] = {"chunks": len(texts), "build_s": round(built_s, 1)}
        half = {f"file-{n:03d}" for n in range(0, SOURCES, 2)}
        for name, filtered in (("all", None), ("half of the sources", half)):
            index.search(questions[0], args.k, filtered)  # first calls (the mask's numbering), not timed
            before_ms, before = timed(lambda q, f=filtered: bm25s_search(index, q, args.k, f), questions)
            now_ms, now = timed(lambda q, f=filtered: index.search(q, args.k, f), questions)
            step[name] = {"bm25s_ms": before_ms, "service_ms": now_ms, "agreement": agreement(before, now)}
    print(json.dumps(step), flush=True)
    return step


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    questions = [json.loads(line)["question"] for line in (args.data / "questions.jsonl").open(encoding="utf-8")]
    questions = questions[:args.questions]
    from bench.scale import POOL
    from bench.scale_corpus import sentence_pool

    pool = sentence_pool([args.data.parent / name for name in POOL], args.pool_cache)  # read once, for every size
    steps = [measure(args, int(size), questions, pool) for size in args.documents.split(",")]
    result = {"benchmark": "lexical_search", "command": command_line("bench.lexical_search", argv),
              "environment": environment(), "dataset": args.data.name, "questions": len(questions), "k": args.k,
              "sources": SOURCES, "steps": steps}
    write_json(args.out, result)
    plot(result, args.out.with_suffix(".png"))
    return 0


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chunks = [step["chunks"] for step in result["steps"]]
    figure, axes = plt.subplots(figsize=(6, 4))
    for name, style in (("all", "-"), ("half of the sources", "--")):
        for way, label in (("bm25s_ms", "bm25s's selection"), ("service_ms", "the service's")):
            axes.plot(chunks, [step[name][way]["p95"] for step in result["steps"]], "o" + style,
                      label=f"{label}, {name}")
    axes.set(xscale="log", yscale="log", xlabel="chunks", ylabel="p95 ms per search",
             title=f"one BM25 search, k={result['k']}")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)


if __name__ == "__main__":
    raise SystemExit(main())
