"""The embeddings client against the fake server's /v1/embeddings over loopback (no mocks), and
the fake's vectors themselves."""

from __future__ import annotations

import asyncio
import math
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest

from consolidation.errors import LLMConfigError, TransientLLMError
from consolidation.llm.embeddings import (
    MAX_INPUTS_PER_REQUEST,
    EmbeddingsConfigError,
    EmbeddingsRetriesExhausted,
    HTTPEmbedder,
    build_embedder,
    vector_literal,
)
from consolidation.settings import load_settings
from consolidation.testing.fake_embeddings import embed_text
from consolidation.testing.fake_llm import FakeLLMConfig, FakeLLMServer
from tests.support.waiting import wait_for
from tests.unit.test_llm import closing_clients, metric


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


@pytest.fixture
def fake() -> Iterator[FakeLLMServer]:
    with FakeLLMServer(FakeLLMConfig(seed=3)) as server:
        yield server


@pytest.fixture
async def make_embedder() -> AsyncIterator[Callable[..., HTTPEmbedder]]:
    async with closing_clients(HTTPEmbedder, "test-embed") as make:
        yield make


# --- the fake's vectors ------------------------------------------------------------------------


def test_fake_vectors_are_unit_length_and_deterministic() -> None:
    vector = embed_text("Alice drinks green tea every morning")
    assert len(vector) == 384
    assert math.isclose(math.sqrt(sum(x * x for x in vector)), 1.0)
    assert vector == embed_text("Alice drinks green tea every morning")
    assert len(embed_text("anything", 16)) == 16
    assert math.isclose(sum(x * x for x in embed_text("")), 1.0)


def test_fake_vectors_put_paraphrases_close_and_unrelated_texts_far() -> None:
    twin = cosine(embed_text("Alice adores matcha"), embed_text("Alice loves green tea"))
    same_person = cosine(embed_text("Alice adores matcha"), embed_text("Alice drives a red car"))
    unrelated = cosine(embed_text("Alice adores matcha"), embed_text("Bob fixed the sink"))
    assert twin > 0.6
    assert twin > same_person + 0.3
    assert abs(unrelated) < 0.2


# --- the fake's endpoint -----------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/embeddings", "/v1/embeddings"])
async def test_fake_answers_in_the_openai_embeddings_shape(fake: FakeLLMServer, path: str) -> None:
    root = fake.url.removesuffix("/v1")
    async with httpx.AsyncClient(base_url=root) as client:
        response = await client.post(path, json={"model": "m", "input": ["a tea", "a car"]})
        single = await client.post(path, json={"model": "m", "input": "a tea", "dimensions": 8})
        bad = await client.post(path, json={"model": "m", "input": [1, 2]})
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "list"
    assert body["model"] == "m"
    assert [d["index"] for d in body["data"]] == [0, 1]
    assert body["data"][0]["embedding"] == embed_text("a tea")
    assert len(single.json()["data"][0]["embedding"]) == 8
    assert bad.status_code == 400
    stats = fake.stats()["embeddings"]
    assert stats["requests"] == 3
    assert stats["inputs"] == 3
    assert stats["statuses"] == {200: 2, 400: 1}
    assert stats["calls"][0]["inputs"] == ["a tea", "a car"]
    assert fake.stats()["requests"] == 0  # chat completions are counted apart


async def test_fake_embeddings_failures_are_injected_apart_from_chat(fake: FakeLLMServer) -> None:
    fake.control(embeddings={"script": [{"status": 429, "retry_after": 1}], "fail_rate": 0.0})
    async with httpx.AsyncClient(base_url=fake.url) as client:
        first = await client.post("/embeddings", json={"input": ["x"]})
        second = await client.post("/embeddings", json={"input": ["x"]})
    assert first.status_code == 429
    assert first.headers["retry-after"] == "1"
    assert second.status_code == 200
    with pytest.raises(ValueError, match="unknown fake embeddings settings"):
        fake.control(embeddings={"latency": 3})
    fake.reset()
    assert fake.stats()["embeddings"]["requests"] == 0


# --- the client ---------------------------------------------------------------------------------


