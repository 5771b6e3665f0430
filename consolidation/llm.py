"""The LLM client: one OpenAI-compatible chat-completions call per pass (DESIGN §3).

:class:`HTTPConsolidator` owns one pooled HTTP client and one semaphore; a single instance per
process is shared by every operation, so its ``max_concurrent`` is the process-wide cap.
:class:`OfflineConsolidator` answers in-process with the offline policy and makes no HTTP call.
Both raise only the typed errors of :mod:`consolidation.errors`.
"""

from __future__ import annotations

import asyncio
import email.utils
import math
import random
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

import aiohttp
import orjson
import structlog

from consolidation import __version__, offline, prompts
from consolidation.errors import InvalidLLMOutput, LLMConfigError, TransientLLMError
from consolidation.metrics import (
    LLM_IN_FLIGHT,
    LLM_LATENCY,
    LLM_REQUESTS,
    LLM_RETRY_AFTER,
    LLM_TOKENS,
)

__all__ = [
    "Consolidator",
    "HTTPConsolidator",
    "LLMAnswer",
    "LLMRetriesExhausted",
    "OfflineConsolidator",
]

log = structlog.get_logger(__name__)

_RESPONSE_FORMAT_MODES = ("json_schema", "json_object")
_RETRYABLE_STATUSES = frozenset({408, 425, 429})
_CONFIG_HINTS = {
    401: "check CONSOLIDATION_LLM_API_KEY",
    403: "check that CONSOLIDATION_LLM_API_KEY is allowed to use this model",
    404: "check CONSOLIDATION_LLM_BASE_URL (usually ends in /v1) and CONSOLIDATION_LLM_MODEL",
    405: "check CONSOLIDATION_LLM_BASE_URL (usually ends in /v1)",
}
# Words by which vLLM, llama.cpp, Ollama and gateways refuse a json_schema response_format.
_SCHEMA_REFUSAL_MARKERS = ("response_format", "json_schema", "response format", "json schema")
# A server asking for a longer pause than the backoff cap is obeyed, but only this far.
_RETRY_AFTER_CAP_FACTOR = 5.0
_BODY_EXCERPT_CHARS = 300


@dataclass(frozen=True)
class LLMAnswer:
    """The assistant content of one successful call, its token usage and how many extra HTTP
    requests it took (transient retries plus a json_object fallback)."""

    content: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None
    retries: int


class Consolidator(Protocol):
    """Something that answers a pass: system prompt + user JSON in, assistant content out."""

    async def complete(self, system: str, user: str) -> LLMAnswer:
        """Return the answer or raise TransientLLMError, InvalidLLMOutput or LLMConfigError."""
        ...

    async def aclose(self) -> None:
        """Release connections; the instance is unusable afterwards."""
        ...


class LLMRetriesExhausted(TransientLLMError):
    """Transport trouble outlasted every retry; ``attempts`` HTTP requests were made."""

    def __init__(self, message: str, attempts: int) -> None:
        super().__init__(message)
        self.attempts = attempts


class _Retryable(Exception):
    """One attempt failed in a way a later attempt may not (timeout, 408/429/5xx, network)."""

    def __init__(self, reason: str, status: int | None = None, retry_after: float | None = None):
        super().__init__(reason)
        self.reason = reason
        self.status = status
        self.retry_after = retry_after


class _SchemaRefused(Exception):
    """The server rejected the json_schema response_format; resend with json_object."""


@dataclass(frozen=True)
class _Reply:
    """One HTTP response, read in full: what the interpretation needs, independent of the
    client library."""

    status: int
    reason: str
    headers: Mapping[str, str]
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")


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


def _excerpt(text: str) -> str:
    text = " ".join(text.split())
    if len(text) > _BODY_EXCERPT_CHARS:
        return text[:_BODY_EXCERPT_CHARS] + "…"
    return text


def _token_count(value: object) -> int:
    # Some gateways send floats or nulls; anything unusable counts as 0 rather than failing.
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0
    return max(0, int(value))


