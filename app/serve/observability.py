"""What the service tells its operators, beyond its own metrics (``app.core.metrics``): every request counted and
timed by route, method and exact status (streams included), a request id on every response and log line, and
logs that say what happened rather than that a probe came by."""

from __future__ import annotations

import atexit
import logging
import queue
from collections.abc import Callable
from logging.handlers import QueueHandler, QueueListener
from typing import NamedTuple

from asgi_correlation_id import CorrelationIdFilter, CorrelationIdMiddleware
from fastapi import FastAPI
from prometheus_fastapi_instrumentator import Instrumentator
from prometheus_fastapi_instrumentator import metrics as http_metrics
from starlette.requests import Request
from starlette.types import Scope

from app.core.logformat import QUIET, formatter
from app.core.metrics import ServiceMetrics
from app.serve.repeats import Repeats

REQUEST_ID_HEADER = "X-Request-ID"
PROBES = frozenset({"/healthz", "/readyz", "/metrics"})


def observe(app: FastAPI, metrics: ServiceMetrics) -> HttpRecord:
    """HTTP metrics into the service's registry (``http_requests_total{handler,method,status}``,
    ``http_request_duration_seconds``), then the request id, outermost, so that even a request the edge refuses
    (401, 413) gets one. A client's own id (any printable text up to 128 characters) is kept. Returned: how a
    layer outside these (``app.serve.refusals``) counts a response it sends itself."""
    recorded = http_metrics.default(registry=metrics.registry)
    assert recorded is not None  # None only when the metrics exist already in this registry
    Instrumentator(should_group_status_codes=False, registry=metrics.registry).add(recorded).instrument(app)
    app.add_middleware(CorrelationIdMiddleware, header_name=REQUEST_ID_HEADER, validator=valid_request_id)
    return HttpRecord(recorded)


def valid_request_id(value: str) -> bool:
    return 0 < len(value) <= 128 and value.isprintable()


class HttpRecord:
    """Counts a response in the HTTP metrics as the instrumentation layer would: by its route's path, method and
    exact status, with its duration and sizes."""

    def __init__(self, recorded: Callable[[http_metrics.Info], None]) -> None:
        self.recorded = recorded

    def __call__(self, scope: Scope, status: int, body_bytes: int, duration_s: float) -> None:
        sent = _Sent({"Content-Length": str(body_bytes)})  # all the layer reads of a response: its length
        self.recorded(http_metrics.Info(Request(scope), sent, scope["method"], scope["path"], str(status),  # type: ignore[arg-type]
                                        duration_s))


class _Sent(NamedTuple):
    headers: dict[str, str]


def configure_logging(level: int | str = logging.INFO, repeats_s: float | None = None, form: str = "text") -> Logs:
    """The entry point's logging, at ``level`` (a name or a number), ``form`` 'text' or 'json' (one object per
    line): the request id on every line; probe access lines only when they fail; httpx's per-request lines off (our
    monitors log state changes instead); with ``repeats_s``, repeated failures of one kind aggregated
    (``app.serve.repeats``). Lines are written by a thread of their own (``QueueListener``): the event loop serving
    every request only queues a record, and never waits on a write to a busy pipe or disk."""
    written = logging.StreamHandler()
    written.setFormatter(formatter(form))
    listener = QueueListener(queue.SimpleQueue(), written)
    handler = QueueHandler(listener.queue)
    handler.setFormatter(logging.Formatter("%(message)s"))  # the message only: the writer adds time, level, id
    handler.addFilter(CorrelationIdFilter(default_value="-"))  # here: the request id is the caller's context
    repeats = Repeats(repeats_s).start() if repeats_s else None
    if repeats is not None:
        handler.addFilter(repeats)
    logging.basicConfig(level=level.upper() if isinstance(level, str) else level, handlers=[handler])
    _skip_unused_record_fields()
    logging.getLogger("uvicorn.access").addFilter(QuietProbes())
    for noisy in QUIET:
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logs = Logs(listener, handler, repeats)
    listener.start()
    atexit.register(logs.close)
    return logs


def _skip_unused_record_fields() -> None:
    """Every record (an access line too, under a retry storm hundreds a second, each on the serving loop) would
    look up its caller's frame, thread, process and task, which no line of ours prints: the logging HOWTO's
    "Optimization" switches."""
    logging._srcfile = None  # the documented switch for the caller's file and line
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    setattr(logging, "logAsyncioTasks", False)  # noqa: B010  # Python 3.12+; harmless before


class Logs:
    """The log's writer thread, and how it ends: ``close`` counts what the repeats still hold back, writes every
    queued line, then writes directly. A server stopped by a signal must call it itself: uvicorn re-raises the
    signal once it has shut down, and a process ended by a signal never runs ``atexit``."""

    def __init__(self, listener: QueueListener, queued: logging.Handler, repeats: Repeats | None) -> None:
        self.listener, self.queued, self.repeats = listener, queued, repeats
        self._closed = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.repeats is not None:
            self.repeats.close()
        self.listener.stop()  # the sentinel queues after the repeats' counts: they are written before it returns
        root = logging.getLogger()
        for written in self.listener.handlers:
            for each in self.queued.filters:  # the queue's own: the request id, the repeats
                written.addFilter(each)
            root.addHandler(written)
        root.removeHandler(self.queued)


class QuietProbes(logging.Filter):
    """Drop uvicorn's access line for a successful health, readiness or metrics probe: a load balancer polling
    every few seconds would otherwise write most of the log."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if len(args) == 5:  # (client, method, path, http version, status): uvicorn's access record
            path, status = str(args[2]).split("?")[0], int(str(args[4]))
            return not (path in PROBES and status < 400)
        return True
