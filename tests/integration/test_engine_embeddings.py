"""The engine with embeddings: the fake's /v1/embeddings over real HTTP, a Postgres with pgvector
(the embedded one when the test server lacks it), never skipped."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import orjson
import pytest

from consolidation import queue, store
from consolidation.engine import OperationEnd, run_operation
from consolidation.llm.client import Consolidator, LLMAnswer
from consolidation.llm.embeddings import HTTPEmbedder
from consolidation.llm.prompts import Chat
from consolidation.settings import Settings
from consolidation.testing.fake_llm import FakeLLMServer
from tests.integration.test_embedding_storage import OTHER_FACTS
from tests.support.engine import http_llm, ingest, logged_pool, markers
from tests.support.invariants import assert_consistent

TWIN = "Alice loves green tea"
OTHERS = OTHER_FACTS[:8]


class PromptLog:
    """The real HTTP client to the fake, keeping the observations each pass was shown."""

    def __init__(self, llm: Consolidator) -> None:
        self._llm = llm
        self.shown: list[list[str]] = []

    async def complete(self, chat: Chat) -> LLMAnswer:
        self.shown.append([o["text"] for o in orjson.loads(chat.user)["observations"]])
        return await self._llm.complete(chat)

    async def aclose(self) -> None:
        await self._llm.aclose()


@pytest.fixture
async def embedder(fake: FakeLLMServer) -> AsyncIterator[HTTPEmbedder]:
    client = HTTPEmbedder(
        base_url=fake.url,
        model="fake-embed",
        max_retries=2,
        backoff_base_s=0.01,
        backoff_max_s=0.05,
    )
    yield client
    await client.aclose()


async def run(
    pool: asyncpg.Pool, llm: Consolidator, settings: Settings, embedder: HTTPEmbedder | None
) -> OperationEnd:
    lease = await queue.start_foreground(pool, "b", "test-worker", 30)
    return await run_operation(pool, lease, llm, settings, embedder=embedder)


async def run_claimed(
    pool: asyncpg.Pool, llm: Consolidator, settings: Settings, embedder: HTTPEmbedder
) -> tuple[OperationEnd, queue.Operation]:
    """A submitted operation (3 attempts) claimed like a worker does, one attempt run."""
    op = (await queue.submit(pool, "b", max_attempts=3)).operation
    lease = await queue.claim(pool, "test-worker", 30)
    assert lease is not None and lease.operation_id == op.id
    end = await run_operation(pool, lease, llm, settings, embedder=embedder)
    return end, await queue.get_operation(pool, op.id)


def tea(n: int, **extra: Any) -> list[dict[str, Any]]:
    return [
        {
            "text": f"Alice drinks green tea every morning, cup {i}",
            "tags": ["alice", "tea"],
            **extra,
        }
        for i in range(n)
    ]


@pytest.mark.parametrize("embeddings", [True, False])
async def test_a_paraphrase_twin_beyond_the_recall_limit_is_recalled_with_embeddings_only(
    vector_pool: asyncpg.Pool, fake: FakeLLMServer, embedder: HTTPEmbedder, embeddings: bool
) -> None:
    # Nine observations, the twin the oldest, written by the engine with their vectors; the
    # eight others share only the name with the fact to come.
    await ingest(vector_pool, "b", [{"text": t, "tags": ["alice"]} for t in [TWIN, *OTHERS]])
    llm = PromptLog(http_llm(fake.url))
    try:
        seeded = await run(vector_pool, llm, Settings(llm_batch_size=1), embedder)
        assert seeded.status == "completed", seeded.error
        stored = await vector_pool.fetch(
            "SELECT embedding IS NOT NULL AND embedding_version = version AS embedded"
            " FROM observations"
        )
        assert len(stored) == 9 and all(r["embedded"] for r in stored)

        await ingest(vector_pool, "b", [{"text": "Alice adores matcha", "tags": ["alice"]}])
        llm.shown.clear()
        end = await run(
            vector_pool, llm, Settings(recall_limit=3), embedder if embeddings else None
        )
    finally:
        await llm.aclose()
    assert end.status == "completed", end.error
    (shown,) = llm.shown
    assert len(shown) == 3
    # Full text ranks the twin with every observation naming Alice, and recency keeps the newest.
    assert (TWIN in shown) is embeddings


async def test_one_embeddings_request_per_wave_for_its_facts_and_per_pass_for_its_writes(
    vector_database_url: str, fake: FakeLLMServer, embedder: HTTPEmbedder
) -> None:
    async with logged_pool(vector_database_url) as (pool, statements):
        # One group, per_tag: each batch of 3 makes two passes (8 passes in all).
        await ingest(pool, "b", tea(10, observation_scopes="per_tag"))
        statements.clear()
        llm = http_llm(fake.url)
        try:
            end = await run(pool, llm, Settings(llm_batch_size=3), embedder)
        finally:
            await llm.aclose()
        census = await assert_consistent(pool)
        unembedded = await pool.fetchval(
            "SELECT count(*) FROM observations"
            " WHERE embedding IS NULL OR embedding_version <> version"
        )
    assert end.status == "completed", end.error
    assert census is not None and unembedded == 0
    stats = fake.stats()
    assert stats["requests"] == 8
    calls = stats["embeddings"]["calls"]
    # The wave's facts in one request, then at most one request per pass: the texts it writes,
    # each text once (a fact writing two scopes, a text written again, are not sent twice).
    assert calls[0]["inputs"] == [m["text"] for m in tea(10)]
    assert len(calls) <= 1 + 8
    sent = [t for c in calls for t in c["inputs"]]
    assert len(sent) == len(set(sent))
    facts = {m["text"] for m in tea(10)}
    assert {t for t in sent if t in facts} == facts
    assert end.summary.perf.embedding_requests == len(calls)
    # The SQL: one hybrid recall statement (the first two passes'), then every recall rides
    # on the hybrid apply.
    assert statements.count(store.recall_statement(2, hybrid=True)) == 1
    assert store.RECALL_HYBRID not in statements
    assert statements.count(store.APPLY_PASS_HYBRID) == 8
    assert store.RECALL not in statements and store.APPLY_PASS not in statements


async def test_an_embeddings_outage_fails_the_operation_and_marks_no_memory_failed(
    vector_pool: asyncpg.Pool, fake: FakeLLMServer, embedder: HTTPEmbedder
) -> None:
    await ingest(vector_pool, "b", tea(4))
    fake.control(embeddings={"fail_rate": 1.0, "fail_status": 503})
    llm = http_llm(fake.url)
    try:
        end, row = await run_claimed(vector_pool, llm, Settings(), embedder)
    finally:
        await llm.aclose()
    # Handed back for a later attempt, with backoff, like an LLM outage.
    assert end.status == "pending" and row.status == "pending" and row.attempt == 1
    assert "EmbeddingsRetriesExhausted" in (row.error or "")
    assert fake.stats()["embeddings"]["requests"] == 3  # max_retries 2
    assert fake.stats()["requests"] == 0  # no LLM call before the facts' vectors
    assert await markers(vector_pool, "b") == {"consolidated": 0, "failed": 0, "pending": 4}
    assert await vector_pool.fetchval("SELECT count(*) FROM observations") == 0


async def test_an_embeddings_outage_after_the_answer_writes_nothing_of_that_pass(
    vector_pool: asyncpg.Pool, fake: FakeLLMServer, embedder: HTTPEmbedder
) -> None:
    await ingest(vector_pool, "b", tea(4))
    # The facts' request succeeds, then the endpoint goes down before the apply.
    fake.control(embeddings={"script": [{"pass": True}, *[{"status": 502}] * 3]})
    llm = http_llm(fake.url)
    try:
        end, _ = await run_claimed(vector_pool, llm, Settings(), embedder)
    finally:
        await llm.aclose()
    assert end.status == "pending"
    assert fake.stats()["requests"] == 1
    assert await markers(vector_pool, "b") == {"consolidated": 0, "failed": 0, "pending": 4}
    assert await vector_pool.fetchval("SELECT count(*) FROM consolidation_outcomes") == 0


async def test_a_rejected_embeddings_key_fails_the_operation_at_once(
    vector_pool: asyncpg.Pool, fake: FakeLLMServer, embedder: HTTPEmbedder
) -> None:
    await ingest(vector_pool, "b", tea(2))
    fake.control(embeddings={"script": [{"status": 401}]})
    llm = http_llm(fake.url)
    try:
        end = await run(vector_pool, llm, Settings(max_attempts=5), embedder)
    finally:
        await llm.aclose()
    assert end.status == "failed"
    assert "CONSOLIDATION_EMBEDDINGS_API_KEY" in (end.error or "")
    assert fake.stats()["embeddings"]["requests"] == 1
    assert await markers(vector_pool, "b") == {"consolidated": 0, "failed": 0, "pending": 2}
