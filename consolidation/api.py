"""The HTTP API (DESIGN §6): thin FastAPI routes over store.py and queue.py.

Every error is JSON ``{"error": {"code", "message", "details"?}}``; bad input always gets a 4xx,
an unreachable database a 503, and anything else a generic 500 (logged).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from datetime import datetime
from http import HTTPStatus
from typing import Annotated, Any, Literal

import asyncpg
import fastapi
import orjson
import structlog
from fastapi import Path, Query, Security
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from fastapi.security import HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, WithJsonSchema
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import consolidation
import consolidation.metrics  # registers the project's metrics, so /metrics lists them
from consolidation import db, queue, store
from consolidation.errors import NotFound, ValidationError
from consolidation.memories import (
    MAX_BANK_ID_CHARS,
    MAX_TEXT_CHARS,
    bank_id_problems,
    parse_memories,
)
from consolidation.scopes import MAX_TAG_CHARS, MAX_TAGS, normalize_scope
from consolidation.settings import Settings

__all__ = ["MAX_BODY_BYTES", "create_app"]

log = structlog.get_logger(__name__)

MAX_BODY_BYTES = 16 * 1024 * 1024
MAX_MEMORIES_PER_REQUEST = 1000
MAX_SCOPES_PER_REQUEST = 100
MAX_PRIORITY = 1000
MAX_PAGE = 1000
READY_TIMEOUT_S = 2.0

# A tag: no control characters and at least one non-space character (the memories' rule).
TAG_PATTERN = r"^[^\x00-\x1f]*[^\x00-\x1f\s][^\x00-\x1f]*$"
BANK_ID_PATTERN = TAG_PATTERN
_TAG_RE = re.compile(TAG_PATTERN)
# Documentation only (the routes answer 422 / 400 themselves): comma-separated tags, and the
# spelling of a 16-byte id in unpadded urlsafe base64 (the last character carries 2 zero bits).
_LISTED_TAG = r"[^\x00-\x1f,]*[^\x00-\x1f,\s][^\x00-\x1f,]*"
SCOPE_PARAM_PATTERN = rf"^(?:{_LISTED_TAG}(?:,{_LISTED_TAG})*)?$"
CURSOR_PATTERN = r"^[A-Za-z0-9_-]{21}[AQgw]$"


# --- errors --------------------------------------------------------------------------------


class ApiError(Exception):
    """An answer other than success, already decided: status, stable code, message, details."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        details: Sequence[str] = (),
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.details = list(details)
        self.headers = dict(headers or {})


class _BodyTooLarge(HTTPException):
    """Raised from the guard's ``receive`` when a streamed body passes MAX_BODY_BYTES.

    An HTTPException so FastAPI's body reader re-raises it instead of turning it into a 400.
    """

    def __init__(self) -> None:
        super().__init__(413, f"request body is larger than {MAX_BODY_BYTES} bytes")


def error_response(
    status: int,
    code: str,
    message: str,
    details: Sequence[str] = (),
    headers: Mapping[str, str] | None = None,
) -> Response:
    """The one error shape of the API."""
    body: dict[str, Any] = {"code": code, "message": message}
    if details:
        body["details"] = list(details)
    return Response(
        orjson.dumps({"error": body}),
        status_code=status,
        media_type="application/json",
        headers=dict(headers or {}),
    )


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
        message = _phrase(exc.status_code)
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
    return error_response(exc.status, exc.code, exc.message, exc.details, exc.headers)


def _on_validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ValidationError)
    return error_response(422, "invalid_request", str(exc), exc.problems)


def _on_not_found(request: Request, exc: Exception) -> Response:
    return error_response(404, "not_found", str(exc))


def _on_database_down(request: Request, exc: Exception) -> Response:
    log.warning("database_unavailable", path=request.url.path, error=repr(exc))
    return _database_unavailable()


def _database_unavailable() -> Response:
    return error_response(
        503,
        "database_unavailable",
        "the database is unavailable; retry later",
        headers={"Retry-After": "1"},
    )


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "error"


# --- the outermost middleware ----------------------------------------------------------------


class _Guard:
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


# --- JSON bodies parsed with orjson ------------------------------------------------------------


