"""``python -m bench.throughput``: answers per second and time to first token under closed-loop load, as users run
the service, against the same vLLM and on the same questions in one run:

- **prefixrag**: the app as users start it (``python -m app``, its settings from the environment), asked over HTTP
  (``POST /ask``), once its pre-warm is done;
- **naive**: dense top-k in the LangChain layout, retrieved in this process, sent straight to vLLM;
- **replay**: vLLM alone, sent exactly the requests the app sent in the prefixrag arm of the same cell (captured at
  the app's client seam), at the same concurrency: what the engine and vLLM's front end do with them.

Each cell (concurrency x answer length x streamed or not) takes a fresh slice of the shuffled questions, the
same slice for every arm, so no arm finds a question the app has already answered. Per arm it reports answers/s,
TTFT p50/p95/p99 (streamed: the first answer text; not streamed: the whole answer), and for the app the time its
stages took (retrieval, building the prompt, vLLM's first token as the app saw it, the relay), the app's CPU
time (all its processes, and its event loop's thread alone), the clients' own CPU time (they run in processes of
at most 32 clients, ``bench.client_processes``; the busiest one's share of its time says whether the clients, not
the app, set the pace), and vLLM's own histograms (queue, prefill, TTFT) over the arm.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from itertools import product
from pathlib import Path

import httpx

from bench.client_processes import ArmSpec, spread_loop
from bench.common import add_app_stack_args, command_line, environment, write_json
from bench.datasets import load_dataset, sample
from bench.fleet import Fleet
from bench.load_report import (
    APP_ENV_DEFAULTS,
    app_figures,
    cpu_seconds,
    engine_figures,
    host_cpu_seconds,
    loop_cpu_seconds,
    plot_throughput,
    sample_stats,
    summary,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.throughput", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_app_stack_args(parser)
    parser.add_argument("--concurrency", default="1,8,32,128", help="closed-loop clients per cell, comma-separated")
    parser.add_argument("--max-tokens", default="16,256", help="answer lengths, comma-separated")
    parser.add_argument("--streamed", default="yes", help="yes, no or yes,no")
    parser.add_argument("--arms", default="prefixrag,replay,naive", help="in this order within each cell")
    parser.add_argument("--requests", type=int, default=4, help="questions per cell: this many per client, "
                        "at least 32 (default 4)")
    parser.add_argument("--duration-s", type=float, default=30.0, help="an arm stops sending after this long")
    parser.add_argument("--warmup-s", type=float, default=0.0, help="before the cells, the app is asked questions "
                        "from the far end of the shuffled list at the first concurrency for this long, unmeasured "
                        "(a fresh app's and vLLM's first seconds under load are slower than the rest)")
    parser.add_argument("--top-k", type=int, default=5, help="k of naive's retrieval")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--app-env", action="append", default=[], metavar="PREFIXRAG_X=V",
                        help="a setting for the app, besides the benchmark's own (repeatable)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/throughput.json"))
    parser.add_argument("--app-log", type=Path, help="keep the app's log here (default: discarded)")
    parser.add_argument("--profile", type=Path, help="sample the app with py-spy during each prefixrag arm "
                        "(folded stacks, one file per cell, into this folder)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dataset = load_dataset(args.data)
    ingest(args, dataset)
    with tempfile.TemporaryDirectory(prefix="bench-throughput-") as tmp:
        if args.vllm_url:
            result = run(args, dataset, args.vllm_url, Path(tmp))
        else:
            from app.vllm.process import LocalVLLM

            with LocalVLLM(Path(tmp) / "vllm.log", max_model_len=8192) as url:
                result = run(args, dataset, url, Path(tmp))
    result |= {"command": command_line("bench.throughput", argv), "environment": environment()}
    write_json(args.out, result)
    plot_throughput(result, args.out.with_suffix(".png"))
    print(summary(result))
    return 0


def ingest(args: argparse.Namespace, dataset) -> None:
    from app.core.embedder import Embedder
    from app.core.settings import Settings
    from ingest.pipeline import run_ingest

    settings = Settings(_env_file=None)
    settings.chroma.path, settings.chroma.collection = args.chroma, dataset.collection
    report = run_ingest([dataset.passages], settings, Embedder(settings.embedding))
    print(f"ingest: {report.chunks_written} chunks written into {dataset.collection}", flush=True)


def run(args: argparse.Namespace, dataset, vllm_url: str, tmp: Path) -> dict:
    from app.vllm.process import app_child, free_port

    port, capture = free_port(), tmp / "capture.jsonl"
    app_env = APP_ENV_DEFAULTS | {"PREFIXRAG_VLLM_URL": vllm_url, "PREFIXRAG_CHROMA_PATH": str(args.chroma),
                                  "PREFIXRAG_COLLECTION": dataset.collection,
                                  "PREFIXRAG_CONTEXT__HOTNESS_DIR": str(tmp / "hotness"),
                                  "PREFIXRAG_VLLM__CAPTURE_PATH": str(capture)}
    app_env |= dict(pair.split("=", 1) for pair in args.app_env)
    cache_reset = asyncio.run(empty_cache(vllm_url))
    app = app_child(args.app_log or tmp / "app.log", app_env, port).start()
    try:
        url = f"http://127.0.0.1:{port}"
        app.wait_for(url + "/readyz", 900)
        warmup = asyncio.run(warmed(url))
        cells = asyncio.run(measure(args, dataset, url, vllm_url, capture, app.pid))
    finally:
        app.stop()
    given = {name: value for name, value in app_env.items() if name not in ("PREFIXRAG_VLLM__CAPTURE_PATH",)}
    return {"dataset": dataset.name, "config": {k: str(v) for k, v in vars(args).items()}, "app_env": given,
            "cache_reset": cache_reset, "warmup": warmup, "results": cells}


async def empty_cache(vllm_url: str) -> bool:
    """Empty vLLM's prefix cache before the app starts: an earlier run's naive arm sent the same prompts (the same
    seed's questions), which would otherwise hit here. False where vLLM does not allow it (no dev mode)."""
    fleet = await Fleet.discover(vllm_url)
    try:
        await fleet.reset()
        return True
    except httpx.HTTPError as exc:
        print(f"vLLM's prefix cache was not emptied ({exc}): an earlier run's prompts may hit", flush=True)
        return False
    finally:
        await fleet.aclose()


async def warmed(url: str, timeout_s: float = 1800) -> dict:
    """Wait until the app's pre-warm has finished (the benchmark measures warm traffic); its progress."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        while time.monotonic() < deadline:
            progress = (await client.get("/readyz")).json()["warmup"]
            if not progress["state"].startswith(("warming", "waiting")):
                print(f"pre-warm {progress['state']}: {progress['units_warmed']} units", flush=True)
                return progress
            await asyncio.sleep(2)
    raise TimeoutError("pre-warm did not finish")


async def measure(args: argparse.Namespace, dataset, app_url: str, vllm_url: str, capture: Path,
                  app_pid: int) -> list[dict]:
    from app.core.settings import VLLMSettings
    from app.vllm.client import LLMClient

    llm = LLMClient(VLLMSettings(url=vllm_url))
    model = (await llm.list_models())[0]["id"]
    await llm.aclose()
    fleet = await Fleet.discover(vllm_url)
    questions = [q.text for q in sample(dataset.questions, len(dataset.questions), args.seed)]
    cells, used, captured = [], 0, 0
    grid = product(map(int, args.max_tokens.split(",")), [s == "yes" for s in args.streamed.split(",")],
                   map(int, args.concurrency.split(",")))
    try:
        if args.warmup_s > 0:  # the shuffled list's far end: cells take theirs from the front
            first = int(args.concurrency.split(",")[0])
            spec = ArmSpec("prefixrag", app_url, vllm_url, model, args.chroma, dataset.collection, args.top_k,
                           int(args.max_tokens.split(",")[0]), True)
            await spread_loop(spec, first, questions[-max(64, 16 * first):], args.warmup_s)
        for max_tokens, streamed, concurrency in grid:
            count = max(32, args.requests * concurrency)
            chosen = [questions[(used + i) % len(questions)] for i in range(count)]
            used += count
            for arm in args.arms.split(","):
                spec = ArmSpec(arm, app_url, vllm_url, model, args.chroma, dataset.collection, args.top_k,
                               max_tokens, streamed)
                with profiled(args.profile if arm == "prefixrag" else None, app_pid,
                              f"c{concurrency}-t{max_tokens}-{'stream' if streamed else 'whole'}"):
                    row, captured = await one_arm(spec, fleet, chosen, capture, captured, app_pid, args.duration_s,
                                                  concurrency)
                cells.append(row)
                print(json.dumps({k: row[k] for k in ("arm", "concurrency", "max_tokens", "streamed",
                                                      "answers_per_s", "ttft_ms")}), flush=True)
    finally:
        await fleet.aclose()
    return cells


async def one_arm(spec: ArmSpec, fleet: Fleet, questions: list[str], capture: Path, captured: int, app_pid: int,
                  duration_s: float, concurrency: int) -> tuple[dict, int]:
    """One arm of a cell, and how many requests the app sent in it (prefixrag; else ``captured`` as given: the
    replay arm sends the last prefixrag arm's requests, in the order the app sent them)."""
    items: list = questions
    if spec.arm == "replay":
        lines = capture.read_text().splitlines()[-captured:] if captured else []
        items = [json.loads(line) for line in lines]
    captured_before = len(capture.read_text().splitlines()) if capture.exists() else 0
    mine = spec.arm == "prefixrag"
    app_before = await app_metrics(spec.app_url) if mine else ""
    before, cpu_before, loop_before = await fleet.metrics(), cpu_seconds(app_pid), loop_cpu_seconds(app_pid)
    host_before = host_cpu_seconds()
    samples, wall_s, shares = await spread_loop(spec, concurrency, items, duration_s)
    host_after = host_cpu_seconds()
    after, cpu_after, loop_after = await fleet.metrics(), cpu_seconds(app_pid), loop_cpu_seconds(app_pid)
    if mine:
        captured = len(capture.read_text().splitlines()) - captured_before if capture.exists() else 0
    row = {"arm": spec.arm, "concurrency": concurrency, "max_tokens": spec.max_tokens, "streamed": spec.streamed}
    row |= engine_figures(before, after) | {
        "app_cpu_s": round(cpu_after - cpu_before, 3) if mine else None,
        "loop_cpu_s": round(loop_after - loop_before, 3) if mine else None,
        # The clients' processes: each one's loop busy for most of its time would mean the clients set the pace.
        "client_processes": len(shares), "client_cpu_s": round(sum(s.cpu_s for s in shares), 3),
        "client_busiest": round(max(s.cpu_s / max(s.ended - s.started, 1e-9) for s in shares), 2),
        # Everything on the host together, in cores: near the core count, every process waits for a core.
        "host_busy_cores": round((host_after[0] - host_before[0]) / max(wall_s, 1e-9), 2),
        "host_stolen_cores": round((host_after[1] - host_before[1]) / max(wall_s, 1e-9), 2),
        "host_cores": os.cpu_count()}
    if mine:  # where the app's own time went: admission, the ranking's stages, its loop's lag, GC
        row["app_histograms"] = app_figures(app_before, await app_metrics(spec.app_url))
    return row | sample_stats(samples, wall_s), captured


async def app_metrics(url: str) -> str:
    async with httpx.AsyncClient(timeout=30) as client:
        return (await client.get(url + "/metrics")).text


@contextlib.contextmanager
def profiled(folder: Path | None, pid: int, name: str) -> Iterator[None]:
    """py-spy samples ``pid`` and its children (the ranking workers; all threads, 100 Hz) while the body runs;
    folded stacks into ``folder``."""
    if folder is None:
        yield
        return
    folder.mkdir(parents=True, exist_ok=True)
    spy = subprocess.Popen([shutil.which("py-spy") or "py-spy", "record", "-p", str(pid), "--subprocesses",
                            "-r", "100", "-f", "raw", "--nonblocking", "-o", str(folder / f"profile-{name}.txt")],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)  # py-spy writes what it sampled and exits
        spy.wait(60)


if __name__ == "__main__":
    sys.exit(main())
