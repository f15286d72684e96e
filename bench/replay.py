"""``python -m bench.replay --prompts DIR --vllm-url URL``: replay the exact prompt token streams that
``bench.prefix_cache --dump-prompts DIR`` wrote, against any vLLM server (e.g. a GPU one), and report the same
hit-rate and TTFT figures, without the rest of the stack (no Chroma, no embedder).

Each ``<mode>.jsonl`` (or ``.jsonl.gz``) in DIR is replayed at every ``--concurrency`` given, each time on a
freshly reset prefix cache warmed with that mode's own pre-warm prompts. Beside the client-side TTFT it reports
vLLM's own per-request means (TTFT, queue, prefill) from its histograms: the difference between the two is
time spent outside the engine (HTTP, streaming, the API server).

Given a vllm-router's URL, each prompt is sent with the routing key it was first sent with (``prefix_key``, in
the dump), the counters are summed over the router's replicas (each reset on its own) and each replica's share
of requests and prompt tokens is reported (``bench.fleet``)."""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import time
from pathlib import Path

import httpx

from app.vllm.prometheus import metric_total, parse_metric_labels
from bench.ceiling import BlockCacheCeiling
from bench.common import environment, write_json
from bench.fleet import Fleet, counters_of, difference
from bench.stats import ms_summary

# vLLM's per-request histograms (seconds); the mean over a mode is (sum delta) / (count delta).
SERVER_HISTOGRAMS = {"ttft": "vllm:time_to_first_token_seconds", "queue": "vllm:request_queue_time_seconds",
                     "prefill": "vllm:request_prefill_time_seconds", "e2e": "vllm:e2e_request_latency_seconds"}


