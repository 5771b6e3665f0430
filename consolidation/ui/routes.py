"""The dashboard at ``/ui``: server-rendered pages over store.py and queue.py, served by the API.

Pages only read. Every action (cancel, recover, consolidate, retry) is a ``fetch`` of the ``/v1``
route itself from static/ui.js, so it passes the same guard, validation and answers as any API
client. With an API key, the guard sends a browser without the session cookie to ``/ui/login``,
which sets the cookie once the key is given (api_guard.Credentials).
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import resources
from typing import Annotated
from urllib.parse import parse_qs, urlsplit

import asyncpg
import fastapi
import structlog
from fastapi import Query
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response

from consolidation import budgets, queue, store
from consolidation.api.errors import ApiError
from consolidation.api.guard import SESSION_COOKIE, Credentials
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
from consolidation.errors import NotFound
from consolidation.settings import Settings
from consolidation.ui import reads
from consolidation.ui.charts import Chart, chart
from consolidation.ui.health import LLM_OUTCOMES, ProcessRequests, Requests
from consolidation.ui.pages import (
    EVERY_SCOPE,
    STATUSES,
    Chrome,
    bank_url,
    render,
    with_query,
)

__all__ = ["add_ui_routes"]

log = structlog.get_logger(__name__)

PAGE = 50
BANK_OPERATIONS = 10
MAX_SCOPES_SHOWN = 200
MAX_LOGIN_BODY = 4096
SESSION_MAX_AGE_S = 30 * 86400
CHART_MINUTES = 60
# Charts read every memory touched in the last hour; many open dashboards share one read.
CHART_TTL_S = 10.0

# No inline script or style anywhere, nothing from another origin, never inside a frame.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}

_STATIC_TYPES = {"ui.css": "text/css; charset=utf-8", "ui.js": "text/javascript; charset=utf-8"}


class _Static:
    """The dashboard's CSS and script, read from the package once; URLs carry their hash."""

    def __init__(self) -> None:
        folder = resources.files("consolidation.ui") / "static"
        self.files = {name: (folder / name).read_bytes() for name in _STATIC_TYPES}
        self.urls = {
            name: f"/ui/static/{name}?v={hashlib.sha256(body).hexdigest()[:12]}"
            for name, body in self.files.items()
        }


@dataclass(frozen=True)
class Health:
    """The strip at the top of the banks and operations pages."""

    workers: reads.Workers
    llm: Requests  # this process's
    last_error: reads.LastError | None
    embeddings_endpoint: str | None  # host of the configured endpoint, never its credentials
    embeddings_model: str
    embeddings: Requests  # this process's


