"""``python -m bench.live_traffic``: does live traffic come first? The app as users run it (``python -m app``,
default settings) on a corpus of thousands of chunks, against one CPU test-model vLLM.

1. **During pre-warm**: from the moment ``/readyz`` says 200, one question every ``--gap-s`` (streamed /ask,
   client TTFT) while pre-warm runs; then, once pre-warm is done, the same questions again.
   Target: the first question's TTFT <= 2x its TTFT after pre-warm. For scale, the same questions are asked a
   third time on an idle server whose prefix cache was just reset (cold; needs vLLM's dev mode). Before that,
   as many questions never asked before (other headings), on the warm server: the share of their prompts that
   pre-warm had cached is what it bought a new user.
2. **Overload**: one client for ``--single-s``, then ``--clients`` closed-loop clients for ``--load-s`` (a
   refused client waits its Retry-After). Targets: only 200 and 429; p99 latency of admitted requests <= 3x the
   single client's p50; ``/healthz`` p99 <= 50 ms; app RSS growth <= 10 %.

Questions are the corpus's own section headings ("What is <heading>?"), sampled with a fixed seed.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import tempfile
import time
from pathlib import Path

import httpx
from httpx_sse import aconnect_sse

from bench.common import command_line, environment, write_json
from bench.live_load import app_pauses, load, renice, rss_kib
from bench.stats import percentile

DEFAULT_DATA = Path("../shared/data/python-3.11-docs-html/files")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.live_traffic", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help=f"corpus to ingest (default {DEFAULT_DATA})")
    parser.add_argument("--chroma", type=Path, default=Path("data/bench-live"), help="on-disk store (re-used)")
    parser.add_argument("--vllm-url", help="a running vLLM (default: start the CPU test model, 8192 window)")
    parser.add_argument("--questions", type=int, default=20, help="questions asked during pre-warm (default 20)")
    parser.add_argument("--gap-s", type=float, default=3.0, help="pause between them (default 3)")
    parser.add_argument("--single-s", type=float, default=30.0, help="single-client phase (default 30)")
    parser.add_argument("--clients", type=int, default=64, help="clients in the overload phase (default 64)")
    parser.add_argument("--load-s", type=float, default=60.0, help="overload phase length (default 60)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/live-traffic.json"))
    parser.add_argument("--app-log", type=Path, help="keep the app's log here (default: discarded)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    collection = "live-" + args.data.resolve().parent.name[:40]
    questions, fresh = prepare_corpus(args, collection)
    with tempfile.TemporaryDirectory(prefix="bench-live-") as tmp:
        if args.vllm_url:
            result = run_with_app(args, args.vllm_url, collection, (questions, fresh), Path(tmp))
        else:
            from app.vllm.process import LocalVLLM

            with LocalVLLM(Path(tmp) / "vllm.log", max_model_len=8192) as url:
                result = run_with_app(args, url, collection, (questions, fresh), Path(tmp))
    result |= {"command": command_line("bench.live_traffic", argv), "environment": environment()}
    write_json(args.out, result)
    from bench.stats import plot_live_traffic

    plot_live_traffic(result, args.out.with_suffix(".png"))
    print(summary_line(result))
    return 0


def prepare_corpus(args: argparse.Namespace, collection: str) -> tuple[list[str], list[str]]:
    """Ingest (idempotent: a re-run only checks) and draw questions from the stored headings: those asked during
    pre-warm (and again after), and as many others, asked only once pre-warm is done."""
    from app.core.embedder import Embedder
    from app.core.records import ChunkRecord
    from app.core.settings import Settings
    from app.core.store import open_collection
    from ingest.pipeline import run_ingest

    settings = Settings(_env_file=None)
    settings.chroma.path, settings.chroma.collection = args.chroma, collection
    embedder = Embedder(settings.embedding)
    report = run_ingest([args.data], settings, embedder)
    metas = open_collection(settings.chroma, embedder, create=False).get(include=["metadatas"])["metadatas"]
    print(f"corpus: {len(metas)} chunks ({report.chunks_written} written now)", flush=True)
    records = [ChunkRecord.from_metadata(meta) for meta in metas]
    headings = sorted({(r.headings or r.title).split(" > ")[-1].strip() for r in records} - {""})
    asked = random.Random(42).sample(headings, args.questions)  # the same draw as before fresh ones were added
    fresh = random.Random(43).sample(sorted(set(headings) - set(asked)), args.questions)
    return [f"What is {h}?" for h in asked], [f"What is {h}?" for h in fresh]


def run_with_app(args, vllm_url: str, collection: str, drawn: tuple[list[str], list[str]], tmp: Path) -> dict:
    from app.vllm.process import app_child, free_port

    port = free_port()
    env = {"PREFIXRAG_VLLM_URL": vllm_url, "PREFIXRAG_CHROMA_PATH": str(args.chroma),
           "PREFIXRAG_COLLECTION": collection, "PREFIXRAG_CONTEXT__HOTNESS_DIR": str(tmp / "hotness")}
    started = time.monotonic()
    app = app_child(tmp / "app.log", env, port).start()
    renice(5)
    try:
        return asyncio.run(phases(args, f"http://127.0.0.1:{port}", vllm_url, app.pid, drawn, started))
    finally:
        app.stop()
        if args.app_log:
            shutil.copyfile(tmp / "app.log", args.app_log)


async def phases(args, url: str, vllm_url: str, pid: int, drawn: tuple[list[str], list[str]],
                 started: float) -> dict:
    questions, fresh_questions = drawn
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=httpx.Limits(max_connections=256)) as client:
        ready_s = await until(lambda: _status(client, "/readyz", 200), started)
        during = [await timed_question(client, q, started, args.gap_s) for q in questions]
        warm_done_s = await until(lambda: _warm_done(client), started, timeout=1800)
        after = [await timed_question(client, q, started, args.gap_s) for q in questions]
        fresh = [await timed_question(client, q, started, args.gap_s) for q in fresh_questions]
        cold = await cold_questions(client, vllm_url, questions, started, args.gap_s)
        single = await load(client, questions, 1, args.single_s)
        rss_before, pauses_before = rss_kib(pid), await app_pauses(client)
        loaded = await load(client, questions, args.clients, args.load_s)
        rss_after, pauses_after = rss_kib(pid), await app_pauses(client)
        readiness = (await client.get("/readyz")).json()
    ratios = [d["ttft_ms"] / a["ttft_ms"] for d, a in zip(during, after)]
    admitted = [r["ms"] for r in loaded["requests"] if r["status"] == 200]
    single_p50 = percentile([r["ms"] for r in single["requests"] if r["status"] == 200], 50)
    return {
        "ready_s": round(ready_s, 1), "warmup_done_s": round(warm_done_s, 1), "warmup": readiness["warmup"],
        "during_warmup": during, "after_warmup": after, "fresh_after_warmup": fresh, "cold_idle": cold,
        "cached_share": {"during_warmup": cached_share(during), "fresh_after_warmup": cached_share(fresh)},
        "fresh_median_ttft_ms": percentile([r["ttft_ms"] for r in fresh], 50),
        "first_ttft_ratio": round(ratios[0], 2), "median_ttft_ratio": round(percentile(ratios, 50), 2),
        "asked_while_warming": sum(d["warming"] for d in during),
        "single": single | {"p50_ms": single_p50},
        "load": loaded | {"clients": args.clients, "p50_ms": percentile(admitted, 50),
                          "p99_ms": percentile(admitted, 99),
                          "p99_over_single_p50": round(percentile(admitted, 99) / single_p50, 2),
                          "app_pauses": {series: {key: round(value - pauses_before.get(series, {}).get(key, 0), 1)
                                                  for key, value in counts.items()}
                                         for series, counts in pauses_after.items()}},
        "rss_kib": [rss_before, rss_after], "rss_growth": round(rss_after / rss_before - 1, 3),
    }


async def timed_question(client: httpx.AsyncClient, question: str, started: float, gap_s: float,
                         max_tokens: int | None = None) -> dict:
    warming = (await client.get("/readyz")).json()["warmup"]["state"] == "warming"
    sent = time.monotonic()
    first, done = None, {}
    body = {"question": question, "stream": True} | ({"max_tokens": max_tokens} if max_tokens else {})
    async with aconnect_sse(client, "POST", "/ask", json=body) as source:
        response = source.response
        if response.status_code == 200:  # else a JSON error body (429, 503), not a stream
            async for event in source.aiter_sse():
                if first is None and event.event == "delta":
                    first = time.monotonic()
                elif event.event == "done":
                    done = event.json()
    await asyncio.sleep(gap_s)
    return {"question": question, "t_s": round(sent - started, 2), "status": response.status_code,
            "ttft_ms": round(((first or time.monotonic()) - sent) * 1000, 1), "warming": warming,
            "server_ms": done.get("timings_ms"), "usage": done.get("usage")}


def cached_share(rows: list[dict]) -> float:
    """The share of these answers' prompt tokens that vLLM found cached."""
    usages = [r["usage"] for r in rows if r["usage"]]
    return round(sum(u["cached_tokens"] for u in usages) / max(1, sum(u["prompt_tokens"] for u in usages)), 3)


