"""``python -m bench.long_context --data DIR --unit-tokens 32768 ...``: long-context RAG on real QA data.

A QA dataset's articles are bound, in file order, into "books" of about ``--unit-tokens`` each (a book is one
parent document: its passages keep their ids, so every question keeps its gold passage). Then, against ONE vLLM
whose window is twice a book (``--max-model-len``, e.g. 65536 for 32K-token books), at each ``--concurrency``:

- ``naive``: LangChain's layout, dense top-k (k = ``--top-k``);
- ``naive-fill``: the same layout filled to the same token budget as a book, with the dense ranking's chunks in
  relevance order (what long-context RAG code does with a long window);
- ``prefixrag``: the service's path with its default settings; its units follow the served window (half the
  room beside the answer), so with a window of twice a book a whole book is one unit, pre-warmed before the cell.

Each mode starts from an empty prefix cache (POST /reset_prefix_cache: vLLM in dev mode). Reported per cell:
TTFT p50/p95, answers/s, gold in the prompt, vLLM's own hit rate, prompt and uncached tokens (bench.stats), and
where vLLM keeps a KV tier in host memory (``--kv-offload-gib``), the prompt tokens loaded from it
(``host_tier``). ``--order books`` asks the books in turn, so that with a GPU cache of fewer books than the
corpus every question's book has left the GPU: it is answered from the host tier, or from a cold prefill.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
from pathlib import Path

from app.core.pages import CHARS_PER_TOKEN
from bench.common import command_line, environment, write_json
from bench.datasets import load_dataset, sample

BOOK_FILL = 0.95  # a book's text stays under this share of --unit-tokens: its unit is never cut in two


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.long_context", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, required=True, help="dataset folder (SQuAD/TAT-QA layout: titled passages)")
    p.add_argument("--questions", type=int, default=64, help="questions drawn (seeded shuffle), the same in every cell")
    p.add_argument("--concurrency", type=lambda text: [int(c) for c in text.split(",")], default=[1, 8, 32],
                   help="comma list of requests in flight, one cell each (default 1,8,32)")
    p.add_argument("--top-k", type=int, default=5, help="k of naive and of prefixrag's retrieval")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=16, help="answer tokens per request")
    p.add_argument("--unit-tokens", type=int, default=32768,
                   help="book size and naive-fill's budget (tokens, estimated at the service's characters per token)")
    p.add_argument("--order", choices=("shuffled", "books"), default="shuffled",
                   help="question order: shuffled, or one question per book in turn (each question's book the "
                   "least recently asked: beyond a GPU cache of a few books, it lives in vLLM's host tier or nowhere)")
    p.add_argument("--warm-piece-tokens", type=int, help="prefixrag's pre-warm piece size (default: the service's)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--vllm-url", help="a running vLLM server (VLLM_SERVER_DEV_MODE=1) whose window holds a book")
    where.add_argument("--start-vllm", action="store_true", help="start the CPU test model server here")
    p.add_argument("--max-model-len", type=int, help="with --start-vllm: its window (default: twice a book)")
    p.add_argument("--modes", default="naive,naive-fill,prefixrag", help="comma list of the modes above")
    p.add_argument("--chroma-path", type=Path, help="keep the bench collection here (default: a fresh temp dir)")
    p.add_argument("--out", type=Path, required=True, help="JSON result; a PNG plot is written beside it")
    return p.parse_args(argv)


def make_books(data: Path, unit_tokens: int, out: Path) -> list[dict]:
    """Write ``data`` (SQuAD/TAT-QA layout) to ``out`` with its articles bound into books of at most
    ``BOOK_FILL * unit_tokens`` estimated tokens each (an article longer than that is a book of its own; the
    service then cuts it into windows); return each book's name, articles and estimated tokens."""
    rows = [json.loads(line) for line in (data / "passages.jsonl").read_text(encoding="utf-8").splitlines()
            if line.strip()]
    articles: dict[str, list[dict]] = {}
    for row in rows:
        articles.setdefault(str(row.get("title") or row["passage_id"]), []).append(row)
    books: list[dict] = []
    for title, passages in articles.items():
        tokens = sum(len(row["text"]) for row in passages) / CHARS_PER_TOKEN
        if not books or books[-1]["tokens"] + tokens > BOOK_FILL * unit_tokens:
            books.append({"name": f"book-{len(books):02d}", "articles": [], "tokens": 0.0, "rows": []})
        book = books[-1]
        book["articles"].append(title)
        book["tokens"] += tokens
        book["rows"] += [row | {"context_id": book["name"]} for row in passages]  # the parent ingest reads
    out.mkdir(parents=True, exist_ok=True)
    with (out / "passages.jsonl").open("w", encoding="utf-8") as handle:
        for book in books:
            handle.writelines(json.dumps(row) + "\n" for row in book.pop("rows"))
    shutil.copyfile(data / "questions.jsonl", out / "questions.jsonl")
    return [{**book, "tokens": round(book["tokens"])} for book in books]


def book_of_passage(root: Path) -> dict[str, str]:
    """Each passage id's book, as ``make_books`` wrote them."""
    rows = (json.loads(line) for line in (root / "passages.jsonl").read_text(encoding="utf-8").splitlines())
    return {str(row["passage_id"]): row["context_id"] for row in rows}


