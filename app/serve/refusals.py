"""Refusals first: a question the service is too busy to admit gets its 429 + Retry-After from the outermost layer,
before the request id, HTTP metrics, authentication's body checks, routing and the body itself. Under a retry storm
the serving loop answers hundreds of refusals a second, and a health probe or an admitted answer waits behind every
one of them; here a refusal costs a fraction of the whole stack's work (``bench.refusal_cost``). ``python -m app``
refuses earlier still, in the connection's own HTTP parser (``app.serve.refusal_protocol``); this layer refuses
for every other ASGI server, and where that one defers.

What the skipped layers give a response is kept: the request id (the client's own, else a new one) on the response
and its access line, the count and duration in ``http_requests_total`` / ``http_request_duration_seconds``, the
OpenAI error body. A request without a valid key is not refused here: the edge answers it with 401, as before.
"""

from __future__ import annotations

import functools
import json
import random
import time

from asgi_correlation_id.context import correlation_id
from starlette.datastructures import Headers, State
from starlette.types import ASGIApp, Receive, Scope, Send

from app.core.errors import Overloaded
from app.runtime.returns import CLIENT
from app.serve.observability import REQUEST_ID_HEADER, HttpRecord, valid_request_id
from app.serve.protocol import error_body
from app.serve.tenants import Tenants

ADMITTED = frozenset({"/ask", "/v1/chat/completions", "/v1/completions"})  # the routes that take a place of admission
ID_HEADER = REQUEST_ID_HEADER.lower()


class RefusalDesk:
    """Whether a question arriving now is refused, and its 429, for whichever layer answers it."""

    def __init__(self, tenants: Tenants, record: HttpRecord, state: State, *, in_parser: bool = True) -> None:
        self.tenants, self.record, self.state = tenants, record, state  # state: the app's, where its services live
        self.in_parser = in_parser  # may refuse before the app (False: a layer of the app adds to every response)

    def refusal(self, authorization: str, client: tuple[str, int] | None) -> Overloaded | None:
        """The refusal of a question with this ``Authorization`` header on connection ``client`` (the ASGI scope's
        host and port), when admission would refuse it at once (``refuses_now``, counted); None to let the app
        answer it: a request without a valid key (the edge's 401), or any while the services are still being
        built. Sets ``CLIENT`` in the caller's context: a refusal's promise is to this connection."""
        services = getattr(self.state, "services", None)  # absent until the lifespan has built them
        if services is None or self.tenants.of(authorization) is None:
            return None
        CLIENT.set(f"{client[0]}:{client[1]}" if client else None)
        refused: Overloaded | None = services.traffic.refuses_now()
        return refused

    @staticmethod
    def request_id(given_id: str) -> str:
        """The response's request id, the client's own else a new one, also set as its access line's (as the
        request id layer would)."""
        request_id = given_id if given_id and valid_request_id(given_id) else f"{random.getrandbits(128):032x}"
        correlation_id.set(request_id)
        return request_id

    @staticmethod
    def response(refused: Overloaded, given_id: str) -> tuple[list[tuple[bytes, bytes]], bytes]:
        """The 429's headers and OpenAI error body; the request id (the client's own, else a new one) is also
        set as the access line's."""
        request_id = RefusalDesk.request_id(given_id)
        body = _body(refused.message, refused.type, refused.param, refused.code)
        return [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                (b"retry-after", str(refused.retry_after_s).encode()),
                (ID_HEADER.encode(), request_id.encode())], body


@functools.lru_cache(maxsize=64)  # a storm's refusals differ only in their limits and Retry-After
def _body(message: str, type_: str, param: str | None, code: str | None) -> bytes:
    return json.dumps(error_body(message, type_, param, code), ensure_ascii=False, separators=(",", ":")).encode()


class Refusals:
    def __init__(self, app: ASGIApp, *, desk: RefusalDesk) -> None:
        self.app, self.desk = app, desk

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in ADMITTED:
            await self.app(scope, receive, send)
            return
        started, headers = time.perf_counter(), Headers(scope=scope)
        refused = self.desk.refusal(headers.get("authorization", ""), scope.get("client"))
        if refused is None:
            await self.app(scope, receive, send)
            return
        response_headers, body = self.desk.response(refused, headers.get(ID_HEADER, ""))
        await send({"type": "http.response.start", "status": 429, "headers": response_headers})
        await send({"type": "http.response.body", "body": body})
        self.desk.record(scope, 429, len(body), time.perf_counter() - started)
