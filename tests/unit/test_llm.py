"""The OpenAI-compatible client against the real fake server over loopback (no mocks)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any, Protocol, TypeVar
from uuid import uuid4

import orjson
import pytest
from aiohttp import web
from prometheus_client import REGISTRY
from structlog.testing import capture_logs

from consolidation.errors import InvalidLLMOutput, LLMConfigError, TransientLLMError
from consolidation.llm import prompts
from consolidation.llm.client import HTTPConsolidator, LLMRetriesExhausted, OfflineConsolidator
from consolidation.llm.transport import parse_retry_after, retry_delay
from consolidation.metrics import EventLoopLagMonitor
from consolidation.testing.fake_llm import FakeLLMConfig, FakeLLMServer
from tests.support.waiting import wait_for
from tests.unit.test_prompts import citations

SYSTEM = "You consolidate memories."


class _Closable(Protocol):
    async def aclose(self) -> None: ...


C = TypeVar("C", bound=_Closable)


def user_message(*facts: str, bank: str = "b1", scope: tuple[str, ...] = ("x",)) -> str:
    return orjson.dumps(
        {
            "bank": bank,
            "scope": list(scope),
            "mission": None,
            "facts": [
                {"ref": f"f{i}", "text": text, "tags": list(scope), "occurred_at": None}
                for i, text in enumerate(facts, start=1)
            ],
            "observations": [],
        }
    ).decode()


def chat(*facts: str, bank: str = "b1", scope: tuple[str, ...] = ("x",)) -> prompts.Chat:
    """The first request of a pass over ``facts`` (no observations), as the engine builds it."""
    request = prompts.build_request(
        bank, scope, None, [prompts.FactInput(uuid4(), text, scope, None) for text in facts], []
    )
    assert request.user_content == user_message(*facts, bank=bank, scope=scope)
    return dataclasses.replace(prompts.pass_chat(request), system=SYSTEM)


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture
def fake() -> Iterator[FakeLLMServer]:
    with FakeLLMServer(FakeLLMConfig(seed=1)) as server:
        yield server


@asynccontextmanager
async def closing_clients(
    client_class: Callable[..., C], model: str
) -> AsyncIterator[Callable[..., C]]:
    """Make ``client_class(base_url, **overrides)`` clients with quick retries; all are closed
    on exit."""
    clients: list[C] = []

    def make(base_url: str, **overrides: Any) -> C:
        options: dict[str, Any] = {
            "model": model,
            "timeout_s": 10.0,
            "max_retries": 3,
            "backoff_base_s": 0.001,
            "backoff_max_s": 0.01,
            **overrides,
        }
        client = client_class(base_url=base_url, **options)
        clients.append(client)
        return client

    try:
        yield make
    finally:
        for client in clients:
            await client.aclose()


@pytest.fixture
async def make_client() -> AsyncIterator[Callable[..., HTTPConsolidator]]:
    async with closing_clients(HTTPConsolidator, "test-model") as make:
        yield make


@pytest.fixture
def base_url(fake: FakeLLMServer, monkeypatch: pytest.MonkeyPatch) -> str:
    """The fake's base URL, reached directly (no proxy from the environment)."""
    _clear_proxy_env(monkeypatch)
    return fake.url


async def test_complete_returns_content_and_usage(
    fake: FakeLLMServer, base_url: str, make_client: Any
) -> None:
    client = make_client(base_url + "/")
    answer = await client.complete(chat("Alice lives in Paris."))
    body = orjson.loads(answer.content)
    assert body["creates"][0]["facts"] == ["f1"]
    assert answer.prompt_tokens > 0
    assert answer.completion_tokens > 0
    assert answer.finish_reason == "stop"
    assert answer.retries == 0
    call = fake.stats()["calls"][0]
    assert call["bank"] == "b1"
    assert call["scope"] == ["x"]
    assert call["response_format"] == "json_schema"