class _OrjsonRequest(Request):
    """orjson rejects what Postgres cannot store (lone surrogates) and NaN/Infinity as bad JSON."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = orjson.loads(await self.body())
        return self._json


class _OrjsonRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def orjson_handler(request: Request) -> Response:
            return await handler(_OrjsonRequest(request.scope, request.receive))

        return orjson_handler


# --- request and response models ---------------------------------------------------------------

Tag = Annotated[str, StringConstraints(min_length=1, max_length=MAX_TAG_CHARS, pattern=TAG_PATTERN)]
BankId = Annotated[
    str,
    Path(
        min_length=1,
        max_length=MAX_BANK_ID_CHARS,
        pattern=BANK_ID_PATTERN,
        description="The memory bank (created by its first ingestion).",
    ),
]
OperationStatus = Literal["pending", "running", "completed", "failed", "cancelled"]


class MemoryIn(BaseModel):
    """One memory (documentation only: ``memories.parse_memories`` does the real checks)."""

    model_config = ConfigDict(extra="forbid")

    id: uuid.UUID | None = Field(
        default=None, description="Idempotency key; a random UUID when absent."
    )
    text: Annotated[
        str,
        StringConstraints(min_length=1, max_length=MAX_TEXT_CHARS, pattern=r"^[^\x00]*\S[^\x00]*$"),
    ]
    tags: Annotated[list[Tag], Field(max_length=MAX_TAGS)] | None = None
    observation_scopes: (
        Literal["combined", "per_tag", "all_combinations", "shared"]
        | Annotated[list[list[Tag]], Field(min_length=1)]
        | None
    ) = Field(default=None, description="Where observations of this memory are written.")
    occurred_at: datetime | None = Field(default=None, description="Event time (ISO-8601).")
    metadata: dict[str, Any] | None = None


MemoryItem = Annotated[Any, WithJsonSchema(MemoryIn.model_json_schema())]


class IngestRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    memories: Annotated[list[MemoryItem], Field(min_length=1, max_length=MAX_MEMORIES_PER_REQUEST)]


class IngestResponse(BaseModel):
    ids: list[uuid.UUID] = Field(description="The memories' ids, in input order.")


class ConsolidationRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    scopes: (
        Annotated[
            list[Annotated[list[Tag], Field(max_length=MAX_TAGS)]],
            Field(min_length=1, max_length=MAX_SCOPES_PER_REQUEST),
        ]
        | None
    ) = Field(default=None, description="Only these scopes ([] is the shared one); all if absent.")
    priority: Annotated[int, Field(ge=-MAX_PRIORITY, le=MAX_PRIORITY)] = 0


class ConsolidationResponse(BaseModel):
    operation_id: uuid.UUID
    status: OperationStatus
    deduplicated: bool = Field(description="True when an already pending operation was reused.")


class OperationResponse(BaseModel):
    operation_id: uuid.UUID
    bank_id: str
    status: OperationStatus
    attempt: int
    progress: dict[str, Any]
    result: dict[str, Any] | None
    error: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


class CancelResponse(BaseModel):
    operation_id: uuid.UUID
    status: OperationStatus


class ObservationOut(BaseModel):
    id: uuid.UUID
    scope: list[str]
    text: str
    source_memory_ids: list[uuid.UUID]
    updated_at: datetime


class ObservationsPage(BaseModel):
    observations: list[ObservationOut]
    next_cursor: str | None = Field(description="Pass as ?cursor= for the next page; null at end.")


class StatsResponse(BaseModel):
    pending: int
    consolidated: int
    failed: int
    observations: int
    oldest_pending_age_s: float | None


class RecoverResponse(BaseModel):
    recovered: int


class StatusResponse(BaseModel):
    status: str


class ErrorDetail(BaseModel):
    code: str
    message: str
    details: list[str] = Field(default=[], description="Every problem found, when several.")


class ErrorBody(BaseModel):
    error: ErrorDetail


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {s: {"model": ErrorBody, "description": _phrase(s)} for s in statuses}


# Every /v1 route can answer these whatever its own errors.
_V1_ERRORS = (400, 401, 404, 405, 413, 422, 500, 503)


# --- the app ---------------------------------------------------------------------------------


def create_app(
    settings: Settings, pool: asyncpg.Pool, *, contact: db.LastContact | None = None
) -> fastapi.FastAPI:
    """The API over ``pool``, which the caller opens and closes (the app never does).

    ``contact`` is the worker's record of its database's last answer: with it, ``/healthz``
    fails once the database has been silent for longer than a lease."""
    api_key = settings.api_key.get_secret_value() if settings.api_key else ""
    app = fastapi.FastAPI(
        title="consolidation",
        version=consolidation.__version__,
        description="Consolidates an AI agent's memories into observations with an LLM.",
        docs_url="/docs",
        openapi_url="/openapi.json",
        redoc_url=None,
        redirect_slashes=False,
    )
    app.add_middleware(_Guard, api_key=api_key or None)
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

    # Enforced by _Guard; declared here so the OpenAPI document shows the scheme.
    security = [Security(HTTPBearer(auto_error=False))] if api_key else []
    v1 = fastapi.APIRouter(
        route_class=_OrjsonRoute,
        dependencies=security,
        responses=_errors(*_V1_ERRORS),
    )
    _add_v1_routes(v1, settings, pool)
    app.include_router(v1)
    _add_probe_routes(app, pool, contact, settings.lease_s)
    return app


def _add_v1_routes(router: fastapi.APIRouter, settings: Settings, pool: asyncpg.Pool) -> None:
    @router.post(
        "/v1/banks/{bank_id}/memories",
        status_code=201,
        response_model=IngestResponse,
        responses=_errors(409),
        summary="Ingest memories",
    )
    async def ingest_memories(bank_id: BankId, body: IngestRequest) -> IngestResponse:
        """Store up to 1,000 memories, all or nothing; re-sending an ``id`` is a no-op."""
        _check_bank_id(bank_id)
        try:
            memories = parse_memories(body.memories)
        except ValidationError as exc:
            raise ApiError(422, "invalid_memories", str(exc), exc.problems) from None
        try:
            result = await store.ingest_memories(pool, bank_id, memories)
        except ValidationError as exc:
            raise ApiError(409, "id_conflict", str(exc), exc.problems) from None
        except asyncpg.DataError as exc:  # U+0000 in JSON, metadata nested too deeply, ...
            reason = str(exc.__cause__ or exc)[:300]  # the cause omits asyncpg's argument repr
            raise ApiError(
                422, "invalid_memories", f"a value cannot be stored: {reason}", [reason]
            ) from None
        if settings.auto_consolidate:
            await queue.submit(pool, bank_id, max_attempts=settings.max_attempts)
        return IngestResponse(ids=result.ids)

    @router.post(
        "/v1/banks/{bank_id}/consolidations",
        status_code=202,
        response_model=ConsolidationResponse,
        summary="Request a consolidation",
    )
    async def request_consolidation(
        bank_id: BankId, body: ConsolidationRequest | None = None
    ) -> ConsolidationResponse:
        """Enqueue a consolidation; an unscoped one joins an already pending one."""
        await _require_bank(pool, bank_id)
        body = body or ConsolidationRequest()
        scopes = None
        if body.scopes is not None:
            scopes = sorted({normalize_scope(tags) for tags in body.scopes})
        submitted = await queue.submit(
            pool,
            bank_id,
            scopes=scopes,
            priority=body.priority,
            max_attempts=settings.max_attempts,
        )
        op = submitted.operation
        return ConsolidationResponse.model_validate(
            {"operation_id": op.id, "status": op.status, "deduplicated": submitted.deduplicated}
        )

    @router.get(
        "/v1/operations/{operation_id}",
        response_model=OperationResponse,
        summary="Get an operation",
    )
    async def get_operation(operation_id: uuid.UUID) -> OperationResponse:
        """An operation's status, progress and result (its merged PerfLog)."""
        op = await _operation_or_404(queue.get_operation(pool, operation_id))
        return OperationResponse.model_validate(op.to_json())

    @router.post(
        "/v1/operations/{operation_id}/cancel",
        status_code=202,
        response_model=CancelResponse,
        summary="Cancel an operation",
    )
    async def cancel_operation(operation_id: uuid.UUID) -> CancelResponse:
        """A pending operation is ``cancelled`` at once; a running one stops within about a
        second (``running`` until then); a finished one is left as it is."""
        op = await _operation_or_404(queue.request_cancel(pool, operation_id))
        return CancelResponse.model_validate({"operation_id": op.id, "status": op.status})

    @router.get(
        "/v1/banks/{bank_id}/observations",
        response_model=ObservationsPage,
        summary="List observations",
    )
    async def list_observations(
        bank_id: BankId,
        scope: Annotated[
            str | None,
            Query(
                description="Comma-separated tags of one scope; empty for the shared scope; "
                "absent for every scope.",
                json_schema_extra={"pattern": SCOPE_PARAM_PATTERN},
            ),
        ] = None,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
        cursor: Annotated[
            str | None,
            Query(
                description="The previous page's next_cursor (opaque).",
                json_schema_extra={"pattern": CURSOR_PATTERN},
            ),
        ] = None,
    ) -> ObservationsPage:
        """Observations of a bank ordered by id, one page at a time."""
        scope_filter = _scope_param(scope)
        after = _decode_cursor(cursor) if cursor is not None else None
        await _require_bank(pool, bank_id)
        rows = await store.list_observations(
            pool, bank_id, scope=scope_filter, after=after, limit=limit + 1
        )
        page = rows[:limit]
        return ObservationsPage(
            observations=[
                ObservationOut(
                    id=r.id,
                    scope=list(r.scope),
                    text=r.text,
                    source_memory_ids=r.source_memory_ids,
                    updated_at=r.updated_at,
                )
                for r in page
            ],
            next_cursor=_encode_cursor(page[-1].id) if len(rows) > limit else None,
        )

    @router.get("/v1/banks/{bank_id}/stats", response_model=StatsResponse, summary="Bank stats")
    async def bank_stats(bank_id: BankId) -> StatsResponse:
        """Memory counts by state, observation count, and the oldest pending memory's age."""
        await _require_bank(pool, bank_id)
        stats = await store.bank_stats(pool, bank_id)
        return StatsResponse(
            pending=stats.pending,
            consolidated=stats.consolidated,
            failed=stats.failed,
            observations=stats.observations,
            oldest_pending_age_s=stats.oldest_pending_age_s,
        )

    @router.post(
        "/v1/banks/{bank_id}/memories/recover",
        response_model=RecoverResponse,
        summary="Retry failed memories",
    )
    async def recover_failed(bank_id: BankId) -> RecoverResponse:
        """Clear failed markers so those memories are consolidated again."""
        await _require_bank(pool, bank_id)
        recovered = await store.recover_failed(pool, bank_id)
        if recovered and settings.auto_consolidate:
            await queue.submit(pool, bank_id, max_attempts=settings.max_attempts)
        return RecoverResponse(recovered=recovered)


