"""``python -m bench.refusal_cost --data DATASET``: what one refusal costs the serving process's event loop.

The app as users run it (``python -m app``; ``PREFIXRAG_TRAFFIC__MAX_IN_FLIGHT=1``, else its defaults) against the
CPU test model (or ``--vllm-url``) over a QA dataset's passages. One streamed question with a long answer takes the
one place; then ``--connections`` clients, each on a connection of its own kept open, ask again the moment they are
refused, for ``--duration-s``, from a process of their own sending raw HTTP/1.1 (as little client work as a
request can take, so that the app, not the clients, sets the pace). Reported: refusals a second, the app's
event-loop CPU per refusal (its main thread's CPU over the run, less what the one stream took in a quiet second
before), and the statuses seen. Under a retry storm this is what every probe and admitted answer waits behind.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from bench.common import add_app_stack_args, command_line, environment, on_vllm, warm_app, write_json
from bench.load_report import loop_cpu_seconds

# Raw HTTP/1.1, closed loops on kept-open connections: argv = port, connections, seconds; prints statuses seen.
CLIENTS = r"""
import asyncio, collections, json, sys, time
port, connections, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
body = json.dumps({"question": "What is this about?", "max_tokens": 1}).encode()
request = (b"POST /ask HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
           % len(body)) + body
statuses = collections.Counter()
async def client(deadline):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    while time.monotonic() < deadline:
        writer.write(request)
        head = (await reader.readuntil(b"\r\n\r\n")).split(b"\r\n")
        length = next(int(line.split(b":")[1]) for line in head if line.lower().startswith(b"content-length:"))
        await reader.readexactly(length)
        statuses[head[0].split()[1].decode()] += 1
    writer.close()
async def main():
    deadline = time.monotonic() + seconds
    await asyncio.gather(*(client(deadline) for _ in range(connections)))
asyncio.run(main())
print(json.dumps(statuses))
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.refusal_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_app_stack_args(parser)
    parser.add_argument("--connections", type=int, default=64, help="clients asking again at once (default 64)")
    parser.add_argument("--duration-s", type=float, default=10.0, help="per run (default 10)")
    parser.add_argument("--runs", type=int, default=3, help="runs, one after the other (default 3)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/refusal-cost.json"))
    return parser.parse_args(argv)


async def hold_the_place(url: str) -> asyncio.Task:
    """A streamed question with a long answer, running until cancelled: the one place in flight is taken."""
    streaming = asyncio.Event()

    async def hold() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=None) as http:
            body = {"question": "What is this about?", "max_tokens": 4000, "stream": True}
            while True:  # until admitted
                async with http.stream("POST", "/ask", json=body) as response:
                    if response.status_code == 200:
                        streaming.set()
                    async for _ in response.aiter_bytes():
                        pass
                    if response.status_code != 200:
                        await asyncio.sleep(0.2)  # ask again at once when it ends: the place stays held

    task = asyncio.create_task(hold())
    await asyncio.wait_for(streaming.wait(), 120)
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        response = await http.post("/ask", json={"question": "Is it taken?", "max_tokens": 1})
    assert response.status_code == 429, f"the place is not held: {response.status_code}"
    return task


async def measure(url: str, app_pid: int, args: argparse.Namespace) -> list[dict]:
    holder = await hold_the_place(url)
    quiet = loop_cpu_seconds(app_pid)
    await asyncio.sleep(2.0)
    stream_cpu_per_s = (loop_cpu_seconds(app_pid) - quiet) / 2.0  # the held stream's own relay
    runs = []
    for _ in range(args.runs):
        before, started = loop_cpu_seconds(app_pid), time.monotonic()
        clients = await asyncio.create_subprocess_exec(sys.executable, "-c", CLIENTS, str(urlsplit(url).port),
                                                       str(args.connections), str(args.duration_s),
                                                       stdout=asyncio.subprocess.PIPE)
        statuses = json.loads((await clients.communicate())[0])
        wall_s, cpu_s = time.monotonic() - started, loop_cpu_seconds(app_pid) - before
        refused = statuses.get("429", 0)
        runs.append({"statuses": statuses, "refusals_per_s": round(refused / args.duration_s, 1),
                     "loop_cpu_s": round(cpu_s, 2),
                     "loop_us_per_refusal": round((cpu_s - stream_cpu_per_s * wall_s) / refused * 1e6, 1)
                     if refused else None})
        print(runs[-1], flush=True)
    holder.cancel()
    return runs


def run(args: argparse.Namespace, vllm_url: str, tmp: Path) -> dict:
    env = {"PREFIXRAG_CONTEXT__HOTNESS_DIR": "", "PREFIXRAG_TRAFFIC__MAX_IN_FLIGHT": "1"}
    with warm_app(args, vllm_url, env, tmp / "app.log") as (dataset, url, app):  # pre-warm done: the place is free
        runs = asyncio.run(measure(url, app.pid, args))
    costs = sorted(r["loop_us_per_refusal"] for r in runs if r["loop_us_per_refusal"] is not None)
    return {"dataset": dataset.name, "config": {k: str(v) for k, v in vars(args).items()}, "app_env": env,
            "runs": runs, "loop_us_per_refusal_median": costs[len(costs) // 2] if costs else None}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = on_vllm(args, "bench-refusal-", run) | {"command": command_line("bench.refusal_cost", argv),
                                                  "environment": environment()}
    write_json(args.out, result)
    print(f"event-loop CPU per refusal: {result['loop_us_per_refusal_median']} us (median of {args.runs})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