async def test_two_503s_then_success_counts_retries(
    fake: FakeLLMServer, base_url: str, make_client: Any
) -> None:
    fake.control(script=[{"status": 503}, {"status": 503}])
    retries_before = metric("consolidation_llm_requests_total", outcome="retry")
    ok_before = metric("consolidation_llm_requests_total", outcome="ok")
    answer = await make_client(base_url).complete(chat("a fact"))
    assert answer.retries == 2
    stats = fake.stats()
    assert stats["requests"] == 3
    assert stats["statuses"] == {503: 2, 200: 1}
    assert metric("consolidation_llm_requests_total", outcome="retry") == retries_before + 2
    assert metric("consolidation_llm_requests_total", outcome="ok") == ok_before + 1


async def test_exhausted_retries_raise_transient_error(
    fake: FakeLLMServer, make_client: Any
) -> None:
    fake.control(fail_rate=1.0, fail_status=502)
    with pytest.raises(TransientLLMError) as caught:
        await make_client(fake.url, max_retries=2).complete(chat("a fact"))
    assert isinstance(caught.value, LLMRetriesExhausted)
    assert caught.value.attempts == 3
    assert "502" in str(caught.value)
    assert fake.stats()["requests"] == 3


async def test_408_and_429_are_retried(fake: FakeLLMServer, make_client: Any) -> None:
    fake.control(script=[{"status": 408}, {"status": 429}])
    answer = await make_client(fake.url).complete(chat("a fact"))
    assert answer.retries == 2


async def test_retry_after_is_honoured(
    fake: FakeLLMServer, base_url: str, make_client: Any
) -> None:
    fake.control(script=[{"status": 503, "retry_after": 0.3}])
    honoured_before = metric("consolidation_llm_retry_after_honoured_total")
    # Backoff alone would wait at most 1 ms; only Retry-After explains the gap.
    client = make_client(base_url, backoff_max_s=0.1)
    answer = await client.complete(chat("a fact"))
    assert answer.retries == 1
    failed, retried = fake.stats()["calls"]
    assert failed["status"] == 503
    assert retried["started"] - failed["ended"] >= 0.3
    assert metric("consolidation_llm_retry_after_honoured_total") == honoured_before + 1


async def test_401_is_a_config_error_without_retry(make_client: Any) -> None:
    with FakeLLMServer(FakeLLMConfig(api_key="secret")) as fake:
        with pytest.raises(LLMConfigError) as caught:
            await make_client(fake.url).complete(chat("a fact"))
        message = str(caught.value)
        assert "401" in message
        assert f"{fake.url}/chat/completions" in message
        assert "CONSOLIDATION_LLM_API_KEY" in message
        assert fake.stats()["requests"] == 1


async def test_api_key_is_sent_as_bearer_token(make_client: Any) -> None:
    with FakeLLMServer(FakeLLMConfig(api_key="secret")) as fake:
        answer = await make_client(fake.url, api_key="secret").complete(chat("a"))
        assert answer.finish_reason == "stop"


def test_an_api_key_with_a_line_break_is_a_config_error_before_any_request() -> None:
    # Sent as is, it would end the authorization header and add one of its own.
    with pytest.raises(LLMConfigError, match="CONSOLIDATION_LLM_API_KEY contains a line break"):
        HTTPConsolidator(base_url="http://127.0.0.1:9/v1", model="m", api_key="k\r\nx-injected: 1")


@pytest.mark.parametrize("status", [403, 404])
async def test_403_and_404_are_config_errors(
    fake: FakeLLMServer, make_client: Any, status: int
) -> None:
    fake.control(script=[{"status": status}])
    with pytest.raises(LLMConfigError, match=str(status)):
        await make_client(fake.url).complete(chat("a fact"))
    assert fake.stats()["requests"] == 1


@pytest.mark.parametrize("status", [400, 422])
async def test_400_and_422_are_invalid_output_without_retry(
    fake: FakeLLMServer, make_client: Any, status: int
) -> None:
    fake.control(script=[{"status": status, "body": "prompt is too long"}])
    with pytest.raises(InvalidLLMOutput, match="prompt is too long"):
        await make_client(fake.url).complete(chat("a fact"))
    assert fake.stats()["requests"] == 1


