"""The HTTP API (DESIGN §6): thin FastAPI routes over store.py and queue.py.

Every error is JSON ``{"error": {"code", "message", "details"?}}`` (api_errors.py); bad input
always gets a 4xx, an unreachable database a 503, and anything else a generic 500 (logged).
Auth and the body cap are the outermost middleware (api_guard.py); request and response models
live in api_models.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Awaitable
from typing import Annotated, Any

import asyncpg
import fastapi
import structlog
from fastapi import Query, Security
from fastapi.security import HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

import consolidation
import consolidation.metrics  # registers the project's metrics, so /metrics lists them
from consolidation import budgets, db, queue, store
from consolidation.api.bodies import OrjsonRoute
from consolidation.api.docs import add_docs_routes
from consolidation.api.errors import (
    ApiError,
    add_exception_handlers,
    database_unavailable,
    error_response,
)
from consolidation.api.guard import MAX_BODY_BYTES, Credentials, Guard
from consolidation.api.models import (
    BANK_CURSOR_PATTERN,
    BANK_ID_PATTERN,
    CURSOR_PATTERN,
    SCOPE_PARAM_PATTERN,
    TIME_CURSOR_PATTERN,
    V1_ERRORS,
    BankDeleted,
    BankId,
    BankOut,
    BanksPage,
    CancelResponse,
    ConfirmationErrorBody,
    ConsolidationRequest,
    ConsolidationResponse,
    ForgetResponse,
    IngestRequest,
    IngestResponse,
    ObservationOut,
    ObservationsPage,
    OperationResponse,
    OperationsPage,
    OperationStatus,
    PageLimit,
    RecoverResponse,
    StatsResponse,
    StatusResponse,
    TokenBudgetRequest,
    TokenBudgetResponse,
    cursor_query,
    error_responses,
)
from consolidation.api.params import (
    check_bank_id,
    decode_bank_cursor,
    decode_cursor,
    decode_time_cursor,
    encode_bank_cursor,
    encode_cursor,
    encode_time_cursor,
    require_bank,
    scope_param,
)
from consolidation.backlog import BACKLOG
from consolidation.errors import NotCancellable, NotFound, ValidationError
from consolidation.memories import MAX_BANK_ID_CHARS, parse_memories
from consolidation.scopes import normalize_scope
from consolidation.settings import Settings
from consolidation.ui import add_ui_routes

__all__ = ["MAX_BODY_BYTES", "create_app"]

log = structlog.get_logger(__name__)

READY_TIMEOUT_S = 2.0
# Whether a session of the pool can write: a hot standby (a failover's old primary, or a replica
# behind the address) is in recovery; a database set read-only gives read-only sessions.
WRITABLE = "SELECT NOT pg_is_in_recovery() AND current_setting('transaction_read_only') = 'off'"


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
        docs_url=None,  # /docs and /redoc come from api_docs.py, without a CDN
        openapi_url="/openapi.json",
        redoc_url=None,
        redirect_slashes=False,
    )
    credentials = Credentials(api_key or None)
    app.add_middleware(Guard, credentials=credentials)
    add_exception_handlers(app)

    # Enforced by Guard (api_guard.py); declared here so the OpenAPI document shows the scheme.
    security = [Security(HTTPBearer(auto_error=False))] if api_key else []
    v1 = fastapi.APIRouter(
        route_class=OrjsonRoute,
        dependencies=security,
        responses=error_responses(*V1_ERRORS),
    )
    _add_v1_routes(v1, settings, pool)
    app.include_router(v1)
    _add_probe_routes(app, pool, contact, settings.lease_s)
    add_docs_routes(app)
    add_ui_routes(app, pool, credentials, settings)
    return app


def _add_v1_routes(router: fastapi.APIRouter, settings: Settings, pool: asyncpg.Pool) -> None:
    @router.post(
        "/v1/banks/{bank_id}/memories",
        status_code=201,
        response_model=IngestResponse,
        responses=error_responses(409),
        summary="Ingest memories",
    )
    async def ingest_memories(bank_id: BankId, body: IngestRequest) -> IngestResponse:
        """Store up to 1,000 memories, all or nothing; re-sending an ``id`` is a no-op."""
        check_bank_id(bank_id)
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
        operation_id = None
        if settings.auto_consolidate:
            submitted = await queue.submit(pool, bank_id, max_attempts=settings.max_attempts)
            operation_id = submitted.operation.id
        return IngestResponse(ids=result.ids, operation_id=operation_id)

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
        await require_bank(pool, bank_id)
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

    @router.get("/v1/operations", response_model=OperationsPage, summary="List operations")
    async def list_operations(
        bank_id: Annotated[
            str | None,
            Query(
                min_length=1,
                max_length=MAX_BANK_ID_CHARS,
                pattern=BANK_ID_PATTERN,
                description="Only this bank's operations.",
            ),
        ] = None,
        status: Annotated[
            OperationStatus | None, Query(description="Only operations in this status.")
        ] = None,
        limit: PageLimit = 100,
        cursor: Annotated[str | None, cursor_query(TIME_CURSOR_PATTERN)] = None,
    ) -> OperationsPage:
        """Operations newest first, one page at a time; the objects of ``GET
        /v1/operations/{operation_id}``."""
        if bank_id is not None:
            check_bank_id(bank_id)
        before = decode_time_cursor(cursor) if cursor is not None else None
        rows = await queue.list_operations(
            pool, bank_id=bank_id, status=status, before=before, limit=limit + 1
        )
        page = rows[:limit]
        return OperationsPage(
            operations=[OperationResponse.model_validate(op.to_json()) for op in page],
            next_cursor=(
                encode_time_cursor(page[-1].created_at, page[-1].id) if len(rows) > limit else None
            ),
        )

    @router.post(
        "/v1/operations/{operation_id}/cancel",
        status_code=202,
        response_model=CancelResponse,
        responses=error_responses(409),
        summary="Cancel an operation",
    )
    async def cancel_operation(operation_id: uuid.UUID) -> CancelResponse:
        """A pending operation is ``cancelled`` at once; a running one stops within about a
        second (``running`` until then); a finished one is left as it is. A forget cannot be
        cancelled (409)."""
        try:
            op = await _operation_or_404(queue.request_cancel(pool, operation_id))
        except NotCancellable as exc:
            raise ApiError(409, "not_cancellable", str(exc)) from None
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
        limit: PageLimit = 100,
        cursor: Annotated[str | None, cursor_query(CURSOR_PATTERN)] = None,
    ) -> ObservationsPage:
        """Observations of a bank ordered by id, one page at a time."""
        scope_filter = scope_param(scope)
        after = decode_cursor(cursor) if cursor is not None else None
        await require_bank(pool, bank_id)
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
            next_cursor=encode_cursor(page[-1].id) if len(rows) > limit else None,
        )

    @router.get("/v1/banks", response_model=BanksPage, summary="List banks")
    async def list_banks(
        limit: PageLimit = 100,
        cursor: Annotated[str | None, cursor_query(BANK_CURSOR_PATTERN)] = None,
    ) -> BanksPage:
        """Banks ordered by id, each with the stats of ``GET /v1/banks/{bank_id}/stats``."""
        after = decode_bank_cursor(cursor) if cursor is not None else None
        rows = await store.list_banks(pool, after=after, limit=limit + 1)
        page = rows[:limit]
        return BanksPage(
            banks=[
                BankOut(bank_id=b.id, created_at=b.created_at, **_stats_json(b.stats)) for b in page
            ],
            next_cursor=encode_bank_cursor(page[-1].id) if len(rows) > limit else None,
        )

    @router.get("/v1/banks/{bank_id}/stats", response_model=StatsResponse, summary="Bank stats")
    async def bank_stats(bank_id: BankId) -> StatsResponse:
        """Memory counts by state, observation count, and the oldest pending memory's age."""
        await require_bank(pool, bank_id)
        return StatsResponse(**_stats_json(await store.bank_stats(pool, bank_id)))

    @router.get(
        "/v1/banks/{bank_id}/token-budget",
        response_model=TokenBudgetResponse,
        summary="A bank's token budget",
    )
    async def get_token_budget(bank_id: BankId) -> TokenBudgetResponse:
        """The budget that applies to the bank, whose it is, the tokens used in the rolling 24 h
        window and, while it is used up, when the bank's operations resume."""
        check_bank_id(bank_id)
        return await _token_budget(pool, bank_id, settings.bank_token_budget)

    @router.put(
        "/v1/banks/{bank_id}/token-budget",
        response_model=TokenBudgetResponse,
        summary="Set a bank's token budget",
    )
    async def set_token_budget(bank_id: BankId, body: TokenBudgetRequest) -> TokenBudgetResponse:
        """Set the bank's own budget (created if new), or null to follow
        CONSOLIDATION_BANK_TOKEN_BUDGET again; operations paused by the budget look again at
        once. Answers like the GET."""
        check_bank_id(bank_id)
        await budgets.set_bank_budget(pool, bank_id, body.tokens_per_24h)
        return await _token_budget(pool, bank_id, settings.bank_token_budget)

    @router.post(
        "/v1/banks/{bank_id}/memories/recover",
        response_model=RecoverResponse,
        summary="Retry failed memories",
    )
    async def recover_failed(bank_id: BankId) -> RecoverResponse:
        """Clear failed markers so those memories are consolidated again."""
        await require_bank(pool, bank_id)
        recovered = await store.recover_failed(pool, bank_id)
        if recovered and settings.auto_consolidate:
            await queue.submit(pool, bank_id, max_attempts=settings.max_attempts)
        return RecoverResponse(recovered=recovered)

    @router.delete(
        "/v1/banks/{bank_id}/memories/{memory_id}",
        status_code=202,
        response_model=ForgetResponse,
        summary="Forget a memory",
    )
    async def forget_memory(bank_id: BankId, memory_id: uuid.UUID) -> ForgetResponse:
        """Forget a memory and what was derived from it. The memory leaves waves and counts at
        once; the returned forget operation deletes it, deletes the observations it alone
        supports and re-derives those it shares from their other sources. Idempotent: asking
        again answers the same operation."""
        await require_bank(pool, bank_id)
        try:
            forgets = await store.request_forget(
                pool, bank_id, [memory_id], max_attempts=settings.max_attempts
            )
        except NotFound as exc:
            raise ApiError(404, "memory_not_found", str(exc)) from None
        return ForgetResponse(memory_id=memory_id, operation_id=forgets[memory_id])

    @router.delete(
        "/v1/banks/{bank_id}",
        response_model=BankDeleted,
        responses={
            400: {
                "model": ConfirmationErrorBody,
                "description": "Without ?confirm={bank_id}: what the deletion would remove.",
            }
        },
        summary="Delete a bank",
    )
    async def delete_bank(
        bank_id: BankId,
        confirm: Annotated[
            str | None, Query(description="The bank id again: the deletion happens only then.")
        ] = None,
    ) -> BankDeleted:
        """Delete a bank and everything in it, after cancelling its operations; answers the
        counts removed. Without a matching ``confirm``: 400 with the same counts, nothing
        deleted."""
        check_bank_id(bank_id)
        confirmed = confirm == bank_id
        try:
            counts = await store.delete_bank(pool, bank_id, dry_run=not confirmed)
        except NotFound as exc:
            raise ApiError(404, "bank_not_found", str(exc)) from None
        counted = dataclasses.asdict(counts)
        if not confirmed:
            raise ApiError(
                400,
                "confirmation_required",
                f"deleting bank {bank_id!r} removes everything in it; repeat the request with "
                "?confirm= set to the bank id to delete it",
                extra={"counts": counted},
            )
        log.info("bank_deleted", bank_id=bank_id, **counted)
        return BankDeleted(bank_id=bank_id, deleted=counts)