def _add_probe_routes(
    app: fastapi.FastAPI, pool: asyncpg.Pool, contact: db.LastContact | None, lease_s: float
) -> None:
    @app.get("/healthz", response_model=StatusResponse, responses=_errors(503), summary="Liveness")
    async def healthz() -> Response | StatusResponse:
        """The process answers (no database call); a worker also fails it once its database
        has not answered for longer than a lease (restarting it is then the cure)."""
        if contact is not None and (silent := contact.silent_for()) > lease_s:
            return error_response(
                503,
                "database_unreachable",
                f"the database has not answered for {silent:.0f} s, longer than the lease "
                f"(CONSOLIDATION_LEASE_S={lease_s:g})",
            )
        return StatusResponse(status="ok")

    @app.get(
        "/readyz",
        response_model=StatusResponse,
        responses=_errors(503),
        summary="Readiness",
    )
    async def readyz() -> Response | StatusResponse:
        """Ready when the database answers ``SELECT 1`` within 2 s."""
        try:
            async with asyncio.timeout(READY_TIMEOUT_S):
                await pool.fetchval("SELECT 1")
        except Exception as exc:
            log.warning("readiness_failed", error=repr(exc))
            return _database_unavailable()
        return StatusResponse(status="ready")

    @app.get(
        "/metrics",
        response_class=Response,
        responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
        summary="Prometheus metrics",
    )
    async def metrics() -> Response:
        """The default Prometheus registry, text format."""
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


