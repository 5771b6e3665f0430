"""The fake OpenAI-compatible server, spoken to with plain httpx over loopback."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest

from consolidation.testing.fake_llm import FakeLLMConfig, FakeLLMServer, create_app
from tests.support.waiting import wait_for
from tests.unit.test_llm import SYSTEM, user_message


def chat_body(*facts: str, bank: str = "b1", scope: tuple[str, ...] = ("x",)) -> dict[str, Any]:
    return {
        "model": "fake-model",
        "temperature": 0,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": user_message(*facts, bank=bank, scope=scope)},
        ],
        "response_format": {"type": "json_object"},
    }


@pytest.fixture
def fake() -> Iterator[FakeLLMServer]:
    with FakeLLMServer(FakeLLMConfig(seed=7)) as server:
        yield server


@pytest.fixture
async def http(fake: FakeLLMServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=fake.url, timeout=10.0) as client:
        yield client


@pytest.mark.parametrize("path", ["/chat/completions", "/v1/chat/completions"])
async def test_answers_in_the_chat_completion_shape(fake: FakeLLMServer, path: str) -> None:
    root = fake.url.removesuffix("/v1")
    async with httpx.AsyncClient(base_url=root) as client:
        response = await client.post(path, json=chat_body("Alice lives in Paris."))
    assert response.status_code == 200
    body = response.json()
    assert body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    assert body["model"] == "fake-model"
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["role"] == "assistant"
    answer = orjson.loads(choice["message"]["content"])
    assert answer["creates"][0]["facts"] == ["f1"]
    assert body["usage"]["prompt_tokens"] > 0
    assert body["usage"]["completion_tokens"] > 0


async def test_records_each_call(fake: FakeLLMServer, http: httpx.AsyncClient) -> None:
    await http.post("/chat/completions", json=chat_body("one", "two", bank="b2", scope=("a", "b")))
    stats = fake.stats()
    assert (stats["requests"], stats["completed"], stats["failed"], stats["aborted"]) == (
        1,
        1,
        0,
        0,
    )
    assert stats["in_flight"] == 0
    assert stats["statuses"] == {200: 1}
    (call,) = stats["calls"]
    assert call["bank"] == "b2"
    assert call["scope"] == ["a", "b"]
    assert call["fact_texts"] == ["one", "two"]
    assert call["status"] == 200
    assert call["started"] <= call["ended"]
    assert call["response_format"] == "json_object"
    assert "messages" not in call


async def test_records_the_messages_when_told_to(
    fake: FakeLLMServer, http: httpx.AsyncClient
) -> None:
    fake.control(record_messages=True)
    body = chat_body("one")
    await http.post("/chat/completions", json=body)

    (call,) = fake.stats()["calls"]

    assert call["messages"] == [[m["role"], m["content"]] for m in body["messages"]]


@pytest.mark.parametrize(
    ("marker", "check"),
    [
        ("[[poison]]", lambda content, finish: "f9999" in content and finish == "stop"),
        ("[[badjson]]", lambda content, finish: content == "this is not json"),
        ("[[empty]]", lambda content, finish: content == ""),
        ("[[truncate]]", lambda content, finish: finish == "length"),
    ],
)
async def test_poison_markers_spoil_the_whole_request(
    http: httpx.AsyncClient, marker: str, check: Callable[[str, str], bool]
) -> None:
    response = await http.post(
        "/chat/completions", json=chat_body("a fine fact", f"a fact {marker} here")
    )
    choice = response.json()["choices"][0]
    assert check(choice["message"]["content"], choice["finish_reason"])


async def test_truncated_answer_is_half_of_the_full_one(
    fake: FakeLLMServer, http: httpx.AsyncClient
) -> None:
    fake.control(pad_bytes=1000)
    response = await http.post("/chat/completions", json=chat_body("x [[truncate]]"))
    content = response.json()["choices"][0]["message"]["content"]
    assert 500 <= len(content) < 1000
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(content)


async def test_pad_bytes_keeps_the_answer_valid_json(
    fake: FakeLLMServer, http: httpx.AsyncClient
) -> None:
    fake.control(pad_bytes=200_000)
    response = await http.post("/chat/completions", json=chat_body("Alice lives in Paris."))
    content = response.json()["choices"][0]["message"]["content"]
    assert len(content) > 200_000
    assert orjson.loads(content)["creates"]


async def test_fail_rate_answers_fail_status_with_retry_after(
    fake: FakeLLMServer, http: httpx.AsyncClient
) -> None:
    fake.control(fail_rate=1.0, fail_status=429, retry_after_s=2)
    response = await http.post("/chat/completions", json=chat_body("a fact"))
    assert response.status_code == 429
    assert response.headers["retry-after"] == "2"
    assert "error" in response.json()
    stats = fake.stats()
    assert (stats["failed"], stats["completed"], stats["statuses"]) == (1, 0, {429: 1})


async def test_same_seed_gives_the_same_failures() -> None:
    async def statuses() -> list[int]:
        with FakeLLMServer(FakeLLMConfig(fail_rate=0.5, seed=42)) as server:
            async with httpx.AsyncClient(base_url=server.url) as client:
                return [
                    (await client.post("/chat/completions", json=chat_body("f"))).status_code
                    for _ in range(20)
                ]

    first = await statuses()
    assert first == await statuses()
    assert {200, 503} == set(first)


async def test_api_key_requires_the_bearer_token() -> None:
    with FakeLLMServer(FakeLLMConfig(api_key="secret")) as server:
        async with httpx.AsyncClient(base_url=server.url) as client:
            missing = await client.post("/chat/completions", json=chat_body("a"))
            wrong = await client.post(
                "/chat/completions",
                json=chat_body("a"),
                headers={"authorization": "Bearer nope"},
            )
            right = await client.post(
                "/chat/completions",
                json=chat_body("a"),
                headers={"authorization": "Bearer secret"},
            )
    assert (missing.status_code, wrong.status_code, right.status_code) == (401, 401, 200)


async def test_script_items_are_consumed_in_order(
    fake: FakeLLMServer, http: httpx.AsyncClient
) -> None:
    fake.control(
        script=[
            {"status": 503, "retry_after": 0.5},
            {"content": "scripted", "finish_reason": "length"},
            {"status": 400, "body": "response_format json_schema is not supported"},
        ]
    )
    first = await http.post("/chat/completions", json=chat_body("a"))
    second = await http.post("/chat/completions", json=chat_body("a"))
    third = await http.post("/chat/completions", json=chat_body("a"))
    fourth = await http.post("/chat/completions", json=chat_body("a"))
    assert (first.status_code, first.headers["retry-after"]) == (503, "0.5")
    assert second.json()["choices"][0] == {
        "index": 0,
        "message": {"role": "assistant", "content": "scripted"},
        "finish_reason": "length",
    }
    assert third.status_code == 400
    assert "response_format" in third.json()["error"]["message"]
    assert fourth.status_code == 200
    assert fake.stats()["script_pending"] == 0


async def test_a_request_containing_fail_when_contains_gets_fail_when_status(
    fake: FakeLLMServer, http: httpx.AsyncClient
) -> None:
    # Whatever its place in the order: the script item waits for the next other request.
    fake.control(fail_when_contains="Mallory", fail_when_status=401, script=[{"status": 503}])
    poisoned = await http.post("/chat/completions", json=chat_body("a", "Mallory lives in Rome."))
    assert poisoned.status_code == 401
    assert "error" in poisoned.json()
    assert fake.stats()["script_pending"] == 1
    scripted = await http.post("/chat/completions", json=chat_body("Alice lives in Paris."))
    clean = await http.post("/chat/completions", json=chat_body("Alice lives in Paris."))
    again = await http.post("/chat/completions", json=chat_body("Mallory is back."))
    assert (scripted.status_code, clean.status_code, again.status_code) == (503, 200, 401)
    fake.control(fail_when_contains=None)
    assert (await http.post("/chat/completions", json=chat_body("Mallory"))).status_code == 200


def test_invalid_control_is_rejected(fake: FakeLLMServer) -> None:
    with pytest.raises(ValueError, match="unknown"):
        fake.control(latency=5)
    with pytest.raises(ValueError):
        fake.control(script=[{"status": 503, "content": "x"}])


async def test_in_flight_accounting_per_scope(fake: FakeLLMServer, http: httpx.AsyncClient) -> None:
    fake.control(script=[{"hang": True}] * 3)
    requests = [
        asyncio.create_task(http.post("/chat/completions", json=chat_body("f", scope=scope)))
        for scope in (("a",), ("a",), ("b",))
    ]
    await wait_for(lambda: fake.stats()["in_flight"] == 3)
    stats = fake.stats()
    assert stats["max_in_flight"] == 3
    assert stats["max_in_flight_per_scope"] == 2
    assert stats["max_distinct_scopes_in_flight"] == 2
    for task in requests:
        task.cancel()
    await asyncio.gather(*requests, return_exceptions=True)
    await wait_for(lambda: fake.stats()["aborted"] == 3)
    stats = fake.stats()
    assert stats["in_flight"] == 0
    assert (stats["completed"], stats["failed"]) == (0, 0)
    assert [call["status"] for call in stats["calls"]] == [None, None, None]


async def test_client_leaving_during_latency_counts_as_aborted(
    fake: FakeLLMServer, http: httpx.AsyncClient
) -> None:
    fake.control(latency_ms=60_000)
    with pytest.raises(httpx.ReadTimeout):
        await http.post("/chat/completions", json=chat_body("a"), timeout=0.2)
    await wait_for(lambda: fake.stats()["aborted"] == 1)
    assert fake.stats()["in_flight"] == 0


async def test_malformed_requests_get_400(fake: FakeLLMServer, http: httpx.AsyncClient) -> None:
    not_json = await http.post("/chat/completions", content=b"{nope")
    body = chat_body("a")
    body["messages"][1]["content"] = "plain words"
    user_not_json = await http.post("/chat/completions", json=body)
    assert (not_json.status_code, user_not_json.status_code) == (400, 400)
    assert "DESIGN" in user_not_json.json()["error"]["message"]
    assert fake.stats()["failed"] == 2


async def test_http_control_stats_and_reset(fake: FakeLLMServer) -> None:
    root = fake.url.removesuffix("/v1")
    async with httpx.AsyncClient(base_url=root) as client:
        control = await client.post("/_control", json={"script": [{"status": 502}], "pad_bytes": 3})
        assert control.status_code == 200
        assert control.json()["config"]["pad_bytes"] == 3
        failed = await client.post("/v1/chat/completions", json=chat_body("a"))
        assert failed.status_code == 502
        stats = (await client.get("/_stats")).json()
        assert stats["requests"] == 1
        assert stats["statuses"] == {"502": 1}
        bad = await client.post("/_control", json={"no_such_setting": 1})
        assert bad.status_code == 400
        assert (await client.post("/_reset")).status_code == 200
    assert fake.stats()["requests"] == 0
    assert fake.stats()["calls"] == []


def test_reset_clears_stats_and_script(fake: FakeLLMServer) -> None:
    fake.control(script=[{"hang": True}], latency_ms=5)
    fake.reset()
    stats = fake.stats()
    assert stats["script_pending"] == 0
    assert stats["requests"] == 0


async def test_stop_does_not_wait_forever_for_a_hanging_request() -> None:
    server = FakeLLMServer().start()
    server.control(script=[{"hang": True}])
    async with httpx.AsyncClient(base_url=server.url) as client:
        request = asyncio.create_task(client.post("/chat/completions", json=chat_body("a")))
        await wait_for(lambda: server.stats()["in_flight"] == 1)
        await asyncio.to_thread(server.stop)
        response = await request
    assert response.status_code == 503
    assert "shutting down" in response.json()["error"]["message"]


async def test_create_app_serves_in_process() -> None:
    transport = httpx.ASGITransport(app=create_app(FakeLLMConfig()))
    async with httpx.AsyncClient(transport=transport, base_url="http://fake") as client:
        response = await client.post("/v1/chat/completions", json=chat_body("Alice is here."))
    assert response.status_code == 200
    assert orjson.loads(response.json()["choices"][0]["message"]["content"])["creates"]


# --- imitating real servers -------------------------------------------------------------------


def _with(body: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return {**body, **changes}


_SCHEMA = {"type": "object", "properties": {}, "additionalProperties": False}
_JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "n", "schema": _SCHEMA}}
_OBJECT_SCHEMA = {"type": "json_object", "schema": _SCHEMA}


async def test_records_response_format_schema_max_tokens_and_roles(
    fake: FakeLLMServer, http: httpx.AsyncClient
) -> None:
    await http.post("/chat/completions", json=_with(chat_body("a"), response_format=_JSON_SCHEMA))
    await http.post(
        "/chat/completions",
        json=_with(chat_body("a"), response_format=_OBJECT_SCHEMA, max_tokens=300),
    )
    body = chat_body("a")
    del body["response_format"]
    body["messages"] += [
        {"role": "assistant", "content": "{}"},
        {"role": "user", "content": "fix it"},
    ]
    await http.post("/chat/completions", json=body)
    calls = fake.stats()["calls"]
    assert [(c["response_format"], c["schema"], c["max_tokens"]) for c in calls] == [
        ("json_schema", True, None),
        ("json_object", True, 300),
        (None, False, None),
    ]
    assert calls[0]["roles"] == ["system", "user"]
    assert calls[2]["roles"] == ["system", "user", "assistant", "user"]
    assert calls[2]["turns"] == ["{}", "fix it"]
    assert [c["instructed"] for c in calls] == [False, False, False]
    # The §3 object is found in the first user message, not in the repair note.
    assert calls[2]["fact_texts"] == ["a"] and calls[2]["status"] == 200


async def test_llama_cpp_python_refuses_json_schema_with_a_500_literal_error() -> None:
    with FakeLLMServer(FakeLLMConfig(dialect="llama-cpp-python")) as fake:
        async with httpx.AsyncClient(base_url=fake.url) as http:
            refused = await http.post(
                "/chat/completions", json=_with(chat_body("a"), response_format=_JSON_SCHEMA)
            )
            constrained = await http.post(
                "/chat/completions", json=_with(chat_body("a"), response_format=_OBJECT_SCHEMA)
            )
    assert refused.status_code == 500
    message = refused.json()["error"]["message"]
    assert "literal_error" in message and "response_format" in message
    assert constrained.status_code == 200


@pytest.mark.parametrize(
    ("dialect", "object_with_schema"), [("no-schema", 200), ("json-object-only", 400)]
)
async def test_servers_without_schema_support_refuse_json_schema_with_a_400(
    dialect: str, object_with_schema: int
) -> None:
    with FakeLLMServer(FakeLLMConfig(dialect=dialect)) as fake:
        async with httpx.AsyncClient(base_url=fake.url) as http:
            schema = await http.post(
                "/chat/completions", json=_with(chat_body("a"), response_format=_JSON_SCHEMA)
            )
            with_schema = await http.post(
                "/chat/completions", json=_with(chat_body("a"), response_format=_OBJECT_SCHEMA)
            )
            plain = await http.post("/chat/completions", json=chat_body("a"))
    assert schema.status_code == 400 and "response_format" in schema.json()["error"]["message"]
    assert with_schema.status_code == object_with_schema
    assert plain.status_code == 200


async def test_max_tokens_cuts_a_longer_answer_unless_told_to_ignore_it(
    fake: FakeLLMServer, http: httpx.AsyncClient
) -> None:
    body = _with(chat_body("Alice " + "drinks green tea, " * 30), max_tokens=20)
    cut = (await http.post("/chat/completions", json=body)).json()
    assert cut["choices"][0]["finish_reason"] == "length"
    assert len(cut["choices"][0]["message"]["content"]) == 80
    assert cut["usage"]["completion_tokens"] == 20
    fake.control(honour_max_tokens=False)
    whole = (await http.post("/chat/completions", json=body)).json()
    assert whole["choices"][0]["finish_reason"] == "stop"
    assert orjson.loads(whole["choices"][0]["message"]["content"])["creates"]


async def test_padding_costs_no_tokens(fake: FakeLLMServer, http: httpx.AsyncClient) -> None:
    plain = (await http.post("/chat/completions", json=chat_body("Alice is here."))).json()
    fake.control(pad_bytes=100_000)
    body = _with(chat_body("Alice is here."), max_tokens=1000)
    padded = (await http.post("/chat/completions", json=body)).json()
    assert padded["choices"][0]["finish_reason"] == "stop"
    assert padded["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]


async def test_think_puts_a_think_block_before_the_answer_and_reasoning_content_beside_it() -> None:
    with FakeLLMServer(FakeLLMConfig(think=True, reasoning_content=True)) as fake:
        async with httpx.AsyncClient(base_url=fake.url) as http:
            message = (await http.post("/chat/completions", json=chat_body("a"))).json()["choices"][
                0
            ]["message"]
    assert message["content"].startswith("<think>")
    _, _, answer = message["content"].partition("</think>")
    assert orjson.loads(answer)["creates"]
    assert message["reasoning_content"]


async def test_a_template_that_drops_the_system_message_leaves_the_model_uninstructed() -> None:
    with FakeLLMServer(FakeLLMConfig(drop_system=True)) as fake:
        async with httpx.AsyncClient(base_url=fake.url) as http:
            with_system = (await http.post("/chat/completions", json=chat_body("a"))).json()
            body = chat_body("a")
            system, user = body["messages"]
            body["messages"] = [
                {"role": "user", "content": system["content"] + "\n\n" + user["content"]}
            ]
            in_user = (await http.post("/chat/completions", json=body)).json()
    prose = with_system["choices"][0]["message"]["content"]
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(prose)
    assert with_system["usage"]["prompt_tokens"] == (len(user["content"]) + 3) // 4
    assert orjson.loads(in_user["choices"][0]["message"]["content"])["creates"]


@pytest.mark.parametrize(
    ("envelope", "media_type"), [("html", "text/html"), ("no-choices", "json")]
)
async def test_envelope_answers_200_with_a_body_that_is_not_a_chat_completion(
    fake: FakeLLMServer, http: httpx.AsyncClient, envelope: str, media_type: str
) -> None:
    fake.control(envelope=envelope)
    response = await http.post("/chat/completions", json=chat_body("a"))
    assert response.status_code == 200
    assert media_type in response.headers["content-type"]
    assert "choices" not in response.text
    fake.control(envelope="completion")
    assert "choices" in (await http.post("/chat/completions", json=chat_body("a"))).json()


async def test_a_repairable_fact_is_answered_well_only_after_a_repair(
    http: httpx.AsyncClient,
) -> None:
    body = chat_body("Alice lives in Paris. [[repairable]]")
    first = (await http.post("/chat/completions", json=body)).json()
    assert "f9999" in first["choices"][0]["message"]["content"]
    body["messages"] += [
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "f9999 is not a fact ref"},
    ]
    second = (await http.post("/chat/completions", json=body)).json()
    assert orjson.loads(second["choices"][0]["message"]["content"])["creates"][0]["facts"] == ["f1"]


def test_unknown_dialects_and_envelopes_are_rejected(fake: FakeLLMServer) -> None:
    with pytest.raises(ValueError, match="dialect"):
        fake.control(dialect="ollama-2")
    with pytest.raises(ValueError, match="envelope"):
        FakeLLMConfig(envelope="xml")


def test_the_cli_rejects_an_unknown_dialect_in_one_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "consolidation.cli", "fake-llm", "--dialect", "ollama-2"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0
    assert "dialect must be one of" in done.stderr and done.stderr.count("\n") == 1
