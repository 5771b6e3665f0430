"""A fake OpenAI-compatible server answering with the offline policy (DESIGN §3).

Used by tests, benchmarks and operators' load tests (``consolidation fake-llm``). It answers
``POST /chat/completions`` and ``POST /v1/chat/completions`` with ``offline.consolidate`` of the
user message, and can inject latency, failures, poisoned answers and scripted responses. It
records what it saw (``GET /_stats``) so tests can assert on concurrency and timing.

Poison markers in a fact's text spoil the answer of the whole request containing that fact:
``[[poison]]`` cites the unknown ref ``f9999``, ``[[badjson]]`` answers ``this is not json``,
``[[truncate]]`` cuts the answer in half with ``finish_reason: "length"``, ``[[empty]]`` answers
an empty content. ``[[answer]]`` plays a model that obeys instructions injected into a memory: the
assistant content is the rest of the first fact text containing the marker, sent verbatim.

Stats (``stats()`` or ``GET /_stats``): ``requests``, ``completed`` (200 sent), ``failed`` (other
status sent), ``aborted`` (client left first), ``in_flight``, ``max_in_flight``,
``max_in_flight_per_scope`` (same (bank, scope) at once), ``max_distinct_scopes_in_flight``,
``statuses`` and ``calls`` (arrival order, the last ``MAX_RECORDED_CALLS``): ``bank``, ``scope``,
``fact_texts``, ``status`` (None while in flight or when aborted), ``started``/``ended``
(``time.monotonic()`` of this process) and ``response_format`` (the requested type).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import socket
import threading
import time
from collections import Counter, deque
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

from consolidation import offline
from consolidation.service import listen_socket

__all__ = ["FakeLLMConfig", "FakeLLMServer", "create_app", "serve"]

log = structlog.get_logger(__name__)

# Long load tests must not grow memory without bound; the oldest calls are dropped first.
MAX_RECORDED_CALLS = 10_000

POISON_MARKER = "[[poison]]"
BADJSON_MARKER = "[[badjson]]"
TRUNCATE_MARKER = "[[truncate]]"
EMPTY_MARKER = "[[empty]]"
ANSWER_MARKER = "[[answer]]"

_CHAT_PATHS = ("/chat/completions", "/v1/chat/completions")

_SCRIPT_KEYS = (
    frozenset({"status", "retry_after", "body"}),
    frozenset({"content", "finish_reason"}),
    frozenset({"hang"}),
    frozenset({"pass"}),
)


@dataclass
class FakeLLMConfig:
    """Behaviour of the fake; every field can be changed at run time with ``control``."""

    latency_ms: float = 0
    jitter_ms: float = 0
    fail_rate: float = 0.0
    fail_status: int = 503
    retry_after_s: float | None = None
    pad_bytes: int = 0
    api_key: str | None = None
    seed: int | None = None


_CONFIG_FIELDS = frozenset(field.name for field in dataclasses.fields(FakeLLMConfig))


@dataclass(frozen=True)
class _Parsed:
    """What the fake understood of one chat-completion request."""

    model: str
    user: dict[str, Any] | None
    bank: str | None
    scope: tuple[str, ...] | None
    fact_texts: tuple[str, ...]
    prompt_chars: int
    response_format: str | None
    problem: str | None


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
    pad_bytes: int = 0


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


def _parse(body: bytes) -> _Parsed:
    """Read the request leniently; ``problem`` says why it cannot be answered (→ 400)."""
    model = "fake"
    problem: str | None = None
    user: dict[str, Any] | None = None
    prompt_chars = 0
    response_format: str | None = None
    try:
        request = orjson.loads(body)
    except orjson.JSONDecodeError:
        request = None
    if not isinstance(request, dict):
        return _Parsed(model, None, None, None, (), 0, None, "request body is not a JSON object")
    if isinstance(request.get("model"), str):
        model = request["model"]
    fmt = request.get("response_format")
    if isinstance(fmt, dict) and isinstance(fmt.get("type"), str):
        response_format = fmt["type"]
    messages = request.get("messages")
    user_content: str | None = None
    if isinstance(messages, list):
        for message in messages:
            if isinstance(message, dict) and isinstance(message.get("content"), str):
                prompt_chars += len(message["content"])
                if message.get("role") == "user":
                    user_content = message["content"]
    if user_content is None:
        problem = "messages must contain a user message with string content"
    else:
        try:
            loaded = orjson.loads(user_content)
        except orjson.JSONDecodeError:
            loaded = None
        if isinstance(loaded, dict):
            user = loaded
        else:
            problem = "the user message content is not the JSON object of DESIGN §3"
    if user is None:
        return _Parsed(model, None, None, None, (), prompt_chars, response_format, problem)
    bank = user.get("bank")
    scope = user.get("scope")
    facts = user.get("facts")
    return _Parsed(
        model=model,
        user=user,
        bank=bank if isinstance(bank, str) else None,
        scope=tuple(str(t) for t in scope) if isinstance(scope, list) else (),
        fact_texts=tuple(
            fact["text"]
            for fact in (facts if isinstance(facts, list) else [])
            if isinstance(fact, dict) and isinstance(fact.get("text"), str)
        ),
        prompt_chars=prompt_chars,
        response_format=response_format,
        problem=None,
    )


def _answer_content(parsed: _Parsed, pad_bytes: int) -> tuple[str, str]:
    """The assistant content and finish_reason for a request, poison markers applied."""
    texts = "\n".join(parsed.fact_texts)
    for text in parsed.fact_texts:
        if ANSWER_MARKER in text:
            return text.split(ANSWER_MARKER, 1)[1], "stop"
    if BADJSON_MARKER in texts:
        return "this is not json", "stop"
    if EMPTY_MARKER in texts:
        return "", "stop"
    if POISON_MARKER in texts:
        answer: dict[str, Any] = {
            "creates": [
                {"text": "An observation citing a fact that does not exist.", "facts": ["f9999"]}
            ],
            "updates": [],
            "merges": [],
        }
    else:
        assert parsed.user is not None
        answer = offline.consolidate(parsed.user)
    content = orjson.dumps(answer).decode()
    if pad_bytes > 0:
        # Whitespace before the closing brace keeps the answer valid JSON of the wanted size.
        content = content[:-1] + " " * pad_bytes + "}"
    if TRUNCATE_MARKER in texts:
        return content[: len(content) // 2], "length"
    return content, "stop"


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


async def _wait(receive: Receive, delay_s: float | None, closing: asyncio.Event) -> str:
    """Wait ``delay_s`` (None: forever). Returns ``"disconnect"`` if the client leaves first,
    ``"closing"`` if the server is stopping first, else ``"elapsed"``."""
    disconnect = asyncio.ensure_future(_wait_for_disconnect(receive))
    stopping = asyncio.ensure_future(closing.wait())
    try:
        done, _ = await asyncio.wait(
            {disconnect, stopping}, timeout=delay_s, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        pending = [task for task in (disconnect, stopping) if not task.done()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
    if disconnect in done:
        return "disconnect"
    return "closing" if stopping in done else "elapsed"


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
        self._routes = Starlette(
            routes=[
                *(Route(path, self._chat, methods=["POST"]) for path in _CHAT_PATHS),
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
            response = await self._chat(Request(scope, receive))
            await response(scope, receive, send)
            return
        await self._routes(scope, receive, send)

    def _clear_stats(self) -> None:
        self._requests = 0
        self._completed = 0
        self._failed = 0
        self._aborted = 0
        self._in_flight = 0
        self._max_in_flight = 0
        self._in_flight_by_scope: Counter[tuple[str, tuple[str, ...]]] = Counter()
        self._max_in_flight_per_scope = 0
        self._max_distinct_scopes = 0
        self._calls: deque[dict[str, Any]] = deque(maxlen=MAX_RECORDED_CALLS)
        self._statuses: Counter[int] = Counter()
        self._next_id = 0

    # --- direct (thread-safe) control -------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """A consistent copy of the counters and recorded calls."""
        with self._lock:
            return {
                "requests": self._requests,
                "completed": self._completed,
                "failed": self._failed,
                "aborted": self._aborted,
                "in_flight": self._in_flight,
                "max_in_flight": self._max_in_flight,
                "max_in_flight_per_scope": self._max_in_flight_per_scope,
                "max_distinct_scopes_in_flight": self._max_distinct_scopes,
                "calls": [
                    {**call, "scope": list(call["scope"]), "fact_texts": list(call["fact_texts"])}
                    for call in self._calls
                ],
                "statuses": dict(self._statuses),
                "script_pending": len(self._script),
            }

    def control(self, **changes: Any) -> None:
        """Change config fields and/or queue ``script`` items (appended, consumed FIFO)."""
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

    def _begin(self, parsed: _Parsed, authorization: str | None) -> tuple[_Call, _Plan]:
        with self._lock:
            config = self._config
            scope_key = None
            if parsed.bank is not None and parsed.scope is not None:
                scope_key = (parsed.bank, parsed.scope)
            record: dict[str, Any] = {
                "bank": parsed.bank,
                "scope": parsed.scope or (),
                "fact_texts": parsed.fact_texts,
                "status": None,
                "started": time.monotonic(),
                "ended": None,
                "response_format": parsed.response_format,
            }
            self._calls.append(record)
            self._requests += 1
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
            if config.api_key is not None and authorization != f"Bearer {config.api_key}":
                return call, _Plan(status=401, body="missing or wrong bearer token")
            if parsed.problem is not None:
                return call, _Plan(status=400, body=parsed.problem)
            delay_s = max(
                0.0,
                (config.latency_ms + self._rng.uniform(-config.jitter_ms, config.jitter_ms))
                / 1000.0,
            )
            item = self._script.popleft() if self._script else None
            # {"pass": true} answers normally: scripts can say "two good answers, then hang".
            if item is not None and not item.get("pass"):
                if item.get("hang"):
                    return call, _Plan(hang=True)
                if "status" in item:
                    return call, _Plan(
                        delay_s=delay_s,
                        status=item["status"],
                        retry_after=item.get("retry_after"),
                        body=item.get("body"),
                    )
                return call, _Plan(
                    delay_s=delay_s,
                    content=item["content"],
                    finish_reason=item.get("finish_reason", "stop"),
                )
            if config.fail_rate > 0 and self._rng.random() < config.fail_rate:
                return call, _Plan(
                    delay_s=delay_s, status=config.fail_status, retry_after=config.retry_after_s
                )
            return call, _Plan(delay_s=delay_s, pad_bytes=config.pad_bytes)

    def _finish(self, call: _Call, status: int | None) -> None:
        """Record the end of a call; ``status`` None means the client went away first."""
        with self._lock:
            call.record["status"] = status
            call.record["ended"] = time.monotonic()
            self._in_flight -= 1
            if call.scope_key is not None:
                self._in_flight_by_scope[call.scope_key] -= 1
                if self._in_flight_by_scope[call.scope_key] <= 0:
                    del self._in_flight_by_scope[call.scope_key]
            if status is None:
                self._aborted += 1
                return
            self._statuses[status] += 1
            if status == 200:
                self._completed += 1
            else:
                self._failed += 1

    # --- endpoints --------------------------------------------------------------------------

    async def _chat(self, request: Request) -> Response:
        parsed = _parse(await request.body())
        call, plan = self._begin(parsed, request.headers.get("authorization"))
        status: int | None = None
        try:
            waited = "elapsed"
            if plan.hang or plan.delay_s > 0:
                delay_s = None if plan.hang else plan.delay_s
                waited = await _wait(request.receive, delay_s, self._closing_event())
            if waited == "disconnect":
                # Nobody is listening any more; this response is never delivered.
                return Response(status_code=499)
            if waited == "closing":
                response = self._status_response(
                    _Plan(status=503, body="the fake LLM server is shutting down")
                )
            else:
                response = self._respond(parsed, plan)
            status = response.status_code
            return response
        finally:
            # Recorded before the response is sent, so "ended" never postdates what the client saw.
            self._finish(call, status)

    def _respond(self, parsed: _Parsed, plan: _Plan) -> Response:
        if plan.status != 200 or plan.body is not None:
            return self._status_response(plan)
        if plan.content is not None:
            content, finish_reason = plan.content, plan.finish_reason
        else:
            try:
                content, finish_reason = _answer_content(parsed, plan.pad_bytes)
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                return self._status_response(
                    _Plan(status=400, body=f"cannot consolidate this request: {exc!r}")
                )
        with self._lock:
            self._next_id += 1
            completion_id = f"chatcmpl-fake-{self._next_id}"
        payload = {
            "id": completion_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": parsed.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": finish_reason,
                }
            ],
            "usage": {
                "prompt_tokens": (parsed.prompt_chars + 3) // 4,
                "completion_tokens": (len(content) + 3) // 4,
                "total_tokens": (parsed.prompt_chars + 3) // 4 + (len(content) + 3) // 4,
            },
        }
        return Response(orjson.dumps(payload), media_type="application/json")

    @staticmethod
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


def create_app(config: FakeLLMConfig) -> ASGIApp:
    """A new, independent fake as an ASGI app (its state lives with the app)."""
    return _FakeLLM(config).app


def _base_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/v1"


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
        url=_base_url(sock),
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
        self.url: str = _base_url(self._socket)
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
