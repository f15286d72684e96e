"""``python -m bench.retry_storm --data DATASET``: refusals under a retry storm. The app as users run it (default
settings) against the CPU test model (or ``--vllm-url``), over a QA dataset's passages; for ``--duration-s``:

- ``--storm`` clients that ignore ``Retry-After`` and send their question again at once after a 429;
- ``--obeying`` clients that wait each 429's ``Retry-After`` before asking again, as a well-behaved client does;
- ``/healthz`` probed every 100 ms from a process of its own.

Every client has a connection of its own, kept open, as separate users' clients do.

The clients run at vLLM's nice (+5, as ``bench.live_traffic``'s), the app and the probe at 0: on this machine the
clients share the app's two cores, and remote clients would not.

It reports every status, how long a 429 took to come back (p50/p95/p99; as the storm's clients saw it, and as a
probe asking every 100 ms from a process of its own saw it), ``/healthz``'s latency, the obeying clients'
retries and how many of them were admitted, the ``Retry-After`` values given, the app's event-loop CPU, its
loop's lag and garbage-collection pauses during the storm (how many over 10 and 50 ms), and the admission limit
as ``/readyz`` reported it once a second (with ``auto``: where vLLM's queue moved it).
Targets (issue 37): 429 p99 <= 100 ms and ``/healthz`` p99 <= 50 ms on the 2-core CPU; an obeying client admitted
on >= 50 % of its retries."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.common import add_app_stack_args, command_line, environment, on_vllm, warm_app, write_json
from bench.datasets import sample
from bench.live_load import HEALTH_PROBE, app_pauses, renice
from bench.load_report import loop_cpu_seconds
from bench.stats import percentile

# A storm client's own loop shares the two cores with vLLM and lags: what the app takes to refuse is measured by
# this probe instead, a process of its own at the app's nice, asking every 100 ms (as HEALTH_PROBE does /healthz).
REFUSAL_PROBE = """
import http.client, json, sys, time, urllib.parse
url = urllib.parse.urlsplit(sys.argv[1])
body = json.dumps({"question": "What is this about?", "max_tokens": 1})
connection, seen = http.client.HTTPConnection(url.hostname, url.port), []
deadline = time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    sent = time.monotonic()
    try:
        connection.request("POST", "/ask", body, {"content-type": "application/json"})
        response = connection.getresponse()
        response.read()
        seen.append([response.status, (time.monotonic() - sent) * 1000])
    except (OSError, http.client.HTTPException):
        connection.close()
    time.sleep(0.1)
print(json.dumps(seen))
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.retry_storm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_app_stack_args(parser)
    parser.add_argument("--storm", type=int, default=64, help="clients that retry at once after a 429")
    parser.add_argument("--obeying", type=int, default=8, help="clients that wait each 429's Retry-After")
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--max-tokens", type=int, default=32, help="answer tokens per question")
    parser.add_argument("--app-env", action="append", default=[], metavar="PREFIXRAG_X=V",
                        help="a setting for the app, besides the benchmark's own (repeatable)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/retry-storm.json"))
    parser.add_argument("--app-log", type=Path, help="keep the app's log here (default: discarded)")
    return parser.parse_args(argv)


@dataclass
class Tally:
    """What one kind of client saw."""

    statuses: dict[str, int] = field(default_factory=dict)
    refused_ms: list[float] = field(default_factory=list)  # how long each 429 took
    answered_ms: list[float] = field(default_factory=list)
    retry_after: dict[str, int] = field(default_factory=dict)
    retries: int = 0  # requests sent after a 429 (obeying: after waiting its Retry-After)
    retries_admitted: int = 0

    def add(self, status: int | str, ms: float, retry: bool, retry_after: str | None) -> None:
        self.statuses[str(status)] = self.statuses.get(str(status), 0) + 1
        (self.refused_ms if status == 429 else self.answered_ms).append(ms)
        if retry_after is not None:
            self.retry_after[retry_after] = self.retry_after.get(retry_after, 0) + 1
        if retry:
            self.retries += 1
            self.retries_admitted += status == 200

    def report(self) -> dict:
        def ms(values: list[float]) -> dict[str, float]:
            return {f"p{q}": round(percentile(values, q), 1) for q in (50, 95, 99)} if values else {}

        return {"statuses": self.statuses, "refused_ms": ms(self.refused_ms), "answered_ms": ms(self.answered_ms),
                "retry_after_s": self.retry_after, "retries": self.retries,
                "retries_admitted": round(self.retries_admitted / self.retries, 3) if self.retries else None}


