"""The HTTP transport of the OpenAI-compatible clients (llm.py, embeddings.py).

An :class:`Endpoint` is one route, ``POST {base_url}/{path}``: pooled aiohttp connections, a
cap on requests in flight, one POST read in full (up to a size cap) and classified by its
status, and the retry loop —
exponential backoff with full jitter, ``Retry-After`` honoured, at most ``max_retries`` retries
and ``retry_budget_s`` seconds per call (DESIGN §2). Each client keeps what is its own: the
request body and how an answer is read.
"""

from __future__ import annotations

import asyncio
import dataclasses
import email.utils
import math
import random
import time
import urllib.parse
import urllib.request
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TypedDict, TypeVar

import aiohttp
import structlog
from prometheus_client import Counter, Gauge, Histogram

from consolidation import __version__
from consolidation.errors import InvalidLLMOutput, LLMConfigError, TransientLLMError
from consolidation.llm import hedge
from consolidation.settings import Settings

__all__ = [
    "Budget",
    "Endpoint",
    "Meters",
    "Options",
    "Reply",
    "Resend",
    "ResponseTooLarge",
    "RetriesExhausted",
    "Retryable",
    "Route",
    "env_proxy",
    "excerpt",
    "options_from",
    "parse_retry_after",
    "retry_delay",
]

log = structlog.get_logger(__name__)

T = TypeVar("T")

# Statuses worth a retry besides 5xx: request timeout, too early, too many requests.
RETRYABLE_STATUSES = frozenset({408, 425, 429})
# A server asking for a longer pause than the backoff cap is obeyed, but only this far.
_RETRY_AFTER_CAP_FACTOR = 5.0
_BODY_EXCERPT_CHARS = 300
# The largest answer body read (after decompression): far above any answer a model sends within
# its max_tokens or any embeddings batch, small enough that a runaway server cannot exhaust the
# worker's memory.
MAX_RESPONSE_BYTES = 64 * 1024 * 1024
_READ_CHUNK_BYTES = 256 * 1024


class RetriesExhausted(TransientLLMError):
    """Transport trouble outlasted every retry; ``attempts`` HTTP requests were made."""

    def __init__(self, message: str, attempts: int) -> None:
        super().__init__(message)
        self.attempts = attempts


class Retryable(Exception):
    """One attempt failed in a way a later attempt may not (timeout, 408/429/5xx, network, an
    answer that is not what the route returns)."""

    def __init__(self, reason: str, status: int | None = None, retry_after: float | None = None):
        super().__init__(reason)
        self.reason = reason
        self.status = status
        self.retry_after = retry_after


class ResponseTooLarge(Retryable):
    """The answer's body is larger than the endpoint's cap; it was not read past the cap."""

    def __init__(self, limit: int, declared: int | None = None) -> None:
        size = f"{declared} bytes" if declared is not None else "more"
        super().__init__(f"answer body of {size} exceeds the cap of {limit} bytes")
        self.limit = limit
        self.declared = declared


class Resend(Exception):
    """The server refused the request in a way the client has just corrected: send it again at
    once, spending no retry."""


@dataclass(frozen=True)
class Reply:
    """One HTTP response, read in full: what the interpretation needs, independent of the
    client library."""

    status: int
    reason: str
    headers: Mapping[str, str]
    body: bytes
    # Requests sent for it: 2 when a hedge's copy went out (consolidation.llm.hedge).
    copies: int = 1

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")

    @property
    def what(self) -> str:
        """``503 Service Unavailable``: the status as messages quote it."""
        return f"{self.status} {self.reason}".strip()


