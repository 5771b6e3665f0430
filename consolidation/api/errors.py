"""The API's one error shape, ``{"error": {"code", "message", "details"?}}``, and the exception
handlers that map every expected exception to it: bad input → 4xx, an unreachable database → 503.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from http import HTTPStatus
from typing import Any

import fastapi
import orjson
import structlog
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from consolidation import db
from consolidation.errors import NotFound, ValidationError

__all__ = [
    "ApiError",
    "add_exception_handlers",
    "database_unavailable",
    "error_response",
    "phrase",
]

log = structlog.get_logger(__name__)


class ApiError(Exception):
    """An answer other than success, already decided: status, stable code, message, details."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        details: Sequence[str] = (),
        headers: Mapping[str, str] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.details = list(details)
        self.headers = dict(headers or {})
        self.extra = dict(extra or {})


def error_response(
    status: int,
    code: str,
    message: str,
    details: Sequence[str] = (),
    headers: Mapping[str, str] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Response:
    """The one error shape of the API (``extra`` keys join ``code`` and ``message``)."""
    body: dict[str, Any] = {"code": code, "message": message}
    if details:
        body["details"] = list(details)
    body.update(extra or {})
    return Response(
        orjson.dumps({"error": body}),
        status_code=status,
        media_type="application/json",
        headers=dict(headers or {}),
    )


# Seconds a client is asked to wait before retrying a request the database could not serve.
DATABASE_RETRY_AFTER_S = 1


def database_unavailable(message: str = "the database is unavailable; retry later") -> Response:
    return error_response(
        503,
        "database_unavailable",
        message,
        headers={"Retry-After": str(DATABASE_RETRY_AFTER_S)},
    )


def phrase(status: int) -> str:
    """The reason phrase of an HTTP status ("Not Found"), or "error"."""
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "error"


def add_exception_handlers(app: fastapi.FastAPI) -> None:
    """Answer every expected exception with the error shape above."""
    handlers: list[tuple[type[Exception], Callable[[Request, Exception], Response]]] = [
        (HTTPException, _on_http_exception),
        (RequestValidationError, _on_request_validation),
        (ApiError, _on_api_error),
        (ValidationError, _on_validation_error),
        (NotFound, _on_not_found),
        *((cls, _on_database_down) for cls in db.DATABASE_DOWN),
    ]
    for cls, handler in handlers:
        app.add_exception_handler(cls, handler)


_HTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    406: "not_acceptable",
    413: "payload_too_large",
    415: "unsupported_media_type",
}


def _on_http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = _HTTP_CODES.get(exc.status_code, "http_error")
    if exc.status_code == 404 and exc.detail == "Not Found":
        message = f"no route for {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    elif isinstance(exc.detail, str) and exc.detail:
        message = exc.detail
    else:
        message = phrase(exc.status_code)
    return error_response(exc.status_code, code, message, headers=exc.headers)


def _on_request_validation(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    errors = list(exc.errors())
    if any(e.get("type") == "json_invalid" for e in errors):
        reason = next(
            str((e.get("ctx") or {}).get("error", ""))
            for e in errors
            if e["type"] == "json_invalid"
        )
        return error_response(400, "invalid_json", f"request body is not valid JSON: {reason}")
    details = [f"{_location(e.get('loc', ()))}: {e.get('msg', 'invalid')}" for e in errors]
    return error_response(422, "invalid_request", "the request is invalid", details)


def _location(loc: Sequence[Any]) -> str:
    """``("body", "scopes", 0, 1)`` → ``body.scopes[0][1]``."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text or "request"


def _on_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(exc.status, exc.code, exc.message, exc.details, exc.headers, exc.extra)


def _on_validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ValidationError)
    return error_response(422, "invalid_request", str(exc), exc.problems)


def _on_not_found(request: Request, exc: Exception) -> Response:
    return error_response(404, "not_found", str(exc))


def _on_database_down(request: Request, exc: Exception) -> Response:
    log.warning("database_unavailable", path=request.url.path, error=repr(exc))
    return database_unavailable(db.unavailable_reason(exc))
