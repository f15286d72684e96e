"""``python -m bench.page_layouts --data DIR --out FILE``: gold in the prompt against the uncached text after a
page, for page sizes and for how many hits follow the page, without vLLM.

For each seeded question it takes the service's hybrid top-k, builds the pages of the ingested collection at each
size (``app.core.pages.build``, as ingest would) and counts, per layout, whether a gold document is shown (the
page's documents plus the hits kept after it) and how much text follows the page (estimated tokens, 4 characters
each). Two page choices: ``most`` (the service's: the page holding most hits, ties to the better-ranked) and
``deep`` (the page with the most fused score among the top ``--depth`` candidates). Questions whose top hit is
not in a page (a document too big for one) count as the plain top-k. Recall only: time is ``bench.prefix_cache``'s.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from bench.common import command_line, environment, write_json
from bench.datasets import load_dataset, sample

CHARS_PER_TOKEN = 4


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.page_layouts", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, required=True, help="dataset folder (SQuAD/TAT-QA or BEIR layout)")
    p.add_argument("--questions", type=int, default=300, help="questions drawn (seeded shuffle)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--top-k", type=int, default=5)
    p.add_argument("--depth", type=int, default=20, help="candidates the deep page choice reads")
    p.add_argument("--sizes", default="2048,3072,4096", help="page sizes in tokens, comma-separated")
    p.add_argument("--chroma-path", type=Path, required=True, help="where the collection is (ingested if absent)")
    p.add_argument("--out", type=Path, required=True, help="JSON result")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = asyncio.run(_run(args))
    write_json(args.out, {"command": command_line("bench.page_layouts", argv), "environment": environment(),
                          "config": {k: str(v) for k, v in vars(args).items()}, "layouts": rows})
    for row in rows:
        print(f"pages {row['page_tokens']:>5} {row['choice']:>4} after page {row['after_page']:>3}: gold in prompt "
              f"{row['recall']:.3f}, hits after the page {row['hits_after_page']:.2f} (~{row['tokens_after_page']} "
              "tokens)")
    return 0


async def _run(args) -> list[dict]:
    from app.core import pages
    from app.core.embedder import Embedder
    from app.core.settings import Settings
    from app.runtime.services import build_services
    from ingest.pipeline import run_ingest

    dataset = load_dataset(args.data)
    settings = Settings(_env_file=None)
    settings.chroma.path, settings.chroma.collection = args.chroma_path, dataset.collection
    embedder = Embedder(settings.embedding)
    run_ingest([dataset.passages], settings, embedder)  # unchanged: nothing written
    services = await build_services(settings, embedder=embedder)
    try:
        retriever = services.retriever
        await services.index.indexes_ready()
        questions = [q for q in sample(dataset.questions, args.questions, args.seed) if q.gold]
        deep = [await retriever.retrieve(q.text, args.depth) for q in questions]
        documents = _documents_of(services.index.collection)
        rows = []
        for size in (int(s) for s in args.sizes.split(",")):
            index = pages.build(services.index.collection, size)
            for choice in ("most", "deep"):
                for after_page in (None, 3, 2, 1, 0):
                    rows.append(_layout(index, documents, questions, deep, args.top_k, choice, after_page))
        return rows
    finally:
        await services.aclose()


def _documents_of(collection) -> dict[str, set[str]]:
    """Each parent (what pages hold) -> the document ids its chunks carry (what gold names)."""
    from app.core.records import ChunkRecord
    from app.core.store import all_rows

    documents: dict[str, set[str]] = {}
    for rows in all_rows(collection, ["metadatas"]):
        for meta in rows["metadatas"]:
            record = ChunkRecord.from_metadata(meta)
            documents.setdefault(record.parent_key, set()).add(record.doc_id)
    return documents


def _layout(index, documents, questions, deep, top_k: int, choice: str, after_page: int | None) -> dict:
    found = after = chars = 0
    for question, candidates in zip(questions, deep):
        hits = candidates[:top_k]
        page = _page(index, hits, candidates, choice) if index.page_of(hits[0].parent) else None
        if page is None:  # the plain top-k
            shown = {hit.doc_id for hit in hits}
        else:
            inside = set(index.pages[page])
            kept = [hit for hit in hits if hit.parent not in inside][:after_page]
            shown = {doc for parent in inside for doc in documents[parent]} | {hit.doc_id for hit in kept}
            after, chars = after + len(kept), chars + sum(len(hit.text) for hit in kept)
        found += bool(shown & question.gold)
    n = len(questions) or 1
    return {"page_tokens": index.tokens, "choice": choice, "after_page": "all" if after_page is None else after_page,
            "recall": round(found / n, 4), "hits_after_page": round(after / n, 3),
            "tokens_after_page": round(chars / n / CHARS_PER_TOKEN), "questions": len(questions)}


def _page(index, hits, candidates, choice: str) -> str:
    """``most``: the service's choice (``leading_page``); ``deep``: the page with the most fused score among all
    candidates."""
    from app.rag.strategies import leading_page

    if choice == "most":
        held: dict[str, list] = {}
        for hit in hits:
            if (page := index.page_of(hit.parent)) is not None:
                held.setdefault(page, []).append(hit)
        return leading_page(held)
    score: dict[str, float] = {}
    for hit in candidates:
        if (page := index.page_of(hit.parent)) is not None:
            score[page] = score.get(page, 0.0) + hit.score
    return max(score, key=lambda page: score[page])


if __name__ == "__main__":
    raise SystemExit(main())