async def client(http: httpx.AsyncClient, questions: list[str], tally: Tally, obeys: bool, deadline: float,
                 max_tokens: int, seed: int) -> None:
    turn, retry = seed, False
    while time.monotonic() < deadline:
        question = questions[turn % len(questions)]
        sent = time.monotonic()
        try:
            response = await http.post("/ask", json={"question": question, "max_tokens": max_tokens})
            status: int | str = response.status_code
            retry_after = response.headers.get("retry-after") if status == 429 else None
        except httpx.TransportError as exc:
            status, retry_after = type(exc).__name__, None
        tally.add(status, (time.monotonic() - sent) * 1000, retry, retry_after)
        retry = status == 429  # the same question again
        if not retry:
            turn += 1
        elif obeys:
            await asyncio.sleep(float(retry_after or 1))


async def admission_limits(url: str, deadline: float) -> list[float]:
    """The admission limit as ``/readyz`` reports it, once a second until ``deadline``."""
    seen: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
                seen.append(float((await http.get("/readyz")).json()["traffic"]["max_in_flight"]))
            await asyncio.sleep(1)
    return seen


def spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "p10": percentile(values, 10), "p50": percentile(values, 50),
            "p90": percentile(values, 90), "max": max(values), "samples": len(values)} if values else {}


async def storm(url: str, questions: list[str], args: argparse.Namespace, app_pid: int) -> dict:
    probe = await asyncio.create_subprocess_exec(sys.executable, "-c", HEALTH_PROBE, url, str(args.duration_s),
                                                 stdout=asyncio.subprocess.PIPE, preexec_fn=lambda: renice(0))
    refusals = await asyncio.create_subprocess_exec(sys.executable, "-c", REFUSAL_PROBE, url, str(args.duration_s),
                                                    stdout=asyncio.subprocess.PIPE, preexec_fn=lambda: renice(0))
    stormy, obeying = Tally(), Tally()
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        pauses_before = await app_pauses(http)
    deadline = time.monotonic() + args.duration_s
    loop_before, clients_before = loop_cpu_seconds(app_pid), time.thread_time()
    # Each client its own connection, kept open (HTTP/1.1 keep-alive), as separate users' clients have.
    def connection() -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=1))

    async def one(obeys: bool, seed: int) -> None:
        async with connection() as http:
            await client(http, questions, obeying if obeys else stormy, obeys, deadline, args.max_tokens, seed)

    limits = asyncio.create_task(admission_limits(url, deadline))
    await asyncio.gather(*(one(False, i) for i in range(args.storm)),
                         *(one(True, 1000 + i) for i in range(args.obeying)))
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        pauses = await app_pauses(http)
    health = json.loads((await probe.communicate())[0])
    probed = Tally()
    for status, ms in json.loads((await refusals.communicate())[0]):
        probed.add(status, ms, False, None)
    return {"storm": stormy.report(), "obeying": obeying.report(), "probe": probed.report(),
            "healthz_ms": {f"p{q}": round(percentile(health, q), 1) for q in (50, 95, 99)},
            "app_loop_cpu_s": round(loop_cpu_seconds(app_pid) - loop_before, 2),
            # The serving loop's own stalls meanwhile: its lag (a task sleeping 0.1 s resumed late) and GC pauses.
            "app_pauses": {series: {key: round(value - pauses_before.get(series, {}).get(key, 0), 1)
                                    for key, value in row.items()} for series, row in pauses.items()},
            "clients_cpu_s": round(time.thread_time() - clients_before, 2), "admission_limit": spread(await limits)}


def run(args: argparse.Namespace, vllm_url: str, tmp: Path) -> dict:
    env = {"PREFIXRAG_CONTEXT__HOTNESS_DIR": str(tmp / "hotness")} | dict(pair.split("=", 1) for pair in args.app_env)
    with warm_app(args, vllm_url, env, args.app_log or tmp / "app.log") as (dataset, url, app):
        renice(5)  # the clients at vLLM's nice, as in bench.live_traffic: remote clients would not take its cores
        questions = [q.text for q in sample(dataset.questions, 2000, 0)]
        result = asyncio.run(storm(url, questions, args, app.pid))
    return {"dataset": dataset.name, "config": {k: str(v) for k, v in vars(args).items()}, "app_env": env} | result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = on_vllm(args, "bench-storm-", run) | {"command": command_line("bench.retry_storm", argv),
                                                  "environment": environment()}
    write_json(args.out, result)
    s, o = result["storm"], result["obeying"]
    p = result["probe"]["refused_ms"]
    print(f"429 p50/p99 {s['refused_ms'].get('p50')}/{s['refused_ms'].get('p99')} ms (probe {p.get('p50')}/"
          f"{p.get('p99')} ms); /healthz p99 "
          f"{result['healthz_ms']['p99']} ms; obeying retries admitted {o['retries_admitted']} of {o['retries']}; "
          f"statuses storm {s['statuses']} obeying {o['statuses']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