async def cold_questions(client: httpx.AsyncClient, vllm_url: str, questions: list[str], started: float,
                         gap_s: float) -> list[dict]:
    """Each question on an idle server with an empty prefix cache ([] where vLLM is not in dev mode)."""
    rows = []
    for question in questions:
        reset = await client.post(vllm_url.removesuffix("/v1") + "/reset_prefix_cache")
        if reset.status_code != 200:
            return []
        rows.append(await timed_question(client, question, started, gap_s))
    return rows


async def until(check, started: float, timeout: float = 600) -> float:
    """Seconds since ``started`` when ``check()`` first held."""
    while not await check():
        if time.monotonic() - started > timeout:
            raise TimeoutError("the app did not get there in time")
        await asyncio.sleep(0.2)
    return time.monotonic() - started


async def _status(client: httpx.AsyncClient, path: str, status: int) -> bool:
    try:
        return (await client.get(path)).status_code == status
    except httpx.HTTPError:
        return False


async def _warm_done(client: httpx.AsyncClient) -> bool:
    return not (await client.get("/readyz")).json()["warmup"]["state"].startswith("warming")


def summary_line(r: dict) -> str:
    load = r["load"]
    return (f"ready after {r['ready_s']} s, pre-warm done after {r['warmup_done_s']} s ({r['warmup']['state']}); "
            f"first question TTFT {r['during_warmup'][0]['ttft_ms']} ms during pre-warm vs "
            f"{r['after_warmup'][0]['ttft_ms']} ms after (x{r['first_ttft_ratio']}, median x{r['median_ttft_ratio']}), "
            f"{r['cold_idle'][0]['ttft_ms'] if r['cold_idle'] else '-'} ms cold on an idle server; "
            f"questions never asked before, after pre-warm: {100 * r['cached_share']['fresh_after_warmup']:.0f} % "
            f"of their prompts cached, TTFT p50 {r['fresh_median_ttft_ms']} ms; "
            f"{load['clients']} clients: {load['statuses']}, p99 {load['p99_ms']} ms = x{load['p99_over_single_p50']} "
            f"single p50 {r['single']['p50_ms']} ms; /healthz p99 {load['healthz_p99_ms']} ms; "
            f"RSS +{100 * r['rss_growth']:.1f} %")


if __name__ == "__main__":
    raise SystemExit(main())
