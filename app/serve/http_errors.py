"""The one place where exceptions become HTTP responses, always in OpenAI's error shape."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from app.core.errors import ServiceError
from app.serve.protocol import INTERNAL_ERROR, error_body

log = logging.getLogger("prefixrag.http")
HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def reported(exc: ServiceError) -> dict[str, Any]:
    """``exc``'s OpenAI error body, as a response or a stream's error event. A failure of ours (5xx) is also
    logged, once, with its reason, on the request's own log line."""
    if exc.status >= 500:
        log.warning("%s %s: %s", exc.status, exc.code, exc.message)
    return error_body(exc.message, exc.type, exc.param, exc.code)


def error_response(exc: ServiceError) -> JSONResponse:
    retry_after = getattr(exc, "retry_after_s", None)  # 503 (vLLM or Chroma away) and 429 (overloaded)
    headers = {"Retry-After": str(retry_after)} if retry_after else None
    if exc.status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    return JSONResponse(reported(exc), status_code=exc.status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        if first["type"] == "json_invalid":  # its loc is a character position, not a parameter
            position = first["loc"][-1]
            message = f"invalid JSON at character {position}: {first.get('ctx', {}).get('error', first['msg'])}"
            return JSONResponse(error_body(message, "invalid_request_error", None, "invalid_json"), status_code=400)
        # The fields and indexes the client sent, not pydantic's names for a union's members or validators.
        field = ".".join(str(p) for p in first["loc"] if p != "body" and (isinstance(p, int) or p.isidentifier()))
        param = field or None
        message = f"{param}: {first['msg']}" if param else first["msg"]
        return JSONResponse(error_body(message, "invalid_request_error", param, "invalid_request"), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(exc.detail), type_, None, HTTP_CODES.get(exc.status_code)),
                            status_code=exc.status_code, headers=exc.headers)  # keeps 405's Allow

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(INTERNAL_ERROR, status_code=500)
