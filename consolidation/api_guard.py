"""The API's outermost ASGI middleware: auth on ``/v1``, the request body cap, one debug log line
per request, and the JSON 500 of last resort."""

from __future__ import annotations

import hashlib
import hmac
import time

import structlog
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from consolidation.api_errors import error_response

__all__ = ["MAX_BODY_BYTES", "Guard"]

log = structlog.get_logger(__name__)

MAX_BODY_BYTES = 16 * 1024 * 1024


class _BodyTooLarge(HTTPException):
    """Raised from the guard's ``receive`` when a streamed body passes MAX_BODY_BYTES.

    An HTTPException so FastAPI's body reader re-raises it instead of turning it into a 400.
    """

    def __init__(self) -> None:
        super().__init__(413, f"request body is larger than {MAX_BODY_BYTES} bytes")


class Guard:
    """Auth on ``/v1``, the request body cap, one debug log line per request, and the JSON 500
    of last resort. Runs before any body is read, so a rejected request costs nothing."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.key_digest = hashlib.sha256(api_key.encode()).digest() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 0
        received = 0

        async def send_tracking(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        async def receive_capped(message_source: Receive = receive) -> Message:
            nonlocal received
            message = await message_source()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > MAX_BODY_BYTES:
                    raise _BodyTooLarge()
            return message

        try:
            rejection = self._reject(scope)
            if rejection is not None:
                await rejection(scope, receive, send_tracking)
            else:
                await self.app(scope, receive_capped, send_tracking)
        except Exception:
            # Expected errors were answered by the app's exception handlers; this is a bug.
            log.exception("http_unhandled_exception", method=scope["method"], path=scope["path"])
            if status:  # the response already started: nothing sane left to send
                raise
            response = error_response(500, "internal_error", "internal server error")
            await response(scope, receive, send_tracking)
        finally:
            log.debug(
                "http_request",
                method=scope["method"],
                path=scope["path"],
                status=status,
                duration_ms=round((time.perf_counter() - started) * 1000, 2),
            )

    def _reject(self, scope: Scope) -> Response | None:
        path: str = scope["path"]
        headers = dict(scope["headers"])
        key = self.key_digest
        protected = path == "/v1" or path.startswith("/v1/")
        if (
            key is not None
            and protected
            and not _bearer_matches(headers.get(b"authorization", b""), key)
        ):
            return error_response(
                401,
                "unauthorized",
                "missing or wrong API key: send 'Authorization: Bearer <key>'",
                headers={"WWW-Authenticate": "Bearer"},
            )
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
            return error_response(
                413, "payload_too_large", f"request body is larger than {MAX_BODY_BYTES} bytes"
            )
        return None


def _bearer_matches(header: bytes, key_digest: bytes) -> bool:
    """Constant time: digests hide the key's length, and the scheme is checked last."""
    scheme, _, token = header.partition(b" ")
    matches = hmac.compare_digest(hashlib.sha256(token.strip()).digest(), key_digest)
    return matches and scheme.lower() == b"bearer"
