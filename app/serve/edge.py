"""The request edge, before any route runs: a request that carries a body is authenticated first and its body
is read only up to a limit, so a keyless or oversized upload costs neither memory nor parsing. (A question the
service is too busy to admit was refused before this, by ``app.serve.refusals``.)

Pure ASGI (no BaseHTTPMiddleware): the body is never buffered here, only counted as it streams through.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.core.errors import UNAUTHORIZED
from app.serve.protocol import error_body
from app.serve.tenants import Tenants

BODYLESS = frozenset({"GET", "HEAD", "OPTIONS", "DELETE"})
UPLOADS = "/v1/documents"  # its bodies are files: their own limit


def unauthorized() -> JSONResponse:
    return JSONResponse(error_body(UNAUTHORIZED, "authentication_error", None, "invalid_api_key"), status_code=401,
                        headers={"WWW-Authenticate": "Bearer"})


def too_large(limit: int, setting: str) -> HTTPException:
    return HTTPException(413, f"request body over the limit of {limit} bytes (PREFIXRAG_SERVICE__{setting.upper()})")


class RequestEdge:
    def __init__(self, app: ASGIApp, *, max_body_bytes: int, max_upload_bytes: int, tenants: Tenants) -> None:
        self.app, self.tenants = app, tenants
        self.limits = {"max_body_bytes": max_body_bytes, "max_upload_bytes": max_upload_bytes}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in BODYLESS:
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if (tenant := self.tenants.of(headers.get("authorization", ""))) is None:
            await unauthorized()(scope, receive, send)  # the body is never read
            return
        scope.setdefault("state", {})["tenant"] = tenant  # the routes' ``TenantDep`` reads it
        setting = "max_upload_bytes" if scope["path"] == UPLOADS else "max_body_bytes"
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.limits[setting]:
            await self._refuse(scope, receive, send, setting)
            return
        await self.app(scope, self._counted(receive, setting), send)

    def _counted(self, receive: Receive, setting: str) -> Receive:
        seen, limit = 0, self.limits[setting]

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:  # a chunked body that says nothing of its size
                raise too_large(limit, setting)  # FastAPI re-raises HTTPException from body reading
            return message

        return counted

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, setting: str) -> None:
        exc = too_large(self.limits[setting], setting)
        response = JSONResponse(error_body(exc.detail, "invalid_request_error", None, "request_too_large"),
                                status_code=413, headers={"Connection": "close"})
        await response(scope, receive, send)
