"""``python -m app``: serve ``create_app(Settings())`` with uvicorn. Every setting comes from the environment
(``PREFIXRAG_*``, ``.env``); the flags below override the few a person changes at the command line."""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn
from pydantic import ValidationError

from app.core.version import add_version

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
                               "timeout_graceful_shutdown": math.ceil(settings.traffic.drain_s),
                               "timeout_keep_alive": service.keep_alive_s, "log_config": None}
    if args.reload:  # a --reload worker is another process: it reads the flags from the environment
        os.environ.update(environment_of(flags))
        uvicorn.run("app.serve.app:create_app", factory=True, reload=True, **options)
        return 0
    app = _create(settings)
    DrainingServer(uvicorn.Config(app, **options), app, settings.traffic.drain_s, logs).run()
    return 0


class DrainingServer(uvicorn.Server):
    """SIGTERM: stop accepting, let requests in flight finish for ``drain_s``; shortly before that, a request
    still running ends with a terminal event (``ShuttingDown``: 503, ``event: error``, a chat's error chunk and
    ``[DONE]``) and its vLLM request is aborted, instead of being cut off mid-body; then exit."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, drain_s: float, logs: Logs) -> None:
        super().__init__(config)
        self.app, self.drain_s, self.logs = app, drain_s, logs

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        services = getattr(self.app.state, "services", None)
        if services is not None:  # the streams end ahead of uvicorn's own cut, so that they can end cleanly
            services.traffic.cutoff.arm(self.drain_s - min(2.0, self.drain_s / 4))
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await super().shutdown(sockets)
        self.logs.close()  # uvicorn re-raises the signal after this: atexit would never run


def _create(settings: Settings) -> FastAPI:
    from app.serve.app import create_app

    return create_app(settings)


if __name__ == "__main__":
    sys.exit(main())
