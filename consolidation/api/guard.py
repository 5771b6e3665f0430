"""The API's outermost ASGI middleware: auth on ``/v1`` and ``/ui``, the request body cap, one
debug log line per request, and the JSON 500 of last resort.

With ``CONSOLIDATION_API_KEY`` set, a ``/v1`` request is let in by ``Authorization: Bearer <key>``
or, when it has no Authorization header, by the dashboard's session cookie. The cookie is
HttpOnly and SameSite=Strict, and a cookie-authenticated request that changes something must
also come from the service's own origin (its ``Origin`` names the ``Host`` it was sent to), so
another site can neither read the cookie nor make a browser use it (CSRF).
"""

from __future__ import annotations

import hashlib
import hmac
import time
from urllib.parse import urlencode

import structlog
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from consolidation.api.errors import error_response

__all__ = ["MAX_BODY_BYTES", "SESSION_COOKIE", "Credentials", "Guard"]

log = structlog.get_logger(__name__)

MAX_BODY_BYTES = 16 * 1024 * 1024
SESSION_COOKIE = "consolidation_session"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# Pages of the dashboard anyone may load: where the key is entered, and its CSS and script.
_UI_OPEN = ("/ui/login", "/ui/static/")


class Credentials:
    """What the API key lets in: a bearer token, or the dashboard's session cookie.

    The cookie holds an HMAC of the key, never the key: it is the same for every replica, and
    changing the key signs every browser out. Every comparison is constant-time.
    """

    def __init__(self, api_key: str | None) -> None:
        self.required = bool(api_key)
        key = (api_key or "").encode()
        self._key_digest = hashlib.sha256(key).digest()
        self._session = hmac.new(key, b"consolidation dashboard session v1", "sha256").hexdigest()

    def bearer_ok(self, header: bytes) -> bool:
        """Constant time: digests hide the key's length, and the scheme is checked last."""
        scheme, _, token = header.partition(b" ")
        matches = hmac.compare_digest(hashlib.sha256(token.strip()).digest(), self._key_digest)
        return matches and scheme.lower() == b"bearer"

    def key_ok(self, candidate: str) -> bool:
        digest = hashlib.sha256(candidate.encode()).digest()
        return hmac.compare_digest(digest, self._key_digest)

    def session_token(self) -> str:
        """The value of the session cookie a browser gets once it gave the key."""
        return self._session

    def session_ok(self, cookie_header: bytes) -> bool:
        token = _cookie(cookie_header, SESSION_COOKIE)
        return token is not None and hmac.compare_digest(token.encode(), self._session.encode())


def same_origin(headers: dict[bytes, bytes]) -> bool:
    """The request's ``Origin`` is the host it was sent to (a form or fetch of our own pages).

    The scheme is not compared, so a proxy that terminates TLS may forward plain HTTP; it must
    pass the ``Host`` header through.
    """
    origin = headers.get(b"origin", b"").decode("latin-1")
    host = headers.get(b"host", b"").decode("latin-1")
    scheme, sep, netloc = origin.partition("://")
    return bool(sep and scheme in ("http", "https") and host and netloc.lower() == host.lower())


def _cookie(header: bytes, name: str) -> str | None:
    for part in header.decode("latin-1").split(";"):
        key, sep, value = part.strip().partition("=")
        if sep and key == name:
            return value
    return None


class _BodyTooLarge(HTTPException):
    """Raised from the guard's ``receive`` when a streamed body passes MAX_BODY_BYTES.

    An HTTPException so FastAPI's body reader re-raises it instead of turning it into a 400.
    """

    def __init__(self) -> None:
        super().__init__(413, f"request body is larger than {MAX_BODY_BYTES} bytes")


class Guard:
    """Auth on ``/v1``, the request body cap, one debug log line per request, and the JSON 500
    of last resort. Runs before any body is read, so a rejected request costs nothing."""

    def __init__(self, app: ASGIApp, credentials: Credentials) -> None:
        self.app = app
        self.credentials = credentials

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
        api = path == "/v1" or path.startswith("/v1/")
        ui = path == "/ui" or path.startswith("/ui/")
        if api and self.credentials.required:
            rejection = self._reject_api(scope["method"], headers)
            if rejection is not None:
                return rejection
        if (
            ui
            and self.credentials.required
            and not path.startswith(_UI_OPEN)
            and not self.credentials.session_ok(headers.get(b"cookie", b""))
        ):
            return _to_login(scope)
        if ui and scope["method"] not in SAFE_METHODS and not same_origin(headers):
            return _cross_origin()
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
            return error_response(
                413, "payload_too_large", f"request body is larger than {MAX_BODY_BYTES} bytes"
            )
        return None

    def _reject_api(self, method: str, headers: dict[bytes, bytes]) -> Response | None:
        authorization = headers.get(b"authorization")
        if authorization is None and self.credentials.session_ok(headers.get(b"cookie", b"")):
            if method not in SAFE_METHODS and not same_origin(headers):
                return _cross_origin()
            return None
        if authorization is not None and self.credentials.bearer_ok(authorization):
            return None
        return error_response(
            401,
            "unauthorized",
            "missing or wrong API key: send 'Authorization: Bearer <key>'",
            headers={"WWW-Authenticate": "Bearer"},
        )


def _cross_origin() -> Response:
    return error_response(
        403,
        "cross_origin",
        "a request authenticated by the dashboard's cookie must come from the dashboard's own "
        "origin (Origin must name the Host)",
    )


def _to_login(scope: Scope) -> Response:
    """Pages of the dashboard send a browser without the session to the key form."""
    target = scope["path"]
    if scope.get("query_string"):
        target += "?" + scope["query_string"].decode("latin-1")
    location = "/ui/login?" + urlencode({"next": target})
    return Response(status_code=303, headers={"Location": location, "Cache-Control": "no-store"})