class _Charts:
    """Throughput and backlog charts of one bank or all, each read at most every CHART_TTL_S."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool
        self._cache: dict[str | None, tuple[float, list[Chart]]] = {}

    async def of(self, bank_id: str | None) -> list[Chart]:
        now = time.monotonic()
        cached = self._cache.get(bank_id)
        if cached is not None and now - cached[0] < CHART_TTL_S:
            return cached[1]
        a = await reads.activity(self._pool, bank_id, CHART_MINUTES)
        done = [c + f for c, f in zip(a.consolidated, a.failed, strict=True)]
        charts = [
            chart("throughput", "Consolidated", "memories/min", done),
            chart("backlog", "Backlog", "pending", a.backlog()),
        ]
        if len(self._cache) > 256:  # banks looked at once each: keep the dict bounded
            self._cache.clear()
        self._cache[bank_id] = (now, charts)
        return charts


def add_ui_routes(
    app: fastapi.FastAPI, pool: asyncpg.Pool, credentials: Credentials, settings: Settings
) -> None:
    """Mount the dashboard on ``app``; ``credentials`` says whether it needs the key."""
    static = _Static()
    requests = ProcessRequests()
    charts = _Charts(pool)
    router = fastapi.APIRouter(include_in_schema=False)

    def chrome(request: Request) -> Chrome:
        return Chrome(
            static=static.urls,
            signed_in=credentials.required
            and credentials.session_ok(request.headers.get("cookie", "").encode("latin-1")),
            now=datetime.now(UTC),
        )

    async def show(request: Request, view: Awaitable[str]) -> Response:
        """A page, or the page that says why not (bad parameter, unknown bank)."""
        try:
            return _html(await view)
        except ApiError as exc:
            title = "Not found" if exc.status == 404 else "Cannot show this page"
            text = "; ".join([exc.message, *exc.details[:3]])
            page = render("message.html", chrome(request), title=title, text=text)
            return _html(page, exc.status)

    async def health() -> Health:
        return Health(
            workers=await reads.workers(pool),
            llm=requests.llm.requests(LLM_OUTCOMES),
            last_error=await reads.last_error(pool),
            embeddings_endpoint=_host(settings.embeddings_base_url),
            embeddings_model=settings.embeddings_model,
            embeddings=requests.embeddings.requests(),
        )

    @app.get(
        "/ui",
        response_class=HTMLResponse,
        summary="Dashboard",
        description="The operator's dashboard (HTML): health, banks, operations, failed memories, "
        "observations. With an API key it asks for the key once and keeps a session cookie.",
        responses={303: {"description": "To /ui/login when an API key is set and not given."}},
    )
    async def dashboard(
        request: Request, cursor: Annotated[str | None, Query(include_in_schema=False)] = None
    ) -> Response:
        return await show(request, banks_view(request, cursor))

    @router.get("/ui/")
    async def dashboard_slash() -> Response:
        return RedirectResponse("/ui", status_code=308)

    async def banks_view(request: Request, cursor: str | None) -> str:
        after = decode_bank_cursor(cursor) if cursor else None
        rows = await store.list_banks(pool, after=after, limit=PAGE + 1)
        page = rows[:PAGE]
        next_url = f"/ui?cursor={encode_bank_cursor(page[-1].id)}" if len(rows) > PAGE else None
        return render(
            "banks.html",
            chrome(request),
            title="Banks",
            active="banks",
            refresh_ms=5000,
            banks=page,
            next_url=next_url,
            health=await health(),
            charts=await charts.of(None),
        )

    @router.get("/ui/operations")
    async def operations(
        request: Request,
        bank_id: Annotated[str | None, Query()] = None,
        status: Annotated[str | None, Query()] = None,
        cursor: Annotated[str | None, Query()] = None,
    ) -> Response:
        return await show(request, operations_view(request, bank_id, status, cursor))

    async def operations_view(
        request: Request, bank_id: str | None, status: str | None, cursor: str | None
    ) -> str:
        bank_id = bank_id or None
        status = status or None
        if bank_id is not None:
            check_bank_id(bank_id)
        if status is not None and status not in STATUSES:
            raise ApiError(422, "invalid_request", f"status must be one of {', '.join(STATUSES)}")
        before = decode_time_cursor(cursor) if cursor else None
        rows = await queue.list_operations(
            pool, bank_id=bank_id, status=status, before=before, limit=PAGE + 1
        )
        page = rows[:PAGE]
        next_url = None
        if len(rows) > PAGE:
            next_url = with_query(
                "/ui/operations",
                bank_id=bank_id,
                status=status,
                cursor=encode_time_cursor(page[-1].created_at, page[-1].id),
            )
        return render(
            "operations.html",
            chrome(request),
            title="Operations",
            active="operations",
            refresh_ms=2000,
            views=reads.operation_views(page),
            bank_id=bank_id,
            status=status,
            next_url=next_url,
            health=await health(),
        )

    @router.get("/ui/operations/{operation_id}")
    async def operation(request: Request, operation_id: str) -> Response:
        return await show(request, operation_view(request, operation_id))

    async def operation_view(request: Request, operation_id: str) -> str:
        try:
            wanted = uuid.UUID(operation_id)
        except ValueError:
            raise ApiError(422, "invalid_request", "an operation id is a UUID") from None
        try:
            view = await reads.operation_view(pool, wanted)
        except NotFound as exc:
            raise ApiError(404, "not_found", str(exc)) from None
        return render(
            "operation.html",
            chrome(request),
            title=f"Operation {str(wanted)[:8]}",
            active="operations",
            refresh_ms=2000 if view.op.status not in queue.TERMINAL else 0,
            view=view,
        )

    @router.get("/ui/banks/{bank_id}")
    async def bank(request: Request, bank_id: str, failed_cursor: str | None = None) -> Response:
        return await show(request, bank_view(request, bank_id, failed_cursor))

    async def bank_view(request: Request, bank_id: str, failed_cursor: str | None) -> str:
        await require_bank(pool, bank_id)
        before = decode_time_cursor(failed_cursor) if failed_cursor else None
        stats = await store.bank_stats(pool, bank_id)
        ops = await queue.list_operations(pool, bank_id=bank_id, limit=BANK_OPERATIONS)
        failed = await store.list_failed_memories(pool, bank_id, before=before, limit=PAGE + 1)
        scopes = await store.list_scopes(pool, bank_id, MAX_SCOPES_SHOWN)
        budget = await budgets.window(pool, bank_id, settings.bank_token_budget)
        resumes_at = None
        if budget is not None and budget.limit is not None and budget.exhausted:
            resumes_at = await budgets.frees_at(pool, bank_id, budget.limit)
        page = failed[:PAGE]
        next_url = None
        if len(failed) > PAGE:
            cursor = encode_time_cursor(page[-1].failed_at, page[-1].id)
            next_url = bank_url(bank_id, failed_cursor=cursor) + "#failed"
        return render(
            "bank.html",
            chrome(request),
            title=bank_id,
            active="banks",
            refresh_ms=3000,
            bank_id=bank_id,
            stats=stats,
            views=reads.operation_views(ops),
            failed=page,
            failed_next_url=next_url,
            scopes=scopes,
            budget=budget,
            resumes_at=resumes_at,
            charts=await charts.of(bank_id),
        )

    @router.get("/ui/banks/{bank_id}/observations")
    async def observations(
        request: Request,
        bank_id: str,
        scope: str | None = None,
        q: str | None = None,
        cursor: str | None = None,
    ) -> Response:
        return await show(request, observations_view(request, bank_id, scope, q, cursor))

    async def observations_view(
        request: Request, bank_id: str, scope: str | None, q: str | None, cursor: str | None
    ) -> str:
        if scope == EVERY_SCOPE:
            scope = None
        scope_filter = scope_param(scope)
        query = (q or "").strip() or None
        if query is not None and len(query) > reads.MAX_QUERY_CHARS:
            raise ApiError(
                422, "invalid_request", f"q is at most {reads.MAX_QUERY_CHARS} characters"
            )
        if query is not None and "\x00" in query:
            raise ApiError(422, "invalid_request", "q must not contain NUL characters")
        after = decode_cursor(cursor) if cursor else None
        await require_bank(pool, bank_id)
        if query is None:
            rows = await store.list_observations(
                pool, bank_id, scope=scope_filter, after=after, limit=PAGE + 1
            )
        else:
            rows = await reads.search_observations(
                pool, bank_id, query, scope=scope_filter, after=after, limit=PAGE + 1
            )
        page = rows[:PAGE]
        wanted: list[uuid.UUID] = [m for o in page for m in o.source_memory_ids]
        sources = await store.memory_texts(pool, bank_id, wanted)
        next_url = None
        if len(rows) > PAGE:
            next_url = bank_url(
                bank_id, "observations", scope=scope, q=query, cursor=encode_cursor(page[-1].id)
            )
        return render(
            "observations.html",
            chrome(request),
            title=f"Observations of {bank_id}",
            active="banks",
            bank_id=bank_id,
            scope=scope_filter,
            query=query,
            max_query=reads.MAX_QUERY_CHARS,
            scopes=await store.list_scopes(pool, bank_id, MAX_SCOPES_SHOWN),
            observations=page,
            sources=sources,
            next_url=next_url,
        )

    @router.get("/ui/login")
    async def login_form(request: Request, next: str = "/ui") -> Response:
        if not credentials.required:
            return RedirectResponse("/ui", status_code=303)
        return _html(login_page(next_url=_safe_next(next), problem=None))

    def login_page(*, next_url: str, problem: str | None) -> str:
        bare = Chrome(static=static.urls, signed_in=False, now=datetime.now(UTC))
        return render("login.html", bare, next_url=next_url, problem=problem)

    @router.post("/ui/login")
    async def login(request: Request) -> Response:
        body = await request.body()
        form = parse_qs(body[:MAX_LOGIN_BODY].decode("utf-8", "replace"))
        next_url = _safe_next((form.get("next") or ["/ui"])[0])
        if not credentials.required:
            return RedirectResponse(next_url, status_code=303)
        if not credentials.key_ok((form.get("key") or [""])[0]):
            log.warning("dashboard_sign_in_refused", client=_client(request))
            page = login_page(next_url=next_url, problem="That is not the API key.")
            return _html(page, 401)
        log.info("dashboard_signed_in", client=_client(request))
        response = RedirectResponse(next_url, status_code=303)
        response.set_cookie(
            SESSION_COOKIE,
            credentials.session_token(),
            max_age=SESSION_MAX_AGE_S,
            path="/",
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
        return response

    @router.post("/ui/logout")
    async def logout() -> Response:
        response = RedirectResponse("/ui/login" if credentials.required else "/ui", 303)
        response.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="strict")
        return response

    @router.get("/ui/static/{name}")
    async def static_file(name: str) -> Response:
        if name not in static.files:
            return Response("not found", status_code=404, media_type="text/plain")
        return Response(
            static.files[name],
            media_type=_STATIC_TYPES[name],
            headers={"Cache-Control": "public, max-age=31536000, immutable"},
        )

    app.include_router(router)


def _html(text: str, status: int = 200) -> Response:
    return HTMLResponse(text, status_code=status, headers=SECURITY_HEADERS)


def _host(url: str | None) -> str | None:
    """The host (and port) of an endpoint URL: what the page may show of it."""
    if not url:
        return None
    parts = urlsplit(url)
    return parts.hostname + (f":{parts.port}" if parts.port else "") if parts.hostname else "?"


def _safe_next(target: str) -> str:
    """Only a dashboard path: never another site (an open redirect)."""
    if target.startswith("/ui") and not target.startswith("//") and "\\" not in target:
        return target
    return "/ui"


def _client(request: Request) -> str | None:
    return request.client.host if request.client else None
