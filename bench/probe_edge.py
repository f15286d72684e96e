"""``python -m bench.probe_edge --out bench/results/probe-edge.json``: hostile-input probes of the real stack.

1. Ingest of one 10 MB document into a fresh on-disk Chroma: stored chunks == the chunker's count.
2. The app as its own process (``python -m app``, API key set, real vLLM CPU test model): 16 concurrent 50 MB
   keyless bodies, then 16 concurrent 50 MB bodies with the key (over the body limit): status and latency of
   each, the app's RSS before, at peak and after.
3. schemathesis (``pip install -e .[probe]``) over the app's OpenAPI schema with ``--checks all``.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from app.vllm.process import LocalVLLM, app_child, free_port
from bench.common import command_line, environment, write_json

KEY = "probe-key"
MB = 1024 * 1024
SENTENCES = [f"Harbour log entry {n}: the tide turned at {n % 12} o'clock and the pilot boat {n % 7} left port."
             for n in range(400)]


def big_document_ingest(tmp: Path) -> dict:
    from app.core.embedder import Embedder
    from app.core.settings import Settings
    from ingest.loaders import load_file
    from ingest.pipeline import run_ingest
    from ingest.preparing import chunker_for

    docs = tmp / "big"
    docs.mkdir()
    text = ""
    while len(text) < 10 * MB:  # 400 distinct sentences over and over: 10 MB, few unique chunks to embed
        text += " ".join(SENTENCES) + "\n\n"
    (docs / "manual.txt").write_text(text)
    settings = Settings(_env_file=None)
    settings.chroma.path, settings.chroma.collection = tmp / "big-chroma", "big"
    embedder = Embedder(settings.embedding)
    expected = len(chunker_for(settings, embedder).chunk(load_file(docs / "manual.txt", "manual.txt")[0]))
    started = time.perf_counter()
    report = run_ingest([docs], settings, embedder)
    from app.core.store import open_collection

    stored = open_collection(settings.chroma, embedder, create=False).count()
    return {"bytes": len(text.encode()), "expected_chunks": expected, "stored_chunks": stored,
            "chunks_embedded": report.chunks_embedded, "failed": report.failed,
            "seconds": round(time.perf_counter() - started, 1), "exact": stored == expected}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def settled_rss_mb(pid: int, window_s: float = 5.0, timeout_s: float = 300.0) -> float:
    """The app's RSS once background work (unit pre-warm reads the collection) stops moving it: flat within
    2 MB over ``window_s``; the bodies' effect is measured from there."""
    deadline, samples = time.monotonic() + timeout_s, list[float]()
    while time.monotonic() < deadline:
        samples = (samples + [rss_mb(pid)])[-int(window_s / 0.25):]
        if len(samples) == int(window_s / 0.25) and max(samples) - min(samples) < 2:
            break
        time.sleep(0.25)
    return samples[-1]


async def flood(url: str, headers: dict, count: int = 16, size_mb: int = 50) -> list[dict]:
    piece = b"x" * MB

    async def body():  # streamed without a length, so only the server's counting can stop it
        for _ in range(size_mb):
            yield piece

    async def one(client: httpx.AsyncClient) -> dict:
        started = time.perf_counter()
        outcome: int | str
        try:
            response = await client.post(url + "/ask", content=body(), headers=headers)
            outcome = response.status_code
        except httpx.HTTPError as exc:  # the server answered and closed while we were still sending
            outcome = type(exc).__name__
        return {"status": outcome, "seconds": round(time.perf_counter() - started, 3)}

    async with httpx.AsyncClient(timeout=60) as client:
        return list(await asyncio.gather(*(one(client) for _ in range(count))))


def body_probe(app_url: str, pid: int) -> dict:
    peak, stop = [rss_mb(pid)], threading.Event()

    def sample():
        while not stop.is_set():
            peak.append(rss_mb(pid))
            time.sleep(0.05)

    before = settled_rss_mb(pid)
    sampler = threading.Thread(target=sample)
    sampler.start()
    keyless = asyncio.run(flood(app_url, {"content-type": "application/json"}))
    oversized = asyncio.run(flood(app_url, {"content-type": "application/json", "authorization": f"Bearer {KEY}"}))
    stop.set()
    sampler.join()
    return {"keyless": keyless, "oversized": oversized, "rss_mb": {"before": round(before, 1),
            "peak": round(max(peak), 1), "after": round(rss_mb(pid), 1)},
            "max_seconds": max(r["seconds"] for r in keyless + oversized)}


def schemathesis_probe(app_url: str, examples: int) -> dict:
    argv = [sys.executable, "-m", "schemathesis.cli", "run", f"{app_url}/openapi.json", "--checks", "all",
            "--header", f"Authorization: Bearer {KEY}", "--max-examples", str(examples)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    return {"command": " ".join(argv[2:]), "exit_code": done.returncode, "summary": done.stdout[-4000:]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.probe_edge", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON result")
    parser.add_argument("--examples", type=int, default=50, help="schemathesis examples per operation")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="probe-") as tmp_name, LocalVLLM(Path(tmp_name) / "vllm.log") as vllm:
        tmp = Path(tmp_name)
        result = {"big_document": big_document_ingest(tmp)}
        port = free_port()
        env = {"PREFIXRAG_API_KEY": KEY, "PREFIXRAG_VLLM_URL": vllm, "PREFIXRAG_CHROMA_PATH": str(tmp / "big-chroma"),
               "PREFIXRAG_COLLECTION": "big", "PREFIXRAG_LIMITS__MAX_TOKENS": "8",
               "PREFIXRAG_CONTEXT__HOTNESS_DIR": str(tmp / "hot")}
        app = app_child(tmp / "app.log", env, port).start()
        try:
            app.wait_for(f"http://127.0.0.1:{port}/healthz", 300)
            app.wait_for(f"http://127.0.0.1:{port}/readyz", 300)
            result["bodies"] = body_probe(f"http://127.0.0.1:{port}", app.pid)
            result["schemathesis"] = schemathesis_probe(f"http://127.0.0.1:{port}", args.examples)
        finally:
            app.stop(30)
    write_json(args.out, result | {"command": command_line("bench.probe_edge", argv), "environment": environment()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
