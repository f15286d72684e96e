"""How long a full garbage collection stops the service process, before and after ``freeze_start_up``.

Builds the service graph on an ingested collection (encoder loaded, Chroma open; with ``--workers N`` the encoder
lives in N ranking workers instead, as on a host of many cores), runs a few retrievals (the BM25 index and pages
load) and reads every chunk (what the corpus strategy holds); with ``--tokenizer DIR`` the served model's tokenizer
is then loaded as token-id prompts load it once vLLM is seen (after start-up's freeze); then times
``gc.collect()`` of each generation. Then the same in a fresh process that freezes the objects alive after
start-up, as the app does in its lifespan (and what the tokenizer's load left, as its composition root does),
timing the same over what was created after. Run it alone on the machine: a full collection is CPU-bound.

    python -m bench.gc_pause --chroma data/bench-live --collection live-python-3.11-docs-html
    python -m bench.gc_pause --chroma C --collection N --workers 2 --tokenizer ~/.cache/prefixrag/test-model
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from bench.common import command_line, environment, write_json

QUESTIONS = ("How do I configure sys.path?", "What is a generator?", "How does the asyncio event loop work?")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gc_pause", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chroma", type=Path, required=True, help="on-disk Chroma holding an ingested collection")
    parser.add_argument("--collection", required=True)
    parser.add_argument("--workers", type=int, default=0, help="ranking workers (default 0: rank in this process)")
    parser.add_argument("--tokenizer", type=Path, help="the served model's tokenizer folder, loaded after start-up")
    parser.add_argument("--out", type=Path, default=Path("bench/results/gc-pause.json"))
    parser.add_argument("--measure-frozen", action="store_true",
                        help="internal: print the frozen measurement only (run in a fresh process)")
    return parser.parse_args(argv)


def collections_ms() -> dict[str, float]:
    """Each generation collected once, youngest first, in milliseconds."""
    timed = {}
    for generation in (0, 1, 2):
        started = time.perf_counter()
        gc.collect(generation)
        timed[f"gen{generation}"] = round((time.perf_counter() - started) * 1000, 1)
    return timed


async def measure(args: argparse.Namespace, freeze: bool) -> dict:
    from app.core.settings import Settings
    from app.runtime.pauses import freeze_start_up
    from app.runtime.services import build_services

    settings = Settings(_env_file=None)
    settings.chroma.path, settings.chroma.collection = args.chroma, args.collection
    settings.context.hotness_dir = None
    settings.retrieval.workers = args.workers
    services = await build_services(settings)
    if freeze:
        freeze_start_up()  # where the app's lifespan calls it: after the graph is built
    if args.tokenizer is not None:  # as when vLLM is first seen: its tokenizer, for token-id prompts
        services.clients.prompt_ids.adopt(SimpleNamespace(root=str(args.tokenizer)))
        await services.clients.prompt_ids.learn([], "")  # returns once the load has ended (and froze what it left)
        if not freeze:
            gc.unfreeze()  # the unfrozen arm: nothing frozen at all
    ranker = services.clients.ranker  # with workers, the encoder is theirs: none is loaded here
    await ranker.prime()
    for question in QUESTIONS:
        await ranker.rank(question, 5)
    chunks = await services.index.chunks_where(None)
    result = {"chunks": len(chunks), "tracked_objects": len(gc.get_objects()), "frozen": gc.get_freeze_count(),
              "collect_ms": collections_ms()}
    await services.aclose()
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.measure_frozen:
        print(json.dumps(asyncio.run(measure(args, freeze=True))))
        return 0
    # Frozen in a fresh process: a process freezes once, and must start with nothing frozen to compare.
    child = subprocess.run([sys.executable, "-m", "bench.gc_pause", *argv, "--measure-frozen"],
                           capture_output=True, text=True, check=True)
    result = {"unfrozen": asyncio.run(measure(args, freeze=False)),
              "frozen": json.loads(child.stdout.strip().splitlines()[-1]),
              "command": command_line("bench.gc_pause", argv), "environment": environment()}
    write_json(args.out, result)
    print({key: result[key]["collect_ms"] for key in ("unfrozen", "frozen")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
