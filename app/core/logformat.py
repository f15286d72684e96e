"""How the service's log lines look, in the serving process and in the processes it starts (retrieval workers):
'text', one readable line, or 'json', one object per line (time, level, request_id, logger, message), so that a
log collector reads every process's lines alike."""

from __future__ import annotations

import logging

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter

LOG_FORMAT = "%(asctime)s %(levelname)s [%(correlation_id)s] %(name)s: %(message)s"
JSON_FIELDS = {"asctime": "time", "levelname": "level", "correlation_id": "request_id", "name": "logger"}
QUIET = ("httpx", "httpx2")  # per-request lines (httpx2: the openai SDK's own copy of httpx); monitors log states


def formatter(form: str) -> logging.Formatter:
    """The formatter of ``form`` ('text' or 'json'); records need a ``correlation_id`` (the request id, or '-')."""
    if form == "json":
        fields = " ".join(f"%({name})s" for name in [*JSON_FIELDS, "message"])
        return JsonFormatter(fields, rename_fields=JSON_FIELDS, json_ensure_ascii=False,
                             reserved_attrs=[*RESERVED_ATTRS, "color_message"])  # uvicorn's, with terminal colours
    return logging.Formatter(LOG_FORMAT)


class NoRequest(logging.Filter):
    """A process that serves no HTTP request itself (a worker) marks its lines as outside any request."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.correlation_id = "-"
        return True


def log_like_the_service(level: str, form: str) -> None:
    """A process the service started writes its lines to the same stderr, at the service's ``level`` and in its
    ``form`` (a spawned process starts with no logging set up: its INFO lines would be lost, the rest bare)."""
    written = logging.StreamHandler()
    written.setFormatter(formatter(form))
    written.addFilter(NoRequest())
    logging.basicConfig(level=level.upper(), handlers=[written], force=True)
    for noisy in QUIET:
        logging.getLogger(noisy).setLevel(logging.WARNING)
