"""``python -m bench.pages_group --chroma DIR --collection NAME``: how long grouping small documents into pages
takes (``app.core.pages.group``, a large part of ingest's "indexes" stage at scale) as their number grows.

The parents are real: their mean vectors and token estimates read from an ingested store, copied with seeded
Gaussian noise (renormalised) until each size of ``--parents`` is reached; only the small ones (those a page
holds, as ``build_from`` groups them). Run it alone on the machine.

    python -m bench.pages_group --chroma /tmp/bs-work/chroma --collection scale --parents 8000,24000,48000
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import command_line, environment, stored_collection, write_json

JITTER = 0.05  # the noise's scale against a unit vector: copies stay near their original, never equal to it


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.pages_group", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chroma", type=Path, required=True, help="on-disk Chroma holding an ingested collection")
    parser.add_argument("--collection", required=True)
    parser.add_argument("--parents", default="8000,24000,48000", help="small parents grouped, comma-separated")
    parser.add_argument("--page-tokens", type=int, default=4096, help="the page size grouped for (tokens)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/pages-group-cpu.json"))
    return parser.parse_args(argv)


def small_parents(args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray]:
    """The store's parents a page of ``--page-tokens`` would group: unit mean vectors and token estimates."""
    from app.core import pages

    parents = pages.read_parents(stored_collection(args.chroma, args.collection))
    small = parents.tokens <= pages.SMALL_SHARE * args.page_tokens
    return parents.vectors[small], parents.tokens[small]


def grown(vectors: np.ndarray, tokens: np.ndarray, size: int, rng: np.random.Generator) -> tuple[np.ndarray, Any]:
    picked = np.arange(size) % len(tokens)
    copies = vectors[picked] + rng.normal(scale=JITTER / np.sqrt(vectors.shape[1]), size=(size, vectors.shape[1]))
    copies[:len(tokens)] = vectors[picked[:len(tokens)]]  # the first copy of each is the original
    return copies / np.linalg.norm(copies, axis=1, keepdims=True), tokens[picked]


def measure(vectors: np.ndarray, tokens: np.ndarray, limit: int) -> dict[str, Any]:
    from app.core import pages

    started = time.perf_counter()
    grouped = pages.group(vectors, tokens, limit)
    return {"parents": len(tokens), "pages": len(grouped), "seconds": round(time.perf_counter() - started, 3)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = [int(size) for size in args.parents.split(",")]
    vectors, tokens = small_parents(args)
    rng = np.random.default_rng(args.seed)
    measure(vectors[:200], tokens[:200], args.page_tokens)  # imports and first calls, not timed
    steps = []
    for size in sizes:
        steps.append(measure(*grown(vectors, tokens, size, rng), args.page_tokens))
        print(steps[-1], flush=True)
    result = {"benchmark": "pages_group", "command": command_line("bench.pages_group", argv),
              "environment": environment(), "store_parents": len(tokens), "page_tokens": args.page_tokens,
              "jitter": JITTER, "steps": steps}
    write_json(args.out, result)
    plot(result, args.out.with_suffix(".png"))
    return 0


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parents = [step["parents"] for step in result["steps"]]
    figure, axes = plt.subplots(figsize=(6, 4))
    axes.plot(parents, [step["seconds"] for step in result["steps"]], "o-")
    axes.set(xlabel="small parents grouped", ylabel="seconds", title="pages' grouping (k-means bisection)")
    figure.tight_layout()
    figure.savefig(path)


if __name__ == "__main__":
    raise SystemExit(main())
