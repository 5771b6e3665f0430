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
(``time.monotonic()`` of this process), ``delay_s`` (the latency drawn for it, when it was
answered or refused after one), ``response_format`` (the requested type), ``schema``
(whether a schema came with it), ``max_tokens`` (None when absent), ``roles`` (of the messages,
in order), ``instructed`` (whether the first user message has instructions before the §3 object)
and ``turns`` (the contents of the messages after it: a repair's answer and note); with
``record_messages`` on, also ``messages`` (``[role, content]`` of every message, as received).

``POST /embeddings`` and ``POST /v1/embeddings`` answer deterministic vectors in which
paraphrases are close (:mod:`consolidation.testing.fake_embeddings`), with their own latency, failure
injection and script (``control(embeddings={...})``) and their own stats (``embeddings``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import random
import socket
import threading
import time
from collections import Counter, deque
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

from consolidation.llm.client import estimate_tokens
from consolidation.net import listen_socket, socket_url
from consolidation.testing.answers import (
    _HTML_PAGE,
    _REASONING,
    ANSWER_MARKER,
    BADJSON_MARKER,
    EMPTY_MARKER,
    POISON_MARKER,
    REPAIRABLE_MARKER,
    TRUNCATE_MARKER,
    _answer_content,
    _refusal,
)
from consolidation.testing.config import (
    _CONFIG_FIELDS,
    DIALECTS,
    ENVELOPES,
    FakeLLMConfig,
    _next_plan,
    _Plan,
    _rejection,
    _validate_script,
    service_delay_s,
)
from consolidation.testing.config import _with_token_time as _with_token_time
from consolidation.testing.embeddings import (
    _EMBEDDINGS_PATHS,
    FakeEmbeddingsConfig,
    _FakeEmbeddings,
)
from consolidation.testing.requests import _observation_texts, _parse, _Parsed
from consolidation.testing.serving import _error_body, _serve, _status_response
from consolidation.testing.stats import MAX_RECORDED_CALLS, _Call, _Tally

# The markers, dialects and latency model are re-exported: tests and tools import them from here.
__all__ = [
    "ANSWER_MARKER",
    "BADJSON_MARKER",
    "DIALECTS",
    "EMPTY_MARKER",
    "ENVELOPES",
    "MAX_RECORDED_CALLS",
    "POISON_MARKER",
    "REPAIRABLE_MARKER",
    "TRUNCATE_MARKER",
    "FakeEmbeddingsConfig",
    "FakeLLMConfig",
    "FakeLLMServer",
    "create_app",
    "serve",
    "service_delay_s",
]

log = structlog.get_logger(__name__)

_CHAT_PATHS = ("/chat/completions", "/v1/chat/completions")


class _FakeLLM:
    """The fake's state and ASGI app. Every state change happens under ``_lock`` because the
    server thread and a test thread both use it."""

    def __init__(self, config: FakeLLMConfig) -> None:
        self._lock = threading.Lock()
        self._config = dataclasses.replace(config)
        self._rng = random.Random(config.seed)
        # How often each request was asked: a seeded lognormal latency is drawn per request.
        self._asked: Counter[bytes] = Counter()
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
                self._asked.clear()
            self._script.extend(script)

    def reset(self) -> None:
        """Zero the stats and drop queued script items; the config is kept."""
        with self._lock:
            self._script.clear()
            self._asked.clear()
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
            if config.record_messages:
                record["messages"] = [list(message) for message in parsed.messages]
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
            delay_s = service_delay_s(config, self._latency_rng(config, parsed, body))
            record["delay_s"] = delay_s
            poison = config.fail_when_contains
            if poison is not None and poison.encode() in body:
                return call, _Plan(delay_s=delay_s, status=config.fail_when_status)
            answer = _Plan(delay_s=delay_s, config=config)
            return call, _next_plan(self._script, answer, config, self._rng)

    def _latency_rng(self, config: FakeLLMConfig, parsed: _Parsed, body: bytes) -> random.Random:
        """What a call's latency is drawn from. A seeded lognormal latency is drawn from the
        seed, what the request asks (its bank, scope, facts and repair turns: not the
        observations shown, whose order and wording vary with ids and timing) and how often that
        was asked before, not from the order of arrival: two runs of one bank that schedule
        their calls differently (or one that sends a hedge's copy) give each request the latency
        it had in the other, so they compare call for call. Under the lock."""
        if config.latency_median_ms <= 0 or config.seed is None:
            return self._rng
        if parsed.bank is not None and parsed.fact_texts:
            asked = orjson.dumps([parsed.bank, parsed.scope, parsed.fact_texts, parsed.turns])
        else:
            asked = body
        digest = hashlib.blake2b(asked, digest_size=16).digest()
        seen = self._asked[digest]
        self._asked[digest] = seen + 1
        return random.Random(f"{config.seed}:{digest.hex()}:{seen}")

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
