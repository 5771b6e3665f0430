"""The LLM client: one OpenAI-compatible chat-completions call per pass (DESIGN §3).

:class:`HTTPConsolidator` owns one pooled HTTP client and one semaphore; a single instance per
process is shared by every operation, so its ``max_concurrent`` is the process-wide cap.
:class:`OfflineConsolidator` answers in-process with the offline policy and makes no HTTP call.
Both raise only the typed errors of :mod:`consolidation.errors`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Protocol, Unpack

import orjson
import structlog

from consolidation.errors import InvalidLLMOutput, LLMConfigError
from consolidation.llm import hedge, offline, prompts
from consolidation.llm.transport import (
    Budget,
    Endpoint,
    Meters,
    Options,
    Reply,
    Resend,
    RetriesExhausted,
    Retryable,
    Route,
    excerpt,
)
from consolidation.metrics import (
    LLM_HEDGES,
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
# How servers refuse a response_format: vLLM, Ollama and gateways with 400/422, llama-cpp-python
# with a 500 carrying a pydantic literal_error; the body names the field.
_REFUSAL_STATUSES = frozenset({400, 422, 500})
_REFUSAL_MARKERS = ("response_format", "json_schema", "response format", "json schema")
# A reasoning model's thoughts before the answer (Qwen3, DeepSeek-R1 and kin).
_THINK_BLOCK = re.compile(r"\A\s*<think>.*?</think>\s*", re.DOTALL | re.IGNORECASE)


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
    """Something that answers a pass: a :class:`~consolidation.llm.prompts.Chat` in, assistant
    content out."""

    async def complete(self, chat: prompts.Chat) -> LLMAnswer:
        """Return the answer or raise TransientLLMError, InvalidLLMOutput or LLMConfigError."""
        ...

    async def aclose(self) -> None:
        """Release connections; the instance is unusable afterwards."""
        ...


class LLMRetriesExhausted(RetriesExhausted):
    """Transport trouble outlasted every retry; ``attempts`` HTTP requests were made."""


class _FormatRefused(Resend):
    """The server refused the response_format form sent; resend with the next one."""


class _TokenFieldRefused(Resend):
    """The server wants ``max_completion_tokens`` instead of ``max_tokens``; resend with it."""


_ROUTE = Route(
    path="chat/completions",
    label="LLM",
    setting="CONSOLIDATION_LLM",
    config_error=LLMConfigError,
    exhausted=LLMRetriesExhausted,
    meters=Meters(
        LLM_REQUESTS,
        LLM_LATENCY,
        in_flight=LLM_IN_FLIGHT,
        retry_after=LLM_RETRY_AFTER,
        hedges=LLM_HEDGES,
    ),
    retry_event="llm_retry",
)


def _token_count(value: object) -> int:
    # Some gateways send floats or nulls; anything unusable counts as 0 rather than failing.
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0
    return max(0, int(value))


class HTTPConsolidator:
    """Client for ``POST {base_url}/chat/completions`` of an OpenAI-compatible server.

    Finds the ``response_format`` form the server accepts (``auto``) and caps ``max_tokens``;
    ``options`` (timeout, retries, retry budget, requests in flight, backoff) are the
    transport's, :class:`consolidation.llm.transport.Endpoint`, shared with the embeddings client;
    ``hedge_quantile`` turns on hedged requests (:mod:`consolidation.llm.hedge`).
    """

    def __init__(
        self,
        *,
        base_url: str,
        model: str,
        api_key: str | None = None,
        response_format: str = "auto",
        max_tokens: int = 4096,
        system_role: str = "system",
        hedge_quantile: float | None = None,
        hedge_min_samples: int = hedge.MIN_SAMPLES,
        **options: Unpack[Options],
    ) -> None:
        if response_format not in RESPONSE_FORMAT_MODES:
            raise ValueError(
                f"response_format must be one of {RESPONSE_FORMAT_MODES}, got {response_format!r}"
            )
        if system_role not in prompts.SYSTEM_ROLES:
            raise ValueError(f"system_role must be one of {prompts.SYSTEM_ROLES}")
        if max_tokens < 1:
            raise ValueError("need max_tokens >= 1")
        self._endpoint = Endpoint(
            _ROUTE,
            base_url=base_url,
            model=model,
            api_key=api_key,
            hedge_quantile=hedge_quantile,
            hedge_min_samples=hedge_min_samples,
            **options,
        )
        self._url = self._endpoint.url
        self._model = model
        self._max_tokens = max_tokens
        self._system_role = system_role
        # auto starts at json_schema and walks down prompts.RESPONSE_FORMATS on refusals; the
        # first form a request is answered with is kept for the life of the process.
        self._auto = response_format == "auto"
        self._form = "json_schema" if self._auto else response_format
        self._form_settled = not self._auto
        self._refusals: list[dict[str, Any]] = []
        # OpenAI's reasoning models (o-series, gpt-5) refuse max_tokens for max_completion_tokens.
        self._token_field = "max_tokens"

    @property
    def max_concurrent(self) -> int:
        """Requests in flight at most (``LLM_MAX_CONCURRENT``: the process's cap)."""
        return self._endpoint.max_concurrent

    @property
    def response_format_mode(self) -> str:
        """The ``response_format`` form requests are sent with now (one of
        ``prompts.RESPONSE_FORMATS``)."""
        return self._form

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._endpoint.aclose()

    async def complete(self, chat: prompts.Chat) -> LLMAnswer:
        """One chat completion for ``chat``.

        Raises LLMRetriesExhausted (a TransientLLMError) when transport trouble outlasts
        ``max_retries`` or ``retry_budget_s``, InvalidLLMOutput for an unusable answer or a
        400/422, LLMConfigError for 401/403/404 or a refused response_format. Cancelling the
        caller aborts the HTTP request.
        """
        try:
            answer = await self._endpoint.call(
                lambda budget, retries: self._attempt(chat, retries, budget)
            )
        except InvalidLLMOutput as exc:
            _count_tokens(exc.prompt_tokens, exc.completion_tokens)
            raise
        _count_tokens(answer.prompt_tokens, answer.completion_tokens)
        return answer

    async def _attempt(self, chat: prompts.Chat, retries: int, budget: Budget) -> LLMAnswer:
        # Every request goes with the current form, even before the endpoint has accepted one:
        # waiting for a verdict would keep every slot but one idle for a whole model latency at
        # each start, while a refusal is fast and moves every later request (and the resend of
        # each refused one) to the next form, so a refusing server costs a few quick errors once.
        return await self._send(chat, self._form, retries, budget)

    async def _send(self, chat: prompts.Chat, form: str, retries: int, budget: Budget) -> LLMAnswer:
        max_tokens = min(chat.max_tokens, self._max_tokens)
        token_field = self._token_field
        body = orjson.dumps(
            {
                "model": self._model,
                "temperature": 0,
                token_field: max_tokens,
                "messages": chat.messages(self._system_role),
                "response_format": prompts.response_format(form, chat.schema),
            }
        )
        reply = await self._endpoint.post(body, budget)
        if reply.status == 400 and token_field == "max_tokens":
            self._check_token_field(reply.text)
        return self._interpret(reply, form, retries, max_tokens, chat.max_tokens)

    def _interpret(
        self, response: Reply, form: str, retries: int, max_tokens: int, wanted_tokens: int
    ) -> LLMAnswer:
        status = response.status
        if status in _REFUSAL_STATUSES and self._names_response_format(response.text):
            self._refused(form, status, response.text)
        self._endpoint.check(response)
        if status >= 400:
            raise InvalidLLMOutput(
                f"LLM endpoint rejected the request with {response.what}: "
                f"{excerpt(response.text)!r}; the batch will be retried and split"
            )
        return self._parse_completion(response, form, retries, max_tokens, wanted_tokens)

    @staticmethod
    def _names_response_format(text: str) -> bool:
        lowered = text.lower()
        return any(marker in lowered for marker in _REFUSAL_MARKERS)

    def _refused(self, form: str, status: int, text: str) -> None:
        """Handle a refusal of ``form``: the next form under ``auto``, else a config error."""
        detail = excerpt(text)
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
        # Passes that sent the same form at once all see the refusal; the first one moves on,
        # the others (and any sent with a form refused earlier) are resent with the current one.
        if self._form == form:
            self._form = prompts.RESPONSE_FORMATS[index + 1]
            self._form_settled = False
            self._refusals.append({"response_format": form, "status": status, "detail": detail})
        raise _FormatRefused

    def _check_token_field(self, text: str) -> None:
        """A 400 to a request sent with ``max_tokens``: if it asks for ``max_completion_tokens``
        instead, that is the endpoint's dialect, never the memories' fault: switch (once, for
        the life of the process) and resend."""
        if "max_completion_tokens" not in text:
            return
        if self._token_field == "max_completion_tokens":
            raise _TokenFieldRefused  # a pass that was in flight when another one switched
        self._token_field = "max_completion_tokens"
        log.warning(
            "llm_max_tokens_field",
            url=self._url,
            model=self._model,
            field="max_completion_tokens",
            detail=excerpt(text),
            hint="the server refuses max_tokens (OpenAI's reasoning models); the bound is sent "
            "as max_completion_tokens from now on",
        )
        raise _TokenFieldRefused

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
        self, response: Reply, form: str, retries: int, max_tokens: int, wanted_tokens: int
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
            raise Retryable(
                f"HTTP {response.status} with a body that is not a chat completion (no "
                f"choices[0].message): {excerpt(response.text)!r}",
                status=response.status,
            )
        assert isinstance(data, dict)
        self._accepted(form)
        finish_reason = choice.get("finish_reason")
        finish_reason = finish_reason if isinstance(finish_reason, str) else None
        content = message.get("content")
        # reasoning_content (vLLM, llama.cpp, DeepSeek) is the model's thinking: never the answer.
        content = _THINK_BLOCK.sub("", content, count=1) if isinstance(content, str) else ""
        usage = data.get("usage")
        usage = usage if isinstance(usage, dict) else {}
        # Spent even when the answer is unusable (a cut-off answer can be thousands of tokens).
        # A hedge's aborted copy is charged its prompt: a server may bill what it was sent.
        prompt_tokens = _token_count(usage.get("prompt_tokens")) * response.copies
        completion_tokens = _token_count(usage.get("completion_tokens"))
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
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
            )
        if not content.strip():
            refusal = message.get("refusal")
            said = f", refusal {excerpt(refusal)!r}" if isinstance(refusal, str) else ""
            raise InvalidLLMOutput(
                f"LLM answer has empty content (finish_reason {finish_reason!r}{said})",
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
            )
        return LLMAnswer(
            content=content,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            finish_reason=finish_reason,
            retries=retries,
        )


# Bound once: labels() validates and looks its child up under a lock on every call.
_PROMPT_TOKENS = LLM_TOKENS.labels(kind="prompt")
_COMPLETION_TOKENS = LLM_TOKENS.labels(kind="completion")


def _count_tokens(prompt: int, completion: int) -> None:
    _PROMPT_TOKENS.inc(prompt)
    _COMPLETION_TOKENS.inc(completion)


def estimate_tokens(text: str) -> int:
    """Rough token count (~4 characters per token) for servers that report no usage."""
    return (len(text) + 3) // 4


class OfflineConsolidator:
    """Answers with the offline policy in-process (no HTTP); usage is estimated from lengths."""

    async def complete(self, chat: prompts.Chat) -> LLMAnswer:
        """Run :func:`consolidation.llm.offline.consolidate` on the §3 object of ``chat``."""
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