async def test_embed_returns_one_vector_per_text_in_one_request(
    fake: FakeLLMServer, make_embedder: Any
) -> None:
    client = make_embedder(fake.url + "/")
    texts = ["Alice adores matcha", "Alice loves green tea", "Bob fixed the sink"]
    vectors = await client.embed(texts)
    assert vectors == [vector_literal(embed_text(t)) for t in texts]
    assert client.dimensions == 384
    calls = fake.stats()["embeddings"]["calls"]
    assert len(calls) == 1
    assert calls[0]["inputs"] == texts
    assert calls[0]["model"] == "test-embed"


async def test_configured_dimensions_are_sent(fake: FakeLLMServer, make_embedder: Any) -> None:
    client = make_embedder(fake.url, dimensions=64)
    (vector,) = await client.embed(["a"])
    assert vector is not None and len(orjson.loads(vector)) == 64
    assert fake.stats()["embeddings"]["calls"][0]["dimensions"] == 64


async def test_a_later_change_of_dimension_is_a_config_error(
    fake: FakeLLMServer, make_embedder: Any
) -> None:
    client = make_embedder(fake.url)
    await client.embed(["a"])
    fake.control(embeddings={"dimensions": 128})
    with pytest.raises(EmbeddingsConfigError, match="128-dimensional vectors, expected 384"):
        await client.embed(["b"])


async def test_transport_trouble_is_retried_honouring_retry_after(
    fake: FakeLLMServer, make_embedder: Any
) -> None:
    fake.control(embeddings={"script": [{"status": 503}, {"status": 429, "retry_after": 0.3}]})
    retries_before = metric("consolidation_embedding_requests_total", outcome="retry")
    vectors = await make_embedder(fake.url, backoff_max_s=0.1).embed(["a"])
    assert vectors == [vector_literal(embed_text("a"))]
    calls = fake.stats()["embeddings"]["calls"]
    assert [c["status"] for c in calls] == [503, 429, 200]
    # Backoff alone waits at most 100 ms; only Retry-After explains the gap.
    assert calls[2]["started"] - calls[1]["ended"] >= 0.3
    assert metric("consolidation_embedding_requests_total", outcome="retry") == retries_before + 2


async def test_exhausted_retries_are_transient_errors(
    fake: FakeLLMServer, make_embedder: Any
) -> None:
    fake.control(embeddings={"fail_rate": 1.0, "fail_status": 502})
    with pytest.raises(TransientLLMError) as caught:
        await make_embedder(fake.url, max_retries=2).embed(["a"])
    assert isinstance(caught.value, EmbeddingsRetriesExhausted)
    assert caught.value.attempts == 3
    assert "502" in str(caught.value)


async def test_an_answer_that_is_not_an_embeddings_list_is_retried(
    fake: FakeLLMServer, make_embedder: Any
) -> None:
    fake.control(
        embeddings={
            "script": [
                {"status": 200, "body": '{"data": "nope"}'},
                {"status": 200, "body": '{"data": [{"index": 0, "embedding": [0.5, "x"]}]}'},
                {"status": 200, "body": '{"data": [{"index": 0, "embedding": [[0.5]]}]}'},
            ]
        }
    )
    vectors = await make_embedder(fake.url).embed(["a"])
    assert vectors == [vector_literal(embed_text("a"))]
    assert fake.stats()["embeddings"]["requests"] == 4


@pytest.mark.parametrize(
    ("status", "setting"),
    [
        (401, "CONSOLIDATION_EMBEDDINGS_API_KEY"),
        (403, "CONSOLIDATION_EMBEDDINGS_API_KEY"),
        (404, "CONSOLIDATION_EMBEDDINGS_BASE_URL"),
    ],
)
async def test_auth_and_not_found_fail_at_once_naming_the_setting(
    fake: FakeLLMServer, make_embedder: Any, status: int, setting: str
) -> None:
    fake.control(embeddings={"script": [{"status": status}]})
    with pytest.raises(LLMConfigError, match=setting):
        await make_embedder(fake.url).embed(["a"])
    assert fake.stats()["embeddings"]["requests"] == 1


