"""``bench.live_traffic``'s overload phase: closed-loop clients that wait out each 429's Retry-After, a probe of
``/healthz`` in a process of its own, and what the app spent meanwhile (its pauses, its memory, the machine's CPU)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

import httpx

from bench.stats import percentile

HEALTH_PROBE = """
import http.client, json, sys, time, urllib.parse
url = urllib.parse.urlsplit(sys.argv[1])
connection, latencies = http.client.HTTPConnection(url.hostname, url.port), []
deadline = time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    sent = time.monotonic()
    try:
        connection.request("GET", "/healthz")
        connection.getresponse().read()
    except (OSError, http.client.HTTPException):  # counted at the time it took to fail, then a new connection
        connection.close()
    latencies.append((time.monotonic() - sent) * 1000)
    time.sleep(0.1)
print(json.dumps(latencies))
"""


async def load(client: httpx.AsyncClient, questions: list[str], clients: int, seconds: float) -> dict:
    """``clients`` closed loops of non-streamed /ask for ``seconds``; /healthz sampled every 100 ms beside, from
    a process of its own (this one's event loop, busy with the clients, would add its own delays)."""
    deadline = time.monotonic() + seconds
    requests = []
    probe = await asyncio.create_subprocess_exec(sys.executable, "-c", HEALTH_PROBE, str(client.base_url),
                                                 str(seconds), stdout=asyncio.subprocess.PIPE,
                                                 preexec_fn=lambda: renice(0))

    async def one_client(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < deadline:
            sent = time.monotonic()
            status: int | str
            try:
                response = await client.post("/ask", json={"question": rng.choice(questions)})
                status = response.status_code
            except httpx.TransportError as exc:  # a failure like any other status: recorded, never a crash
                response, status = None, type(exc).__name__
            requests.append({"status": status, "ms": round((time.monotonic() - sent) * 1000, 1)})
            if response is not None and response.status_code == 429:
                await asyncio.sleep(float(response.headers.get("Retry-After", "1")))

    cpu_before = cpu_times()
    await asyncio.gather(*(one_client(seed) for seed in range(clients)))
    cpu = [after - before for before, after in zip(cpu_before, cpu_times())]
    health = json.loads((await probe.communicate())[0])
    statuses: dict[str, int] = {}
    for row in requests:
        statuses[str(row["status"])] = statuses.get(str(row["status"]), 0) + 1
    return {"seconds": seconds, "statuses": statuses, "requests": requests,
            "healthz_p99_ms": round(percentile(health, 99), 1),
            # Where the CPU went meanwhile (shares of all cores' time; steal: taken by the VM's host).
            "cpu_share": {name: round(cpu[i] / sum(cpu), 3) for i, name in CPU_FIELDS.items()}}


PAUSES = {"prefixrag_gc_pause_seconds": "gc", "prefixrag_event_loop_lag_seconds": "loop"}


async def app_pauses(client: httpx.AsyncClient) -> dict[str, dict[str, float]]:
    """The app's pauses so far, from its /metrics: garbage collections (per generation) and event-loop lag (how
    late a task sleeping 0.1 s was resumed): how many, their total, how many over 10 and over 50 ms."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families((await client.get("/metrics")).text):
        if family.name not in PAUSES:
            continue
        for sample in family.samples:
            series = PAUSES[family.name] + (f":{sample.labels['generation']}" if "generation" in sample.labels else "")
            row = found.setdefault(series, {"count": 0, "total_ms": 0.0, "over_10ms": 0, "over_50ms": 0})
            if sample.name.endswith("_count"):
                row["count"] += sample.value
                row["over_10ms"] += sample.value
                row["over_50ms"] += sample.value
            elif sample.name.endswith("_sum"):
                row["total_ms"] += sample.value * 1000
            elif sample.name.endswith("_bucket") and sample.labels["le"] in ("0.01", "0.05"):
                row["over_10ms" if sample.labels["le"] == "0.01" else "over_50ms"] -= sample.value
    return found


CPU_FIELDS = {0: "user", 1: "nice", 2: "system", 3: "idle", 7: "steal"}  # columns of /proc/stat's "cpu" line


def cpu_times() -> list[int]:
    return [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def renice(value: int) -> None:
    """This machine is also the clients': they run at vLLM's nice (+5), as remote clients would not compete with
    the app for its cores; the /healthz probe at the app's (0). (Clients at -5, above the app, measured worse:
    their own CPU then delays the app.) Lowering needs root; else it stays as it is."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, value)
    except PermissionError:
        pass
