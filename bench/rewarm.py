"""``python -m bench.rewarm``: after an ingest under steady traffic, how soon is the changed corpus warm again, and
what does re-warming cost the users meanwhile?

Per arm (``--beside-users``, one app each, the same corpus copied afresh): the app as users run it (``python -m
app``) is started and its first pre-warm awaited; ``--clients`` closed loops then ask streamed ``/ask`` questions
without pause (a user request is present all the time) for ``--steady-s`` (the baseline), then ``--changed``
documents are edited and ``python -m ingest`` runs beside the traffic; the clients go on until pre-warm has ended
again (or ``--limit-s``). Reported: seconds from the ingest's end to pre-warm's end (read at least a second
after the app's last reload, every 0.2 s), the units it warmed and those it kept unsent, user
TTFT p50/p95/p99 before and during the re-warm, answers/s, and the share of prompt tokens vLLM found cached.
Questions are the corpus's own headings ("What is <heading>?"), drawn with a fixed seed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import command_line, environment, write_json
from bench.live_traffic import timed_question
from bench.stats import percentile

DEFAULT_DATA = Path("../shared/data/fastapi-docs-md/files")
POLL_S = 0.5  # how often the app looks for a changed collection (PREFIXRAG_CHROMA__POLL_S)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.rewarm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help=f"corpus (default {DEFAULT_DATA})")
    parser.add_argument("--vllm-url", help="a running vLLM (default: start the CPU test model, 8192 window)")
    parser.add_argument("--arms", default="0,1", help="PREFIXRAG_WARMUP__BESIDE_USERS of each arm (default 0,1)")
    parser.add_argument("--clients", type=int, default=2, help="closed-loop clients (default 2)")
    parser.add_argument("--changed", type=int, default=35, help="documents edited before the ingest (default 35)")
    parser.add_argument("--steady-s", type=float, default=30.0, help="baseline traffic before the edit (default 30)")
    parser.add_argument("--limit-s", type=float, default=180.0, help="longest wait for the re-warm (default 180)")
    parser.add_argument("--max-tokens", type=int, default=16, help="answer length (default 16)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/rewarm.json"))
    parser.add_argument("--app-log", type=Path, help="keep each arm's app log here, as NAME-arm<N>.log (default: "
                        "discarded)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    arms = [int(arm) for arm in args.arms.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-rewarm-") as tmp:
        if args.vllm_url:
            results = [run_arm(args, args.vllm_url, beside, Path(tmp) / f"arm-{beside}") for beside in arms]
        else:
            from app.vllm.process import LocalVLLM

            with LocalVLLM(Path(tmp) / "vllm.log", max_model_len=8192) as url:
                results = [run_arm(args, url, beside, Path(tmp) / f"arm-{beside}") for beside in arms]
    payload = {"command": command_line("bench.rewarm", argv), "environment": environment(),
               "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "arms": results}
    write_json(args.out, payload)
    plot(payload, args.out.with_suffix(".png"))
    for arm in results:
        print(summary_line(arm))
    return 0


def run_arm(args: argparse.Namespace, vllm_url: str, beside: int, work: Path) -> dict:
    """One app over a fresh copy of the corpus: first pre-warm, baseline traffic, the edit and ingest, re-warm."""
    from app.vllm.process import app_child, free_port

    docs, chroma = work / "docs", work / "chroma"
    shutil.copytree(args.data, docs)
    env = {"PREFIXRAG_VLLM_URL": vllm_url, "PREFIXRAG_CHROMA_PATH": str(chroma), "PREFIXRAG_COLLECTION": "rewarm",
           "PREFIXRAG_CONTEXT__HOTNESS_DIR": str(work / "hotness"), "PREFIXRAG_CHROMA__POLL_S": str(POLL_S),
           "PREFIXRAG_WARMUP__BESIDE_USERS": str(beside)}
    ingest(docs, env)
    questions = headings(chroma)
    port = free_port()
    log = args.app_log.with_name(f"{args.app_log.stem}-arm{beside}.log") if args.app_log else work / "app.log"
    app = app_child(log, env, port).start()
    try:
        return asyncio.run(arm_phases(args, f"http://127.0.0.1:{port}", docs, env, questions)) | {
            "beside_users": beside}
    finally:
        app.stop()


def ingest(docs: Path, env: dict[str, str]) -> float:
    """``python -m ingest`` as users run it; its seconds."""
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "ingest", str(docs)], env=os.environ | env,
                   check=True, stdout=subprocess.DEVNULL)
    return time.monotonic() - started


def headings(chroma: Path) -> list[str]:
    from app.core.embedder import Embedder
    from app.core.records import ChunkRecord
    from app.core.settings import Settings
    from app.core.store import open_collection

    settings = Settings(_env_file=None)
    settings.chroma.path, settings.chroma.collection = chroma, "rewarm"
    metas = open_collection(settings.chroma, Embedder(settings.embedding), create=False).get(
        include=["metadatas"])["metadatas"]
    found = sorted({(r.headings or r.title).split(" > ")[-1].strip()
                    for r in map(ChunkRecord.from_metadata, metas)} - {""})
    return [f"What is {h}?" for h in random.Random(42).sample(found, min(200, len(found)))]


def edit(docs: Path, count: int) -> list[str]:
    """Append a sentence to ``count`` documents (a fixed draw): each is then a changed unit."""
    files = sorted(p for p in docs.rglob("*") if p.is_file())
    chosen = random.Random(7).sample(files, min(count, len(files)))
    for path in chosen:
        path.write_text(path.read_text() + f"\n\nEdited at {time.time():.0f}: this note was added later.\n")
    return [str(p.relative_to(docs)) for p in chosen]


async def arm_phases(args, url: str, docs: Path, env: dict[str, str], questions: list[str]) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        started = time.monotonic()
        while not await _ready(client):
            await asyncio.sleep(0.2)
        first = await warm_ended(client, time.monotonic() + 1800)
        phase: dict[str, str] = {"name": "steady"}  # the phase a question is sent in
        rows: list[dict] = []
        stop = asyncio.Event()
        clients = [asyncio.create_task(ask_forever(client, questions, seed, phase, rows, started, stop, args))
                   for seed in range(args.clients)]
        await asyncio.sleep(args.steady_s)
        phase["name"] = "ingest"
        reloads = await reload_count(client)
        changed = edit(docs, args.changed)
        ingest_s = await asyncio.to_thread(ingest, docs, env)
        ingested = time.monotonic()
        phase["name"] = "rewarm"
        reloaded = await until_reloaded(client, reloads, ingested + 30)
        await asyncio.sleep(2 * POLL_S)  # the app's last reload (the ingest's final stamp) has happened
        second = await warm_ended(client, ingested + args.limit_s)
        rewarm_s = time.monotonic() - ingested
        phase["name"] = "after"
        stop.set()
        await asyncio.gather(*clients)
    return {"first_warmup": first, "changed": len(changed), "ingest_s": round(ingest_s, 1),
            "reload_seen": reloaded, "rewarm": second, "rewarm_s": round(rewarm_s, 1),
            "rewarm_done": not second["state"].startswith("warming"),
            "ttft_ms": {name: ttft(rows, name) for name in ("steady", "ingest", "rewarm")},
            "answers_per_s": {name: throughput(rows, name) for name in ("steady", "rewarm")},
            "cached_share": {name: cached(rows, name) for name in ("steady", "rewarm")},
            "statuses": sorted({r["status"] for r in rows}), "requests": rows}


async def ask_forever(client, questions, seed, phase, rows, started, stop, args) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        name = phase["name"]
        row = await timed_question(client, rng.choice(questions), started, 0.0, max_tokens=args.max_tokens)
        rows.append(row | {"phase": name, "done_s": round(time.monotonic() - started, 2)})  # phase when sent


async def warm_ended(client: httpx.AsyncClient, deadline: float) -> dict:
    """Pre-warm's state once it is no longer warming (or at ``deadline``)."""
    while (warmup := (await client.get("/readyz")).json()["warmup"])["state"].startswith("warming"):
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    return {k: warmup[k] for k in ("state", "units_planned", "units_warmed", "units_kept", "units_too_long", "tokens",
                                   "seconds")}


