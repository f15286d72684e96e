"""``python -m bench.replay --prompts DIR --vllm-url URL``: replay the exact prompt token streams that
``bench.prefix_cache --dump-prompts DIR`` wrote, against any vLLM server (e.g. a GPU one), and report the same
hit-rate and TTFT figures, without the rest of the stack (no Chroma, no embedder)."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import httpx

from app.llm import metric_total, parse_metric_labels
from bench.ceiling import BlockCacheCeiling
from bench.common import environment, write_json
from bench.stats import ms_summary


async def replay_mode(client: httpx.AsyncClient, model: str, rows: list[dict], concurrency: int,
                      block: int) -> dict:
    reset = await client.post("/reset_prefix_cache")
    if reset.status_code != 200:
        print(f"warning: could not reset the prefix cache ({reset.status_code}); start vLLM with "
              "VLLM_SERVER_DEV_MODE=1 for comparable numbers")
    warmups = [row for row in rows if row.get("warmup")]
    rows = [row for row in rows if not row.get("warmup")]
    for row in warmups:  # the service's pre-warm, replayed before the counters are read
        warm = await client.post("/v1/completions", json={"model": model, "prompt": row["prompt_token_ids"],
                                                          "max_tokens": 1, "temperature": 0})
        warm.raise_for_status()
    before = (await client.get("/metrics")).text
    queue: asyncio.Queue = asyncio.Queue()
    for row in rows:
        queue.put_nowait(row)
    ttfts, cached, errors = [], [], 0

    async def one(row: dict) -> None:
        nonlocal errors
        body = {"model": model, "prompt": row["prompt_token_ids"], "max_tokens": row["max_tokens"],
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        started, first = time.perf_counter(), None
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                errors += 1
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and first is None:
                    first = time.perf_counter()
                if chunk.get("usage"):
                    details = chunk["usage"].get("prompt_tokens_details") or {}
                    cached.append(details.get("cached_tokens") or 0)
        ttfts.append((first or time.perf_counter()) - started)

    async def worker():
        while not queue.empty():
            await one(queue.get_nowait())

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - started
    after = (await client.get("/metrics")).text
    hits = metric_total(after, "vllm:prefix_cache_hits_total") - metric_total(before, "vllm:prefix_cache_hits_total")
    queries = (metric_total(after, "vllm:prefix_cache_queries_total")
               - metric_total(before, "vllm:prefix_cache_queries_total"))
    ceiling = BlockCacheCeiling(block)
    for row in warmups:
        ceiling.prime(row["prompt_token_ids"])
    for row in rows:
        ceiling.add(row["prompt_token_ids"])
    return {"questions": len(rows), "errors": errors, "hit_rate": round(hits / queries, 4) if queries else 0.0,
            "ceiling": round(ceiling.hit_rate, 4), "ttft_ms": ms_summary(ttfts),
            "mean_prompt_tokens": round(sum(len(r["prompt_token_ids"]) for r in rows) / max(len(rows), 1), 1),
            "mean_cached_tokens": round(sum(cached) / max(len(cached), 1), 1),
            "throughput_qps": round(len(rows) / wall, 3)}


async def run(args) -> dict:
    root = args.vllm_url.rstrip("/").removesuffix("/v1")
    async with httpx.AsyncClient(base_url=root, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        cache = parse_metric_labels((await client.get("/metrics")).text, "vllm:cache_config_info") or {}
        block = int(cache.get("block_size") or 16)
        results = {}
        for path in sorted(args.prompts.glob("*.jsonl")):
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            results[path.stem] = await replay_mode(client, model, rows, args.concurrency, block)
            print(path.stem, json.dumps(results[path.stem]), flush=True)
        return {"vllm_url": args.vllm_url, "model": model, "block_size": block, "results": results,
                "environment": environment()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.replay", description=__doc__)
    parser.add_argument("--prompts", type=Path, required=True, help="folder of <mode>.jsonl token streams")
    parser.add_argument("--vllm-url", required=True, help="vLLM base URL (…/v1)")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--out", type=Path, help="JSON result (default: <prompts>/replay.json)")
    args = parser.parse_args(argv)
    write_json(args.out or args.prompts / "replay.json", asyncio.run(run(args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
