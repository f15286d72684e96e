"""What a reload costs the questions asked just after it, in a service that ranks in its own process (the
default on hosts of fewer than 8 cores).

When an ingest (or an upload, or a deletion) changes the collection, the service opens the store afresh: an
embedded Chroma's vector index must be loaded from disk again, which grows with the corpus. This opens the
service's own retriever over an ingested collection, then, round after round, asks a few questions at rest, has
the index reopen as the collection watcher does on a change, and asks questions back to back for ``--window-s``:
the first one's latency and the slowest in the window, against the questions at rest. Run it alone on the
machine.

    python -m bench.reload_stall --chroma data/bench-scale/chroma --collection scale
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.common import command_line, environment, write_json
from bench.stats import ms_summary

QUESTIONS = ("When was the harbour dredged?", "Who founded the university?", "What is a generator in Python?",
             "How are path parameters declared?", "What did the survey of the glacier record?")


def timed(retriever: Any, question: str) -> float:
    started = time.perf_counter()
    retriever.rank_sync(question, 5)
    return time.perf_counter() - started


def run(args: argparse.Namespace) -> dict[str, Any]:
    from app.core.embedder import Embedder
    from app.core.settings import Settings
    from app.rag.retriever import Retriever

    settings = Settings(_env_file=None)
    settings.chroma.path, settings.chroma.collection = args.chroma, args.collection
    retriever = Retriever.over(Embedder(settings.embedding), settings.chroma, ThreadPoolExecutor(1),
                               settings.retrieval)
    index = retriever.index
    index.lexical_index(wait=True)
    timed(retriever, QUESTIONS[0])  # the vector index loaded, the encoder warm
    at_rest: list[float] = []
    first: list[float] = []
    slowest: list[float] = []
    for round_ in range(args.rounds):
        at_rest += [timed(retriever, question) for question in QUESTIONS]
        index.reopen()  # what ``Service.collection_changed`` does
        window: list[float] = []
        ends = time.perf_counter() + args.window_s
        while time.perf_counter() < ends:
            window.append(timed(retriever, QUESTIONS[len(window) % len(QUESTIONS)]))
        first.append(window[0])
        slowest.append(max(window))
        index.lexical_index(wait=True)  # the reload done before the next round
        while getattr(index, "reopening", False):  # getattr: the same file measured the code before it had one
            time.sleep(0.01)
        print(f"round {round_}: first {window[0] * 1e3:.1f} ms, slowest {max(window) * 1e3:.1f} ms, "
              f"{len(window)} questions in the window")
    index.close()
    return {"chunks": index.collection.count(), "rounds": args.rounds, "window_s": args.window_s,
            "at_rest_ms": ms_summary(at_rest), "first_after_reload_ms": ms_summary(first, (50, 100)),
            "slowest_in_window_ms": ms_summary(slowest, (50, 100))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.reload_stall", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chroma", type=Path, required=True, help="on-disk Chroma folder of an ingested collection")
    parser.add_argument("--collection", required=True, help="the collection")
    parser.add_argument("--rounds", type=int, default=10, help="reloads measured")
    parser.add_argument("--window-s", type=float, default=2.0, help="seconds of questions after each reload")
    parser.add_argument("--out", type=Path, default=Path("bench/results/reload-stall.json"), help="JSON output")
    args = parser.parse_args(argv)
    result = run(args) | {"command": command_line("bench.reload_stall", argv), "environment": environment()}
    write_json(args.out, result)
    print(f"{result['chunks']} chunks: at rest p50 {result['at_rest_ms']['p50']} ms; first question after a "
          f"reload p50 {result['first_after_reload_ms']['p50']} ms, slowest in {args.window_s:g} s after p50 "
          f"{result['slowest_in_window_ms']['p50']} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
