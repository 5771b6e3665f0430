"""The fake's ``POST /embeddings`` and ``POST /v1/embeddings``: deterministic vectors from
:mod:`consolidation.testing.fake_embeddings`, with their own latency, failures, script and stats."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

import orjson
from starlette.requests import Request
from starlette.responses import Response

from consolidation.llm.client import estimate_tokens
from consolidation.testing.config import (
    FakeLLMConfig,
    _next_plan,
    _Plan,
    _rejection,
    _validate_script,
)
from consolidation.testing.fake_embeddings import DEFAULT_DIMENSIONS, embed_text
from consolidation.testing.serving import _serve, _status_response
from consolidation.testing.stats import _Tally

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


class _Owner(Protocol):
    """The chat fake an embeddings endpoint belongs to: its API key, seed and shutdown."""

    def config(self) -> FakeLLMConfig: ...

    def _closing_event(self) -> asyncio.Event: ...


class _FakeEmbeddings:
    """The fake's OpenAI-compatible embeddings endpoint: vectors from
    :func:`consolidation.testing.fake_embeddings.embed_text` (paraphrases close, unrelated texts far),
    the request's ``dimensions`` honoured. Stats under ``stats()["embeddings"]``: ``requests``,
    ``inputs`` (texts answered), ``completed``, ``failed``, ``aborted``, ``statuses`` and
    ``calls`` (``inputs``, ``model``, ``dimensions``, ``status``, ``started``, ``ended``)."""

    def __init__(self, owner: _Owner) -> None:
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
