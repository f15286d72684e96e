"""Refusals first: a question the service is too busy to admit gets its 429 + Retry-After from the outermost layer,
before the request id, HTTP metrics, authentication's body checks, routing and the body itself. Under a retry storm
the serving loop answers hundreds of refusals a second, and a health probe or an admitted answer waits behind every
one of them; here a refusal costs a fraction of the whole stack's work (``bench.refusal_cost``).

What the skipped layers give a response is kept: the request id (the client's own, else a new one) on the response
and its access line, the count and duration in ``http_requests_total`` / ``http_request_duration_seconds``, the
OpenAI error body. A request without a valid key is not refused here: the edge answers it with 401, as before.
"""

from __future__ import annotations

import json
import time
from uuid import uuid4

from asgi_correlation_id.context import correlation_id
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from app.core.errors import Overloaded
from app.runtime.returns import CLIENT
from app.serve.http_errors import reported
from app.serve.observability import REQUEST_ID_HEADER, HttpRecord, valid_request_id
from app.serve.tenants import Tenants

ADMITTED = frozenset({"/ask", "/v1/chat/completions", "/v1/completions"})  # the routes that take a place of admission
_ID_HEADER = REQUEST_ID_HEADER.lower()


def overloaded(scope: Scope) -> Overloaded | None:
    """The refusal of a question arriving now, when admission would refuse it at once (``refuses_now``)."""
    services = getattr(scope["app"].state, "services", None)  # absent until the lifespan has built them
    return services.traffic.refuses_now() if services is not None else None


class Refusals:
    def __init__(self, app: ASGIApp, *, tenants: Tenants, record: HttpRecord) -> None:
        self.app, self.tenants, self.record = app, tenants, record

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in ADMITTED:
            await self.app(scope, receive, send)
            return
        started, headers = time.perf_counter(), Headers(scope=scope)
        if self.tenants.of(headers.get("authorization", "")) is None:
            await self.app(scope, receive, send)  # the edge's 401
            return
        client = scope.get("client")
        CLIENT.set(f"{client[0]}:{client[1]}" if client else None)  # a refusal's promise is to this connection
        if (refused := overloaded(scope)) is None:
            await self.app(scope, receive, send)
            return
        sent = await self._refuse(send, headers, refused)
        self.record(scope, 429, sent, time.perf_counter() - started)

    async def _refuse(self, send: Send, headers: Headers, refused: Overloaded) -> int:
        """Send the 429; the body's length."""
        given = headers.get(_ID_HEADER, "")
        request_id = given if given and valid_request_id(given) else uuid4().hex
        correlation_id.set(request_id)  # the access line's id, as the request id layer would set it
        body = json.dumps(reported(refused), ensure_ascii=False, separators=(",", ":")).encode()
        await send({"type": "http.response.start", "status": 429, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"retry-after", str(refused.retry_after_s).encode()), (_ID_HEADER.encode(), request_id.encode())]})
        await send({"type": "http.response.body", "body": body})
        return len(body)
