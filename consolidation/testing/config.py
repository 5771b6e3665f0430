"""What the fake is told to do, and how each request's answer is planned from it.

``FakeLLMConfig`` with its dialects and envelopes, the ``script`` items tests queue, the plan of
one request (``_Plan``: a refusal, a scripted or random failure, a hang or the answer after its
delay, ``_next_plan``), and the modelled latency (``service_delay_s``, ``_with_token_time``).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

import orjson
from starlette.responses import Response

DIALECTS = ("openai", "llama-cpp-python", "no-schema", "json-object-only", "openai-reasoning")
ENVELOPES = ("completion", "html", "no-choices")


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
    # Keep each call's messages (role, content) in its record: what a token study of the
    # requests reads. Off by default, since a load test's 10,000 records would hold them all.
    record_messages: bool = False

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


class _Failures(Protocol):
    """The random-failure settings shared by the chat and the embeddings configs."""

    @property
    def fail_rate(self) -> float: ...

    @property
    def fail_status(self) -> int: ...

    @property
    def retry_after_s(self) -> float | None: ...


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
    failures: _Failures,
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
