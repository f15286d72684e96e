"""The app as users start it, over a store ``bench.scale`` built: ``python -m app`` against ``bench.instant_vllm``
(the engine taken out: start-up and memory are the app's own), seconds to ``/readyz`` 200 and resident memory."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import httpx

READY_TIMEOUT_S = 1800.0
WARM_WAIT_S = 120.0  # how long pre-warm is followed after ready (its plan scans the collection)


def app_startup(settings: Any, work: Path) -> dict[str, Any]:
    """Start the instant vLLM and the app over ``settings``' store; measure; stop both."""
    import psutil

    from app.vllm.process import Child, app_child, free_port

    vllm_port, app_port = free_port(), free_port()
    vllm = Child("instant vLLM", [sys.executable, "-m", "bench.instant_vllm", "--port", str(vllm_port)],
                 work / "vllm.log").start()
    chroma = settings.chroma
    store = ({"PREFIXRAG_CHROMA_URL": chroma.url, "PREFIXRAG_CHROMA__LEXICAL_DIR": str(chroma.lexical_dir)}
             if chroma.url else {"PREFIXRAG_CHROMA_PATH": str(chroma.path)})
    env = {"PREFIXRAG_VLLM_URL": f"http://127.0.0.1:{vllm_port}/v1", "PREFIXRAG_COLLECTION": settings.chroma.collection,
           "PREFIXRAG_CONTEXT__HOTNESS_DIR": str(work / "hotness"), **store}
    try:
        vllm.wait_for(f"http://127.0.0.1:{vllm_port}/v1/models", 60)
        started = time.perf_counter()
        app = app_child(work / "app.log", env, app_port).start()
        try:
            url = f"http://127.0.0.1:{app_port}"
            app.wait_for(url + "/readyz", READY_TIMEOUT_S)
            ready_s = time.perf_counter() - started
            process = psutil.Process(app.pid)
            result: dict[str, Any] = {"ready_s": round(ready_s, 2), "rss_mib": rss_mib(process),
                      "processes": 1 + len(process.children(recursive=True))}
            result["warmup"] = follow_warmup(url, started)
            result["rss_mib_after_warmup"] = rss_mib(process)
            return result
        finally:
            app.stop()
    finally:
        vllm.stop()


def rss_mib(process: Any) -> float:
    """Resident memory of the process and every process it started (its ranking workers), MiB."""
    total = process.memory_info().rss
    for child in process.children(recursive=True):
        try:
            total += child.memory_info().rss
        except Exception:  # a child that exited meanwhile
            continue
    return round(total / 2**20, 1)


def follow_warmup(url: str, started: float) -> dict[str, Any]:
    """Pre-warm's progress as ``/readyz`` shows it once it ends, or after ``WARM_WAIT_S``; with the seconds from
    the app's start."""
    deadline = time.perf_counter() + WARM_WAIT_S
    warmup: dict[str, Any] = {}
    while time.perf_counter() < deadline:
        warmup = httpx.get(url + "/readyz", timeout=10).json().get("warmup", {})
        if not str(warmup.get("state", "")).startswith("warming"):
            break
        time.sleep(0.5)
    return warmup | {"seen_at_s": round(time.perf_counter() - started, 2)}
