"""``python -m app``: serve ``create_app(Settings())`` with uvicorn. Every setting comes from the environment
(``PREFIXRAG_*``, ``.env``); the flags below override the few a person changes at the command line."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import socket
import sys
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn
from pydantic import ValidationError

from app.core.version import add_version
from app.runtime.cutoff import Cutoff

CLOSE_S = 2.0  # at most, between ending the requests still running and cutting what has not ended
log = logging.getLogger("prefixrag")

if TYPE_CHECKING:
    from fastapi import FastAPI

    from app.core.settings import Settings
    from app.serve.observability import Logs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m app", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Settings: see docs/configuration.md (e.g. PREFIXRAG_VLLM_URL, "
                                            "PREFIXRAG_CHROMA_PATH, PREFIXRAG_COLLECTION, PREFIXRAG_API_KEY).")
    parser.add_argument("--host", help="bind address (PREFIXRAG_SERVICE__HOST, default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (PREFIXRAG_SERVICE__PORT, default 8080)")
    parser.add_argument("--workers", metavar="N",
                        help="processes that rank questions beside the serving one: encoder, Chroma query, BM25 "
                             "(PREFIXRAG_RETRIEVAL__WORKERS; default auto: one per two cores, at most 8, on 8 cores or "
                             "more; 0: rank in the serving process)")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"],
                        help="lowest level logged (PREFIXRAG_SERVICE__LOG_LEVEL, default info)")
    parser.add_argument("--log-format", choices=["text", "json"],
                        help="text lines, or one JSON object per line (PREFIXRAG_SERVICE__LOG_FORMAT, default text)")
    parser.add_argument("--reload", action="store_true", help="restart on code changes (development)")
    return add_version(parser).parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from app.core.settings import Settings, UnknownSetting, environment_of, invalid_setting, overridden
    from app.serve.observability import configure_logging

    args = parse_args(argv)
    flags = {"service.host": args.host, "service.port": args.port, "retrieval.workers": args.workers,
             "service.log_level": args.log_level, "service.log_format": args.log_format}
    try:
        settings = overridden(Settings(), flags)
    except (ValidationError, UnknownSetting) as exc:
        print(f"error: {invalid_setting(exc)}", file=sys.stderr)
        return 2
    service = settings.service
    logs = configure_logging(service.log_level, service.log_repeats_s, service.log_format)
    # log_config=None: uvicorn's lines go through ours (request id, quiet probes).
    options: dict[str, Any] = {"host": service.host, "port": service.port, "log_level": service.log_level,
                               "timeout_keep_alive": service.keep_alive_s, "log_config": None}
    if args.reload:  # a --reload worker is another process: it reads the flags from the environment
        os.environ.update(environment_of(flags))
        uvicorn.run("app.serve.app:create_app", factory=True, reload=True,
                    timeout_graceful_shutdown=math.ceil(settings.traffic.drain_s), **options)
        return 0
    app = _create(settings)
    from app.serve.refusal_protocol import refusing_protocol

    options["http"] = refusing_protocol(app)
    DrainingServer(uvicorn.Config(app, **options), app, settings.traffic.drain_s, logs).run()
    return 0


class DrainingServer(uvicorn.Server):
    """SIGTERM: stop accepting, let requests in flight finish for ``drain_s``; shortly before that, a request
    still running ends with a terminal event (``ShuttingDown``: 503, ``event: error``, a chat's error chunk and
    ``[DONE]``) and its vLLM request is aborted, instead of being cut off mid-body; then exit.

    The server's own cut (cancel what has still not ended) replaces uvicorn's ``timeout_graceful_shutdown`` and
    comes after ``CLOSE_S`` of the event loop's running time since ours: both timed from the signal, a loop stalled
    past both deadlines (a CPU vLLM keeps busy) ran them in one turn, and cut the streams before their terminal
    events were out."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, drain_s: float, logs: Logs) -> None:
        super().__init__(config)
        self.app, self.logs = app, logs
        self.close_s = min(CLOSE_S, drain_s / 4)  # for the terminal events and the connections' closes
        self.ends_in = drain_s - self.close_s  # from the signal, when requests still running are ended
        self.cutoff: Cutoff | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._armed()
        super().handle_exit(sig, frame)

    def _armed(self) -> Cutoff:
        """The service's cutoff, armed once (at the signal) to end what still runs ``ends_in`` from now."""
        if self.cutoff is None:
            services = getattr(self.app.state, "services", None)  # none while the app still starts
            self.cutoff = services.traffic.cutoff if services is not None else Cutoff()
            self.cutoff.arm(self.ends_in)
        return self.cutoff

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        ending = asyncio.create_task(self._end_what_still_runs())
        try:
            await super().shutdown(sockets)
        finally:
            ending.cancel()
        self.logs.close()  # uvicorn re-raises the signal after this: atexit would never run

    async def _end_what_still_runs(self) -> None:
        cutoff = self._armed()  # by the signal, or now: a server may stop without one
        await asyncio.sleep(cutoff.seconds_left())
        cutoff.cut()
        await running_time(self.close_s)
        if tasks := self.server_state.tasks:
            log.error("%d request(s) still running after the drain time: cancelled", len(tasks))
        for task in tasks:
            task.cancel(msg="the drain time is over")


async def running_time(seconds: float, step: float = 0.1) -> None:
    """Sleep for ``seconds`` of the event loop's running time: a stall (the process not scheduled) counts as two
    steps at most, so that what was waiting when it began still gets its turns after it."""
    loop = asyncio.get_running_loop()
    while seconds > 0:
        started = loop.time()
        await asyncio.sleep(min(step, seconds))
        seconds -= min(loop.time() - started, 2 * step)


def _create(settings: Settings) -> FastAPI:
    from app.serve.app import create_app

    return create_app(settings)


if __name__ == "__main__":
    sys.exit(main())