async def test_api_key_is_sent_as_bearer_token(make_embedder: Any) -> None:
    with FakeLLMServer(FakeLLMConfig(api_key="s3cret")) as server:
        with pytest.raises(EmbeddingsConfigError, match="EMBEDDINGS_API_KEY"):
            await make_embedder(server.url).embed(["a"])
        vectors = await make_embedder(server.url, api_key="s3cret").embed(["a"])
        assert vectors == [vector_literal(embed_text("a"))]


async def test_a_refused_text_gets_no_vector_and_the_others_do(
    fake: FakeLLMServer, make_embedder: Any
) -> None:
    # The batch is refused (a text too long for the model, say), the probe passes, and each
    # text is tried alone: only the one the server refuses again goes without a vector.
    fake.control(
        embeddings={"script": [{"status": 413}, {"pass": True}, {"pass": True}, {"status": 400}]}
    )
    refused_before = metric("consolidation_embedding_requests_total", outcome="refused_input")
    vectors = await make_embedder(fake.url).embed(["short", "very long"])
    assert vectors == [vector_literal(embed_text("short")), None]
    inputs = [c["inputs"] for c in fake.stats()["embeddings"]["calls"]]
    assert inputs[0] == ["short", "very long"]
    assert inputs[2:] == [["short"], ["very long"]]
    assert metric("consolidation_embedding_requests_total", outcome="refused_input") == (
        refused_before + 1
    )


async def test_a_server_refusing_every_request_is_a_config_error(
    fake: FakeLLMServer, make_embedder: Any
) -> None:
    fake.control(embeddings={"fail_rate": 1.0, "fail_status": 400})
    with pytest.raises(EmbeddingsConfigError, match=r"refuses every request.*DIMENSIONS"):
        await make_embedder(fake.url, dimensions=32).embed(["a", "b"])


async def test_timeout_is_transient_and_aborts_the_request(
    fake: FakeLLMServer, make_embedder: Any
) -> None:
    fake.control(embeddings={"script": [{"hang": True}]})
    with pytest.raises(EmbeddingsRetriesExhausted, match="no answer within"):
        await make_embedder(fake.url, timeout_s=0.2, max_retries=0).embed(["a"])
    await wait_for(lambda: fake.stats()["embeddings"]["aborted"] == 1, what="abort seen")