async def reload_count(client: httpx.AsyncClient) -> float:
    from app.vllm.prometheus import metric_total

    return metric_total((await client.get("/metrics")).text, "prefixrag_collection_reloads_total")


async def until_reloaded(client: httpx.AsyncClient, before: float, deadline: float) -> bool:
    """Until the app has seen the ingest (a collection reload since ``before``): pre-warm starts again then."""
    while await reload_count(client) <= before:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.1)
    return True


async def _ready(client: httpx.AsyncClient) -> bool:
    try:
        return (await client.get("/readyz")).status_code == 200
    except httpx.HTTPError:
        return False


def ttft(rows: list[dict], phase: str) -> dict:
    values = [r["ttft_ms"] for r in rows if r["phase"] == phase and r["status"] == 200]
    return {"n": len(values), **{f"p{q}": percentile(values, q) for q in (50, 95, 99)}} if values else {"n": 0}


def throughput(rows: list[dict], phase: str) -> float | None:
    times = [r["done_s"] for r in rows if r["phase"] == phase and r["status"] == 200]
    return round(len(times) / (max(times) - min(times)), 2) if len(times) > 1 else None


def cached(rows: list[dict], phase: str) -> float | None:
    usages = [r["usage"] for r in rows if r["phase"] == phase and r["usage"]]
    prompt = sum(u["prompt_tokens"] for u in usages)
    return round(sum(u["cached_tokens"] for u in usages) / prompt, 3) if prompt else None


def plot(payload: dict, path: Path) -> None:
    """Per arm, each answer's TTFT at the time it was sent, by phase: the baseline, during the ingest, during
    the re-warm (until pre-warm ended or the limit), after it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = payload["arms"]
    fig, axes = plt.subplots(1, len(arms), figsize=(5.5 * len(arms), 4), sharey=True, squeeze=False)
    for axis, arm in zip(axes[0], arms, strict=True):
        for phase in ("steady", "ingest", "rewarm", "after"):
            rows = [r for r in arm["requests"] if r["phase"] == phase and r["status"] == 200]
            axis.plot([r["t_s"] for r in rows], [r["ttft_ms"] for r in rows], ".", markersize=3, label=phase)
        axis.set_title(f"beside_users={arm['beside_users']}: re-warm {arm['rewarm']['state']} "
                       f"{arm['rewarm_s']} s after the ingest", fontsize=9)
        axis.set_xlabel("seconds since the app was started")
        axis.set_yscale("log")
        axis.legend(fontsize=8)
    axes[0][0].set_ylabel("TTFT (ms)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_line(arm: dict) -> str:
    steady, during = arm["ttft_ms"]["steady"], arm["ttft_ms"]["rewarm"]
    return (f"beside_users={arm['beside_users']}: {arm['changed']} documents changed, re-warm "
            f"{arm['rewarm']['state']} ({arm['rewarm']['units_warmed']}/{arm['rewarm']['units_planned']} units) "
            f"{arm['rewarm_s']} s after the ingest; TTFT p50/p99 {steady.get('p50')}/{steady.get('p99')} ms before, "
            f"{during.get('p50')}/{during.get('p99')} ms during; cached share {arm['cached_share']}")


if __name__ == "__main__":
    raise SystemExit(main())