class HTTPConsolidator:
    """Client for ``POST {base_url}/chat/completions`` of an OpenAI-compatible server.

    Retries transport trouble with backoff, falls back once from json_schema to json_object when
    the server refuses schemas, and caps in-flight requests at ``max_concurrent``.

    The transport is aiohttp (keep-alive pool of ``max_concurrent`` connections, no redirects
    followed, ``HTTP(S)_PROXY`` / ``NO_PROXY`` read once): a tenth of httpx's CPU per request
    under concurrency (docs/benchmarks.md, "What the profiles led to").
    """

    def __init__(
        self,
        *,
        base_url: str,
        model: str,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        max_retries: int = 4,
        max_concurrent: int = 16,
        response_format: str = "json_schema",
        backoff_base_s: float = 0.5,
        backoff_max_s: float = 30.0,
    ) -> None:
        if response_format not in _RESPONSE_FORMAT_MODES:
            raise ValueError(
                f"response_format must be one of {_RESPONSE_FORMAT_MODES}, got {response_format!r}"
            )
        if max_concurrent < 1 or max_retries < 0 or timeout_s <= 0:
            raise ValueError("need max_concurrent >= 1, max_retries >= 0 and timeout_s > 0")
        base = base_url.rstrip("/")
        parts = urllib.parse.urlsplit(base)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise LLMConfigError(
                f"LLM base URL {base_url!r} is not an http(s) URL: set CONSOLIDATION_LLM_BASE_URL "
                "to something like http://127.0.0.1:8000/v1"
            )
        self._url = f"{base}/chat/completions"
        self._proxy = env_proxy(self._url)
        self._model = model
        self._timeout_s = timeout_s
        self._max_retries = max_retries
        self._mode = response_format
        self._backoff_base_s = backoff_base_s
        self._backoff_max_s = backoff_max_s
        self._max_concurrent = max_concurrent
        self._semaphore = asyncio.Semaphore(max_concurrent)
        self._response_formats: dict[str, dict[str, Any]] = {}
        self._headers = {
            "accept": "application/json",
            "content-type": "application/json",
            "user-agent": f"consolidation/{__version__}",
        }
        if api_key:
            self._headers["authorization"] = f"Bearer {api_key}"
        # Created on first use: an aiohttp session belongs to the event loop it is created on.
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    @property
    def response_format_mode(self) -> str:
        """The mode requests are currently sent with (``json_object`` after a fallback)."""
        return self._mode

    async def aclose(self) -> None:
        """Close the connection pool."""
        self._closed = True
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def _client(self) -> aiohttp.ClientSession:
        if self._closed:
            raise RuntimeError("HTTPConsolidator is closed")
        if self._session is None:
            self._session = aiohttp.ClientSession(
                headers=self._headers,
                timeout=aiohttp.ClientTimeout(total=self._timeout_s),
                connector=aiohttp.TCPConnector(limit=self._max_concurrent),
                # Not trust_env: it reads ~/.netrc in a thread on every request (half of the
                # engine's CPU at a fast LLM); the proxy is resolved once instead.
            )
        return self._session

    async def complete(self, system: str, user: str) -> LLMAnswer:
        """One chat completion for ``system`` + ``user``.

        Raises LLMRetriesExhausted (a TransientLLMError) when transport trouble outlasts
        ``max_retries``, InvalidLLMOutput for an unusable answer or a 400/422, LLMConfigError
        for 401/403/404. Cancelling the caller aborts the HTTP request.
        """
        extra_requests = 0
        failures = 0
        while True:
            try:
                answer = await self._attempt(system, user, extra_requests)
            except _Retryable as exc:
                if failures >= self._max_retries:
                    LLM_REQUESTS.labels(outcome="transient").inc()
                    attempts = extra_requests + 1
                    raise LLMRetriesExhausted(
                        f"LLM endpoint POST {self._url} still failing after {attempts} "
                        f"attempt(s) (last: {exc.reason}): the operation will be retried later; "
                        "check that the LLM server is up and not overloaded, or raise "
                        "CONSOLIDATION_LLM_TIMEOUT_S / CONSOLIDATION_LLM_MAX_RETRIES",
                        attempts=attempts,
                    ) from None
                LLM_REQUESTS.labels(outcome="retry").inc()
                delay, honoured = retry_delay(
                    failures,
                    exc.retry_after,
                    base_s=self._backoff_base_s,
                    max_s=self._backoff_max_s,
                )
                if honoured:
                    LLM_RETRY_AFTER.inc()
                failures += 1
                extra_requests += 1
                log.warning(
                    "llm_retry",
                    url=self._url,
                    status=exc.status,
                    reason=exc.reason,
                    retry=failures,
                    max_retries=self._max_retries,
                    delay_s=round(delay, 3),
                    retry_after_s=exc.retry_after,
                )
                await asyncio.sleep(delay)
            except _SchemaRefused:
                LLM_REQUESTS.labels(outcome="retry").inc()
                extra_requests += 1
            except InvalidLLMOutput:
                LLM_REQUESTS.labels(outcome="invalid").inc()
                raise
            except LLMConfigError:
                LLM_REQUESTS.labels(outcome="config").inc()
                raise
            else:
                LLM_REQUESTS.labels(outcome="ok").inc()
                LLM_TOKENS.labels(kind="prompt").inc(answer.prompt_tokens)
                LLM_TOKENS.labels(kind="completion").inc(answer.completion_tokens)
                return answer

    def _response_format(self, mode: str) -> dict[str, Any]:
        found = self._response_formats.get(mode)
        if found is None:
            found = self._response_formats[mode] = prompts.response_format(mode)
        return found

    async def _attempt(self, system: str, user: str, retries: int) -> LLMAnswer:
        mode = self._mode
        body = orjson.dumps(
            {
                "model": self._model,
                "temperature": 0,
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": user},
                ],
                "response_format": self._response_format(mode),
            }
        )
        async with self._semaphore:
            LLM_IN_FLIGHT.inc()
            started = time.perf_counter()
            try:
                async with self._client().post(
                    self._url, data=body, allow_redirects=False, proxy=self._proxy
                ) as response:
                    reply = _Reply(
                        response.status,
                        response.reason or "",
                        response.headers,
                        await response.read(),
                    )
            except TimeoutError as exc:
                raise _Retryable(
                    f"no answer within {self._timeout_s:g}s ({type(exc).__name__})"
                ) from None
            except aiohttp.ClientError as exc:
                detail = str(exc) or "connection failed"
                raise _Retryable(f"{type(exc).__name__}: {detail}") from None
            finally:
                LLM_IN_FLIGHT.dec()
                LLM_LATENCY.observe(time.perf_counter() - started)
        return self._interpret(reply, mode, retries)

    def _interpret(self, response: _Reply, mode: str, retries: int) -> LLMAnswer:
        status = response.status
        what = f"{status} {response.reason}".strip()
        if status in _RETRYABLE_STATUSES or status >= 500:
            raise _Retryable(
                f"HTTP {what}",
                status=status,
                retry_after=parse_retry_after(response.headers.get("retry-after")),
            )
        if status in _CONFIG_HINTS:
            raise LLMConfigError(
                f"LLM endpoint answered {what} for POST {self._url} (model {self._model!r}): "
                f"{_CONFIG_HINTS[status]}"
            )
        if 300 <= status < 400:
            raise LLMConfigError(
                f"LLM endpoint answered {what} for POST {self._url}, redirecting to "
                f"{response.headers.get('location')!r}: set CONSOLIDATION_LLM_BASE_URL to the "
                "final URL"
            )
        if status >= 400:
            text = response.text
            if status in (400, 422) and mode == "json_schema" and self._refuses_schema(text):
                self._fall_back_to_json_object(status, text)
                raise _SchemaRefused
            raise InvalidLLMOutput(
                f"LLM endpoint rejected the request with {what}: {_excerpt(text)!r}; the batch "
                "will be retried and split"
            )
        return self._parse_completion(response, retries)

    @staticmethod
    def _refuses_schema(text: str) -> bool:
        lowered = text.lower()
        return any(marker in lowered for marker in _SCHEMA_REFUSAL_MARKERS)

    def _fall_back_to_json_object(self, status: int, text: str) -> None:
        # Several passes may hit the refusal at once; the first one switches and logs.
        if self._mode == "json_object":
            return
        self._mode = "json_object"
        log.warning(
            "llm_response_format_fallback",
            url=self._url,
            model=self._model,
            status=status,
            detail=_excerpt(text),
            hint="the server refuses json_schema response_format; using json_object from now on "
            "(set CONSOLIDATION_LLM_RESPONSE_FORMAT=json_object to skip this probe)",
        )

    def _parse_completion(self, response: _Reply, retries: int) -> LLMAnswer:
        try:
            data = orjson.loads(response.body)
        except orjson.JSONDecodeError:
            raise InvalidLLMOutput(
                f"LLM endpoint answered {response.status} with a body that is not JSON: "
                f"{_excerpt(response.text)!r}"
            ) from None
        choices = data.get("choices") if isinstance(data, dict) else None
        choice = choices[0] if isinstance(choices, list) and choices else None
        message = choice.get("message") if isinstance(choice, dict) else None
        if not isinstance(choice, dict) or not isinstance(message, dict):
            raise InvalidLLMOutput(
                "LLM endpoint answered with something that is not an OpenAI chat completion "
                f"(no choices[0].message): {_excerpt(response.text)!r}"
            )
        finish_reason = choice.get("finish_reason")
        finish_reason = finish_reason if isinstance(finish_reason, str) else None
        if finish_reason == "length":
            raise InvalidLLMOutput(
                "LLM answer was truncated (finish_reason 'length'): the model ran out of tokens; "
                "the batch will be split"
            )
        content = message.get("content")
        if not isinstance(content, str) or not content.strip():
            raise InvalidLLMOutput(
                f"LLM answer has empty content (finish_reason {finish_reason!r})"
            )
        usage = data.get("usage")
        usage = usage if isinstance(usage, dict) else {}
        return LLMAnswer(
            content=content,
            prompt_tokens=_token_count(usage.get("prompt_tokens")),
            completion_tokens=_token_count(usage.get("completion_tokens")),
            finish_reason=finish_reason,
            retries=retries,
        )


def estimate_tokens(text: str) -> int:
    """Rough token count (~4 characters per token) for servers that report no usage."""
    return (len(text) + 3) // 4


class OfflineConsolidator:
    """Answers with the offline policy in-process (no HTTP); usage is estimated from lengths."""

    async def complete(self, system: str, user: str) -> LLMAnswer:
        """Run :func:`consolidation.offline.consolidate` on the parsed user message."""
        request = orjson.loads(user)
        if not isinstance(request, dict):
            raise ValueError("the user message must be the JSON object of DESIGN §3")
        content = orjson.dumps(offline.consolidate(request)).decode()
        return LLMAnswer(
            content=content,
            prompt_tokens=estimate_tokens(system) + estimate_tokens(user),
            completion_tokens=estimate_tokens(content),
            finish_reason="stop",
            retries=0,
        )

    async def aclose(self) -> None:
        """Nothing to release."""
