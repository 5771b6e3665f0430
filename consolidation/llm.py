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
import re
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
    "RESPONSE_FORMAT_MODES",
    "Consolidator",
    "HTTPConsolidator",
    "LLMAnswer",
    "LLMRetriesExhausted",
    "OfflineConsolidator",
]

log = structlog.get_logger(__name__)

RESPONSE_FORMAT_MODES = ("auto", "json_schema", "json_object")
_RETRYABLE_STATUSES = frozenset({408, 425, 429})
_CONFIG_HINTS = {
    401: "check CONSOLIDATION_LLM_API_KEY",
    403: "check that CONSOLIDATION_LLM_API_KEY is allowed to use this model",
    404: "check CONSOLIDATION_LLM_BASE_URL (usually ends in /v1) and CONSOLIDATION_LLM_MODEL",
    405: "check CONSOLIDATION_LLM_BASE_URL (usually ends in /v1)",
}
# How servers refuse a response_format: vLLM, Ollama and gateways with 400/422, llama-cpp-python
# with a 500 carrying a pydantic literal_error; the body names the field.
_REFUSAL_STATUSES = frozenset({400, 422, 500})
_REFUSAL_MARKERS = ("response_format", "json_schema", "response format", "json schema")
# A reasoning model's thoughts before the answer (Qwen3, DeepSeek-R1 and kin).
_THINK_BLOCK = re.compile(r"\A\s*<think>.*?</think>\s*", re.DOTALL | re.IGNORECASE)
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
    """Something that answers a pass: a :class:`~consolidation.prompts.Chat` in, assistant
    content out."""

    async def complete(self, chat: prompts.Chat) -> LLMAnswer:
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


class _FormatRefused(Exception):
    """The server refused the response_format form sent; resend with the next one."""