def _add_probe_routes(
    app: fastapi.FastAPI, pool: asyncpg.Pool, contact: db.LastContact | None, lease_s: float
) -> None:
    @app.get(
        "/healthz",
        response_model=StatusResponse,
        responses=error_responses(503),
        summary="Liveness",
    )
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
        responses=error_responses(503),
        summary="Readiness",
    )
    async def readyz() -> Response | StatusResponse:
        """Ready when the database answers within 2 s and can take writes (not read-only, not a
        server in recovery: ingestion and submits would fail)."""
        try:
            async with asyncio.timeout(READY_TIMEOUT_S):
                writable = await pool.fetchval(WRITABLE)
        except Exception as exc:
            log.warning("readiness_failed", error=repr(exc))
            return database_unavailable()
        if not writable:
            log.warning("readiness_failed", error="the database cannot take writes")
            return database_unavailable(
                "the database cannot take writes (read-only, or a server in recovery); retry later"
            )
        return StatusResponse(status="ready")

    @app.get(
        "/metrics",
        response_class=Response,
        responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
        summary="Prometheus metrics",
    )
    async def metrics() -> Response:
        """The default Prometheus registry, text format, with the backlog read from the database
        (at most every few seconds; ``consolidation_backlog_up 0`` when it cannot be read)."""
        await BACKLOG.refresh(pool)
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


# --- helpers ---------------------------------------------------------------------------------


async def _token_budget(
    pool: asyncpg.Pool, bank_id: str, setting: int | None
) -> TokenBudgetResponse:
    window = await budgets.window(pool, bank_id, setting)
    if window is None:
        raise ApiError(404, "bank_not_found", f"bank {bank_id!r} does not exist")
    resumes_at = None
    if window.limit is not None and window.exhausted:
        resumes_at = await budgets.frees_at(pool, bank_id, window.limit)
    return TokenBudgetResponse(
        bank_id=bank_id,
        tokens_per_24h=window.limit,
        source=window.source,
        used_24h=window.used,
        resumes_at=resumes_at,
    )


def _stats_json(stats: store.BankStats) -> dict[str, Any]:
    return dataclasses.asdict(stats)


async def _operation_or_404(call: Awaitable[queue.Operation]) -> queue.Operation:
    try:
        return await call
    except NotFound as exc:
        raise ApiError(404, "operation_not_found", str(exc)) from None