async def test_a_hanging_endpoint_is_given_up_on_when_the_llm_retry_budget_is_spent(
    fake: FakeLLMServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The embeddings client shares the LLM's timeout, retries and retry budget (README).
    monkeypatch.setenv("CONSOLIDATION_EMBEDDINGS_BASE_URL", fake.url)
    monkeypatch.setenv("CONSOLIDATION_LLM_TIMEOUT_S", "0.2")
    monkeypatch.setenv("CONSOLIDATION_LLM_RETRY_BUDGET_S", "0.5")
    monkeypatch.setenv("CONSOLIDATION_LLM_MAX_RETRIES", "20")
    monkeypatch.setenv("CONSOLIDATION_LLM_BACKOFF_MAX_S", "0.01")
    fake.control(embeddings={"script": [{"hang": True}] * 100})
    embedder = build_embedder(load_settings())
    assert embedder is not None
    try:
        with pytest.raises(EmbeddingsRetriesExhausted) as caught:
            await embedder.embed(["a"])
    finally:
        await embedder.aclose()
    message = str(caught.value)
    assert "retry budget of 0.5s spent" in message
    assert "CONSOLIDATION_LLM_RETRY_BUDGET_S" in message
    # The budget, not the 20 retries, ended it; every abandoned request was aborted.
    assert caught.value.attempts < 10
    await wait_for(
        lambda: fake.stats()["embeddings"]["aborted"] == caught.value.attempts,
        what="every attempt aborted",
    )


async def test_connection_refused_is_transient(make_embedder: Any) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(EmbeddingsRetriesExhausted):
        await make_embedder(f"http://127.0.0.1:{port}/v1", max_retries=1).embed(["a"])


async def test_cancelling_the_caller_aborts_the_http_request(
    fake: FakeLLMServer, make_embedder: Any
) -> None:
    fake.control(embeddings={"script": [{"hang": True}]})
    task = asyncio.create_task(make_embedder(fake.url).embed(["a"]))
    await wait_for(lambda: fake.stats()["embeddings"]["requests"] == 1, what="request arrived")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_for(lambda: fake.stats()["embeddings"]["aborted"] == 1, what="abort seen")


async def _waiting_behind_a_hung_request(
    fake: FakeLLMServer, client: HTTPEmbedder, texts: list[str]
) -> tuple[asyncio.Task[Any], list[asyncio.Task[Any]]]:
    """A first request that hangs, and one caller per text waiting for it to end."""
    first = asyncio.create_task(client.embed(["a"]))
    await wait_for(lambda: fake.stats()["embeddings"]["requests"] == 1, what="request arrived")
    later = [asyncio.create_task(client.embed([t])) for t in texts]
    # The callers have joined the next batch (the only place they can be seen waiting).
    await wait_for(lambda: client._next is not None and client._next.waiters == len(texts))
    return first, later


async def test_texts_asked_while_a_request_is_in_flight_travel_together_in_the_next(
    fake: FakeLLMServer, make_embedder: Any
) -> None:
    fake.control(embeddings={"script": [{"hang": True}]})
    client = make_embedder(fake.url)
    first, (b, c, d) = await _waiting_behind_a_hung_request(fake, client, ["b", "c", "d"])
    c.cancel()  # one caller leaves; the others still get theirs
    first.cancel()  # nobody waits for the hung request any more: it is abandoned
    with pytest.raises(asyncio.CancelledError):
        await first
    assert await b == [vector_literal(embed_text("b"))]
    assert await d == [vector_literal(embed_text("d"))]
    with pytest.raises(asyncio.CancelledError):
        await c
    calls = fake.stats()["embeddings"]["calls"]
    assert [call["inputs"] for call in calls] == [["a"], ["b", "c", "d"]]
    await wait_for(lambda: fake.stats()["embeddings"]["aborted"] == 1, what="abort seen")


async def test_an_error_of_a_coalesced_request_reaches_every_caller(
    fake: FakeLLMServer, make_embedder: Any
) -> None:
    fake.control(embeddings={"script": [{"hang": True}, {"status": 401}]})
    client = make_embedder(fake.url)
    first, later = await _waiting_behind_a_hung_request(fake, client, ["b", "c"])
    first.cancel()
    for task in later:
        with pytest.raises(EmbeddingsConfigError):
            await task


async def test_the_requests_of_a_large_batch_go_at_once_and_the_first_error_ends_them(
    fake: FakeLLMServer, make_embedder: Any
) -> None:
    # Two requests: the first hangs, the second is refused for auth. Sent one after the other,
    # the second would never go; sent at once, its error ends the call and the hung one.
    fake.control(embeddings={"script": [{"hang": True}, {"status": 401}]})
    texts = [f"text {i}" for i in range(MAX_INPUTS_PER_REQUEST + 2)]
    with pytest.raises(EmbeddingsConfigError):
        await make_embedder(fake.url).embed(texts)
    await wait_for(lambda: fake.stats()["embeddings"]["aborted"] == 1, what="hung request aborted")
    sizes = sorted(len(c["inputs"]) for c in fake.stats()["embeddings"]["calls"])
    assert sizes == [2, MAX_INPUTS_PER_REQUEST]


def test_invalid_base_url_is_a_config_error() -> None:
    with pytest.raises(EmbeddingsConfigError, match="CONSOLIDATION_EMBEDDINGS_BASE_URL"):
        HTTPEmbedder(base_url="localhost:8000", model="m")


def test_build_embedder_follows_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    assert build_embedder(load_settings()) is None
    monkeypatch.setenv("CONSOLIDATION_EMBEDDINGS_BASE_URL", "http://127.0.0.1:9/v1/")
    monkeypatch.setenv("CONSOLIDATION_EMBEDDINGS_DIMENSIONS", "256")
    embedder = build_embedder(load_settings())
    assert embedder is not None
    assert embedder.url == "http://127.0.0.1:9/v1/embeddings"
    assert embedder.dimensions == 256
    monkeypatch.setenv("CONSOLIDATION_EMBEDDINGS_DIMENSIONS", "")
    assert build_embedder(load_settings()).dimensions is None  # type: ignore[union-attr]
