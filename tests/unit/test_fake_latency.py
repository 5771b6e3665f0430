"""The fake LLM's realistic latency: a seeded heavy tail with the configured median and p99,
time to the first token, and time per completion token."""

from __future__ import annotations

import dataclasses
import random
import statistics

import httpx
import orjson
import pytest
from starlette.responses import Response

from consolidation.testing.fake_llm import (
    FakeLLMConfig,
    FakeLLMServer,
    _with_token_time,
    service_delay_s,
)
from tests.unit.test_llm import SYSTEM, user_message


def draws(config: FakeLLMConfig, n: int = 20_000, seed: int = 7) -> list[float]:
    rng = random.Random(seed)
    return sorted(service_delay_s(config, rng) for _ in range(n))


def test_lognormal_latency_has_the_configured_median_and_p99() -> None:
    samples = draws(FakeLLMConfig(latency_median_ms=1000, latency_p99_ms=8000))
    median = statistics.median(samples)
    p99 = samples[int(0.99 * len(samples))]
    assert median == pytest.approx(1.0, rel=0.05)
    assert p99 == pytest.approx(8.0, rel=0.12)
    assert samples[-1] > p99 > median  # heavy-tailed, not clipped


def test_the_same_seed_draws_the_same_latencies() -> None:
    config = FakeLLMConfig(latency_median_ms=500, latency_p99_ms=4000)
    assert draws(config, 100, seed=3) == draws(config, 100, seed=3)
    assert draws(config, 100, seed=3) != draws(config, 100, seed=4)


def test_time_to_first_token_is_added_to_every_draw() -> None:
    base = draws(FakeLLMConfig(latency_ms=100, jitter_ms=20), 50)
    shifted = draws(FakeLLMConfig(latency_ms=100, jitter_ms=20, ttft_ms=250), 50)
    assert [b - a for a, b in zip(base, shifted, strict=True)] == pytest.approx([0.25] * 50)


def test_fixed_latency_keeps_its_uniform_jitter() -> None:
    samples = draws(FakeLLMConfig(latency_ms=100, jitter_ms=20), 1000)
    assert samples[0] >= 0.08 and samples[-1] <= 0.12


def completion(tokens: int, status: int = 200) -> Response:
    body = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": tokens}}
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def test_each_completion_token_adds_its_time() -> None:
    config = FakeLLMConfig(per_token_ms=20)
    response, extra_s = _with_token_time(completion(50), config)
    assert extra_s == pytest.approx(1.0)
    assert response.status_code == 200


def test_errors_and_a_zero_per_token_time_add_nothing() -> None:
    assert _with_token_time(completion(50, status=503), FakeLLMConfig(per_token_ms=20))[1] == 0
    assert _with_token_time(completion(50), FakeLLMConfig())[1] == 0


@pytest.mark.parametrize(
    "fields",
    [
        {"latency_median_ms": 1000, "latency_p99_ms": 500},
        {"ttft_ms": -1},
        {"per_token_ms": -1},
    ],
)
def test_impossible_latencies_are_refused(fields: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        FakeLLMConfig(**fields)  # type: ignore[arg-type]


def _delays(fake: FakeLLMServer, bodies: list[bytes]) -> dict[bytes, list[float]]:
    drawn: dict[bytes, list[float]] = {}
    for body in bodies:
        response = httpx.post(
            f"{fake.url}/chat/completions",
            content=body,
            headers={"content-type": "application/json"},
            timeout=30,
        )
        assert response.status_code == 200
        drawn.setdefault(body, []).append(fake.stats()["calls"][-1]["delay_s"])
    return drawn


def test_a_seeded_lognormal_latency_belongs_to_the_request_not_to_its_arrival() -> None:
    # Two runs that send the same requests in other orders (a schedule change, a hedge's copy)
    # give each request the latency it had in the other: they compare call for call.
    config = FakeLLMConfig(latency_median_ms=1, latency_p99_ms=5, seed=3)
    one, two = (
        orjson.dumps(
            {
                "model": "m",
                "messages": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": user_message(f"fact {i}")},
                ],
            }
        )
        for i in (1, 2)
    )
    with FakeLLMServer(config) as fake:
        forward = _delays(fake, [one, two, one])
    with FakeLLMServer(config) as fake:
        backward = _delays(fake, [two, one, one])
    assert forward == backward
    assert forward[one][0] != forward[one][1]  # the same request again draws anew
    with FakeLLMServer(dataclasses.replace(config, seed=4)) as fake:
        assert _delays(fake, [one, two]) != {b: d[:1] for b, d in forward.items()}