class _Budget:
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

    Retries transport trouble with backoff within ``max_retries`` and ``retry_budget_s``, finds
    the ``response_format`` form the server accepts (``auto``), caps ``max_tokens`` and in-flight
    requests.

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
        retry_budget_s: float | None = None,
        max_concurrent: int = 16,
        response_format: str = "auto",
        max_tokens: int = 4096,
        system_role: str = "system",
        backoff_base_s: float = 0.5,
        backoff_max_s: float = 30.0,
    ) -> None:
        if response_format not in RESPONSE_FORMAT_MODES:
            raise ValueError(
                f"response_format must be one of {RESPONSE_FORMAT_MODES}, got {response_format!r}"
            )
        if system_role not in prompts.SYSTEM_ROLES:
            raise ValueError(f"system_role must be one of {prompts.SYSTEM_ROLES}")
        budget = 2 * timeout_s if retry_budget_s is None else retry_budget_s
        if max_concurrent < 1 or max_retries < 0 or timeout_s <= 0 or max_tokens < 1:
            raise ValueError(
                "need max_concurrent >= 1, max_retries >= 0, timeout_s > 0 and max_tokens >= 1"
            )
        if budget < timeout_s:
            raise ValueError("retry_budget_s must be at least timeout_s")
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
        self._retry_budget_s = budget
        self._max_tokens = max_tokens
        self._system_role = system_role
        # auto starts at json_schema and walks down prompts.RESPONSE_FORMATS on refusals; the
        # first form a request is answered with is kept for the life of the process.
        self._auto = response_format == "auto"
        self._form = "json_schema" if self._auto else response_format
        self._form_settled = not self._auto
        self._form_probe: asyncio.Future[bool] | None = None
        self._refusals: list[dict[str, Any]] = []
        self._backoff_base_s = backoff_base_s
        self._backoff_max_s = backoff_max_s
        self._max_concurrent = max_concurrent
        self._semaphore = asyncio.Semaphore(max_concurrent)
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
        """The ``response_format`` form requests are sent with now (one of
        ``prompts.RESPONSE_FORMATS``)."""
        return self._form

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
                connector=aiohttp.TCPConnector(limit=self._max_concurrent),
                # Not trust_env: it reads ~/.netrc in a thread on every request (half of the
                # engine's CPU at a fast LLM); the proxy is resolved once instead.
            )
        return self._session

    async def complete(self, chat: prompts.Chat) -> LLMAnswer:
        """One chat completion for ``chat``.

        Raises LLMRetriesExhausted (a TransientLLMError) when transport trouble outlasts
        ``max_retries`` or ``retry_budget_s``, InvalidLLMOutput for an unusable answer or a
        400/422, LLMConfigError for 401/403/404 or a refused response_format. Cancelling the
        caller aborts the HTTP request.
        """
        extra_requests = 0
        failures = 0
        budget = _Budget(self._retry_budget_s)
        while True:
            try:
                answer = await self._attempt(chat, extra_requests, budget)
            except _Retryable as exc:
                delay, honoured = retry_delay(
                    failures,
                    exc.retry_after,
                    base_s=self._backoff_base_s,
                    max_s=self._backoff_max_s,
                )
                # A retry with less than a tenth of the timeout left is not worth sending.
                least = self._timeout_s / 10
                if failures >= self._max_retries or not budget.allows(delay, least):
                    LLM_REQUESTS.labels(outcome="transient").inc()
                    raise self._exhausted(exc, extra_requests + 1, failures, budget) from None
                LLM_REQUESTS.labels(outcome="retry").inc()
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
            except _FormatRefused:
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

    def _exhausted(
        self, exc: _Retryable, attempts: int, failures: int, budget: _Budget
    ) -> LLMRetriesExhausted:
        if failures >= self._max_retries:
            spent = f"{self._max_retries} retries spent"
        else:
            spent = f"retry budget of {budget.seconds:g}s spent"
        return LLMRetriesExhausted(
            f"LLM endpoint POST {self._url} still failing after {attempts} attempt(s) in "
            f"{budget.elapsed():.1f}s, {spent} (last: {exc.reason}): the operation will be "
            "retried later; check that the LLM server is up and not overloaded, or raise "
            "CONSOLIDATION_LLM_TIMEOUT_S / CONSOLIDATION_LLM_MAX_RETRIES / "
            "CONSOLIDATION_LLM_RETRY_BUDGET_S",
            attempts=attempts,
        )

    async def _attempt(self, chat: prompts.Chat, retries: int, budget: _Budget) -> LLMAnswer:
        # Until the endpoint has accepted a form, one request at a time probes it; the others
        # wait for its verdict rather than all collect the same refusal. A probe that ends
        # without one (a timeout, a 503) lets them all go: a slow endpoint must not make the
        # passes queue behind each other's timeouts.
        while not self._form_settled:
            probe = self._form_probe
            if probe is None:
                return await self._probe(chat, retries, budget)
            if not await asyncio.shield(probe):
                break
        return await self._send(chat, self._form, retries, budget)

    async def _probe(self, chat: prompts.Chat, retries: int, budget: _Budget) -> LLMAnswer:
        form = self._form
        probe = self._form_probe = asyncio.get_running_loop().create_future()
        try:
            return await self._send(chat, form, retries, budget)
        finally:
            self._form_probe = None
            # A verdict: the form was accepted, or refused and the next one is current.
            probe.set_result(self._form_settled or self._form != form)

    async def _send(
        self, chat: prompts.Chat, form: str, retries: int, budget: _Budget
    ) -> LLMAnswer:
        max_tokens = min(chat.max_tokens, self._max_tokens)
        body = orjson.dumps(
            {
                "model": self._model,
                "temperature": 0,
                "max_tokens": max_tokens,
                "messages": chat.messages(self._system_role),
                "response_format": prompts.response_format(form, chat.schema),
            }
        )
        async with self._semaphore:
            timeout_s = budget.timeout(self._timeout_s)
            if timeout_s <= 0:
                raise _Retryable("the retry budget ran out while waiting for a free request slot")
            LLM_IN_FLIGHT.inc()
            started = time.perf_counter()
            try:
                async with self._client().post(
                    self._url,
                    data=body,
                    allow_redirects=False,
                    proxy=self._proxy,
                    timeout=aiohttp.ClientTimeout(total=timeout_s),
                ) as response:
                    reply = _Reply(
                        response.status,
                        response.reason or "",
                        response.headers,
                        await response.read(),
                    )
            except TimeoutError as exc:
                rest = " (the rest of the retry budget)" if timeout_s < self._timeout_s else ""
                raise _Retryable(
                    f"no answer within {timeout_s:.3g}s{rest} ({type(exc).__name__})"
                ) from None
            except aiohttp.ClientError as exc:
                detail = str(exc) or "connection failed"
                raise _Retryable(f"{type(exc).__name__}: {detail}") from None
            finally:
                LLM_IN_FLIGHT.dec()
                LLM_LATENCY.observe(time.perf_counter() - started)
        return self._interpret(reply, form, retries, max_tokens, chat.max_tokens)

    def _interpret(
        self, response: _Reply, form: str, retries: int, max_tokens: int, wanted_tokens: int
    ) -> LLMAnswer:
        status = response.status
        what = f"{status} {response.reason}".strip()
        if status in _REFUSAL_STATUSES and self._names_response_format(response.text):
            self._refused(form, status, response.text)
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
            raise InvalidLLMOutput(
                f"LLM endpoint rejected the request with {what}: {_excerpt(response.text)!r}; "
                "the batch will be retried and split"
            )
        return self._parse_completion(response, form, retries, max_tokens, wanted_tokens)

    @staticmethod
    def _names_response_format(text: str) -> bool:
        lowered = text.lower()
        return any(marker in lowered for marker in _REFUSAL_MARKERS)

    def _refused(self, form: str, status: int, text: str) -> None:
        """Handle a refusal of ``form``: the next form under ``auto``, else a config error."""
        detail = _excerpt(text)
        if not self._auto:
            raise LLMConfigError(
                f"LLM endpoint POST {self._url} refused response_format {form} with HTTP "
                f"{status}: {detail!r}; set CONSOLIDATION_LLM_RESPONSE_FORMAT=auto to use a "
                "form it accepts"
            )
        index = prompts.RESPONSE_FORMATS.index(form)
        if index + 1 == len(prompts.RESPONSE_FORMATS):
            raise LLMConfigError(
                f"LLM endpoint POST {self._url} refuses every response_format "
                f"({', '.join(prompts.RESPONSE_FORMATS)}); last HTTP {status}: {detail!r}: "
                "the service needs a server with at least a JSON mode"
            )
        # Passes that sent the same form at once all see the refusal; the first one moves on.
        if self._form == form:
            self._form = prompts.RESPONSE_FORMATS[index + 1]
            self._form_settled = False
            self._refusals.append({"response_format": form, "status": status, "detail": detail})
        raise _FormatRefused

    def _accepted(self, form: str) -> None:
        """The endpoint answered a request sent with ``form``: keep it, say so once."""
        if self._form_settled or form != self._form:
            return
        self._form_settled = True
        constrained = form != "json_object"
        (log.info if constrained else log.warning)(
            "llm_response_format",
            url=self._url,
            model=self._model,
            response_format=form,
            constrained_decoding=constrained,
            refused=self._refusals,
        )

    def _parse_completion(
        self, response: _Reply, form: str, retries: int, max_tokens: int, wanted_tokens: int
    ) -> LLMAnswer:
        # A body that is not a chat completion (a gateway's HTML page, an error object sent
        # with 200) is the endpoint's fault, never the memories': retried like a 503.
        try:
            data = orjson.loads(response.body)
        except orjson.JSONDecodeError:
            data = None
        choices = data.get("choices") if isinstance(data, dict) else None
        choice = choices[0] if isinstance(choices, list) and choices else None
        message = choice.get("message") if isinstance(choice, dict) else None
        if not isinstance(choice, dict) or not isinstance(message, dict):
            raise _Retryable(
                f"HTTP {response.status} with a body that is not a chat completion (no "
                f"choices[0].message): {_excerpt(response.text)!r}",
                status=response.status,
            )
        assert isinstance(data, dict)
        self._accepted(form)
        finish_reason = choice.get("finish_reason")
        finish_reason = finish_reason if isinstance(finish_reason, str) else None
        content = message.get("content")
        # reasoning_content (vLLM, llama.cpp, DeepSeek) is the model's thinking: never the answer.
        content = _THINK_BLOCK.sub("", content, count=1) if isinstance(content, str) else ""
        if finish_reason == "length":
            capped = (
                f", capped by CONSOLIDATION_LLM_MAX_TOKENS={self._max_tokens}"
                if max_tokens < wanted_tokens
                else ""
            )
            raise InvalidLLMOutput(
                f"LLM answer was cut off by max_tokens={max_tokens} (finish_reason 'length'; the "
                f"pass asked for {wanted_tokens}{capped}): the retry asks for a complete answer, "
                "then the batch is split",
                answer=content,
                problems=[
                    f"the answer was cut off at the limit of {max_tokens} tokens before it was "
                    "complete; write a shorter answer"
                ],
                truncated=True,
            )
        if not content.strip():
            refusal = message.get("refusal")
            said = f", refusal {_excerpt(refusal)!r}" if isinstance(refusal, str) else ""
            raise InvalidLLMOutput(
                f"LLM answer has empty content (finish_reason {finish_reason!r}{said})"
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

    async def complete(self, chat: prompts.Chat) -> LLMAnswer:
        """Run :func:`consolidation.offline.consolidate` on the §3 object of ``chat``."""
        request = prompts.find_request_object(chat.user)
        if request is None:
            raise ValueError("the user message must end with the JSON object of DESIGN §3")
        content = orjson.dumps(offline.consolidate(request)).decode()
        return LLMAnswer(
            content=content,
            prompt_tokens=(chat.prompt_chars + 3) // 4,
            completion_tokens=estimate_tokens(content),
            finish_reason="stop",
            retries=0,
        )

    async def aclose(self) -> None:
        """Nothing to release."""
