"""A fake OpenAI-compatible server answering with the offline policy (DESIGN §3).

Used by tests, benchmarks and operators' load tests (``consolidation fake-llm``). It answers
``POST /chat/completions`` and ``POST /v1/chat/completions`` with ``offline.consolidate`` of the
user message (a contract v2 request, ``"contract": "v2"``, with ``narrow.offline_answer``), and can
inject latency, failures, poisoned answers and scripted responses. It
records what it saw (``GET /_stats``) so tests can assert on concurrency and timing.

Poison markers in a fact's text spoil the answer of the whole request containing that fact:
``[[poison]]`` cites the unknown ref ``f9999``, ``[[badjson]]`` answers ``this is not json``,
``[[truncate]]`` cuts the answer in half with ``finish_reason: "length"``, ``[[empty]]`` answers
an empty content, ``[[repairable]]`` spoils it like ``[[poison]]`` unless the request carries a
repair (the previous answer and its problems), as a model that corrects itself when told what is
wrong. ``[[answer]]`` plays a model that obeys instructions injected into a memory: the assistant
content is the rest of the first fact text containing the marker, sent verbatim.

Real servers differ (``FakeLLMConfig``, also ``consolidation fake-llm`` flags): ``dialect``
``openai`` accepts every ``response_format``; ``llama-cpp-python`` refuses ``json_schema`` with a
500 carrying a pydantic ``literal_error`` and honours ``{"type": "json_object", "schema": …}``;
``no-schema`` refuses ``json_schema`` with a 400 and ignores a schema sent with ``json_object``;
``json-object-only`` also refuses that schema (400); ``openai-reasoning`` (OpenAI's o-series
and gpt-5) refuses ``max_tokens`` with OpenAI's 400 ``unsupported_parameter`` and takes
``max_completion_tokens`` instead. ``max_tokens`` is honoured (the answer is
cut, ``finish_reason: "length"``) unless ``honour_max_tokens`` is off; tokens are characters / 4
and ``pad_bytes`` whitespace is free (it models a big body, not a long generation). ``think``
puts a ``<think>…</think>`` block before the answer, ``reasoning_content`` adds that field beside
it, ``drop_system`` plays a chat template that drops the system message (a model left without
instructions answers prose), ``envelope`` answers 200 with an ``html`` page or a ``no-choices``
JSON body instead of a chat completion.

Stats (``stats()`` or ``GET /_stats``): ``requests``, ``completed`` (200 sent), ``failed`` (other
status sent), ``aborted`` (client left first), ``in_flight``, ``max_in_flight``,
``max_in_flight_per_scope`` (same (bank, scope) at once), ``max_distinct_scopes_in_flight``,
``statuses`` and ``calls`` (arrival order, the last ``MAX_RECORDED_CALLS``): ``bank``, ``scope``,
``fact_texts``, ``status`` (None while in flight or when aborted), ``started``/``ended``
(``time.monotonic()`` of this process), ``response_format`` (the requested type), ``schema``
(whether a schema came with it), ``max_tokens`` (None when absent), ``roles`` (of the messages,
in order), ``instructed`` (whether the first user message has instructions before the §3 object)
and ``turns`` (the contents of the messages after it: a repair's answer and note).

``POST /embeddings`` and ``POST /v1/embeddings`` answer deterministic vectors in which
paraphrases are close (:mod:`consolidation.testing.fake_embeddings`), with their own latency, failure
injection and script (``control(embeddings={...})``) and their own stats (``embeddings``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import heapq
import itertools
import math
import random
import socket
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import orjson
import structlog
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from consolidation.llm import narrow, offline, prompts, prompts_v2
from consolidation.llm.client import estimate_tokens
from consolidation.net import listen_socket, socket_url
from consolidation.testing.fake_embeddings import DEFAULT_DIMENSIONS, embed_text

__all__ = ["FakeEmbeddingsConfig", "FakeLLMConfig", "FakeLLMServer", "create_app", "serve"]

log = structlog.get_logger(__name__)

# Long load tests must not grow memory without bound; the oldest calls are dropped first.
MAX_RECORDED_CALLS = 10_000

POISON_MARKER = "[[poison]]"
BADJSON_MARKER = "[[badjson]]"
TRUNCATE_MARKER = "[[truncate]]"
EMPTY_MARKER = "[[empty]]"
ANSWER_MARKER = "[[answer]]"
REPAIRABLE_MARKER = "[[repairable]]"

DIALECTS = ("openai", "llama-cpp-python", "no-schema", "json-object-only", "openai-reasoning")
ENVELOPES = ("completion", "html", "no-choices")

_CHAT_PATHS = ("/chat/completions", "/v1/chat/completions")

_SCRIPT_KEYS = (
    frozenset({"status", "retry_after", "body"}),
    frozenset({"content", "finish_reason"}),
    frozenset({"hang"}),
    frozenset({"pass"}),
)


@dataclass
class FakeLLMConfig:
    """Behaviour of the fake; every field can be changed at run time with ``control``.

    A fault can follow a request's content rather than its order: a chat request whose body
    contains ``fail_when_contains`` (as sent, JSON-escaped) is answered ``fail_when_status``,
    whatever the script and ``fail_rate`` say and without consuming a script item — say, a 401
    for the passes that carry one memory, wherever they fall in the request order."""

    # From the request's arrival to its answer, the fake's own work included (a model's
    # latency is its whole service time).
    latency_ms: float = 0
    jitter_ms: float = 0
    # A real server's shape instead (used when latency_median_ms > 0): a heavy-tailed base drawn
    # from a lognormal with this median and 99th percentile, plus the time to the first token,
    # plus the answer's tokens times the time per token. Seeded by ``seed`` like the rest.
    latency_median_ms: float = 0
    latency_p99_ms: float = 0
    ttft_ms: float = 0
    per_token_ms: float = 0
    fail_rate: float = 0.0
    fail_status: int = 503
    fail_when_contains: str | None = None
    fail_when_status: int = 503
    retry_after_s: float | None = None
    pad_bytes: int = 0
    api_key: str | None = None
    seed: int | None = None
    dialect: str = "openai"
    honour_max_tokens: bool = True
    think: bool = False
    reasoning_content: bool = False
    drop_system: bool = False
    envelope: str = "completion"

    def __post_init__(self) -> None:
        if self.latency_median_ms > 0 and self.latency_p99_ms < self.latency_median_ms:
            raise ValueError("the latency's p99 must be at least its median")
        if min(self.latency_median_ms, self.ttft_ms, self.per_token_ms) < 0:
            raise ValueError("latencies must not be negative")
        if self.dialect not in DIALECTS:
            raise ValueError(f"dialect must be one of {DIALECTS}, got {self.dialect!r}")
        if self.envelope not in ENVELOPES:
            raise ValueError(f"envelope must be one of {ENVELOPES}, got {self.envelope!r}")


_CONFIG_FIELDS = frozenset(field.name for field in dataclasses.fields(FakeLLMConfig))


@dataclass(frozen=True)
class _Parsed:
    """What the fake understood of one chat-completion request."""

    model: str
    user: dict[str, Any] | None
    bank: str | None
    scope: tuple[str, ...] | None
    fact_texts: tuple[str, ...]
    response_format: str | None
    problem: str | None
    schema: bool = False
    max_tokens: int | None = None
    # Which field carried the bound: max_tokens, max_completion_tokens or None.
    token_field: str | None = None
    messages: tuple[tuple[str, str], ...] = ()
    # Whether the first user message carries instructions before the §3 object.
    instructed_user: bool = False

    @property
    def turns(self) -> tuple[str, ...]:
        """The contents of the messages after the first user message (a repair's)."""
        roles = [role for role, _ in self.messages]
        if "user" not in roles:
            return ()
        return tuple(content for _, content in self.messages[roles.index("user") + 1 :])

    @property
    def repair(self) -> bool:
        """A previous answer and a note about it follow the first user message."""
        return bool(self.turns)


@dataclass(frozen=True)
class _Plan:
    """How to answer one request, decided under the lock when it arrives."""

    delay_s: float = 0.0
    hang: bool = False
    status: int = 200
    retry_after: float | None = None
    body: str | None = None
    content: str | None = None
    finish_reason: str = "stop"
    config: FakeLLMConfig = dataclasses.field(default_factory=FakeLLMConfig)


def _error_body(message: str, code: int) -> bytes:
    """An OpenAI-style error object."""
    if code == 401:
        kind = "authentication_error"
    elif code == 429:
        kind = "rate_limit_error"
    elif code >= 500:
        kind = "server_error"
    else:
        kind = "invalid_request_error"
    return orjson.dumps({"error": {"message": message, "type": kind, "code": code}})


_THINKING = (
    "<think>\nThe facts and observations are listed; I answer with one JSON object.\n</think>\n\n"
)
_REASONING = "The facts and observations are listed; I answer with one JSON object."
_UNINSTRUCTED = "Thank you for the facts! What would you like me to do with them?"
_HTML_PAGE = (
    "<html><head><title>502 Bad Gateway</title></head><body><center><h1>502 Bad Gateway</h1>"
    "</center><hr><center>nginx</center></body></html>"
)
# What llama-cpp-python 0.3.x answers to {"type": "json_schema", ...}: its pydantic request model
# accepts only text and json_object, and the validation error surfaces as a 500.
_LLAMA_CPP_PYTHON_REFUSAL = (
    "[{'type': 'literal_error', 'loc': ('body', 'response_format', 'type'), "
    "'msg': \"Input should be 'text' or 'json_object'\", 'input': 'json_schema', "
    "'ctx': {'expected': \"'text' or 'json_object'\"}}]"
)


# What OpenAI answers a reasoning model (o-series, gpt-5) sent max_tokens.
_OPENAI_MAX_TOKENS_REFUSAL = orjson.dumps(
    {
        "error": {
            "message": "Unsupported parameter: 'max_tokens' is not supported with this model. "
            "Use 'max_completion_tokens' instead.",
            "type": "invalid_request_error",
            "param": "max_tokens",
            "code": "unsupported_parameter",
        }
    }
).decode()


def _parse(body: bytes) -> _Parsed:
    """Read the request leniently; ``problem`` says why it cannot be answered (→ 400)."""
    model = "fake"
    user: dict[str, Any] | None = None
    response_format: str | None = None
    schema = False
    max_tokens: int | None = None
    token_field: str | None = None
    try:
        request = orjson.loads(body)
    except orjson.JSONDecodeError:
        request = None
    if not isinstance(request, dict):
        return _Parsed(model, None, None, None, (), None, "request body is not a JSON object")
    if isinstance(request.get("model"), str):
        model = request["model"]
    fmt = request.get("response_format")
    if isinstance(fmt, dict) and isinstance(fmt.get("type"), str):
        response_format = fmt["type"]
        inner = fmt.get("json_schema")
        schema = isinstance(fmt.get("schema"), dict) or (
            isinstance(inner, dict) and isinstance(inner.get("schema"), dict)
        )
    for field in ("max_tokens", "max_completion_tokens"):
        value = request.get(field)
        if isinstance(value, int) and not isinstance(value, bool):
            max_tokens, token_field = value, field
            break
    messages: list[tuple[str, str]] = []
    raw_messages = request.get("messages")
    for message in raw_messages if isinstance(raw_messages, list) else []:
        if isinstance(message, dict) and isinstance(message.get("content"), str):
            messages.append((str(message.get("role")), message["content"]))
    # The §3 object is in the first user message; later ones are repair notes.
    user_content = next((content for role, content in messages if role == "user"), None)
    parsed = functools.partial(
        _Parsed,
        model=model,
        response_format=response_format,
        schema=schema,
        max_tokens=max_tokens,
        token_field=token_field,
        messages=tuple(messages),
    )
    if user_content is None:
        problem = "messages must contain a user message with string content"
        return parsed(user=None, bank=None, scope=None, fact_texts=(), problem=problem)
    # Parsed once: a user message that is the whole object carries no instructions.
    whole = _json_object(user_content)
    user = whole if whole is not None else prompts.find_request_object(user_content)
    if user is None:
        problem = "the user message content does not end with the JSON object of DESIGN §3"
        return parsed(user=None, bank=None, scope=None, fact_texts=(), problem=problem)
    bank = user.get("bank")
    scope = user.get("scope")
    facts = user.get("facts")
    return parsed(
        user=user,
        bank=bank if isinstance(bank, str) else None,
        scope=tuple(str(t) for t in scope) if isinstance(scope, list) else (),
        fact_texts=tuple(
            fact["text"]
            for fact in (facts if isinstance(facts, list) else [])
            if isinstance(fact, dict) and isinstance(fact.get("text"), str)
        ),
        problem=None,
        instructed_user=whole is None,
    )


def _observation_texts(user: dict[str, Any] | None) -> list[str]:
    """The texts of the observations a request showed (recorded with its call)."""
    shown = user.get("observations") if user is not None else None
    return [
        o["text"]
        for o in (shown if isinstance(shown, list) else [])
        if isinstance(o, dict) and isinstance(o.get("text"), str)
    ]


def _json_object(content: str) -> dict[str, Any] | None:
    try:
        value = orjson.loads(content)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def _refusal(dialect: str, parsed: _Parsed) -> _Plan | None:
    """How ``dialect`` refuses the request's response_format or token bound, if it does."""
    if dialect == "openai-reasoning" and parsed.token_field == "max_tokens":
        return _Plan(status=400, body=_OPENAI_MAX_TOKENS_REFUSAL)
    if parsed.response_format == "json_schema":
        if dialect == "llama-cpp-python":
            return _Plan(
                status=500,
                body=orjson.dumps(
                    {
                        "error": {
                            "message": _LLAMA_CPP_PYTHON_REFUSAL,
                            "type": "internal_server_error",
                            "param": None,
                            "code": None,
                        }
                    }
                ).decode(),
            )
        if dialect in ("no-schema", "json-object-only"):
            return _Plan(
                status=400,
                body="response_format type 'json_schema' is not supported; use 'json_object'",
            )
    if parsed.response_format == "json_object" and parsed.schema and dialect == "json-object-only":
        return _Plan(
            status=400, body="Unrecognized request argument supplied: response_format.schema"
        )
    return None


def _answer_content(parsed: _Parsed, config: FakeLLMConfig) -> tuple[str, str, int]:
    """The assistant content, finish_reason and completion tokens for a request, poison
    markers, thinking, ``max_tokens`` and padding applied."""
    texts = "\n".join(parsed.fact_texts)
    for text in parsed.fact_texts:
        if ANSWER_MARKER in text:
            content = text.split(ANSWER_MARKER, 1)[1]
            return content, "stop", estimate_tokens(content)
    if config.drop_system and not parsed.instructed_user:
        # The template dropped the instructions: the model never learnt what to answer.
        content = _UNINSTRUCTED
    elif BADJSON_MARKER in texts:
        content = "this is not json"
    elif EMPTY_MARKER in texts:
        content = ""
    else:
        if POISON_MARKER in texts or (REPAIRABLE_MARKER in texts and not parsed.repair):
            answer: dict[str, Any] = {
                "creates": [
                    {
                        "text": "An observation citing a fact that does not exist.",
                        "facts": ["f9999"],
                    }
                ],
                "updates": [],
                "merges": [],
            }
        else:
            assert parsed.user is not None
            if prompts_v2.is_v2_request(parsed.user):
                answer = narrow.offline_answer(parsed.user)
            else:
                answer = offline.consolidate(parsed.user)
        content = orjson.dumps(answer).decode()
    if config.think:
        content = _THINKING + content
    tokens = estimate_tokens(content)
    limit = parsed.max_tokens
    if config.honour_max_tokens and limit is not None and tokens > limit:
        return content[: limit * 4], "length", limit
    if config.pad_bytes > 0 and content.endswith("}"):
        # Whitespace before the closing brace keeps the answer valid JSON of the wanted size.
        content = content[:-1] + " " * config.pad_bytes + "}"
    if TRUNCATE_MARKER in texts:
        return content[: len(content) // 2], "length", tokens // 2
    return content, "stop", tokens


def _validate_script(script: object) -> list[dict[str, Any]]:
    if not isinstance(script, list):
        raise ValueError("script must be a list of override objects")
    items: list[dict[str, Any]] = []
    for item in script:
        if not isinstance(item, dict) or not item:
            raise ValueError(f"script item {item!r} must be a non-empty object")
        keys = frozenset(item)
        if not any(keys <= allowed for allowed in _SCRIPT_KEYS):
            raise ValueError(
                f"script item {item!r} must be one of {{status, retry_after?, body?}}, "
                "{content, finish_reason?}, {hang: true} or {pass: true}"
            )
        if "status" in keys and not isinstance(item["status"], int):
            raise ValueError(f"script item {item!r}: status must be an integer")
        if "retry_after" in keys and "status" not in keys:
            raise ValueError(f"script item {item!r}: retry_after needs a status")
        if "body" in keys and "status" not in keys:
            raise ValueError(f"script item {item!r}: body needs a status")
        if "finish_reason" in keys and "content" not in keys:
            raise ValueError(f"script item {item!r}: finish_reason needs a content")
        items.append(dict(item))
    return items


async def _wait_for_disconnect(receive: Receive) -> None:
    # The request body has been read, so the next message the server delivers is the disconnect.
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class _Clock:
    """Resolves futures at a deadline to within a fraction of a millisecond. The event loop's
    own timers are coarser (uvloop's count whole milliseconds and fire up to one late), which a
    benchmark would charge to the engine as time the model did not take: one thread sleeps
    until the earliest deadline and hands each due future back to its loop."""

    def __init__(self) -> None:
        self._due = threading.Condition()
        self._heap: list[tuple[float, int, asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None

    def at(self, deadline: float) -> asyncio.Future[None]:
        """A future of the running loop resolved at ``deadline`` (``time.monotonic()``)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._due:
            heapq.heappush(self._heap, (deadline, next(self._order), loop, future))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="fake-clock", daemon=True)
                self._thread.start()
            self._due.notify()
        return future

    def _run(self) -> None:
        with self._due:
            while True:
                if not self._heap:
                    self._due.wait()
                    continue
                wait = self._heap[0][0] - time.monotonic()
                if wait > 0:
                    self._due.wait(wait)
                    continue
                _, _, loop, future = heapq.heappop(self._heap)
                with contextlib.suppress(RuntimeError):  # its loop has closed meanwhile
                    loop.call_soon_threadsafe(_resolve, future)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():  # not cancelled by a client that left
        future.set_result(None)


_CLOCK = _Clock()


async def _wait(receive: Receive, deadline: float | None, closing: asyncio.Event) -> str:
    """Wait until ``deadline`` (``time.monotonic()``; None: forever). Returns ``"disconnect"``
    if the client leaves first, ``"closing"`` if the server is stopping first, else
    ``"elapsed"``."""
    disconnect = asyncio.ensure_future(_wait_for_disconnect(receive))
    stopping = asyncio.ensure_future(closing.wait())
    waiting: set[asyncio.Future[Any]] = {disconnect, stopping}
    if deadline is not None:
        waiting.add(_CLOCK.at(deadline))
    try:
        done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    finally:
        pending = [future for future in waiting if not future.done()]
        for future in pending:
            future.cancel()
        if pending:
            await asyncio.wait(pending)
    if disconnect in done:
        return "disconnect"
    return "closing" if stopping in done else "elapsed"


async def _serve(
    receive: Receive,
    closing: asyncio.Event,
    plan: _Plan,
    respond: Callable[[], tuple[Response, float]],
    finish: Callable[[int | None], None],
    since: float,
) -> Response:
    """Answer ``respond()`` once ``plan``'s delay has passed ``since`` the request arrived (the
    answer is worked out within it, as a model's is: the latency is the whole service time), a
    503 instead if the server is stopping first, nothing if the client leaves first. ``finish``
    records the status (None: the client left), before the response is sent, so "ended" never
    postdates what the client saw."""
    status: int | None = None
    try:
        answer, token_s = (None, 0.0) if plan.hang else respond()
        delay_s = plan.delay_s + token_s
        waited = "elapsed"
        if plan.hang or delay_s > 0:
            waited = await _wait(receive, None if plan.hang else since + delay_s, closing)
        if waited == "disconnect":
            # Nobody is listening any more; this response is never delivered.
            return Response(status_code=499)
        if waited == "closing":
            response = _status_response(
                _Plan(status=503, body="the fake LLM server is shutting down")
            )
        else:
            assert answer is not None  # a plan that hangs never gets here
            response = answer
        status = response.status_code
        return response
    finally:
        finish(status)


# The z-score of the 99th percentile of a standard normal distribution.
_Z99 = 2.3263478740408408


def service_delay_s(config: FakeLLMConfig, rng: random.Random) -> float:
    """The part of a call's service time known when it arrives: the base latency (fixed with
    uniform jitter, or lognormal with the configured median and p99) plus the time to the
    first token."""
    if config.latency_median_ms > 0:
        mu = math.log(config.latency_median_ms)
        sigma = math.log(config.latency_p99_ms / config.latency_median_ms) / _Z99
        base_ms = rng.lognormvariate(mu, sigma)
    else:
        base_ms = config.latency_ms + rng.uniform(-config.jitter_ms, config.jitter_ms)
    return max(0.0, base_ms + config.ttft_ms) / 1000.0


def _with_token_time(response: Response, config: FakeLLMConfig) -> tuple[Response, float]:
    """``response`` and the time its completion tokens add (``per_token_ms`` each)."""
    if config.per_token_ms <= 0 or response.status_code != 200:
        return response, 0.0
    try:
        usage = orjson.loads(bytes(response.body)).get("usage") or {}
    except (orjson.JSONDecodeError, AttributeError):
        return response, 0.0
    return response, int(usage.get("completion_tokens", 0)) * config.per_token_ms / 1000.0


def _status_response(plan: _Plan) -> Response:
    headers = {}
    if plan.retry_after is not None:
        headers["retry-after"] = f"{plan.retry_after:g}"
    body = plan.body
    if body is None:
        content = _error_body(f"fake LLM failure {plan.status}", plan.status)
    else:
        # A plain message becomes an OpenAI-style error object; a JSON body is sent as is.
        try:
            orjson.loads(body)
        except orjson.JSONDecodeError:
            content = _error_body(body, plan.status)
        else:
            content = body.encode()
    return Response(
        content, status_code=plan.status, headers=headers, media_type="application/json"
    )


def _rejection(api_key: str | None, authorization: str | None, problem: str | None) -> _Plan | None:
    """The 401 or 400 a request gets for a wrong bearer token or a body it cannot answer."""
    if api_key is not None and authorization != f"Bearer {api_key}":
        return _Plan(status=401, body="missing or wrong bearer token")
    if problem is not None:
        return _Plan(status=400, body=problem)
    return None


def _next_plan(
    script: deque[dict[str, Any]],
    answer: _Plan,
    failures: FakeLLMConfig | FakeEmbeddingsConfig,
    rng: random.Random,
) -> _Plan:
    """How to answer an acceptable request: as the next script item says, else with
    ``fail_status`` at ``fail_rate``, else ``answer`` (after its delay). Under the lock."""
    item = script.popleft() if script else None
    # {"pass": true} answers normally: scripts can say "two good answers, then hang".
    if item is not None and not item.get("pass"):
        if item.get("hang"):
            return _Plan(hang=True)
        if "status" in item:
            return _Plan(
                delay_s=answer.delay_s,
                status=item["status"],
                retry_after=item.get("retry_after"),
                body=item.get("body"),
            )
        return dataclasses.replace(
            answer, content=item["content"], finish_reason=item.get("finish_reason", "stop")
        )
    if failures.fail_rate > 0 and rng.random() < failures.fail_rate:
        return _Plan(
            delay_s=answer.delay_s, status=failures.fail_status, retry_after=failures.retry_after_s
        )
    return answer


class _Tally:
    """The counters of one endpoint of the fake; used only under the fake's lock."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.requests = 0
        self.completed = 0
        self.failed = 0
        self.aborted = 0
        self.statuses: Counter[int] = Counter()
        self.calls: deque[dict[str, Any]] = deque(maxlen=MAX_RECORDED_CALLS)

    def begin(self, record: dict[str, Any]) -> None:
        self.calls.append(record)
        self.requests += 1

    def finish(self, record: dict[str, Any], status: int | None) -> None:
        """``status`` None means the client went away first."""
        record["status"] = status
        record["ended"] = time.monotonic()
        if status is None:
            self.aborted += 1
            return
        self.statuses[status] += 1
        if status == 200:
            self.completed += 1
        else:
            self.failed += 1

    def counts(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "completed": self.completed,
            "failed": self.failed,
            "aborted": self.aborted,
            "statuses": dict(self.statuses),
        }


class _Call:
    """One recorded request; mutated only under the fake's lock."""

    __slots__ = ("record", "scope_key")

    def __init__(self, record: dict[str, Any], scope_key: tuple[str, tuple[str, ...]] | None):
        self.record = record
        self.scope_key = scope_key


class _FakeLLM:
    """The fake's state and ASGI app. Every state change happens under ``_lock`` because the
    server thread and a test thread both use it."""

    def __init__(self, config: FakeLLMConfig) -> None:
        self._lock = threading.Lock()
        self._config = dataclasses.replace(config)
        self._rng = random.Random(config.seed)
        self._script: deque[dict[str, Any]] = deque()
        # Created in the server's loop on the first request; set from any thread by close().
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing: asyncio.Event | None = None
        self._closing_requested = False
        self._clear_stats()
        self.embeddings = _FakeEmbeddings(self)
        self._routes = Starlette(
            routes=[
                *(Route(path, self._chat, methods=["POST"]) for path in _CHAT_PATHS),
                *(
                    Route(path, self.embeddings.endpoint, methods=["POST"])
                    for path in _EMBEDDINGS_PATHS
                ),
                Route("/_stats", self._stats_endpoint, methods=["GET"]),
                Route("/_control", self._control_endpoint, methods=["POST"]),
                Route("/_reset", self._reset_endpoint, methods=["POST"]),
            ]
        )

    async def app(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI app. A chat completion, the load path, is served without Starlette's
        routing and middleware (a seventh of the fake's CPU under load); the rest, including
        a chat path asked with another method, goes through them."""
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in _CHAT_PATHS:
            response = await self._chat(Request(scope, receive), arrived=time.monotonic())
            await response(scope, receive, send)
            return
        if (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and scope["path"] in _EMBEDDINGS_PATHS
        ):
            response = await self.embeddings.endpoint(Request(scope, receive))
            await response(scope, receive, send)
            return
        await self._routes(scope, receive, send)

    def _clear_stats(self) -> None:
        self._tally = _Tally()
        self._in_flight = 0
        self._max_in_flight = 0
        self._in_flight_by_scope: Counter[tuple[str, tuple[str, ...]]] = Counter()
        self._max_in_flight_per_scope = 0
        self._max_distinct_scopes = 0
        self._next_id = 0

    # --- direct (thread-safe) control -------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """A consistent copy of the counters and recorded calls."""
        with self._lock:
            return {
                **self._tally.counts(),
                "in_flight": self._in_flight,
                "max_in_flight": self._max_in_flight,
                "max_in_flight_per_scope": self._max_in_flight_per_scope,
                "max_distinct_scopes_in_flight": self._max_distinct_scopes,
                "calls": [
                    {**call, "scope": list(call["scope"]), "fact_texts": list(call["fact_texts"])}
                    for call in self._tally.calls
                ],
                "script_pending": len(self._script),
                "embeddings": self.embeddings.stats(),
            }

    def control(self, **changes: Any) -> None:
        """Change config fields and/or queue ``script`` items (appended, consumed FIFO)."""
        if "embeddings" in changes:
            self.embeddings.control(changes.pop("embeddings"))
        unknown = set(changes) - _CONFIG_FIELDS - {"script"}
        if unknown:
            raise ValueError(f"unknown fake LLM settings {sorted(unknown)}")
        script = _validate_script(changes.pop("script")) if "script" in changes else []
        with self._lock:
            self._config = dataclasses.replace(self._config, **changes)
            if "seed" in changes:
                self._rng.seed(changes["seed"])
            self._script.extend(script)

    def reset(self) -> None:
        """Zero the stats and drop queued script items; the config is kept."""
        with self._lock:
            self._script.clear()
            self._clear_stats()
        self.embeddings.reset()

    def close(self) -> None:
        """Answer 503 to hanging and sleeping requests now and to any later ones, so a server
        shutdown does not wait for them."""
        with self._lock:
            self._closing_requested = True
            loop, event = self._loop, self._closing
        if loop is not None and event is not None:
            # The loop may already be gone when the server stopped on its own.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(event.set)

    def _closing_event(self) -> asyncio.Event:
        with self._lock:
            if self._closing is None:
                self._loop = asyncio.get_running_loop()
                self._closing = asyncio.Event()
                if self._closing_requested:
                    self._closing.set()
            return self._closing

    def config(self) -> FakeLLMConfig:
        with self._lock:
            return dataclasses.replace(self._config)

    # --- request accounting -----------------------------------------------------------------

    def _begin(
        self, body: bytes, parsed: _Parsed, authorization: str | None, arrived: float
    ) -> tuple[_Call, _Plan]:
        with self._lock:
            config = self._config
            scope_key = None
            if parsed.bank is not None and parsed.scope is not None:
                scope_key = (parsed.bank, parsed.scope)
            record: dict[str, Any] = {
                "bank": parsed.bank,
                "scope": parsed.scope or (),
                "fact_texts": parsed.fact_texts,
                "observation_texts": _observation_texts(parsed.user),
                "status": None,
                "started": arrived,
                "ended": None,
                "response_format": parsed.response_format,
                "schema": parsed.schema,
                "max_tokens": parsed.max_tokens,
                "token_field": parsed.token_field,
                "roles": [role for role, _ in parsed.messages],
                "instructed": parsed.instructed_user,
                "turns": list(parsed.turns),
            }
            self._tally.begin(record)
            self._in_flight += 1
            self._max_in_flight = max(self._max_in_flight, self._in_flight)
            if scope_key is not None:
                self._in_flight_by_scope[scope_key] += 1
                self._max_in_flight_per_scope = max(
                    self._max_in_flight_per_scope, self._in_flight_by_scope[scope_key]
                )
                self._max_distinct_scopes = max(
                    self._max_distinct_scopes, len(self._in_flight_by_scope)
                )
            call = _Call(record, scope_key)
            refusal = _rejection(config.api_key, authorization, parsed.problem) or _refusal(
                config.dialect, parsed
            )
            if refusal is not None:
                return call, refusal
            delay_s = service_delay_s(config, self._rng)
            poison = config.fail_when_contains
            if poison is not None and poison.encode() in body:
                return call, _Plan(delay_s=delay_s, status=config.fail_when_status)
            answer = _Plan(delay_s=delay_s, config=config)
            return call, _next_plan(self._script, answer, config, self._rng)

    def _finish(self, call: _Call, status: int | None) -> None:
        """Record the end of a call; ``status`` None means the client went away first."""
        with self._lock:
            self._tally.finish(call.record, status)
            self._in_flight -= 1
            if call.scope_key is not None:
                self._in_flight_by_scope[call.scope_key] -= 1
                if self._in_flight_by_scope[call.scope_key] <= 0:
                    del self._in_flight_by_scope[call.scope_key]

    # --- endpoints --------------------------------------------------------------------------

    async def _chat(self, request: Request, arrived: float | None = None) -> Response:
        """A chat completion; its latency runs from the request's arrival (``arrived``, else
        now), so that reading and parsing it are part of the service time, as a model's are."""
        arrived = time.monotonic() if arrived is None else arrived
        body = await request.body()
        parsed = _parse(body)
        call, plan = self._begin(body, parsed, request.headers.get("authorization"), arrived)
        return await _serve(
            request.receive,
            self._closing_event(),
            plan,
            lambda: _with_token_time(self._respond(parsed, plan), plan.config),
            lambda status: self._finish(call, status),
            call.record["started"],
        )

    def _respond(self, parsed: _Parsed, plan: _Plan) -> Response:
        if plan.status != 200 or plan.body is not None:
            return _status_response(plan)
        config = plan.config
        if config.envelope == "html":
            return Response(_HTML_PAGE, media_type="text/html")
        if config.envelope == "no-choices":
            body = {"object": "error", "message": "upstream model unavailable", "code": 200}
            return Response(orjson.dumps(body), media_type="application/json")
        if plan.content is not None:
            content, finish_reason = plan.content, plan.finish_reason
            completion_tokens = estimate_tokens(content)
        else:
            try:
                content, finish_reason, completion_tokens = _answer_content(parsed, config)
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                return _status_response(
                    _Plan(status=400, body=f"cannot consolidate this request: {exc!r}")
                )
        with self._lock:
            self._next_id += 1
            completion_id = f"chatcmpl-fake-{self._next_id}"
        # A template that drops the system message never shows it to the model.
        prompt_tokens = sum(
            estimate_tokens(text)
            for role, text in parsed.messages
            if not (role == "system" and config.drop_system)
        )
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if config.reasoning_content:
            message["reasoning_content"] = _REASONING
        payload = {
            "id": completion_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": parsed.model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }
        return Response(orjson.dumps(payload), media_type="application/json")

    async def _stats_endpoint(self, request: Request) -> Response:
        return Response(
            orjson.dumps(self.stats(), option=orjson.OPT_NON_STR_KEYS),
            media_type="application/json",
        )

    async def _control_endpoint(self, request: Request) -> Response:
        try:
            changes = orjson.loads(await request.body())
            if not isinstance(changes, dict):
                raise ValueError("body must be a JSON object of config fields and/or script")
            self.control(**changes)
        except (ValueError, TypeError) as exc:
            return Response(_error_body(str(exc), 400), 400)
        return Response(
            orjson.dumps({"config": dataclasses.asdict(self.config())}),
            media_type="application/json",
        )

    async def _reset_endpoint(self, request: Request) -> Response:
        self.reset()
        return Response(orjson.dumps({"reset": True}), media_type="application/json")


# --- embeddings ------------------------------------------------------------------------------

_EMBEDDINGS_PATHS = ("/embeddings", "/v1/embeddings")


@dataclass
class FakeEmbeddingsConfig:
    """Behaviour of ``POST /v1/embeddings``; changed at run time with
    ``control(embeddings={...})`` (also ``{"script": [...]}``: ``{status, retry_after?, body?}``,
    ``{hang: true}`` or ``{pass: true}`` items, consumed one per request)."""

    latency_ms: float = 0
    fail_rate: float = 0.0
    fail_status: int = 503
    retry_after_s: float | None = None
    dimensions: int = DEFAULT_DIMENSIONS


_EMBEDDINGS_FIELDS = frozenset(f.name for f in dataclasses.fields(FakeEmbeddingsConfig))


class _FakeEmbeddings:
    """The fake's OpenAI-compatible embeddings endpoint: vectors from
    :func:`consolidation.testing.fake_embeddings.embed_text` (paraphrases close, unrelated texts far),
    the request's ``dimensions`` honoured. Stats under ``stats()["embeddings"]``: ``requests``,
    ``inputs`` (texts answered), ``completed``, ``failed``, ``aborted``, ``statuses`` and
    ``calls`` (``inputs``, ``model``, ``dimensions``, ``status``, ``started``, ``ended``)."""

    def __init__(self, owner: _FakeLLM) -> None:
        self._owner = owner
        self._lock = threading.Lock()
        self._config = FakeEmbeddingsConfig()
        self._rng = random.Random(owner.config().seed)
        self._script: deque[dict[str, Any]] = deque()
        self._clear()

    def _clear(self) -> None:
        self._tally = _Tally()
        self._inputs = 0

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                **self._tally.counts(),
                "inputs": self._inputs,
                "calls": [{**c, "inputs": list(c["inputs"])} for c in self._tally.calls],
                "script_pending": len(self._script),
            }

    def control(self, changes: object) -> None:
        if not isinstance(changes, dict):
            raise ValueError("embeddings must be an object of embeddings settings and/or script")
        changes = dict(changes)
        unknown = set(changes) - _EMBEDDINGS_FIELDS - {"script"}
        if unknown:
            raise ValueError(f"unknown fake embeddings settings {sorted(unknown)}")
        script = _validate_script(changes.pop("script")) if "script" in changes else []
        if any("content" in item for item in script):
            raise ValueError("embeddings script items are {status…}, {hang} or {pass}")
        with self._lock:
            self._config = dataclasses.replace(self._config, **changes)
            self._script.extend(script)

    def reset(self) -> None:
        with self._lock:
            self._script.clear()
            self._clear()

    def _begin(
        self, inputs: list[str], model: str, dimensions: int, problem: str | None, auth: str | None
    ) -> tuple[dict[str, Any], _Plan]:
        api_key = self._owner.config().api_key
        with self._lock:
            config = self._config
            record: dict[str, Any] = {
                "inputs": tuple(inputs),
                "model": model,
                "dimensions": dimensions,
                "status": None,
                "started": time.monotonic(),
                "ended": None,
            }
            self._tally.begin(record)
            refusal = _rejection(api_key, auth, problem)
            if refusal is not None:
                return record, refusal
            answer = _Plan(delay_s=config.latency_ms / 1000.0)
            return record, _next_plan(self._script, answer, config, self._rng)

    def _finish(self, record: dict[str, Any], status: int | None) -> None:
        with self._lock:
            self._tally.finish(record, status)
            if status == 200:
                self._inputs += len(record["inputs"])

    @staticmethod
    def _parse(body: bytes, default_dimensions: int) -> tuple[list[str], str, int, str | None]:
        try:
            request = orjson.loads(body)
        except orjson.JSONDecodeError:
            request = None
        if not isinstance(request, dict):
            return [], "fake", default_dimensions, "request body is not a JSON object"
        model = request["model"] if isinstance(request.get("model"), str) else "fake"
        raw = request.get("input")
        inputs = [raw] if isinstance(raw, str) else raw
        if (
            not isinstance(inputs, list)
            or not inputs
            or not all(isinstance(t, str) for t in inputs)
        ):
            return [], model, default_dimensions, "input must be a string or a list of strings"
        dimensions = request.get("dimensions", default_dimensions)
        if isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1:
            return inputs, model, default_dimensions, "dimensions must be a positive integer"
        return inputs, model, dimensions, None

    async def endpoint(self, request: Request) -> Response:
        with self._lock:
            default_dimensions = self._config.dimensions
        inputs, model, dimensions, problem = self._parse(await request.body(), default_dimensions)
        record, plan = self._begin(
            inputs, model, dimensions, problem, request.headers.get("authorization")
        )
        return await _serve(
            request.receive,
            self._owner._closing_event(),
            plan,
            lambda: (_embeddings_response(plan, inputs, model, dimensions), 0.0),
            lambda status: self._finish(record, status),
            record["started"],
        )


def _embeddings_response(plan: _Plan, inputs: list[str], model: str, dimensions: int) -> Response:
    if plan.status != 200 or plan.body is not None:
        return _status_response(plan)
    return Response(
        orjson.dumps(_embeddings_payload(inputs, model, dimensions)), media_type="application/json"
    )


def _embeddings_payload(inputs: list[str], model: str, dimensions: int) -> dict[str, Any]:
    tokens = sum(estimate_tokens(text) for text in inputs)
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": embed_text(text, dimensions)}
            for i, text in enumerate(inputs)
        ],
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def create_app(config: FakeLLMConfig) -> ASGIApp:
    """A new, independent fake as an ASGI app (its state lives with the app)."""
    return _FakeLLM(config).app


class _Server(uvicorn.Server):
    """uvicorn server that answers hanging requests before waiting for them, so stopping the
    fake (Ctrl-C, ``FakeLLMServer.stop``) is prompt and clean."""

    def __init__(self, fake: _FakeLLM, **options: Any) -> None:
        # interface: a bound method is not recognised as ASGI 3 by uvicorn's sniffing.
        config = uvicorn.Config(
            fake.app, interface="asgi3", log_config=None, access_log=False, **options
        )
        super().__init__(config)
        self._fake = fake

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._fake.close()
        await super().shutdown(sockets)


def serve(host: str, port: int, config: FakeLLMConfig) -> None:
    """Serve the fake on ``host:port`` until interrupted (blocking; ``port`` 0 picks one)."""
    sock = listen_socket(host, port)
    # log_config=None: the CLI has configured logging already.
    server = _Server(_FakeLLM(config), lifespan="off", timeout_graceful_shutdown=2)
    log.info(
        "fake_llm_listening",
        url=socket_url(sock) + "/v1",
        **{k: v for k, v in dataclasses.asdict(config).items() if k != "api_key"},
        auth=config.api_key is not None,
    )
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()


class FakeLLMServer:
    """Runs the fake under uvicorn in a background thread on 127.0.0.1 and a free port.

    ``stats``, ``control`` and ``reset`` act on the fake directly (no HTTP round trip).
    """

    def __init__(self, config: FakeLLMConfig | None = None) -> None:
        self._fake = _FakeLLM(config or FakeLLMConfig())
        self._socket = listen_socket("127.0.0.1", 0)
        self.url: str = socket_url(self._socket) + "/v1"
        # log_config=None: a test helper must not reconfigure the process's logging.
        self._server = _Server(self._fake, lifespan="off", timeout_graceful_shutdown=1)
        self._thread: threading.Thread | None = None

    def start(self, timeout_s: float = 10.0) -> FakeLLMServer:
        """Start serving; returns once the server accepts connections."""
        if self._thread is not None:
            raise RuntimeError("FakeLLMServer already started")
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [self._socket]},
            name="fake-llm",
            daemon=True,
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("fake LLM server thread died while starting")
            if time.monotonic() > deadline:
                raise RuntimeError(f"fake LLM server did not start within {timeout_s}s")
            time.sleep(0.005)
        return self

    def stop(self) -> None:
        """Stop serving and join the thread; hanging and sleeping requests get a 503."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._server.should_exit = True
            thread.join(timeout=10)
            if thread.is_alive():
                self._server.force_exit = True
                thread.join(timeout=10)
        self._socket.close()

    def __enter__(self) -> FakeLLMServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def stats(self) -> dict[str, Any]:
        """A copy of the counters and recorded calls (keys in the module docstring)."""
        return self._fake.stats()

    def control(self, **changes: Any) -> None:
        """Change config fields and/or queue ``script`` overrides."""
        self._fake.control(**changes)

    def reset(self) -> None:
        """Zero the stats and drop queued script items."""
        self._fake.reset()
