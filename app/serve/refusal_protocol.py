"""Refusals and liveness in the HTTP parser: ``python -m app`` serves with uvicorn's httptools protocol, extended so
that a question the service is too busy to admit is refused in the connection's own callback, as soon as its
headers are in, with one write: no ASGI task, no scope through the layers, no send events. Under a retry storm the
serving loop answers hundreds of refusals a second, and every health probe and admitted answer waits behind them
(``bench.refusal_cost``). ``GET /healthz`` is answered the same way: liveness says the serving loop turns, and a
probe answered in the callback that reads it waits for one turn of the loop, not for a task's turns behind a wave
of admitted questions.

The refusal is the one ``app.serve.refusals`` sends (429, Retry-After, the request id, the OpenAI error body,
counted in the HTTP metrics, its access line); that layer still refuses where this one defers: with CORS
configured (its headers come from the app), behind a ``root_path``, and while an earlier request on the same
connection is still being answered (HTTP/1.1 answers in order)."""

from __future__ import annotations

import asyncio
import contextvars
import time
from typing import TYPE_CHECKING, Any

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string

from app.serve.refusals import ADMITTED, ID_HEADER, RefusalDesk

if TYPE_CHECKING:
    from fastapi import FastAPI

_ADMITTED = frozenset(path.encode() for path in ADMITTED)
_ID = ID_HEADER.encode()
_LIVENESS, _ALIVE = b"/healthz", b'{"status":"ok"}'  # the app's own /healthz route answers the same body


class _Answered:
    """The cycle of a request refused here: answered, so its body is read and dropped, and the connection's next
    request starts at once."""

    response_complete = True

    class message_event:  # noqa: N801  # uvicorn sets it when the connection is lost
        @staticmethod
        def set() -> None:
            pass


ANSWERED: Any = _Answered()


def refusing_protocol(app: FastAPI) -> type[asyncio.Protocol] | str:
    """The HTTP protocol for uvicorn's ``http`` option serving ``create_app``'s ``app``: refusing in the parser, or
    uvicorn's own ('auto') where this cannot answer as the app would (CORS headers)."""
    desk: RefusalDesk = app.state.refusals
    if not desk.in_parser:
        return "auto"

    class RefusingProtocol(HttpToolsProtocol):
        def on_headers_complete(self) -> None:
            if not self._answered():
                super().on_headers_complete()

        def _answered(self) -> bool:
            """Answer the request whose headers are complete here, if it is a liveness probe or a question
            admission refuses; True when it was."""
            if self.root_path or (self.cycle is not None and not self.cycle.response_complete):
                return False
            method, parsed = self.parser.get_method(), httptools.parse_url(self.url)
            if method == b"GET" and parsed.path == _LIVENESS:
                return contextvars.Context().run(self._alive, parsed)  # the request id stays its own
            if method != b"POST" or parsed.path not in _ADMITTED:
                return False
            return contextvars.Context().run(self._refuse, parsed)  # CLIENT and the request id stay its own

        def _alive(self, parsed: Any) -> bool:
            started, given_id = time.perf_counter(), dict(self.headers).get(_ID, b"").decode("latin-1")
            headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(_ALIVE)),
                       (_ID, desk.request_id(given_id).encode())]
            self._write(200, headers, _ALIVE, "GET", parsed, started)
            return True

        def _refuse(self, parsed: Any) -> bool:
            started, headers = time.perf_counter(), dict(self.headers)
            refused = desk.refusal(headers.get(b"authorization", b"").decode("latin-1"), self.client)
            if refused is None:
                return False
            response_headers, body = desk.response(refused, headers.get(_ID, b"").decode("latin-1"))
            self._write(429, response_headers, body, "POST", parsed, started)
            return True

        def _write(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes, method: str, parsed: Any,
                   started: float) -> None:
            """Send the whole response in one write, end the request's cycle, and log and count it."""
            keep_alive = self.parser.get_http_version() != "1.0" and self.parser.should_keep_alive()
            self.transport.write(_response(status, self.server_state.default_headers, headers, body, keep_alive))
            self.cycle = ANSWERED
            self._log_and_count(status, method, parsed, len(body), time.perf_counter() - started)
            if keep_alive:
                self.on_response_complete()
            else:
                self.transport.close()

        def _log_and_count(self, status: int, method: str, parsed: Any, body_bytes: int, duration_s: float) -> None:
            scope: dict[str, Any] = self.scope  # type: ignore[assignment]  # completed here, as the parser would
            scope["method"], scope["path"], scope["raw_path"] = method, parsed.path.decode("ascii"), parsed.path
            scope["query_string"] = parsed.query or b""
            scope["http_version"] = self.parser.get_http_version()
            # uvicorn's own access line, so that the log's repeats fold it like the app's 429s; none for a live
            # probe (``QuietProbes`` drops those of the app's route too)
            if self.access_log and status != 200:
                self.access_logger.info('%s - "%s %s HTTP/%s" %d', get_client_addr(self.scope), method,
                                        get_path_with_query_string(self.scope), scope["http_version"], status)
            desk.record(scope, status, body_bytes, duration_s)

    return RefusingProtocol


def _response(status: int, defaults: list[tuple[bytes, bytes]], headers: list[tuple[bytes, bytes]], body: bytes,
              keep_alive: bool) -> bytes:
    lines = [STATUS_LINE[status]]
    for name, value in [*defaults, *headers, *([] if keep_alive else [(b"connection", b"close")])]:
        lines += [name, b": ", value, b"\r\n"]
    return b"".join([*lines, b"\r\n", body])