def load_rows(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def mode_name(path: Path) -> str:
    return path.name.removesuffix(".gz").removesuffix(".jsonl")


def server_means(before: str, after: str) -> dict[str, float | None]:
    means = {}
    for key, name in SERVER_HISTOGRAMS.items():
        count = metric_total(after, name + "_count") - metric_total(before, name + "_count")
        total = metric_total(after, name + "_sum") - metric_total(before, name + "_sum")
        means[f"{key}_mean_ms"] = round(total / count * 1000, 2) if count else None
    return means


AFFINITY_HEADER = "X-Session-ID"  # what vllm-router's consistent_hash reads (app.core.settings.VLLMSettings)


def routing(row: dict) -> dict[str, str]:
    return {AFFINITY_HEADER: row["prefix_key"]} if row.get("prefix_key") else {}


async def stream_one(client: httpx.AsyncClient, model: str, row: dict) -> tuple[float, int] | None:
    """Send one prompt streamed; return (client TTFT seconds, cached tokens), or None on an error status."""
    body = {"model": model, "prompt": row["prompt_token_ids"], "max_tokens": row["max_tokens"],
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    started, first, cached = time.perf_counter(), None, 0
    async with client.stream("POST", "/v1/completions", json=body, headers=routing(row)) as response:
        if response.status_code != 200:
            return None
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and first is None:
                first = time.perf_counter()
            if chunk.get("usage"):
                cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return (first or time.perf_counter()) - started, cached


async def replay_mode(client: httpx.AsyncClient, fleet: Fleet, model: str, rows: list[dict], concurrency: int,
                      block: int) -> dict:
    try:
        await fleet.reset()
    except httpx.HTTPStatusError as exc:
        print(f"warning: could not reset the prefix cache ({exc.response.status_code}); start vLLM with "
              "VLLM_SERVER_DEV_MODE=1 for comparable numbers")
    warmups = [row for row in rows if row.get("warmup")]
    rows = [row for row in rows if not row.get("warmup")]
    for row in warmups:  # the service's pre-warm, replayed before the counters are read
        warm = await client.post("/v1/completions", json={"model": model, "prompt": row["prompt_token_ids"],
                                                          "max_tokens": 1, "temperature": 0}, headers=routing(row))
        warm.raise_for_status()
    before_texts = await fleet.metrics()
    queue: asyncio.Queue = asyncio.Queue()
    for row in rows:
        queue.put_nowait(row)
    outcomes: list[tuple[float, int] | None] = []

    async def worker():
        while not queue.empty():
            outcomes.append(await stream_one(client, model, queue.get_nowait()))

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - started
    after_texts = await fleet.metrics()
    before, after = "\n".join(before_texts.values()), "\n".join(after_texts.values())
    counted = difference({s: counters_of(t) for s, t in before_texts.items()},
                         {s: counters_of(t) for s, t in after_texts.items()})
    ok = [o for o in outcomes if o is not None]
    hits, queries = counted["hits"], counted["queries"]
    ceiling = BlockCacheCeiling(block)
    for row in warmups:
        ceiling.prime(row["prompt_token_ids"])
    for row in rows:
        ceiling.add(row["prompt_token_ids"])
    prompt_tokens = sum(len(r["prompt_token_ids"]) for r in rows)
    return {"concurrency": concurrency, "questions": len(rows), "errors": len(outcomes) - len(ok),
            "warmup_prompts": len(warmups), "hit_rate": round(hits / queries, 4) if queries else 0.0,
            "ceiling": round(ceiling.hit_rate, 4), "ttft_ms": ms_summary([o[0] for o in ok]),
            "server_ms": server_means(before, after),
            "mean_prompt_tokens": round(prompt_tokens / max(len(rows), 1), 1),
            "mean_cached_tokens": round(sum(o[1] for o in ok) / max(len(ok), 1), 1),
            "throughput_qps": round(len(ok) / wall, 3), "prompt_tokens_per_s": round(prompt_tokens / wall),
            **({"replicas": counted["servers"]} if fleet.routed else {})}


async def server_identity(client: httpx.AsyncClient) -> dict:
    models = (await client.get("/v1/models")).json()["data"]
    version = await client.get("/version")
    cache = parse_metric_labels((await client.get("/metrics")).text, "vllm:cache_config_info") or {}
    return {"model": models[0]["id"], "max_model_len": models[0].get("max_model_len"),
            "vllm_version": version.json().get("version") if version.status_code == 200 else None,
            "block_size": int(cache.get("block_size") or 16), "cache_config": cache}


async def run(args) -> dict:
    root = args.vllm_url.rstrip("/").removesuffix("/v1")
    wanted = [m.strip() for m in args.modes.split(",")] if args.modes else None
    paths = sorted(p for p in args.prompts.iterdir() if p.name.endswith((".jsonl", ".jsonl.gz")))
    paths = [p for p in paths if wanted is None or mode_name(p) in wanted]
    if wanted is not None:  # keep the order asked for
        paths.sort(key=lambda p: wanted.index(mode_name(p)))
    fleet = await Fleet.discover(args.vllm_url, args.replica_metrics)
    async with httpx.AsyncClient(base_url=root, timeout=600) as client:
        server = await server_identity(client)
        results = []
        for path in paths:
            rows = load_rows(path)
            for concurrency in args.concurrency:
                result = {"mode": mode_name(path)} | await replay_mode(client, fleet, server["model"], rows,
                                                                      concurrency, server["block_size"])
                print(json.dumps(result), flush=True)
                results.append(result)
    await fleet.aclose()
    config = {"prompts": str(args.prompts), "concurrency": args.concurrency, "modes": args.modes,
              "out": str(args.out), "label": args.label}
    return {"config": config, "vllm_url": args.vllm_url, "server": server, "results": results,
            "environment": environment()}


def concurrency_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("concurrency: comma list of integers >= 1, e.g. 1,8,32")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.replay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=Path, required=True, help="folder of <mode>.jsonl[.gz] token streams")
    parser.add_argument("--vllm-url", required=True, help="vLLM base URL (…/v1), started with VLLM_SERVER_DEV_MODE=1")
    parser.add_argument("--replica-metrics", type=lambda text: text.split(","),
                        help="with --vllm-url of a vllm-router: its replicas' URLs, comma-separated (default: read "
                             "from the router's /workers)")
    parser.add_argument("--concurrency", type=concurrency_list, default=[1], help="e.g. 1,8,32 (default 1)")
    parser.add_argument("--modes", help="comma list of modes to replay, in this order (default: every dump)")
    parser.add_argument("--label", help="what the prompts are (e.g. the dataset), for the report")
    parser.add_argument("--out", type=Path, help="JSON result (default: <prompts>/replay.json); a PNG beside it")
    args = parser.parse_args(argv)
    args.out = args.out or args.prompts / "replay.json"
    payload = asyncio.run(run(args))
    write_json(args.out, payload)
    try:
        from bench.stats import plot_replay

        plot_replay(payload["results"], args.out.with_suffix(".png"),
                    f"{args.label or args.prompts.name}: replay on {payload['environment'].get('gpu') or 'CPU'}")
    except ImportError:  # matplotlib is optional where the replay runs; the JSON holds every figure
        print("matplotlib not available: no plot written")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