async def test_finish_reason_length_is_invalid_output_carrying_the_cut_answer(
    fake: FakeLLMServer, make_client: Any
) -> None:
    fake.control(script=[{"content": '{"creates": [', "finish_reason": "length"}])
    with pytest.raises(InvalidLLMOutput, match="cut off by max_tokens=1280") as caught:
        await make_client(fake.url).complete(chat("a fact"))
    assert caught.value.truncated and caught.value.answer == '{"creates": ['
    # The tokens the cut answer cost are reported with it (PerfLog and metrics count them).
    assert caught.value.prompt_tokens > 0 and caught.value.completion_tokens > 0
    assert fake.stats()["requests"] == 1


@pytest.mark.parametrize(
    "script_item",
    [
        {"content": ""},
        {"content": "  \n"},
        {"status": 200, "body": '{"choices": [{"message": {"content": null}}]}'},
        {"status": 200, "body": '{"choices": [{"message": {"content": null, "refusal": "no"}}]}'},
    ],
)
async def test_an_empty_assistant_content_is_invalid_output(
    fake: FakeLLMServer, make_client: Any, script_item: dict[str, Any]
) -> None:
    fake.control(script=[script_item])
    with pytest.raises(InvalidLLMOutput, match="empty content"):
        await make_client(fake.url).complete(chat("a fact"))
    assert fake.stats()["requests"] == 1


@pytest.mark.parametrize(
    "script_item",
    [
        {"status": 200, "body": '{"object": "list"}'},
        {"status": 200, "body": '{"choices": []}'},
        {"status": 200, "body": '{"choices": [{"text": "legacy completion"}]}'},
        {"status": 200, "body": '{"error": {"message": "upstream timed out"}}'},
    ],
)
async def test_a_200_that_is_not_a_chat_completion_is_retried_as_an_endpoint_fault(
    fake: FakeLLMServer, make_client: Any, script_item: dict[str, Any]
) -> None:
    fake.control(script=[script_item])
    answer = await make_client(fake.url).complete(chat("a fact"))
    assert answer.retries == 1
    assert fake.stats()["statuses"] == {200: 2}


async def test_an_html_200_on_every_try_exhausts_the_retries(
    fake: FakeLLMServer, make_client: Any
) -> None:
    fake.control(envelope="html")
    with pytest.raises(LLMRetriesExhausted, match="not a chat completion") as caught:
        await make_client(fake.url, max_retries=2).complete(chat("a fact"))
    assert caught.value.attempts == 3
    assert "502 Bad Gateway" in str(caught.value)
    assert fake.stats()["requests"] == 3


async def test_missing_usage_counts_zero_tokens(fake: FakeLLMServer, make_client: Any) -> None:
    body = '{"choices": [{"message": {"content": "{}"}, "finish_reason": "stop"}]}'
    fake.control(script=[{"status": 200, "body": body}])
    answer = await make_client(fake.url).complete(chat("a fact"))
    assert (answer.content, answer.prompt_tokens, answer.completion_tokens) == ("{}", 0, 0)


async def test_poison_markers_reach_the_caller_as_unusable_answers(
    fake: FakeLLMServer, make_client: Any
) -> None:
    client = make_client(fake.url)
    for marker in ("[[truncate]]", "[[empty]]"):
        with pytest.raises(InvalidLLMOutput):
            await client.complete(chat("fine fact", f"bad {marker} fact"))
    # Content the client cannot judge is returned; prompts.parse_answer rejects it.
    badjson = await client.complete(chat("[[badjson]]"))
    assert badjson.content == "this is not json"
    poison = await client.complete(chat("[[poison]]"))
    assert "f9999" in orjson.loads(poison.content)["creates"][0]["facts"]


async def test_timeout_is_transient_and_aborts_the_request(
    fake: FakeLLMServer, base_url: str, make_client: Any
) -> None:
    fake.control(script=[{"hang": True}])
    client = make_client(base_url, timeout_s=0.2, max_retries=0)
    with pytest.raises(TransientLLMError, match="no answer within"):
        await client.complete(chat("a fact"))
    await wait_for(lambda: fake.stats()["aborted"] == 1)


async def test_connection_refused_is_transient(make_client: Any) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = make_client(f"http://127.0.0.1:{port}/v1", max_retries=1)
    with pytest.raises(LLMRetriesExhausted) as caught:
        await client.complete(chat("a fact"))
    assert caught.value.attempts == 2


