"""``python -m bench.scale_out --data DIR``: N vLLM replicas behind vllm-router against one replica, and a replica
SIGKILLed mid-run.

Starts the topology with ``app.vllm.cluster`` (the CPU test model, dev mode) and replays one seeded question stream
through the service's pipeline (the default strategy, its pre-warm first) three times, caches reset in between:
``single`` straight to replica 0; ``routed`` through the router (counters summed over the replicas, each one's
share of requests and prompt tokens); ``failover`` through the router with one replica SIGKILLed once
``--kill-after`` questions are answered: every question's status and time, when the router marked the replica
unhealthy (polled on its /workers), and which requests failed before and after that.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import add_stream_args, command_line, environment, write_json
from bench.datasets import load_dataset, sample


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.scale_out", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_stream_args(p, questions=300, concurrency=4)
    p.add_argument("--replicas", type=int, default=2, help="vLLM replicas behind the router")
    p.add_argument("--kill-after", type=int, help="failover: SIGKILL the last replica after this many answers "
                   "(default: half the questions)")
    p.add_argument("--max-model-len", type=int, default=32768, help="each replica's window")
    p.add_argument("--chroma-path", type=Path, help="keep the bench collection here (default: a temp dir)")
    p.add_argument("--out", type=Path, required=True, help="JSON result; a PNG plot is written beside it")
    p.set_defaults(dump_prompts=None, replica_metrics=None)  # the harness's options this benchmark does not use
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from app.vllm.cluster import Cluster
    from app.vllm.process import free_port

    args = parse_args(argv)
    args.kill_after = args.kill_after or args.questions // 2
    dataset = load_dataset(args.data)
    stream = sample(dataset.questions, args.questions, args.seed)
    with tempfile.TemporaryDirectory(prefix="scale-out-") as tmp:
        flags = ["--test-model", "--dev-mode", "--max-model-len", str(args.max_model_len)]
        with Cluster(args.replicas, flags, Path(tmp) / "logs", first_vllm_port=free_port(), router_port=None,
                     router_metrics_port=None, chroma_port=None, chroma_path=Path(tmp)) as cluster:
            chroma = args.chroma_path or Path(tmp) / "chroma"
            phases = asyncio.run(_run(args, dataset, stream, cluster, chroma))
    payload = {"command": command_line("bench.scale_out", argv),
               "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "dataset": dataset.name, "environment": environment(), **phases}
    payload["summary"] = summary(phases)
    write_json(args.out, payload)
    plot(payload, args.out.with_suffix(".png"))
    print(payload["summary"])
    return 0


async def _run(args, dataset, stream, cluster, chroma: Path) -> dict:
    from bench.harness import Harness

    single = await Harness.create(dataset, cluster.replica_urls[0] + "/v1", chroma, args)
    try:
        await single.fleet.reset()  # the other replicas stay empty and idle during this phase
        phases = {"single": await single.run_mode("prefixrag", stream, [])}
    finally:
        await single.close()
    routed = await Harness.create(dataset, cluster.router_url, chroma, args)
    try:
        phases["routed"] = await routed.run_mode("prefixrag", stream, [])
        phases["failover"] = await failover(routed, cluster, stream, args)
    finally:
        await routed.close()
    return phases


async def failover(harness, cluster, stream, args) -> dict:
    from bench.modes import Record, run_prefixrag

    victim = len(cluster.replica_urls) - 1
    service = harness.service("prefixrag")
    await harness.fleet.reset()
    await service.warmer.warm(harness.upstream.require())
    started, events, marks = time.monotonic(), [], {}

    async def one(question) -> Record:
        begun = time.monotonic() - started
        try:
            record = await run_prefixrag(question, args.top_k, service, args.max_tokens)
        except Exception as exc:  # every failure is kept with its status: nothing is lost silently
            record = Record(question.id, error=f"{getattr(exc, 'status', '')} {type(exc).__name__}: {exc}")
        events.append({"question_id": question.id, "started_s": round(begun, 3),
                       "finished_s": round(time.monotonic() - started, 3), "error": record.error})
        if len(events) == args.kill_after:
            marks["killed_s"] = time.monotonic() - started
            await asyncio.to_thread(cluster.kill_replica, victim)
        return record

    watcher = asyncio.create_task(_watch_router(cluster, victim, started, marks))
    records = await harness._replay(stream, one)
    watcher.cancel()
    service.planner.close()
    return describe_failover(events, records, marks, cluster.replica_urls[victim])


async def _watch_router(cluster, victim: int, started: float, marks: dict) -> None:
    """Record when the router stops counting the killed replica as healthy."""
    url = cluster.replica_urls[victim]
    async with httpx.AsyncClient(timeout=5) as http:
        while True:
            workers = (await http.get(cluster.router_url.removesuffix("/v1") + "/workers")).json()["workers"]
            if "killed_s" in marks and not next(w["is_healthy"] for w in workers if w["url"] == url):
                marks["router_noticed_s"] = time.monotonic() - started
                return
            await asyncio.sleep(0.1)


def describe_failover(events: list[dict], records, marks: dict, victim: str) -> dict:
    killed, noticed = marks.get("killed_s"), marks.get("router_noticed_s")
    after_kill = [e for e in events if killed is not None and e["finished_s"] > killed]
    # A request that began before the router noticed may have been routed to the dead replica; after, none may fail.
    after_notice = [e for e in events if noticed is not None and e["started_s"] > noticed]
    return {"victim": victim, "killed_s": round(killed, 3) if killed else None,
            "router_noticed_s": round(noticed, 3) if noticed else None,
            "notice_delay_s": round(noticed - killed, 3) if killed and noticed else None,
            "questions": len(records), "answered": sum(r.error is None for r in records),
            "failed": [e for e in events if e["error"]],
            "finished_after_kill": len(after_kill), "failed_after_kill": sum(bool(e["error"]) for e in after_kill),
            "started_after_notice": len(after_notice),
            "failed_after_notice": sum(bool(e["error"]) for e in after_notice),
            "unaccounted": len(records) - len(events), "events": events}


def summary(phases: dict) -> dict:
    single, routed, failover = phases["single"], phases["routed"], phases["failover"]
    return {"single_hit_rate": single["hit_rate"], "routed_hit_rate": routed["hit_rate"],
            "routed_vs_single": round(routed["hit_rate"] / single["hit_rate"], 4) if single["hit_rate"] else None,
            "request_shares": [r["request_share"] for r in routed["replicas"].values()],
            "token_shares": [r["token_share"] for r in routed["replicas"].values()],
            "single_recall": single["recall"], "routed_recall": routed["recall"],
            "failover_answered": f"{failover['answered']}/{failover['questions']}",
            "failover_notice_delay_s": failover["notice_delay_s"],
            "failover_failed_after_notice": failover["failed_after_notice"]}


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    single, routed, failover = payload["single"], payload["routed"], payload["failover"]
    fig, (hits, shares, timeline) = plt.subplots(1, 3, figsize=(15, 4))
    hits.bar(["single replica", f"{len(routed['replicas'])} replicas, router"],
             [single["hit_rate"], routed["hit_rate"]], color="#2e5bff")
    hits.set_ylim(0, 1)
    hits.set_title("prefix-cache hit rate (vLLM counters)")
    names = [f"replica {i}" for i in range(len(routed["replicas"]))]
    width = 0.4
    xs = range(len(names))
    shares.bar([x - width / 2 for x in xs], [r["request_share"] for r in routed["replicas"].values()], width,
               label="requests")
    shares.bar([x + width / 2 for x in xs], [r["token_share"] for r in routed["replicas"].values()], width,
               label="prompt tokens")
    shares.set_xticks(list(xs), names)
    shares.set_ylim(0, 1)
    shares.legend()
    shares.set_title("each replica's share (routed)")
    for status, colour in (("ok", "#2e5bff"), ("error", "#d62728")):
        chosen = [e for e in failover["events"] if bool(e["error"]) == (status == "error")]
        timeline.scatter([e["finished_s"] for e in chosen], [e["finished_s"] - e["started_s"] for e in chosen],
                         s=8, color=colour, label=status)
    for key, style in (("killed_s", "--"), ("router_noticed_s", ":")):
        if failover.get(key):
            timeline.axvline(failover[key], color="black", linestyle=style, label=key.removesuffix("_s"))
    timeline.set_xlabel("seconds into the failover run")
    timeline.set_ylabel("request latency (s)")
    timeline.legend()
    timeline.set_title(f"one replica SIGKILLed: {failover['answered']}/{failover['questions']} answered")
    fig.suptitle(f"{payload['dataset']}: {payload['config']['questions']} questions, concurrency "
                 f"{payload['config']['concurrency']}, CPU test model")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