class Budget:
    """The time one call may spend across its attempts and backoff, counted from its first
    request (``CONSOLIDATION_LLM_RETRY_BUDGET_S``)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.started: float | None = None

    def timeout(self, per_attempt: float) -> float:
        """The timeout of the attempt starting now: ``per_attempt``, or what is left."""
        now = time.monotonic()
        if self.started is None:
            self.started = now
        return min(per_attempt, self.started + self.seconds - now)

    def allows(self, delay: float, least: float) -> bool:
        """Whether a retry after ``delay`` seconds would still have ``least`` seconds."""
        if self.started is None:
            return True
        return time.monotonic() + delay + least <= self.started + self.seconds

    def elapsed(self) -> float:
        return 0.0 if self.started is None else time.monotonic() - self.started


class Options(TypedDict, total=False):
    """How an endpoint is called (the defaults are :class:`Endpoint`'s): the timeout of one
    request, how many retries and how long in all (``retry_budget_s``, unset: 2 × ``timeout_s``)
    one call may take, requests in flight, backoff."""

    timeout_s: float
    max_retries: int
    retry_budget_s: float | None
    max_concurrent: int
    backoff_base_s: float
    backoff_max_s: float
    max_response_bytes: int


def options_from(settings: Settings) -> Options:
    """The ``CONSOLIDATION_LLM_*`` settings every endpoint shares (the LLM's and the embeddings
    one): timeout, retries, retry budget, concurrency, backoff."""
    return Options(
        timeout_s=settings.llm_timeout_s,
        max_retries=settings.llm_max_retries,
        retry_budget_s=settings.llm_retry_budget_s,
        max_concurrent=settings.llm_max_concurrent,
        backoff_base_s=settings.llm_backoff_base_s,
        backoff_max_s=settings.llm_backoff_max_s,
    )


@dataclass(frozen=True)
class Meters:
    """The Prometheus objects one endpoint reports to: requests by outcome (``ok``, ``retry``,
    ``transient``, ``invalid``, ``config``), the latency of each request and, optionally, the
    requests in flight and the retries Retry-After decided."""

    requests: Counter
    latency: Histogram
    in_flight: Gauge | None = None
    retry_after: Counter | None = None
    hedges: Counter | None = None  # by outcome: first, copy, neither, preempted


@dataclass(frozen=True)
class Route:
    """What tells one client's endpoint from another's: its path under the base URL, how
    messages name it (``label``, ``LLM``) and its settings (``setting``, the prefix
    ``CONSOLIDATION_LLM``), the errors it raises, the metrics it reports to and the event it
    logs a retry with."""

    path: str
    label: str
    setting: str
    config_error: type[LLMConfigError]
    exhausted: type[RetriesExhausted]
    meters: Meters
    retry_event: str


def parse_retry_after(value: str | None, now: datetime | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or HTTP-date), or None when
    absent or unreadable. Never negative."""
    if value is None or not value.strip():
        return None
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = (when - (now or datetime.now(UTC))).total_seconds()
    if not math.isfinite(seconds):
        return None
    return max(0.0, seconds)


def retry_delay(
    failures: int,
    retry_after: float | None,
    *,
    base_s: float,
    max_s: float,
    uniform: Callable[[float, float], float] = random.uniform,
) -> tuple[float, bool]:
    """Delay before retry number ``failures + 1`` and whether Retry-After decided it.

    Exponential backoff with full jitter (``uniform(0, min(max_s, base_s * 2**failures))``); a
    Retry-After wins when longer, honoured up to ``5 * max_s``.
    """
    # The exponent is clamped so a huge retry count cannot overflow the float.
    backoff = uniform(0.0, min(max_s, base_s * 2.0 ** min(failures, 60)))
    if retry_after is None:
        return backoff, False
    asked = min(retry_after, _RETRY_AFTER_CAP_FACTOR * max_s)
    if asked >= backoff:
        return asked, True
    return backoff, False


def env_proxy(url: str) -> str | None:
    """The proxy ``HTTP_PROXY`` / ``HTTPS_PROXY`` (either case) set for ``url``, unless
    ``NO_PROXY`` exempts its host; None when there is none."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    if host and urllib.request.proxy_bypass(host):
        return None
    return urllib.request.getproxies_environment().get(parts.scheme) or None


def excerpt(text: str) -> str:
    """``text`` on one line, cut to a length a log line or an error message can carry."""
    text = " ".join(text.split())
    if len(text) > _BODY_EXCERPT_CHARS:
        return text[:_BODY_EXCERPT_CHARS] + "…"
    return text


def _retryable(status: int) -> bool:
    """Whether a response with ``status`` is worth a retry (and leaves a hedge's race open)."""
    return status in RETRYABLE_STATUSES or status >= 500


class Endpoint:
    """``POST {base_url}/{route.path}`` of an OpenAI-compatible server, with retries.

    A 401, 403, 404, 405 or a redirect raises ``route.config_error`` with a message naming the
    setting to fix; transport trouble that outlasts the retries raises ``route.exhausted``.

    The transport is aiohttp: a keep-alive pool of ``max_concurrent`` connections, no redirects
    followed, ``HTTP(S)_PROXY`` / ``NO_PROXY`` read once, bodies read up to
    ``max_response_bytes`` (:class:`ResponseTooLarge` past it, retried like a transport fault).
    With ``hedge_quantile``, a slow request gets a second copy when a slot is spare
    (:mod:`consolidation.llm.hedge`).
    """

    def __init__(
        self,
        route: Route,
        *,
        base_url: str,
        model: str,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        max_retries: int = 4,
        retry_budget_s: float | None = None,
        max_concurrent: int = 16,
        backoff_base_s: float = 0.5,
        backoff_max_s: float = 30.0,
        max_response_bytes: int = MAX_RESPONSE_BYTES,
        hedge_quantile: float | None = None,
        hedge_min_samples: int = hedge.MIN_SAMPLES,
    ) -> None:
        budget = 2 * timeout_s if retry_budget_s is None else retry_budget_s
        if max_concurrent < 1 or max_retries < 0 or timeout_s <= 0 or max_response_bytes < 1:
            raise ValueError(
                "need max_concurrent >= 1, max_retries >= 0, timeout_s > 0 and "
                "max_response_bytes >= 1"
            )
        if budget < timeout_s:
            raise ValueError("retry_budget_s must be at least timeout_s")
        label, setting = route.label, route.setting
        base = base_url.rstrip("/")
        parts = urllib.parse.urlsplit(base)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise route.config_error(
                f"{label} base URL {base_url!r} is not an http(s) URL: set {setting}_BASE_URL "
                "to something like http://127.0.0.1:8000/v1"
            )
        self.url = f"{base}/{route.path}"
        self.route = route
        self.model = model
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.retry_budget_s = budget
        self._proxy = env_proxy(self.url)
        self._backoff_base_s = backoff_base_s
        self._backoff_max_s = backoff_max_s
        self.max_response_bytes = max_response_bytes
        key, url = f"{setting}_API_KEY", f"{setting}_BASE_URL"
        self._config_hints = {
            401: f"check {key}",
            403: f"check that {key} is allowed to use this model",
            404: f"check {url} (usually ends in /v1) and {setting}_MODEL",
            405: f"check {url} (usually ends in /v1)",
        }
        # The requests counter's child of each outcome, bound once (labels() takes a lock).
        self._outcomes = {
            outcome: route.meters.requests.labels(outcome=outcome)
            for outcome in ("ok", "retry", "transient", "invalid", "config")
        }
        self.max_concurrent = max_concurrent
        self._semaphore = asyncio.Semaphore(max_concurrent)
        self._hedging = (
            None
            if hedge_quantile is None
            else hedge.Hedging(
                hedge_quantile, outcomes=route.meters.hedges, min_samples=hedge_min_samples
            )
        )
        self._headers = {
            "accept": "application/json",
            "content-type": "application/json",
            "user-agent": f"consolidation/{__version__}",
        }
        if api_key:
            if any(ch in api_key for ch in "\r\n\0"):
                # It would end the header line and start another (aiohttp sends it as is).
                raise route.config_error(
                    f"{key} contains a line break or a NUL: set it to the key alone"
                )
            self._headers["authorization"] = f"Bearer {api_key}"
        # Created on first use: an aiohttp session belongs to the event loop it is created on.
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    async def aclose(self) -> None:
        """Close the connection pool; the endpoint is unusable afterwards."""
        self._closed = True
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                headers=self._headers,
                connector=aiohttp.TCPConnector(limit=self.max_concurrent),
                # Not trust_env: it reads ~/.netrc in a thread on every request (half of the
                # engine's CPU at a fast LLM); the proxy is resolved once instead.
            )
        return self._session

    async def call(self, attempt: Callable[[Budget, int], Awaitable[T]]) -> T:
        """Run ``attempt(budget, retries)`` until it returns, retrying :class:`Retryable` with
        backoff and :class:`Resend` at once; ``retries`` counts the requests made before.

        Raises ``exhausted`` when ``max_retries`` or ``retry_budget_s`` is spent; any other
        exception of ``attempt`` passes through.
        """
        retries = 0
        failures = 0
        budget = Budget(self.retry_budget_s)
        meters = self.route.meters
        outcomes = self._outcomes
        while True:
            try:
                result = await attempt(budget, retries)
            except Retryable as exc:
                delay, honoured = retry_delay(
                    failures,
                    exc.retry_after,
                    base_s=self._backoff_base_s,
                    max_s=self._backoff_max_s,
                )
                # A retry with less than a tenth of the timeout left is not worth sending.
                least = self.timeout_s / 10
                if failures >= self.max_retries or not budget.allows(delay, least):
                    outcomes["transient"].inc()
                    raise self._exhausted(exc, retries + 1, failures, budget) from None
                outcomes["retry"].inc()
                if honoured and meters.retry_after is not None:
                    meters.retry_after.inc()
                failures += 1
                retries += 1
                log.warning(
                    self.route.retry_event,
                    url=self.url,
                    status=exc.status,
                    reason=exc.reason,
                    retry=failures,
                    max_retries=self.max_retries,
                    delay_s=round(delay, 3),
                    retry_after_s=exc.retry_after,
                )
                await asyncio.sleep(delay)
            except Resend:
                outcomes["retry"].inc()
                retries += 1
            except InvalidLLMOutput:
                outcomes["invalid"].inc()
                raise
            except LLMConfigError:
                outcomes["config"].inc()
                raise
            else:
                outcomes["ok"].inc()
                return result

    def _exhausted(
        self, exc: Retryable, attempts: int, failures: int, budget: Budget
    ) -> RetriesExhausted:
        if failures >= self.max_retries:
            spent = f"{self.max_retries} retries spent"
        else:
            spent = f"retry budget of {budget.seconds:g}s spent"
        # The timeout, retries and budget are the LLM's settings whichever endpoint this is.
        label = self.route.label
        return self.route.exhausted(
            f"{label} endpoint POST {self.url} still failing after {attempts} attempt(s) in "
            f"{budget.elapsed():.1f}s, {spent} (last: {exc.reason}): check that "
            f"the {label} server is up and not overloaded, or "
            "raise CONSOLIDATION_LLM_TIMEOUT_S / CONSOLIDATION_LLM_MAX_RETRIES / "
            "CONSOLIDATION_LLM_RETRY_BUDGET_S",
            attempts=attempts,
        )

    async def post(self, body: bytes, budget: Budget) -> Reply:
        """One request, within the cap on requests in flight and what is left of ``budget``;
        with hedging on, a second copy of it once it is slow and a slot is spare
        (:mod:`consolidation.llm.hedge`): :attr:`Reply.copies` says how many were sent.

        Raises :class:`Retryable` for a timeout or a connection error, :class:`ResponseTooLarge`
        for a body over ``max_response_bytes``. Cancelling the caller aborts the request.
        """
        if self._closed:
            raise RuntimeError(f"the {self.route.label} client is closed")
        hedging = self._hedging
        if hedging is None:
            return await self._request(body, budget)
        sent: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        reply, copies = await hedging.race(
            self._request(body, budget, sent),
            lambda: self._copy(body, budget),
            lambda reply: not _retryable(reply.status),
            sent,
        )
        return reply if copies == 1 else dataclasses.replace(reply, copies=copies)

    async def _copy(self, body: bytes, budget: Budget) -> Awaitable[Reply] | None:
        """A second copy of a request, holding a slot taken now, or None when no slot is free
        or a request waits for one (copies only ever use spare capacity)."""
        if self._semaphore.locked():
            return None
        await self._semaphore.acquire()  # a free slot: taken at once, without waiting
        return self._held(body, budget)

    async def _request(
        self, body: bytes, budget: Budget, sent: asyncio.Future[None] | None = None
    ) -> Reply:
        if self._semaphore.locked() and self._hedging is not None:
            self._hedging.preempt()  # a copy's slot is a first request's first
        await self._semaphore.acquire()
        if sent is not None and not sent.done():
            sent.set_result(None)  # a hedge's delay runs from here
        return await self._held(body, budget)

    async def _held(self, body: bytes, budget: Budget) -> Reply:
        """One request on a slot already taken; the slot is freed when it ends."""
        try:
            timeout_s = budget.timeout(self.timeout_s)
            if timeout_s <= 0:
                raise Retryable("the retry budget ran out while waiting for a free request slot")
            meters = self.route.meters
            in_flight = meters.in_flight
            if in_flight is not None:
                in_flight.inc()
            started = time.perf_counter()
            try:
                async with self._client().post(
                    self.url,
                    data=body,
                    allow_redirects=False,
                    proxy=self._proxy,
                    timeout=aiohttp.ClientTimeout(total=timeout_s),
                ) as response:
                    reply = Reply(
                        response.status,
                        response.reason or "",
                        response.headers,
                        await self._read(response),
                    )
            except TimeoutError as exc:
                rest = " (the rest of the retry budget)" if timeout_s < self.timeout_s else ""
                raise Retryable(
                    f"no answer within {timeout_s:.3g}s{rest} ({type(exc).__name__})"
                ) from None
            except (aiohttp.ClientError, OSError) as exc:
                detail = str(exc) or "connection failed"
                raise Retryable(f"{type(exc).__name__}: {detail}") from None
            finally:
                elapsed = time.perf_counter() - started
                if in_flight is not None:
                    in_flight.dec()
                meters.latency.observe(elapsed)
            if reply.status == 200 and self._hedging is not None:
                self._hedging.observe(elapsed)
            return reply
        finally:
            self._semaphore.release()

    async def _read(self, response: aiohttp.ClientResponse) -> bytes:
        """The body, read no further than the cap (a declared length over it is not read)."""
        limit = self.max_response_bytes
        declared = response.content_length
        if declared is not None and declared > limit:
            raise ResponseTooLarge(limit, declared)
        chunks: list[bytes] = []
        size = 0
        async for chunk in response.content.iter_chunked(_READ_CHUNK_BYTES):
            size += len(chunk)
            if size > limit:
                raise ResponseTooLarge(limit)
            chunks.append(chunk)
        return b"".join(chunks)

    def check(self, reply: Reply) -> None:
        """Raise for what every OpenAI-compatible route means alike: :class:`Retryable` for
        408/425/429/5xx (with its Retry-After), ``config_error`` for 401/403/404/405 and
        redirects. Other statuses are the client's to read."""
        status = reply.status
        if _retryable(status):
            raise Retryable(
                f"HTTP {reply.what}",
                status=status,
                retry_after=parse_retry_after(reply.headers.get("retry-after")),
            )
        hint = self._config_hints.get(status)
        if hint is not None:
            raise self.route.config_error(
                f"{self.route.label} endpoint answered {reply.what} for POST {self.url} (model "
                f"{self.model!r}): {hint}"
            )
        if 300 <= status < 400:
            raise self.route.config_error(
                f"{self.route.label} endpoint answered {reply.what} for POST {self.url}, "
                f"redirecting to {reply.headers.get('location')!r}: set "
                f"{self.route.setting}_BASE_URL to the final URL"
            )