async def test_cancelling_the_caller_aborts_the_http_request(
    fake: FakeLLMServer, base_url: str, make_client: Any
) -> None:
    fake.control(script=[{"hang": True}])
    task = asyncio.create_task(make_client(base_url).complete(chat("a fact")))
    await wait_for(lambda: fake.stats()["in_flight"] == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_for(lambda: fake.stats()["aborted"] == 1)
    assert fake.stats()["in_flight"] == 0


async def test_max_concurrent_caps_requests_in_flight(
    fake: FakeLLMServer, base_url: str, make_client: Any
) -> None:
    fake.control(latency_ms=50)
    client = make_client(base_url, max_concurrent=3)
    answers = await asyncio.gather(
        *(client.complete(chat(f"fact {i}", scope=(f"s{i}",))) for i in range(12))
    )
    assert len(answers) == 12
    stats = fake.stats()
    assert stats["completed"] == 12
    assert stats["max_in_flight"] == 3


def _clear_proxy_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("http_proxy", "https_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)


async def test_requests_go_through_the_proxy_the_environment_names(
    fake: FakeLLMServer, make_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _clear_proxy_env(monkeypatch)
    monkeypatch.setenv("HTTP_PROXY", fake.url.removesuffix("/v1"))
    # llm.invalid never resolves: only the proxy (the fake, taking the absolute-form request)
    # can answer.
    answer = await make_client("http://llm.invalid/v1").complete(chat("a fact"))
    assert orjson.loads(answer.content)["creates"]
    assert fake.stats()["completed"] == 1


async def test_no_proxy_exempts_the_llm_host(
    fake: FakeLLMServer, make_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _clear_proxy_env(monkeypatch)
    with socket.socket() as sock:  # a port nothing listens on: a proxied request would fail
        sock.bind(("127.0.0.1", 0))
        dead_proxy = f"http://127.0.0.1:{sock.getsockname()[1]}"
    monkeypatch.setenv("HTTP_PROXY", dead_proxy)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    await make_client(fake.url, max_retries=0).complete(chat("a fact"))
    assert fake.stats()["completed"] == 1
    monkeypatch.delenv("NO_PROXY")
    with pytest.raises(LLMRetriesExhausted):
        await make_client(fake.url, max_retries=0).complete(chat("a fact"))


def test_invalid_base_url_is_a_config_error() -> None:
    with pytest.raises(LLMConfigError, match="CONSOLIDATION_LLM_BASE_URL"):
        HTTPConsolidator(base_url="127.0.0.1:8000/v1", model="m")


async def test_offline_consolidator_returns_a_valid_answer() -> None:
    facts = [
        prompts.FactInput(uuid4(), "Alice lives in Paris.", ("x",), None),
        prompts.FactInput(uuid4(), "Bob plays chess on Sundays.", ("x",), None),
    ]
    request = prompts.build_request("b1", ("x",), None, facts, [])
    consolidator = OfflineConsolidator()
    answer = await consolidator.complete(prompts.pass_chat(request))
    await consolidator.aclose()
    plan = prompts.parse_answer(answer.content, request)
    assert set(citations(plan)) == {fact.memory_id for fact in facts}
    assert answer.finish_reason == "stop"
    assert answer.retries == 0
    assert answer.prompt_tokens > 0
    assert answer.completion_tokens > 0


@pytest.mark.parametrize(
    ("header", "expected"),
    [(None, None), ("", None), ("2", 2.0), (" 0.5 ", 0.5), ("-3", 0.0), ("soon", None)],
)
def test_parse_retry_after_seconds(header: str | None, expected: float | None) -> None:
    assert parse_retry_after(header) == expected


def test_parse_retry_after_http_date() -> None:
    now = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    header = format_datetime(now + timedelta(seconds=7), usegmt=True)
    assert parse_retry_after(header, now=now) == 7.0
    past = format_datetime(now - timedelta(seconds=7), usegmt=True)
    assert parse_retry_after(past, now=now) == 0.0


def test_retry_delay_uses_full_jitter_capped_exponential_backoff() -> None:
    # uniform=lambda a, b: b picks full jitter's upper end, uniform(0, x) -> x.
    assert retry_delay(0, None, base_s=0.5, max_s=30, uniform=lambda a, b: b) == (0.5, False)
    assert retry_delay(3, None, base_s=0.5, max_s=30, uniform=lambda a, b: b) == (4.0, False)
    assert retry_delay(10, None, base_s=0.5, max_s=30, uniform=lambda a, b: b) == (30.0, False)
    assert retry_delay(5000, None, base_s=0.5, max_s=30, uniform=lambda a, b: b)[0] == 30.0
    assert retry_delay(3, None, base_s=0.5, max_s=30, uniform=lambda a, b: a) == (0.0, False)


def test_retry_delay_honours_retry_after_up_to_five_times_the_cap() -> None:
    assert retry_delay(0, 45.0, base_s=0.5, max_s=30, uniform=lambda a, b: b) == (45.0, True)
    assert retry_delay(0, 1000.0, base_s=0.5, max_s=30, uniform=lambda a, b: b) == (150.0, True)
    # A shorter Retry-After than the drawn backoff leaves the backoff in charge.
    assert retry_delay(4, 1.0, base_s=0.5, max_s=30, uniform=lambda a, b: b) == (8.0, False)


async def test_lag_monitor_sees_a_blocked_event_loop() -> None:
    async with EventLoopLagMonitor(interval_s=0.01) as monitor:
        await wait_for(lambda: monitor.snapshot()["samples"] >= 1)
        samples = monitor.snapshot()["samples"]

        async def hog() -> None:
            time.sleep(0.3)  # noqa: ASYNC251 - blocking the loop is the point

        await hog()
        await wait_for(lambda: monitor.snapshot()["samples"] > samples)
        snapshot = monitor.snapshot()
    assert snapshot["max_ms"] >= 250
    assert snapshot["p50_ms"] <= snapshot["p99_ms"] <= snapshot["max_ms"]
    assert metric("consolidation_event_loop_lag_seconds", quantile="max") >= 0.25
    monitor.reset()
    assert monitor.snapshot()["samples"] == 0


async def test_lag_monitor_stops_its_task_on_exit() -> None:
    monitor = EventLoopLagMonitor(interval_s=0.01)
    async with monitor:
        pass
    tasks = {task.get_name() for task in asyncio.all_tasks()}
    assert "event-loop-lag-monitor" not in tasks


# --- response_format dialects -----------------------------------------------------------------


def _formats(fake: FakeLLMServer) -> list[tuple[str | None, bool, int | None]]:
    return [(c["response_format"], c["schema"], c["status"]) for c in fake.stats()["calls"]]


async def test_auto_sends_json_schema_with_the_pass_refs_pinned(make_client: Any) -> None:
    with FakeLLMServer() as fake:
        request = prompts.build_request(
            "b1",
            ("x",),
            None,
            [prompts.FactInput(uuid4(), "Alice lives in Paris.", ("x",), None)],
            [prompts.ObservationInput(uuid4(), "Alice lives in France.", 1, datetime.now(UTC))],
        )
        client = make_client(fake.url)
        await client.complete(prompts.pass_chat(request))
        assert _formats(fake) == [("json_schema", True, 200)]
        assert client.response_format_mode == "json_schema"


async def test_auto_falls_back_from_llama_cpp_pythons_500_to_json_object_with_a_schema(
    make_client: Any,
) -> None:
    with FakeLLMServer(FakeLLMConfig(dialect="llama-cpp-python")) as fake:
        transient_before = metric("consolidation_llm_requests_total", outcome="transient")
        client = make_client(fake.url, max_retries=0)
        with capture_logs() as logs:
            answer = await client.complete(chat("a fact"))
            await client.complete(chat("another fact"))
        # The 500 is a refusal, not an outage: no retry was spent on it (max_retries=0).
        assert answer.retries == 1
        assert _formats(fake) == [
            ("json_schema", True, 500),
            ("json_object", True, 200),
            ("json_object", True, 200),
        ]
        assert client.response_format_mode == "json_object+schema"
        assert metric("consolidation_llm_requests_total", outcome="transient") == transient_before
        assert not [e for e in logs if e["event"] == "llm_retry"]
        (chosen,) = [e for e in logs if e["event"] == "llm_response_format"]
        assert chosen["response_format"] == "json_object+schema"
        assert chosen["constrained_decoding"] is True
        assert chosen["refused"][0]["status"] == 500
        assert "literal_error" in chosen["refused"][0]["detail"]


async def test_auto_keeps_the_schema_for_a_server_that_ignores_it_in_json_object(
    make_client: Any,
) -> None:
    with FakeLLMServer(FakeLLMConfig(dialect="no-schema")) as fake:
        client = make_client(fake.url)
        await client.complete(chat("a fact"))
        assert _formats(fake) == [("json_schema", True, 400), ("json_object", True, 200)]


async def test_auto_ends_at_plain_json_object_and_warns_that_decoding_is_unconstrained(
    make_client: Any,
) -> None:
    with FakeLLMServer(FakeLLMConfig(dialect="json-object-only")) as fake:
        client = make_client(fake.url)
        with capture_logs() as logs:
            answer = await client.complete(chat("a fact"))
        assert answer.retries == 2
        assert _formats(fake) == [
            ("json_schema", True, 400),
            ("json_object", True, 400),
            ("json_object", False, 200),
        ]
        assert client.response_format_mode == "json_object"
        (chosen,) = [e for e in logs if e["event"] == "llm_response_format"]
        assert chosen["log_level"] == "warning" and chosen["constrained_decoding"] is False
        assert [r["response_format"] for r in chosen["refused"]] == [
            "json_schema",
            "json_object+schema",
        ]


async def test_auto_sends_the_first_calls_together_and_resends_each_refused_one_once(
    make_client: Any,
) -> None:
    with FakeLLMServer(FakeLLMConfig(dialect="llama-cpp-python", latency_ms=20)) as fake:
        client = make_client(fake.url, max_concurrent=8, max_retries=0)
        with capture_logs() as logs:
            answers = await asyncio.gather(
                *(client.complete(chat(f"fact {i}", scope=(f"s{i}",))) for i in range(12))
            )
        calls = fake.stats()["calls"]
        refused = [c for c in calls if c["status"] == 500]
        # Each pass is refused at most once: its resend, and every request built after the
        # first refusal, carries the next form.
        assert 1 <= len(refused) <= 12
        assert {c["response_format"] for c in refused} == {"json_schema"}
        assert [c["status"] for c in calls].count(200) == 12
        assert {c["response_format"] for c in calls if c["status"] == 200} == {"json_object"}
        assert all(a.retries <= 1 for a in answers)
        assert len([e for e in logs if e["event"] == "llm_response_format"]) == 1


async def test_auto_does_not_hold_the_first_calls_behind_one_answer(make_client: Any) -> None:
    # A latency long enough that eight requests leave before the first answer comes back.
    with FakeLLMServer(FakeLLMConfig(latency_ms=1000)) as fake:
        client = make_client(fake.url, max_concurrent=8)
        await asyncio.gather(
            *(client.complete(chat(f"fact {i}", scope=(f"s{i}",))) for i in range(8))
        )
        calls = fake.stats()["calls"]
        assert len(calls) == 8 and {c["status"] for c in calls} == {200}
        first_answer = min(c["ended"] for c in calls)
        assert all(c["started"] < first_answer for c in calls)
        assert client.response_format_mode == "json_schema"


async def test_passes_do_not_queue_behind_a_first_call_that_times_out(make_client: Any) -> None:
    with FakeLLMServer() as fake:
        fake.control(script=[{"hang": True}] * 4)
        client = make_client(fake.url, timeout_s=0.3, max_retries=0)
        results = await asyncio.gather(
            *(client.complete(chat(f"fact {i}", scope=(f"s{i}",))) for i in range(4)),
            return_exceptions=True,
        )
        assert all(isinstance(r, LLMRetriesExhausted) for r in results)
        # No call waits for another's verdict on the format (queued one by one, at most two
        # would overlap: one leaving, one arriving).
        assert fake.stats()["max_in_flight"] >= 3
        assert client.response_format_mode == "json_schema"


async def test_auto_gives_a_config_error_when_every_form_is_refused(
    fake: FakeLLMServer, make_client: Any
) -> None:
    refusal = {"status": 400, "body": "response_format is not supported by this server"}
    fake.control(script=[refusal] * 3)
    client = make_client(fake.url)
    with pytest.raises(LLMConfigError, match="refuses every response_format"):
        await client.complete(chat("a fact"))
    assert [f for f, _, _ in _formats(fake)] == ["json_schema", "json_object", "json_object"]


@pytest.mark.parametrize(("dialect", "status"), [("llama-cpp-python", 500), ("no-schema", 400)])
async def test_an_explicit_json_schema_refused_is_a_config_error_without_retry(
    make_client: Any, dialect: str, status: int
) -> None:
    with FakeLLMServer(FakeLLMConfig(dialect=dialect)) as fake:
        client = make_client(fake.url, response_format="json_schema")
        with pytest.raises(LLMConfigError, match="CONSOLIDATION_LLM_RESPONSE_FORMAT") as caught:
            await client.complete(chat("a fact"))
        assert f"HTTP {status}" in str(caught.value)
        assert fake.stats()["requests"] == 1


async def test_an_explicit_json_object_is_sent_without_a_schema(make_client: Any) -> None:
    with FakeLLMServer(FakeLLMConfig(dialect="json-object-only")) as fake:
        await make_client(fake.url, response_format="json_object").complete(chat("a fact"))
        assert _formats(fake) == [("json_object", False, 200)]


async def test_a_500_that_does_not_name_the_response_format_is_an_outage(
    fake: FakeLLMServer, make_client: Any
) -> None:
    fake.control(script=[{"status": 500, "body": "CUDA out of memory"}])
    client = make_client(fake.url)
    answer = await client.complete(chat("a fact"))
    assert answer.retries == 1
    assert client.response_format_mode == "json_schema"


# --- max_tokens, reasoning models, system role ------------------------------------------------


async def test_max_tokens_is_derived_from_the_pass_and_capped_by_the_setting(
    fake: FakeLLMServer, make_client: Any
) -> None:
    await make_client(fake.url).complete(chat("one"))
    await make_client(fake.url).complete(chat("one", "two", "three"))
    await make_client(fake.url, max_tokens=1500).complete(chat("one", "two", "three"))
    sent = [c["max_tokens"] for c in fake.stats()["calls"]]
    base, per_fact = prompts.MAX_TOKENS_BASE, prompts.MAX_TOKENS_PER_FACT
    assert sent == [base + per_fact, base + 3 * per_fact, 1500]


async def test_an_answer_cut_at_max_tokens_says_so_and_names_the_setting(
    fake: FakeLLMServer, make_client: Any
) -> None:
    client = make_client(fake.url, max_tokens=64)
    with pytest.raises(InvalidLLMOutput) as caught:
        await client.complete(chat("Alice " + "likes green tea very much, " * 20))
    message = str(caught.value)
    assert "cut off by max_tokens=64" in message
    assert "CONSOLIDATION_LLM_MAX_TOKENS=64" in message
    assert caught.value.truncated
    assert caught.value.answer is not None and len(caught.value.answer) == 64 * 4
    assert fake.stats()["calls"][0]["max_tokens"] == 64


async def test_a_think_block_before_the_answer_is_stripped(make_client: Any) -> None:
    with FakeLLMServer(FakeLLMConfig(think=True)) as fake:
        answer = await make_client(fake.url).complete(chat("Alice lives in Paris."))
    assert answer.content.startswith("{")
    assert orjson.loads(answer.content)["creates"][0]["facts"] == ["f1"]


async def test_reasoning_content_is_ignored(make_client: Any) -> None:
    with FakeLLMServer(FakeLLMConfig(reasoning_content=True)) as fake:
        answer = await make_client(fake.url).complete(chat("Alice lives in Paris."))
    assert orjson.loads(answer.content)["creates"][0]["facts"] == ["f1"]


@pytest.mark.parametrize(("system_role", "usable"), [("system", False), ("user", True)])
async def test_system_role_user_reaches_a_template_that_drops_the_system_message(
    make_client: Any, system_role: str, usable: bool
) -> None:
    with FakeLLMServer(FakeLLMConfig(drop_system=True)) as fake:
        client = make_client(fake.url, system_role=system_role)
        answer = await client.complete(chat("Alice lives in Paris."))
        (call,) = fake.stats()["calls"]
    assert call["roles"] == (["user"] if system_role == "user" else ["system", "user"])
    assert call["instructed"] is usable
    assert call["fact_texts"] == ["Alice lives in Paris."]
    # Without the instructions the model answers prose; with them in the user message, JSON.
    assert answer.content.startswith("{") is usable


@pytest.mark.parametrize(
    ("system_role", "roles"),
    [("system", ["system", "user", "assistant", "user"]), ("user", ["user", "assistant", "user"])],
)
async def test_a_repair_is_sent_as_an_assistant_turn_and_a_user_turn(
    fake: FakeLLMServer, make_client: Any, system_role: str, roles: list[str]
) -> None:
    first = chat("Alice lives in Paris.")
    error = InvalidLLMOutput("bad", answer='{"creates": []', problems=["not valid JSON"])
    await make_client(fake.url, system_role=system_role).complete(prompts.repair_chat(first, error))
    (call,) = fake.stats()["calls"]
    assert call["roles"] == roles
    assert call["turns"][0] == '{"creates": []'
    assert "not valid JSON" in call["turns"][1]
    assert call["fact_texts"] == ["Alice lives in Paris."]


# --- the time budget of one call --------------------------------------------------------------


async def test_a_hanging_endpoint_is_given_up_on_when_the_retry_budget_is_spent(
    fake: FakeLLMServer, make_client: Any
) -> None:
    fake.control(script=[{"hang": True}] * 100)
    client = make_client(fake.url, timeout_s=0.2, retry_budget_s=0.5, max_retries=50)
    with pytest.raises(LLMRetriesExhausted) as caught:
        await client.complete(chat("a fact"))
    message = str(caught.value)
    assert "retry budget of 0.5s spent" in message
    assert "CONSOLIDATION_LLM_RETRY_BUDGET_S" in message
    # The budget, not the 50 retries, ended it; every abandoned request was aborted.
    assert caught.value.attempts < 10
    await wait_for(lambda: fake.stats()["aborted"] == caught.value.attempts)


def test_a_retry_budget_shorter_than_the_timeout_is_rejected() -> None:
    with pytest.raises(ValueError, match="retry_budget_s"):
        HTTPConsolidator(
            base_url="http://127.0.0.1:1/v1", model="m", timeout_s=10, retry_budget_s=5
        )


# --- the body cap ------------------------------------------------------------------------------


async def test_an_answer_declared_over_the_body_cap_is_refused_as_transport_trouble(
    fake: FakeLLMServer, base_url: str, make_client: Any
) -> None:
    # The fake pads a valid answer to 200 kB (its Content-Length says so); the cap is 100 kB.
    fake.control(pad_bytes=200_000)
    client = make_client(base_url, max_retries=1, max_response_bytes=100_000)
    with pytest.raises(LLMRetriesExhausted, match="exceeds the cap of 100000 bytes") as caught:
        await client.complete(chat("a fact"))
    assert caught.value.attempts == 2  # retried like any transport fault, never "invalid"
    assert fake.stats()["requests"] == 2
    fake.control(pad_bytes=50_000)  # under the cap: read in full
    answer = await client.complete(chat("a fact"))
    assert len(answer.content) > 50_000


async def test_a_streamed_answer_is_not_read_past_the_body_cap(make_client: Any) -> None:
    # A peer that streams an endless body without a length: the client stops at the cap.
    sent: list[int] = []

    async def endless(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "application/json"})
        await response.prepare(request)
        with contextlib.suppress(ConnectionError):
            for _ in range(10_000):
                await response.write(b" " * 65_536)
                sent.append(65_536)
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", endless)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        client = make_client(
            f"http://127.0.0.1:{port}/v1", max_retries=0, max_response_bytes=300_000
        )
        with pytest.raises(LLMRetriesExhausted, match="answer body of more exceeds the cap"):
            await client.complete(chat("a fact"))
    finally:
        await runner.cleanup()
    assert sum(sent) < 10_000 * 65_536  # the connection was dropped, not read to the end
