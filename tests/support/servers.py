"""Real servers for tests: the vLLM CPU test model, the app under uvicorn, a TCP proxy that can cut the app off
from vLLM (vLLM itself keeps running: restarting it costs ~40 s on CPU), a static site on another origin, and
Debian's chromium driven headless by Playwright (no browser download)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import shutil
import threading
import time
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from app.serve.refusal_protocol import refusing_protocol
from app.vllm.process import free_port, wait_for_http

# A probe (/readyz, /metrics) normally answers in milliseconds, but the app here shares 2 cores (and, in process,
# the GIL) with vLLM and the test; under load its loop stalls for seconds (bench/README.md, live traffic). Tests
# check what a probe says, not how fast: its timeout only bounds a hung app.
PROBE_TIMEOUT = 30
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@contextlib.contextmanager
def browser_page():
    """A page of a fresh headless chromium."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            yield browser.new_page()
        finally:
            browser.close()


@contextlib.contextmanager
def static_site(folder: Path) -> Iterator[str]:
    """``folder`` served over HTTP on a port of its own (another origin than the app's); yields its origin."""
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(folder))
    handler.log_message = lambda *args: None
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def reset_prefix_cache(vllm_url: str) -> None:
    httpx.post(vllm_url.removesuffix("/v1") + "/reset_prefix_cache", timeout=30).raise_for_status()


class AppServer:
    """The real app on a real port, in a background thread (uvicorn runs its lifespan), served as ``python -m app``
    serves it (refusals in the HTTP parser) unless ``http`` names another of uvicorn's protocols; ``asgi``: the
    ASGI callable given to uvicorn, when it wraps ``app``."""

    def __init__(self, app, http: str | None = None, asgi=None) -> None:
        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(asgi or app, host="127.0.0.1", port=self.port, log_level="warning",
                                http=http or refusing_protocol(app))
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> AppServer:
        self.thread.start()
        wait_for_http(self.url + "/healthz", 60)
        return self

    def wait_ready(self, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            response = httpx.get(self.url + "/readyz", timeout=PROBE_TIMEOUT)
            if response.status_code == 200:
                return response.json()
            time.sleep(0.2)
        raise TimeoutError(f"app not ready: {response.json()}")

    def wait_warmed(self, units: int = 0, timeout: float = 60, done: bool = False) -> dict:
        """Wait until background pre-warm has warmed the stable prefix and ``units`` units (or the corpus), or
        with ``done`` until it finished; return /readyz."""
        def warmed(w: dict) -> bool:
            return w["prefix_tokens"] > 0 and w["units_warmed"] >= units and (w["state"] == "done" or not done)

        deadline = time.monotonic() + timeout
        while not warmed((status := httpx.get(self.url + "/readyz", timeout=PROBE_TIMEOUT).json())["warmup"]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"pre-warm did not reach {units} units: {status}")
            time.sleep(0.2)
        return status

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)


class TcpProxy:
    """Forward 127.0.0.1:port -> target; ``down()`` refuses and drops connections, ``up()`` restores."""

    def __init__(self, target_port: int) -> None:
        self.target_port, self.port = target_port, free_port()
        self.loop = asyncio.new_event_loop()
        self.server = None
        self.writers: set[asyncio.StreamWriter] = set()
        self.accepted = 0  # connections clients opened through the proxy
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def up(self) -> None:
        self._call(self._start())

    def down(self) -> None:
        self._call(self._stop())

    async def _start(self) -> None:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)

    async def _stop(self) -> None:
        if self.server:
            self.server.close()
            await self.server.wait_closed()
            self.server = None
        for writer in list(self.writers):
            writer.transport.abort()
        self.writers.clear()

    async def _handle(self, reader, writer) -> None:
        self.accepted += 1
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self.writers |= {writer, up_writer}

        async def pipe(src, dst):
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            with contextlib.suppress(Exception):
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


def proxy_in_front_of(vllm_url: str) -> tuple[TcpProxy, str]:
    """A running proxy to the vLLM at ``vllm_url`` and the ``/v1`` URL to give the app instead."""
    proxy = TcpProxy(int(vllm_url.rsplit(":", 1)[1].split("/")[0]))
    proxy.up()
    return proxy, f"http://127.0.0.1:{proxy.port}/v1"


def http_requests(metrics_text: str) -> dict[tuple[str, str, str], float]:
    """(handler, method, status) -> requests answered, from the service's /metrics."""
    families = text_string_to_metric_families(metrics_text)
    family = next(f for f in families if f.name == "http_requests")
    return {(s.labels["handler"], s.labels["method"], s.labels["status"]): s.value
            for s in family.samples if s.name == "http_requests_total"}
