"""consolidation.client's retry policy and error mapping, over scripted HTTP answers (no service:
tests/acceptance/test_client.py drives a real one)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime

import httpx
import pytest

from consolidation.client import (
    APIError,
    AsyncClient,
    BadRequest,
    Client,
    NotFound,
    RateLimited,
    Retries,
    ServerError,
    Unavailable,
    error_from,
    retry_after,
)

STATS = {"pending": 1, "consolidated": 2, "failed": 0, "observations": 1, "oldest_pending_age_s": 3}


def _error(status: int, code: str, headers: dict[str, str] | None = None) -> httpx.Response:
    body = {"error": {"code": code, "message": f"{code} happened"}}
    return httpx.Response(status, json=body, headers=headers)


class Script:
    """Answers requests with the given responses in order, recording each request."""

    def __init__(self, *responses: httpx.Response) -> None:
        self._responses: Iterator[httpx.Response] = iter(responses)
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return next(self._responses)


def test_retry_after_reads_seconds_and_http_dates() -> None:
    now = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert retry_after("7", now) == 7.0
    assert retry_after(" 0 ", now) == 0.0
    assert retry_after("Fri, 02 Jan 2026 03:04:15 GMT", now) == 10.0
    assert retry_after("Fri, 02 Jan 2026 03:00:00 GMT", now) == 0.0  # in the past: now
    assert retry_after(None, now) is None
    assert retry_after("soon", now) is None
    assert retry_after("-1", now) is None


def test_only_503_and_429_are_retried_within_the_bounds() -> None:
    retries = Retries(max_retries=2, backoff_s=0.5, max_wait_s=10)
    assert retries.delay(_error(503, "x", {"Retry-After": "3"}), 0) == 3.0
    assert retries.delay(_error(429, "x"), 0) == 0.5  # no Retry-After: exponential backoff
    assert retries.delay(_error(429, "x"), 1) == 1.0
    assert retries.delay(_error(503, "x"), 2) is None  # max_retries spent
    assert retries.delay(_error(503, "x", {"Retry-After": "11"}), 0) is None  # too long a wait
    for status in (200, 400, 404, 500, 502):
        assert retries.delay(_error(status, "x"), 0) is None, status


def test_a_503_is_retried_after_retry_after_and_the_answer_returned() -> None:
    script = Script(
        _error(503, "database_unavailable", {"Retry-After": "0"}),
        _error(429, "slow_down", {"Retry-After": "0"}),
        httpx.Response(200, json=STATS),
    )
    with Client("http://svc", api_key="k", transport=httpx.MockTransport(script)) as client:
        assert client.stats("a b/c").consolidated == 2
    assert len(script.requests) == 3
    assert {r.url.raw_path for r in script.requests} == {b"/v1/banks/a%20b%2Fc/stats"}
    assert all(r.headers["authorization"] == "Bearer k" for r in script.requests)


def test_when_retries_run_out_the_last_answer_is_raised_with_its_code() -> None:
    script = Script(*[_error(503, "database_unavailable", {"Retry-After": "0"})] * 3)
    retries = Retries(max_retries=2)
    transport = httpx.MockTransport(script)
    with (
        Client("http://svc", transport=transport, retries=retries) as client,
        pytest.raises(Unavailable) as raised,
    ):
        client.stats("b")
    assert len(script.requests) == 3
    assert (raised.value.status, raised.value.code) == (503, "database_unavailable")
    assert raised.value.message == "database_unavailable happened"
    assert isinstance(raised.value, ServerError)


async def test_a_429_asking_for_a_longer_wait_than_allowed_is_raised_at_once() -> None:
    script = Script(_error(429, "rate_limited", {"Retry-After": "3600"}))
    transport = httpx.MockTransport(script)
    async with AsyncClient("http://svc", transport=transport) as client:
        with pytest.raises(RateLimited) as raised:
            await client.stats("b")
    assert len(script.requests) == 1 and raised.value.code == "rate_limited"


def test_error_answers_map_to_typed_exceptions_even_without_the_error_shape() -> None:
    assert isinstance(error_from(_error(404, "bank_not_found")), NotFound)
    assert isinstance(error_from(_error(400, "invalid_cursor")), BadRequest)
    teapot = error_from(_error(418, "teapot"))
    assert type(teapot) is APIError and teapot.code == "teapot"
    proxy = error_from(httpx.Response(502, text="<html>Bad Gateway</html>"))
    assert isinstance(proxy, ServerError) and proxy.status == 502
    assert proxy.code == "http_error" and "Bad Gateway" in proxy.message
    assert str(proxy).startswith("502 http_error: ")


def test_a_bank_deletion_dry_run_reads_the_counts_of_the_400() -> None:
    counts = {
        "memories": 3,
        "observations": 1,
        "observation_sources": 3,
        "observation_history": 0,
        "consolidation_outcomes": 3,
        "operations": 1,
        "operations_cancelled": 0,
    }
    body = {"error": {"code": "confirmation_required", "message": "confirm", "counts": counts}}
    script = Script(httpx.Response(400, json=body))
    with Client("http://svc", transport=httpx.MockTransport(script)) as client:
        assert client.delete_bank_dry_run("b").memories == 3
    assert script.requests[0].method == "DELETE" and not script.requests[0].url.query
