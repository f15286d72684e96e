"""Small named exceptions, each carrying its HTTP status and OpenAI error type. Mapped to responses in one
place (``app.serve.http_errors``); the RAG service raises these and knows nothing of HTTP."""

from __future__ import annotations


class ServiceError(Exception):
    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code or self.code


class BadRequest(ServiceError):
    status, type, code = 400, "invalid_request_error", "invalid_request"


class ContextTooLong(BadRequest):
    """The prompt does not fit the model's context window (ours, or vLLM's verdict)."""

    code = "context_length_exceeded"


UNAUTHORIZED = "missing or invalid API key: send 'Authorization: Bearer <key>'"


class Unauthorized(ServiceError):
    status, type, code = 401, "authentication_error", "invalid_api_key"


class Forbidden(ServiceError):
    status, type, code = 403, "permission_error", "forbidden"


class NotFound(ServiceError):
    status, type, code = 404, "invalid_request_error", "not_found"


class Conflict(ServiceError):
    """The request contradicts what exists (a collection made twice, one configured deleted)."""

    status, type, code = 409, "invalid_request_error", "conflict"


class UnsupportedMediaType(ServiceError):
    status, type, code = 415, "invalid_request_error", "unsupported_media_type"


class UpstreamUnavailable(ServiceError):
    """vLLM cannot be reached; the client should retry later."""

    status, type, code = 503, "service_unavailable", "upstream_unavailable"
    retry_after_s = 5


class StoreUnavailable(UpstreamUnavailable):
    """The Chroma collection is missing or unreadable (not vLLM's fault: readiness and logs say which)."""

    code = "collection_unavailable"


class ShuttingDown(ServiceError):
    """The service is stopping (SIGTERM) and its drain time is over: a request still running ends with this,
    its vLLM request aborted; a client retries elsewhere or after the restart."""

    status, type, code = 503, "service_unavailable", "shutting_down"
    retry_after_s = 1


class Overloaded(ServiceError):
    """Admission control: every slot and queue place is taken; refused at once rather than answered late."""

    status, type, code = 429, "rate_limit_error", "overloaded"

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ClientGone(ServiceError):
    """The client disconnected before its answer was ready; its vLLM request was aborted (nginx's 499)."""

    status, type, code = 499, "client_closed_request", "client_closed_request"


class UpstreamTimeout(ServiceError):
    status, type, code = 504, "timeout", "upstream_timeout"


class UpstreamError(ServiceError):
    """vLLM answered with an error we did not expect (its message is passed on)."""

    status, type, code = 502, "upstream_error", "upstream_error"
