"""``python -m bench.scale_out --data DIR``: N vLLM replicas behind vllm-router against one replica, and a replica
SIGKILLed mid-run.

Starts the topology with ``app.vllm.cluster`` (the CPU test model, or ``--model`` with ``--launcher-args``, e.g.
two CUDA replicas sharing one GPU, dev mode) and replays one seeded question stream through the service's pipeline
(the default strategy, its pre-warm first), caches reset in between: ``single`` straight to replica 0; ``routed``
through the router (counters summed over the replicas, each one's share of requests and prompt tokens); with
``--skew S``, ``skewed_single`` and ``skewed_routed``, the same for a stream drawn Zipf-like over documents (a few
hot ones: does ``consistent_hash`` pile them onto one replica?); ``failover`` through the router with one replica
SIGKILLed once ``--kill-after`` questions are answered: every question's status and time, when the router marked
the replica unhealthy (polled on its /workers), and which requests failed before and after that.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import add_stream_args, command_line, environment, write_json
from bench.datasets import load_dataset, sample, zipf_sample


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.scale_out", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_stream_args(p, questions=300, concurrency=4)
    p.add_argument("--replicas", type=int, default=2, help="vLLM replicas behind the router")
    p.add_argument("--kill-after", type=int, help="failover: SIGKILL the last replica after this many answers "
                   "(default: half the questions)")
    p.add_argument("--max-model-len", type=int, default=32768, help="each replica's window")
    p.add_argument("--model", help="what each replica serves (default: the CPU test model)")
    p.add_argument("--launcher-args", default="", help="further `python -m app.vllm_server` flags for each "
                   "replica, one string (e.g. '--load-format dummy --gpu-memory-utilization 0.42')")
    p.add_argument("--router-policy", help="vllm-router's --policy (default: the stack's, "
                   "app.vllm.cluster.ROUTER_FLAGS; e.g. consistent_hash to compare)")
    p.add_argument("--skew", type=float, default=0.0, help="also replay a stream drawn Zipf-like over documents "
                   "with this exponent (e.g. 1.1), single and routed (0: no skewed phases)")
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
        model = ["--model", args.model] if args.model else ["--test-model"]
        flags = [*model, "--dev-mode", "--max-model-len", str(args.max_model_len), *shlex.split(args.launcher_args)]
        with Cluster(args.replicas, flags, Path(tmp) / "logs", first_vllm_port=free_port(), router_port=None,
                     router_metrics_port=None, chroma_port=None, chroma_path=Path(tmp),
                     **({"router_policy": args.router_policy} if args.router_policy else {})) as cluster:
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

    streams = {"": stream}
    if args.skew:
        streams["skewed_"] = zipf_sample(dataset.questions, args.questions, args.seed, args.skew)
    phases = {}
    single = await Harness.create(dataset, cluster.replica_urls[0] + "/v1", chroma, args)
    try:
        for name, questions in streams.items():
            await single.fleet.reset()  # the other replicas stay empty and idle during this phase
            phases[f"{name}single"] = await single.run_mode("prefixrag", questions, [])
    finally:
        await single.close()
    routed = await Harness.create(dataset, cluster.router_url, chroma, args)
    try:
        for name, questions in streams.items():
            phases[f"{name}routed"] = await routed.run_mode("prefixrag", questions, [])
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
    failover = phases["failover"]
    figures: dict = {}
    for name in ("", "skewed_"):
        if f"{name}routed" in phases:
            figures |= {f"{name}{key}": value
                        for key, value in split(phases[f"{name}single"], phases[f"{name}routed"]).items()}
    return figures | {"failover_answered": f"{failover['answered']}/{failover['questions']}",
                      "failover_notice_delay_s": failover["notice_delay_s"],
                      "failover_failed_after_notice": failover["failed_after_notice"]}


def split(single: dict, routed: dict) -> dict:
    """One stream, one replica against the router: hit rates, each replica's shares, the busiest one's load against
    the mean (requests), recall."""
    requests = [r["request_share"] for r in routed["replicas"].values()]
    return {"single_hit_rate": single["hit_rate"], "routed_hit_rate": routed["hit_rate"],
            "routed_vs_single": round(routed["hit_rate"] / single["hit_rate"], 4) if single["hit_rate"] else None,
            "request_shares": requests, "token_shares": [r["token_share"] for r in routed["replicas"].values()],
            "busiest_vs_mean": round(max(requests) * len(requests), 3) if requests else None,
            "spread_requests": routed.get("spread", {}).get("requests"),
            "single_recall": single["recall"], "routed_recall": routed["recall"]}


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    failover = payload["failover"]
    routes = [name for name in ("routed", "skewed_routed") if name in payload]
    fig, (hits, shares, timeline) = plt.subplots(1, 3, figsize=(15, 4))
    bars = [name for name in ("single", "routed", "skewed_single", "skewed_routed") if name in payload]
    hits.bar([name.replace("_", "\n") for name in bars], [payload[name]["hit_rate"] for name in bars],
             color="#2e5bff")
    hits.set_ylim(0, 1)
    hits.set_title("prefix-cache hit rate (vLLM counters)")
    names = [f"replica {i}" for i in range(len(payload["routed"]["replicas"]))]
    width = 0.8 / (2 * len(routes))
    for n, (route, share) in enumerate((r, s) for r in routes for s in ("request_share", "token_share")):
        shares.bar([x + (n - len(routes) + 0.5) * width for x in range(len(names))],
                   [replica[share] for replica in payload[route]["replicas"].values()], width,
                   label=f"{route}: {share.removesuffix('_share')}s")
    shares.set_xticks(list(range(len(names))), names)
    shares.set_ylim(0, 1)
    shares.legend(fontsize=7)
    shares.set_title("each replica's share")
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
                 f"{payload['config']['concurrency']}, {payload['config'].get('model') or 'CPU test model'}, router "
                 f"{payload['config'].get('router_policy') or 'default'}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