# --- helpers ---------------------------------------------------------------------------------


def _check_bank_id(bank_id: str) -> None:
    problems = bank_id_problems(bank_id)
    if problems:
        raise ApiError(422, "invalid_bank_id", problems[0], problems)


async def _require_bank(pool: asyncpg.Pool, bank_id: str) -> None:
    _check_bank_id(bank_id)
    if not await store.bank_exists(pool, bank_id):
        raise ApiError(404, "bank_not_found", f"bank {bank_id!r} does not exist")


async def _operation_or_404(call: Awaitable[queue.Operation]) -> queue.Operation:
    try:
        return await call
    except NotFound as exc:
        raise ApiError(404, "operation_not_found", str(exc)) from None


def _scope_param(value: str | None) -> tuple[str, ...] | None:
    """``None`` (absent) → every scope; ``""`` → the shared scope; ``a,b`` → that scope."""
    if value is None:
        return None
    if value == "":
        return ()
    tags = value.split(",")
    problems = [
        f"scope tag {tag[:20]!r} must be 1 to {MAX_TAG_CHARS} characters, not blank, "
        "without control characters"
        for tag in tags
        if len(tag) > MAX_TAG_CHARS or not _TAG_RE.fullmatch(tag)
    ]
    scope = normalize_scope(tags)
    if len(scope) > MAX_TAGS:
        problems.append(f"a scope has at most {MAX_TAGS} tags, got {len(scope)}")
    if problems:
        raise ApiError(422, "invalid_request", "invalid scope parameter", problems)
    return scope


def _encode_cursor(last_id: uuid.UUID) -> str:
    return base64.urlsafe_b64encode(last_id.bytes).rstrip(b"=").decode()


def _decode_cursor(cursor: str) -> uuid.UUID:
    invalid = ApiError(400, "invalid_cursor", "cursor is not one this API returned")
    if len(cursor) != 22 or not cursor.isascii():
        raise invalid
    try:
        raw = base64.b64decode(cursor + "==", altchars=b"-_", validate=True)
    except (binascii.Error, ValueError):
        raise invalid from None
    if len(raw) != 16:
        raise invalid
    last_id = uuid.UUID(bytes=raw)
    if _encode_cursor(last_id) != cursor:  # only the canonical spelling is accepted
        raise invalid
    return last_id
