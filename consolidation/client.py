"""A Python client for the HTTP API: ``Client`` (blocking) and ``AsyncClient`` (asyncio), on httpx.

Results are the API's own response models (api_models.py). An error answer raises an
``APIError`` subclass carrying the API's ``{"error": {"code", "message"}}``; a 503 or 429 is
retried a bounded number of times, honouring ``Retry-After``. List routes are iterators that
fetch the next page when the previous one is used up.

    with Client("http://127.0.0.1:8080", api_key="…") as client:
        answer = client.ingest("alice", [{"text": "Alice drinks green tea", "tags": ["alice"]}])
        client.wait(answer.operation_id, timeout_s=60)
        for observation in client.list_observations("alice"):
            print(observation.text)
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from types import TracebackType
from typing import Any, Self, TypeVar
from urllib.parse import quote

import httpx
import orjson
from pydantic import BaseModel, TypeAdapter
from pydantic import ValidationError as PydanticValidationError

import consolidation
from consolidation.api.models import (
    BankDeleted,
    BankOut,
    BanksPage,
    CancelResponse,
    ConsolidationResponse,
    ForgetResponse,
    IngestResponse,
    MemoryIn,
    ObservationOut,
    ObservationsPage,
    OperationResponse,
    OperationsPage,
    OperationStatus,
    RecoverResponse,
    StatsResponse,
    TokenBudgetResponse,
)
from consolidation.store import BankCounts

__all__ = [
    "DEFAULT_BASE_URL",
    "TERMINAL_STATUSES",
    "APIError",
    "AsyncClient",
    "BadRequest",
    "BankCounts",
    "BankDeleted",
    "BankOut",
    "CancelResponse",
    "Client",
    "ClientError",
    "Conflict",
    "ConsolidationResponse",
    "Forbidden",
    "ForgetResponse",
    "IngestResponse",
    "InvalidRequest",
    "MemoryIn",
    "NotFound",
    "ObservationOut",
    "OperationResponse",
    "PayloadTooLarge",
    "RateLimited",
    "RecoverResponse",
    "Retries",
    "ServerError",
    "StatsResponse",
    "TransportError",
    "Unauthorized",
    "Unavailable",
    "UnsupportedMediaType",
    "WaitTimeout",
]

DEFAULT_BASE_URL = "http://127.0.0.1:8080"
TERMINAL_STATUSES: frozenset[OperationStatus] = frozenset({"completed", "failed", "cancelled"})
DEFAULT_PAGE_SIZE = 100

M = TypeVar("M", bound=BaseModel)
P = TypeVar("P", bound=BaseModel)
T = TypeVar("T")

Memory = Mapping[str, Any] | MemoryIn


# --- errors -----------------------------------------------------------------------------------


class ClientError(Exception):
    """Base of every error this client raises."""


class APIError(ClientError):
    """The API answered with an error: its HTTP ``status`` and the ``code``, ``message`` and
    ``details`` of its ``{"error": …}`` body (``error`` holds that whole object)."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        details: Sequence[str] = (),
        error: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.details = list(details)
        self.error: dict[str, Any] = dict(error or {"code": code, "message": message})


class BadRequest(APIError):
    """400: malformed JSON, a bad cursor, or a bank deletion without its confirmation."""


class Unauthorized(APIError):
    """401: the API key is missing or wrong (``Client(api_key=…)``)."""


class Forbidden(APIError):
    """403."""


class NotFound(APIError):
    """404: no such bank, operation, memory or route."""


class Conflict(APIError):
    """409: an ``id`` already used by another memory, or an operation that cannot be cancelled."""


class PayloadTooLarge(APIError):
    """413: the request body is over the API's cap (16 MiB)."""


class UnsupportedMediaType(APIError):
    """415: a request body that is not sent as JSON."""


class InvalidRequest(APIError):
    """422: the request is well-formed but invalid; ``details`` lists every problem found."""