def books_in_turn(stream: list, book_of: dict[str, str], count: int) -> list:
    """``count`` questions of ``stream``, one per book in turn (book 0, 1, ..., n-1, 0, ...), each book's in
    ``stream``'s order: every question's book is the one asked least recently."""
    queues: dict[str, list] = {}
    for question in stream:
        if question.gold:
            queues.setdefault(book_of[min(question.gold)], []).append(question)
    ordered: list = []
    turn = [queues[book] for book in sorted(queues)]
    while len(ordered) < count and any(turn):
        ordered += [queue.pop(0) for queue in turn if queue][:count - len(ordered)]
    return ordered


def mode_name(mode: str, args) -> str:
    """``prefixrag`` as the service runs by default (its units follow the served window: half the room beside the
    answer, so a window of twice a book holds a whole book as one unit), pre-warm's piece size where given."""
    if mode == "prefixrag" and args.warm_piece_tokens:
        return f"prefixrag:piece_tokens={args.warm_piece_tokens}"
    return mode


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.fill_tokens, args.dump_prompts, concurrencies = args.unit_tokens, None, args.concurrency
    if args.start_vllm:
        args.max_model_len = args.max_model_len or 2 * args.unit_tokens
    from bench.prefix_cache import _vllm

    with tempfile.TemporaryDirectory(prefix="bench-long-") as tmp:
        root = Path(tmp) / f"{args.data.name}-books-{args.unit_tokens // 1024}k"
        books = make_books(args.data, args.unit_tokens, root)
        dataset = load_dataset(root)
        stream = sample(dataset.questions, len(dataset.questions) if args.order == "books" else args.questions,
                        args.seed)
        if args.order == "books":
            stream = books_in_turn(stream, book_of_passage(root), args.questions)
        with _vllm(args, Path(tmp)) as vllm_url:
            chroma = args.chroma_path or Path(tmp) / "chroma"
            results, served = asyncio.run(_run(args, concurrencies, dataset, stream, vllm_url, chroma))
    args.concurrency = concurrencies
    payload = {"command": command_line("bench.long_context", argv),
               "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "dataset": dataset.name, "books": books, "question_ids": [q.id for q in stream], "served": served,
               "environment": environment(), "results": results}
    write_json(args.out, payload)
    plot(results, args.out.with_suffix(".png"), f"{args.data.name} in books of ~{args.unit_tokens // 1024}K "
                                                f"tokens, {len(stream)} questions")
    print(table(results))
    return 0


async def _run(args, concurrencies: list[int], dataset, stream, vllm_url: str,
               chroma: Path) -> tuple[list[dict], dict]:
    """Every cell's result, and what vLLM serves (its window and its KV cache's tiers, in tokens)."""
    from dataclasses import asdict

    from bench.harness import Harness

    harness = await Harness.create(dataset, vllm_url, chroma, args)
    info = harness.upstream.require()
    served = {k: v for k, v in asdict(info).items() if k != "special_tokens"}
    results: list[dict] = []
    try:
        for concurrency in concurrencies:
            args.concurrency = concurrency  # the harness sizes admission by it
            for mode in (m.strip() for m in args.modes.split(",") if m.strip()):
                result = await harness.run_mode(mode_name(mode, args), stream, results)
                result |= {"mode": mode, "concurrency": concurrency}
                print(json.dumps({k: result.get(k) for k in ("mode", "concurrency", "hit_rate", "recall", "host_tier",
                                                             "mean_prompt_tokens", "ttft_ms", "throughput_qps")}),
                      flush=True)
                results.append(result)
    finally:
        await harness.close()
    return results, served


def table(results: list[dict]) -> str:
    rows = [f"{'mode':<12}{'c':>4}{'prompt':>8}{'uncached':>9}{'hit':>7}{'ttft p50':>10}{'p95':>8}{'ans/s':>8}"
            f"{'gold':>7}{'host':>8}"]
    for r in results:
        if "skipped" in r:
            rows.append(f"{r['mode']:<12}{r['concurrency']:>4}  skipped: {r['skipped']}")
            continue
        rows.append(f"{r['mode']:<12}{r['concurrency']:>4}{r['mean_prompt_tokens']:>8.0f}"
                    f"{r['mean_uncached_prompt_tokens']:>9.0f}{r['hit_rate']:>7.3f}{r['ttft_ms']['p50']:>10.0f}"
                    f"{r['ttft_ms']['p95']:>8.0f}{r['throughput_qps']:>8.2f}{r['recall'] or 0:>7.3f}"
                    f"{r.get('host_tier', {}).get('tokens_loaded', 0):>8}")
    return "\n".join(rows)


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for mode in dict.fromkeys(r["mode"] for r in results if "skipped" not in r):
        cells = [r for r in results if r["mode"] == mode and "skipped" not in r]
        ax.plot([r["concurrency"] for r in cells], [r["ttft_ms"]["p50"] for r in cells], marker="o", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("requests in flight")
    ax.set_ylabel("TTFT p50 (ms)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
