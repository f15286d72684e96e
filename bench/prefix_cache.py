"""``python -m bench.prefix_cache --data DIR ...``: prefix-cache hit rate, TTFT and recall of prefixrag vs naive
RAG on real QA data, read from vLLM's own counters.

Every mode replays the same seeded, shuffled question stream against ONE vLLM server, whose prefix cache is
reset between modes (POST /reset_prefix_cache: start vLLM with VLLM_SERVER_DEV_MODE=1, as --start-vllm does).
Given a vllm-router's URL, the counters are summed over its replicas (each reset on its own) and each replica's
share of the requests and prompt tokens is reported (bench.fleet).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

from bench.common import add_stream_args, environment, write_json
from bench.datasets import load_dataset, sample

DEFAULT_MODES = "naive,prefixrag,naive-matched"


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.prefix_cache", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_stream_args(p, questions=100, concurrency=1)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--vllm-url", help="a running vLLM server (with VLLM_SERVER_DEV_MODE=1)")
    where.add_argument("--start-vllm", action="store_true", help="start the CPU test model server here")
    p.add_argument("--max-model-len", type=int, default=32768, help="with --start-vllm")
    p.add_argument("--replica-metrics", type=lambda text: text.split(","),
                   help="with --vllm-url of a vllm-router: its replicas' URLs, comma-separated, whose counters are "
                        "summed (default: read from the router's /workers)")
    p.add_argument("--modes", default=DEFAULT_MODES,
                   help="comma list: naive, naive-matched, prefixrag (= service default), or a strategy name; "
                        "generation settings may follow a strategy: document:unit_quorum=1")
    p.add_argument("--chroma-path", type=Path, help="keep the bench collection here (default: a fresh temp dir)")
    p.add_argument("--dump-prompts", type=Path, help="write each mode's prompt token ids here (for bench.replay)")
    p.add_argument("--out", type=Path, required=True, help="JSON result; a PNG plot is written beside it")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dataset = load_dataset(args.data)
    stream = sample(dataset.questions, args.questions, args.seed)
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp, _vllm(args, Path(tmp)) as vllm_url:
        chroma = args.chroma_path or Path(tmp) / "chroma"
        results, skipped, retrieval = asyncio.run(_run(args, dataset, stream, vllm_url, chroma))
    from bench.stats import plot, retrieval_table, table

    payload = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "dataset": dataset.name, "question_ids": [q.id for q in stream], "environment": environment(),
               "retrieval": retrieval, "results": results, "skipped": skipped}
    write_json(args.out, payload)
    plot(results, args.out.with_suffix(".png"), f"{dataset.name}: {len(stream)} questions, "
                                                f"concurrency {args.concurrency}, top-k {args.top_k}")
    print(table(results))
    print(retrieval_table(retrieval))
    return 0


async def _run(args, dataset, stream, vllm_url: str, chroma: Path) -> tuple[list[dict], list[dict], dict]:
    from bench.harness import Harness

    harness = await Harness.create(dataset, vllm_url, chroma, args)
    try:
        retrieval = await harness.retrieval_report(stream)
        print(json.dumps({"retrieval": retrieval}), flush=True)
        results: list[dict] = []
        skipped: list[dict] = []
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        # naive-matched needs the best recall of the prefixrag modes: run it last.
        for mode in sorted(modes, key=lambda m: m == "naive-matched"):
            result = await harness.run_mode(mode, stream, results)
            if "skipped" in result:
                print(json.dumps(result), flush=True)
                skipped.append(result)
                continue
            print(json.dumps({k: result[k] for k in ("mode", "k", "hit_rate", "ceiling", "recall")}), flush=True)
            results.append(result)
        return results, skipped, retrieval
    finally:
        await harness.close()


class _vllm:
    """Use --vllm-url, or start the CPU test model server (dev mode) for the run and stop it after."""

    def __init__(self, args, tmp: Path) -> None:
        from app.vllm.process import LocalVLLM

        self.url = args.vllm_url
        self.local = None if self.url else LocalVLLM(tmp / "vllm.log", args.max_model_len)

    def __enter__(self) -> str:
        if self.url:
            return self.url
        assert self.local is not None  # no --vllm-url: one was made in __init__
        return self.local.__enter__()

    def __exit__(self, *exc) -> None:
        if self.local is not None:
            self.local.__exit__(*exc)


if __name__ == "__main__":
    raise SystemExit(main())