class RateLimited(APIError):
    """429 after the client's retries (a proxy in front of the API may answer it)."""


class ServerError(APIError):
    """5xx: the service failed; the request may be retried later."""


class Unavailable(ServerError):
    """503 after the client's retries: the database cannot be reached or cannot take writes."""


class TransportError(ClientError):
    """The API could not be reached, or did not answer within the timeout."""


class WaitTimeout(ClientError, TimeoutError):
    """``wait`` gave up: the operation had not ended within ``timeout_s``; ``operation`` is the
    last state seen."""

    def __init__(self, operation: OperationResponse, timeout_s: float) -> None:
        super().__init__(
            f"operation {operation.operation_id} is still {operation.status} after {timeout_s:g} s"
        )
        self.operation = operation
        self.timeout_s = timeout_s


_ERRORS: dict[int, type[APIError]] = {
    400: BadRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    413: PayloadTooLarge,
    415: UnsupportedMediaType,
    422: InvalidRequest,
    429: RateLimited,
    503: Unavailable,
}


def error_from(response: httpx.Response) -> APIError:
    """The typed exception for an error answer; a body without the API's error shape (a proxy's
    HTML page) still gives its status and the start of its text."""
    cls = _ERRORS.get(response.status_code)
    if cls is None:
        cls = ServerError if response.status_code >= 500 else APIError
    try:
        error = orjson.loads(response.content)["error"]
        code, message = str(error["code"]), str(error["message"])
        details = [str(d) for d in error.get("details", [])]
    except (orjson.JSONDecodeError, TypeError, KeyError):
        reason = response.reason_phrase or "error"
        text = response.text.strip()[:200]
        return cls(response.status_code, "http_error", f"{reason}: {text}" if text else reason)
    return cls(response.status_code, code, message, details, error)


# --- retries ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Retries:
    """How a 503 or 429 answer is retried: at most ``max_retries`` more requests, each after the
    answer's ``Retry-After`` or else an exponential backoff from ``backoff_s``. An answer asking
    for a wait longer than ``max_wait_s`` is not retried: its error is raised at once."""

    max_retries: int = 3
    backoff_s: float = 0.5
    max_wait_s: float = 30.0
    statuses: frozenset[int] = field(default=frozenset({429, 503}))

    def delay(self, response: httpx.Response, retry: int) -> float | None:
        """Seconds to wait before retry number ``retry`` (from 0), or None to give up."""
        if response.status_code not in self.statuses or retry >= self.max_retries:
            return None
        asked = retry_after(response.headers.get("retry-after"))
        wait = asked if asked is not None else self.backoff_s * 2**retry
        return None if wait > self.max_wait_s else wait


def retry_after(value: str | None, now: datetime | None = None) -> float | None:
    """Seconds a ``Retry-After`` header asks for (delta-seconds or an HTTP date), or None when
    absent or unreadable."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())


# --- requests, shared by both clients ---------------------------------------------------------


@dataclass(frozen=True)
class _Call:
    method: str
    path: str
    params: Mapping[str, str | int] | None = None
    body: Any = None


def _segment(value: str | uuid.UUID) -> str:
    return quote(str(value), safe="")


def _ingest(bank_id: str, memories: Sequence[Memory]) -> _Call:
    items = [
        m.model_dump(mode="json", exclude_none=True) if isinstance(m, MemoryIn) else dict(m)
        for m in memories
    ]
    return _Call("POST", f"/v1/banks/{_segment(bank_id)}/memories", body={"memories": items})


def _token_budget(bank_id: str) -> str:
    return f"/v1/banks/{_segment(bank_id)}/token-budget"


def _submit(bank_id: str, scopes: Sequence[Sequence[str]] | None, priority: int | None) -> _Call:
    body: dict[str, Any] = {}
    if scopes is not None:
        body["scopes"] = [list(s) for s in scopes]
    if priority is not None:
        body["priority"] = priority
    return _Call("POST", f"/v1/banks/{_segment(bank_id)}/consolidations", body=body)


def _operations(
    bank_id: str | None, status: OperationStatus | None, limit: int, cursor: str | None
) -> _Call:
    params: dict[str, str | int] = {"limit": limit}
    if bank_id is not None:
        params["bank_id"] = bank_id
    if status is not None:
        params["status"] = status
    if cursor is not None:
        params["cursor"] = cursor
    return _Call("GET", "/v1/operations", params)


def _observations(
    bank_id: str, scope: Sequence[str] | None, limit: int, cursor: str | None
) -> _Call:
    params: dict[str, str | int] = {"limit": limit}
    if scope is not None:
        if any("," in tag for tag in scope):
            raise ValueError("a scope filter cannot name a tag that contains a comma")
        params["scope"] = ",".join(scope)
    if cursor is not None:
        params["cursor"] = cursor
    return _Call("GET", f"/v1/banks/{_segment(bank_id)}/observations", params)


def _banks(limit: int, cursor: str | None) -> _Call:
    params: dict[str, str | int] = {"limit": limit}
    if cursor is not None:
        params["cursor"] = cursor
    return _Call("GET", "/v1/banks", params)


def _delete_bank(bank_id: str, confirm: str | None) -> _Call:
    params = None if confirm is None else {"confirm": confirm}
    return _Call("DELETE", f"/v1/banks/{_segment(bank_id)}", params)


def _dry_run_counts(error: BadRequest) -> BankCounts:
    if error.code != "confirmation_required" or "counts" not in error.error:
        raise error
    return _COUNTS.validate_python(error.error["counts"])


_COUNTS = TypeAdapter(BankCounts)


def _headers(api_key: str | None) -> dict[str, str]:
    headers = {
        "Accept": "application/json",
        "User-Agent": f"consolidation-client/{consolidation.__version__}",
    }
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def _build(http: httpx.Client | httpx.AsyncClient, call: _Call) -> httpx.Request:
    content = None if call.body is None else orjson.dumps(call.body)
    headers = None if content is None else {"Content-Type": "application/json"}
    return http.build_request(
        call.method, call.path, params=call.params, content=content, headers=headers
    )


def _parse(response: httpx.Response, model: type[M]) -> M:
    if response.is_error:
        raise error_from(response)
    try:
        return model.model_validate_json(response.content)
    except PydanticValidationError as exc:
        raise ClientError(
            f"{response.request.method} {response.request.url.path} answered "
            f"{response.status_code} with a body that is not a {model.__name__}: {exc}"
        ) from None


def _timeout_left(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.monotonic()


# --- the clients ------------------------------------------------------------------------------


class Client:
    """A blocking client of one consolidation service; close it (or use ``with``) when done.

    ``api_key`` is sent as ``Authorization: Bearer`` (the service's ``CONSOLIDATION_API_KEY``);
    ``timeout_s`` bounds each HTTP request; ``transport`` replaces httpx's (tests, proxies).
    """

    def __init__(
        self,
        base_url: str = DEFAULT_BASE_URL,
        *,
        api_key: str | None = None,
        timeout_s: float = 30.0,
        retries: Retries = Retries(),
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.retries = retries
        self._http = httpx.Client(
            base_url=base_url, headers=_headers(api_key), timeout=timeout_s, transport=transport
        )

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # memories and consolidations

    def ingest(self, bank_id: str, memories: Sequence[Memory]) -> IngestResponse:
        """Store up to 1,000 memories (dicts with the API's fields, or ``MemoryIn``), all or
        nothing. A memory with an ``id`` is stored once however often it is sent."""
        return self._request(_ingest(bank_id, memories), IngestResponse)

    def submit(
        self,
        bank_id: str,
        *,
        scopes: Sequence[Sequence[str]] | None = None,
        priority: int | None = None,
    ) -> ConsolidationResponse:
        """Enqueue a consolidation of the bank (of these scopes only, when given); an unscoped
        one joins an already pending one (``deduplicated``)."""
        return self._request(_submit(bank_id, scopes, priority), ConsolidationResponse)

    def forget(self, bank_id: str, memory_id: uuid.UUID | str) -> ForgetResponse:
        """Forget a memory and what was derived from it; ``wait`` on the answer's
        ``operation_id`` to know when it is done."""
        call = _Call("DELETE", f"/v1/banks/{_segment(bank_id)}/memories/{_segment(memory_id)}")
        return self._request(call, ForgetResponse)

    def recover(self, bank_id: str) -> RecoverResponse:
        """Clear the bank's failed markers so those memories are consolidated again."""
        call = _Call("POST", f"/v1/banks/{_segment(bank_id)}/memories/recover")
        return self._request(call, RecoverResponse)

    # operations

    def get_operation(self, operation_id: uuid.UUID | str) -> OperationResponse:
        return self._request(
            _Call("GET", f"/v1/operations/{_segment(operation_id)}"), OperationResponse
        )

    def list_operations(
        self,
        *,
        bank_id: str | None = None,
        status: OperationStatus | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
    ) -> Iterator[OperationResponse]:
        """Operations newest first, fetched ``page_size`` at a time as the iterator advances."""
        return self._paged(
            lambda cursor: _operations(bank_id, status, page_size, cursor),
            OperationsPage,
            lambda page: page.operations,
        )

    def cancel_operation(self, operation_id: uuid.UUID | str) -> CancelResponse:
        """Ask an operation to stop: a pending one is cancelled at once, a running one within
        about a second (``wait`` for it)."""
        call = _Call("POST", f"/v1/operations/{_segment(operation_id)}/cancel")
        return self._request(call, CancelResponse)

    def wait(
        self,
        operation_id: uuid.UUID | str,
        *,
        timeout_s: float | None = 300.0,
        poll_s: float = 0.5,
    ) -> OperationResponse:
        """The operation once it has ended (completed, failed or cancelled: check ``status``);
        raises ``WaitTimeout`` if it has not within ``timeout_s`` (None: no limit)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        interval = min(0.05, poll_s)
        while True:
            operation = self.get_operation(operation_id)
            if operation.status in TERMINAL_STATUSES:
                return operation
            left = _timeout_left(deadline)
            if left is not None and left <= 0:
                raise WaitTimeout(operation, timeout_s or 0.0)
            time.sleep(interval if left is None else min(interval, left))
            interval = min(interval * 2, poll_s)

    # banks

    def stats(self, bank_id: str) -> StatsResponse:
        return self._request(_Call("GET", f"/v1/banks/{_segment(bank_id)}/stats"), StatsResponse)

    def token_budget(self, bank_id: str) -> TokenBudgetResponse:
        """The bank's token budget, whose it is, its tokens used in the last 24 h and, while it
        is used up, when its operations resume."""
        return self._request(_Call("GET", _token_budget(bank_id)), TokenBudgetResponse)

    def set_token_budget(self, bank_id: str, tokens_per_24h: int | None) -> TokenBudgetResponse:
        """Set the bank's own token budget (None: follow the service's setting again)."""
        call = _Call("PUT", _token_budget(bank_id), body={"tokens_per_24h": tokens_per_24h})
        return self._request(call, TokenBudgetResponse)

    def list_banks(self, *, page_size: int = DEFAULT_PAGE_SIZE) -> Iterator[BankOut]:
        """Every bank with its stats, ordered by bank id."""
        return self._paged(lambda cursor: _banks(page_size, cursor), BanksPage, lambda p: p.banks)

    def list_observations(
        self,
        bank_id: str,
        *,
        scope: Sequence[str] | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
    ) -> Iterator[ObservationOut]:
        """The bank's observations ordered by id: of one scope when ``scope`` is given (``[]`` is
        the shared scope), else of every scope."""
        _observations(bank_id, scope, page_size, None)  # a bad scope fails here, not at next()
        return self._paged(
            lambda cursor: _observations(bank_id, scope, page_size, cursor),
            ObservationsPage,
            lambda page: page.observations,
        )

    def delete_bank(self, bank_id: str) -> BankDeleted:
        """Delete the bank and everything in it, after cancelling its operations."""
        return self._request(_delete_bank(bank_id, confirm=bank_id), BankDeleted)

    def delete_bank_dry_run(self, bank_id: str) -> BankCounts:
        """What ``delete_bank`` would remove, without removing anything."""
        try:
            self._request(_delete_bank(bank_id, confirm=None), BankDeleted)
        except BadRequest as exc:
            return _dry_run_counts(exc)
        raise ClientError(f"bank {bank_id!r} was deleted by a request without confirmation")

    # plumbing

    def _request(self, call: _Call, model: type[M]) -> M:
        return _parse(self._send(call), model)

    def _send(self, call: _Call) -> httpx.Response:
        retry = 0
        while True:
            try:
                response = self._http.send(_build(self._http, call))
            except httpx.TransportError as exc:
                raise TransportError(f"{call.method} {call.path}: {exc!r}") from exc
            wait = self.retries.delay(response, retry)
            if wait is None:
                return response
            time.sleep(wait)
            retry += 1

    def _paged(
        self,
        call: Callable[[str | None], _Call],
        model: type[P],
        items: Callable[[P], Sequence[T]],
    ) -> Iterator[T]:
        cursor: str | None = None
        while True:
            page = self._request(call(cursor), model)
            yield from items(page)
            cursor = getattr(page, "next_cursor", None)
            if cursor is None:
                return


class AsyncClient:
    """The asyncio twin of ``Client``: the same methods, awaited (list methods are async
    iterators); close it with ``await client.aclose()`` or ``async with``."""

    def __init__(
        self,
        base_url: str = DEFAULT_BASE_URL,
        *,
        api_key: str | None = None,
        timeout_s: float = 30.0,
        retries: Retries = Retries(),
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.retries = retries
        self._http = httpx.AsyncClient(
            base_url=base_url, headers=_headers(api_key), timeout=timeout_s, transport=transport
        )

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def ingest(self, bank_id: str, memories: Sequence[Memory]) -> IngestResponse:
        """See ``Client.ingest``."""
        return await self._request(_ingest(bank_id, memories), IngestResponse)

    async def submit(
        self,
        bank_id: str,
        *,
        scopes: Sequence[Sequence[str]] | None = None,
        priority: int | None = None,
    ) -> ConsolidationResponse:
        """See ``Client.submit``."""
        return await self._request(_submit(bank_id, scopes, priority), ConsolidationResponse)

    async def forget(self, bank_id: str, memory_id: uuid.UUID | str) -> ForgetResponse:
        """See ``Client.forget``."""
        call = _Call("DELETE", f"/v1/banks/{_segment(bank_id)}/memories/{_segment(memory_id)}")
        return await self._request(call, ForgetResponse)

    async def recover(self, bank_id: str) -> RecoverResponse:
        """See ``Client.recover``."""
        call = _Call("POST", f"/v1/banks/{_segment(bank_id)}/memories/recover")
        return await self._request(call, RecoverResponse)

    async def get_operation(self, operation_id: uuid.UUID | str) -> OperationResponse:
        return await self._request(
            _Call("GET", f"/v1/operations/{_segment(operation_id)}"), OperationResponse
        )

    def list_operations(
        self,
        *,
        bank_id: str | None = None,
        status: OperationStatus | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
    ) -> AsyncIterator[OperationResponse]:
        """See ``Client.list_operations``."""
        return self._paged(
            lambda cursor: _operations(bank_id, status, page_size, cursor),
            OperationsPage,
            lambda page: page.operations,
        )

    async def cancel_operation(self, operation_id: uuid.UUID | str) -> CancelResponse:
        """See ``Client.cancel_operation``."""
        call = _Call("POST", f"/v1/operations/{_segment(operation_id)}/cancel")
        return await self._request(call, CancelResponse)

    async def wait(
        self,
        operation_id: uuid.UUID | str,
        *,
        timeout_s: float | None = 300.0,
        poll_s: float = 0.5,
    ) -> OperationResponse:
        """See ``Client.wait``."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        interval = min(0.05, poll_s)
        while True:
            operation = await self.get_operation(operation_id)
            if operation.status in TERMINAL_STATUSES:
                return operation
            left = _timeout_left(deadline)
            if left is not None and left <= 0:
                raise WaitTimeout(operation, timeout_s or 0.0)
            await asyncio.sleep(interval if left is None else min(interval, left))
            interval = min(interval * 2, poll_s)

    async def stats(self, bank_id: str) -> StatsResponse:
        return await self._request(
            _Call("GET", f"/v1/banks/{_segment(bank_id)}/stats"), StatsResponse
        )

    async def token_budget(self, bank_id: str) -> TokenBudgetResponse:
        """See ``Client.token_budget``."""
        return await self._request(_Call("GET", _token_budget(bank_id)), TokenBudgetResponse)

    async def set_token_budget(
        self, bank_id: str, tokens_per_24h: int | None
    ) -> TokenBudgetResponse:
        """See ``Client.set_token_budget``."""
        call = _Call("PUT", _token_budget(bank_id), body={"tokens_per_24h": tokens_per_24h})
        return await self._request(call, TokenBudgetResponse)

    def list_banks(self, *, page_size: int = DEFAULT_PAGE_SIZE) -> AsyncIterator[BankOut]:
        """See ``Client.list_banks``."""
        return self._paged(lambda cursor: _banks(page_size, cursor), BanksPage, lambda p: p.banks)

    def list_observations(
        self,
        bank_id: str,
        *,
        scope: Sequence[str] | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
    ) -> AsyncIterator[ObservationOut]:
        """See ``Client.list_observations``."""
        _observations(bank_id, scope, page_size, None)
        return self._paged(
            lambda cursor: _observations(bank_id, scope, page_size, cursor),
            ObservationsPage,
            lambda page: page.observations,
        )

    async def delete_bank(self, bank_id: str) -> BankDeleted:
        """See ``Client.delete_bank``."""
        return await self._request(_delete_bank(bank_id, confirm=bank_id), BankDeleted)

    async def delete_bank_dry_run(self, bank_id: str) -> BankCounts:
        """See ``Client.delete_bank_dry_run``."""
        try:
            await self._request(_delete_bank(bank_id, confirm=None), BankDeleted)
        except BadRequest as exc:
            return _dry_run_counts(exc)
        raise ClientError(f"bank {bank_id!r} was deleted by a request without confirmation")

    async def _request(self, call: _Call, model: type[M]) -> M:
        return _parse(await self._send(call), model)

    async def _send(self, call: _Call) -> httpx.Response:
        retry = 0
        while True:
            try:
                response = await self._http.send(_build(self._http, call))
            except httpx.TransportError as exc:
                raise TransportError(f"{call.method} {call.path}: {exc!r}") from exc
            wait = self.retries.delay(response, retry)
            if wait is None:
                return response
            await asyncio.sleep(wait)
            retry += 1

    async def _paged(
        self,
        call: Callable[[str | None], _Call],
        model: type[P],
        items: Callable[[P], Sequence[T]],
    ) -> AsyncIterator[T]:
        cursor: str | None = None
        while True:
            page = await self._request(call(cursor), model)
            for item in items(page):
                yield item
            cursor = getattr(page, "next_cursor", None)
            if cursor is None:
                return
