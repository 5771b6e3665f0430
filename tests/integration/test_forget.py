"""Forgetting a memory: its text leaves every table, observations it alone supported go, those it
shared are re-derived from their other sources, and the redo after a failure changes nothing.

The LLM is the fake over real HTTP; Postgres is real. The forgotten memories carry a word found
nowhere else (``zebraquartz``) so every table can be searched for it.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import asyncpg
import pytest

from consolidation import queue, store
from consolidation.engine import StopReason, StopSignal, run_operation
from consolidation.errors import NotCancellable, NotFound
from consolidation.llm.embeddings import HTTPEmbedder
from consolidation.settings import Settings
from consolidation.testing.fake_llm import BADJSON_MARKER, FakeLLMServer
from tests.support.engine import (
    consolidate,
    http_llm,
    ingest,
    markers,
    observations_by_scope,
    run_next,
)
from tests.support.invariants import assert_consistent, tables_containing
from tests.support.waiting import wait_for

SECRET = "zebraquartz"


async def sources(pool: asyncpg.Pool, bank: str) -> dict[tuple[str, ...], list[set[uuid.UUID]]]:
    rows = await pool.fetch(
        """SELECT o.scope, array_agg(s.memory_id) AS memories
           FROM observations o JOIN observation_sources s ON s.observation_id = o.id
           WHERE o.bank_id = $1 GROUP BY o.id, o.scope""",
        bank,
    )
    out: dict[tuple[str, ...], list[set[uuid.UUID]]] = {}
    for r in rows:
        out.setdefault(tuple(r["scope"]), []).append(set(r["memories"]))
    return out


async def merged_bank(pool: asyncpg.Pool, fake: FakeLLMServer) -> dict[str, uuid.UUID]:
    """Bank ``b`` where the secret memory ``s`` is the only source of an observation in scope
    [v], and in scope [t] was merged, with ``bob`` and ``both``, into one observation (history:
    an update, a merge and a merged-away text holding the secret); ``dave`` failed in [t]."""
    llm = http_llm(fake.url)
    try:
        s, bob = await ingest(
            pool,
            "b",
            [
                {
                    "text": f"Alice hikes mountain {SECRET} trails",
                    "tags": ["t", "v"],
                    "observation_scopes": "per_tag",
                },
                {"text": "Bob swims ocean laps", "tags": ["t"]},
            ],
        )
        assert (await consolidate(pool, "b", llm)).status == "completed"
        both, dave = await ingest(
            pool,
            "b",
            [
                {"text": "Alice hikes mountain trails and Bob swims ocean laps", "tags": ["t"]},
                {"text": f"{BADJSON_MARKER} Dave reads novels", "tags": ["t"]},
            ],
        )
        assert (await consolidate(pool, "b", llm)).status == "completed"
    finally:
        await llm.aclose()
    actions = await pool.fetch("SELECT action FROM observation_history ORDER BY id")
    assert {r["action"] for r in actions} >= {"merged", "merged_away"}
    assert await sources(pool, "b") == {("t",): [{s, bob, both}], ("v",): [{s}]}
    return {"s": s, "bob": bob, "both": both, "dave": dave}


async def test_a_forgotten_memory_leaves_no_row_and_what_it_shared_is_rederived_without_it(
    pool: asyncpg.Pool, fake: FakeLLMServer
) -> None:
    ids = await merged_bank(pool, fake)
    present = await tables_containing(pool, SECRET)
    assert {"memories", "observations", "observation_history"} <= set(present)

    forgets = await store.request_forget(pool, "b", [ids["s"]])
    fake.reset()
    llm = http_llm(fake.url)
    try:
        end = await run_next(pool, llm, Settings(group_parallelism=1))
    finally:
        await llm.aclose()

    assert end.status == "completed", end.error
    assert await tables_containing(pool, SECRET) == {}
    # The model re-derived [t] from Bob's two memories alone: it never saw the secret.
    calls = fake.stats()["calls"]
    assert len(calls) == 1 and calls[0]["scope"] == ["t"]
    assert not any(SECRET in text for call in calls for text in call["fact_texts"])
    assert await sources(pool, "b") == {("t",): [{ids["bob"], ids["both"]}]}
    texts = await observations_by_scope(pool, "b")
    assert list(texts) == [("t",)] and "Bob swims ocean laps" in texts[("t",)][0]
    assert await pool.fetchval("SELECT count(*) FROM observation_history") == 0
    # The failed memory of the same scope keeps its marker, not its reason.
    dave = await pool.fetchrow(
        "SELECT consolidation_failed_at, consolidation_failed_reason FROM memories WHERE id = $1",
        ids["dave"],
    )
    assert dave["consolidation_failed_at"] is not None
    assert dave["consolidation_failed_reason"].startswith("withheld")
    await assert_consistent(pool)

    op = await queue.get_operation(pool, forgets[ids["s"]])
    assert op.kind == "forget" and op.status == "completed" and op.attempt == 1
    assert op.result is not None
    assert {k: op.result[k] for k in ("forgotten", "observations_affected")} == {
        "forgotten": 1,
        "observations_affected": 2,
    }
    assert op.result["observations_rederived"] == 1 and op.result["observations_created"] == 1
    assert op.result["observations_deleted"] == 2 and op.result["failure_reasons_withheld"] == 1
    tombstone = await pool.fetchrow("SELECT * FROM forgotten_memories")
    assert tombstone["memory_id"] == ids["s"] and tombstone["completed_at"] is not None


async def test_asking_again_answers_the_same_operation_before_and_after_it_ran(
    pool: asyncpg.Pool, fake: FakeLLMServer
) -> None:
    first, second = await ingest(
        pool, "b", [{"text": f"one {SECRET}", "tags": ["t"]}, {"text": "two", "tags": ["u"]}]
    )
    asked = await store.request_forget(pool, "b", [first])
    assert await store.request_forget(pool, "b", [first, first]) == asked
    # A second memory joins the pending forget operation.
    both = await store.request_forget(pool, "b", [second, first])
    assert both == {second: asked[first], first: asked[first]}
    assert await pool.fetchval("SELECT count(*) FROM operations") == 1

    llm = http_llm(fake.url)
    try:
        assert (await run_next(pool, llm)).status == "completed"
    finally:
        await llm.aclose()
    assert await pool.fetchval("SELECT count(*) FROM memories") == 0
    assert await store.request_forget(pool, "b", [first]) == asked
    await ingest(pool, "other", [{"text": "three"}])
    with pytest.raises(NotFound, match=str(first)):  # not a memory of that bank
        await store.request_forget(pool, "other", [first])
    with pytest.raises(NotFound, match="bank 'nope' does not exist"):
        await store.request_forget(pool, "nope", [first])
    unknown = uuid.uuid4()
    with pytest.raises(NotFound, match=str(unknown)):
        await store.request_forget(pool, "b", [second, unknown])


async def test_a_memory_forgotten_then_ingested_again_can_be_forgotten_again(
    pool: asyncpg.Pool, fake: FakeLLMServer
) -> None:
    memory = {"id": str(uuid.uuid4()), "text": f"tea {SECRET}", "tags": ["t"]}
    (memory_id,) = await ingest(pool, "b", [memory])
    first = (await store.request_forget(pool, "b", [memory_id]))[memory_id]
    llm = http_llm(fake.url)
    try:
        await run_next(pool, llm)
        await ingest(pool, "b", [memory])
        assert await markers(pool, "b") == {"consolidated": 0, "failed": 0, "pending": 1}
        second = (await store.request_forget(pool, "b", [memory_id]))[memory_id]
        assert second != first
        assert (await run_next(pool, llm)).status == "completed"
    finally:
        await llm.aclose()
    assert await tables_containing(pool, SECRET) == {}


async def test_a_memory_being_forgotten_is_never_sent_counted_or_marked(
    pool: asyncpg.Pool, fake: FakeLLMServer
) -> None:
    secret, _ = await ingest(
        pool,
        "b",
        [{"text": f"Alice {SECRET}", "tags": ["t"]}, {"text": "Alice drinks tea", "tags": ["t"]}],
    )
    await store.request_forget(pool, "b", [secret])
    stats = await store.bank_stats(pool, "b")
    assert stats.pending == 1
    op = (await queue.submit(pool, "b")).operation
    llm = http_llm(fake.url)
    try:
        # The forget goes first (its priority), then the consolidation sees one memory.
        assert (await run_next(pool, llm)).summary.total == 1
        end = await run_next(pool, llm)
    finally:
        await llm.aclose()
    assert end.status == "completed" and end.summary.total == 1
    assert (await queue.get_operation(pool, op.id)).status == "completed"
    assert not any(SECRET in t for c in fake.stats()["calls"] for t in c["fact_texts"])


async def test_a_forget_cannot_be_cancelled(pool: asyncpg.Pool) -> None:
    (memory_id,) = await ingest(pool, "b", [{"text": "x", "tags": []}])
    operation_id = (await store.request_forget(pool, "b", [memory_id]))[memory_id]
    with pytest.raises(NotCancellable):
        await queue.request_cancel(pool, operation_id)
    assert (await queue.get_operation(pool, operation_id)).status == "pending"


async def test_a_forget_asked_while_a_consolidation_runs_waits_for_it_and_leaves_no_trace(
    pool: asyncpg.Pool, fake: FakeLLMServer
) -> None:
    memories: list[dict[str, Any]] = [
        {"text": f"Person{t} drinks green tea every morning, note {i}", "tags": [f"topic-{t}"]}
        for t in range(3)
        for i in range(4)
    ]
    memories[1]["text"] += f" with {SECRET} honey"
    ids = await ingest(pool, "b", memories)
    fake.control(latency_ms=150)
    await queue.submit(pool, "b")
    llm = http_llm(fake.url)
    config = Settings(llm_batch_size=2, group_parallelism=1)
    try:
        running = asyncio.create_task(run_next(pool, llm, config))
        # The secret's pass is in flight: the engine fetched it before the forget was asked.
        await wait_for(
            lambda: any(SECRET in t for c in fake.stats()["calls"] for t in c["fact_texts"]),
            what="the secret's pass",
        )
        forget_id = (await store.request_forget(pool, "b", [ids[1]]))[ids[1]]
        # One operation per bank: no worker can start the forget while the consolidation runs.
        assert await queue.claim(pool, "other-worker", 30) is None
        assert (await running).status == "completed"
        assert SECRET in "".join((await observations_by_scope(pool, "b"))[("topic-0",)])
        fake.reset()
        end = await run_next(pool, llm, config)
    finally:
        await llm.aclose()
    assert end.status == "completed" and end.summary.total == 1
    assert (await queue.get_operation(pool, forget_id)).status == "completed"
    assert await tables_containing(pool, SECRET) == {}
    census = await assert_consistent(pool)
    assert census.memories == 11 and census.consolidated == 11
    # Nothing else was lost: every topic still has its observation, from all its memories.
    by_scope = await sources(pool, "b")
    assert sorted(by_scope) == [("topic-0",), ("topic-1",), ("topic-2",)]
    assert set().union(*by_scope[("topic-0",)]) == {ids[0], ids[2], ids[3]}


async def test_a_forget_that_fails_half_way_is_redone_from_the_database_without_duplicates(
    pool: asyncpg.Pool, fake: FakeLLMServer
) -> None:
    memories: list[dict[str, Any]] = [
        {"text": f"Person{t} drinks green tea every morning, note {i}", "tags": [f"topic-{t}"]}
        for t in range(3)
        for i in range(3)
    ]
    for t in range(3):
        memories[3 * t]["text"] += f" {SECRET}"
    ids = await ingest(pool, "b", memories)
    llm = http_llm(fake.url, max_retries=0)
    config = Settings(group_parallelism=1, retry_backoff_s=0)
    try:
        assert (await consolidate(pool, "b", llm, config)).status == "completed"
        forgotten = [ids[0], ids[3], ids[6]]
        operation_id = (await store.request_forget(pool, "b", forgotten))[ids[0]]
        fake.reset()
        # The first re-derivation is answered, the second gets a 503: the attempt fails.
        fake.control(script=[{"pass": True}, {"status": 503}])
        first = await run_next(pool, llm, config)
        assert first.status == "pending" and first.error is not None
        assert "503" in first.error
        assert (
            await pool.fetchval("SELECT count(*) FROM memories WHERE forgotten_at IS NOT NULL") == 3
        )
        assert len(await tables_containing(pool, SECRET)) > 0
        second = await run_next(pool, llm, config)
    finally:
        await llm.aclose()
    assert second.status == "completed", second.error
    op = await queue.get_operation(pool, operation_id)
    assert op.status == "completed" and op.attempt == 2
    # The redo re-derived only the two observations the first attempt had not replaced.
    assert len(fake.stats()["calls"]) == 1 + 1 + 2
    assert await tables_containing(pool, SECRET) == {}
    census = await assert_consistent(pool)
    assert census.memories == 6 and census.observations == 3
    by_scope = await sources(pool, "b")
    assert all(len(found) == 1 and len(found[0]) == 2 for found in by_scope.values())


async def test_forgetting_never_blocks_ingestion_into_the_bank(
    pool: asyncpg.Pool, fake: FakeLLMServer
) -> None:
    ids = await ingest(
        pool,
        "b",
        [
            {"text": f"Alice drinks green tea {SECRET}", "tags": ["t"]},
            {"text": "Alice drinks green tea daily", "tags": ["t"]},
        ],
    )
    llm = http_llm(fake.url)
    try:
        await consolidate(pool, "b", llm)
        await store.request_forget(pool, "b", [ids[0]])
        fake.control(script=[{"hang": True}])
        stop = StopSignal()
        forgetting = asyncio.create_task(run_next(pool, llm, stop=stop))
        await wait_for(lambda: fake.stats()["in_flight"] == 1, what="the re-derivation")
        # Mid-forget, the same bank takes new memories and new forget requests at once.
        added = await asyncio.wait_for(
            ingest(pool, "b", [{"text": "Alice drinks coffee", "tags": ["t"]}]), 30
        )
        later = await asyncio.wait_for(store.request_forget(pool, "b", added), 30)
        running = await pool.fetchval("SELECT id FROM operations WHERE status = 'running'")
        assert later[added[0]] != running
        assert (await queue.get_operation(pool, later[added[0]])).status == "pending"
        stop.set(StopReason.SHUTDOWN)  # as a worker that exits: the forget is handed back
        stop.force()
        # ... to the newer forget, which now covers both memories.
        assert (await forgetting).status == "cancelled"
        again = await store.request_forget(pool, "b", [ids[0], added[0]])
        assert again == {ids[0]: later[added[0]], added[0]: later[added[0]]}
    finally:
        await llm.aclose()


async def test_with_embeddings_a_rederived_observation_is_stored_with_its_vector(
    vector_pool: asyncpg.Pool, fake: FakeLLMServer
) -> None:
    pool = vector_pool
    ids = await ingest(
        pool,
        "b",
        [
            {"text": f"Alice drinks green tea every morning {SECRET}", "tags": ["t"]},
            {"text": "Alice drinks green tea every morning", "tags": ["t"]},
            {"text": "Alice drinks green tea every evening", "tags": ["t"]},
        ],
    )
    llm = http_llm(fake.url)
    embedder = HTTPEmbedder(base_url=fake.url, model="fake-embed", max_retries=0)
    try:
        lease = await queue.start_foreground(pool, "b", "test-worker", 30)
        await run_operation(pool, lease, llm, Settings(), embedder=embedder)
        await store.request_forget(pool, "b", [ids[0]])
        end = await run_next(pool, llm, embedder=embedder)
    finally:
        await llm.aclose()
        await embedder.aclose()
    assert end.status == "completed", end.error
    assert end.summary.perf.embedding_requests >= 1
    rows = await pool.fetch(
        "SELECT embedding IS NOT NULL AS has, embedding_version FROM observations"
    )
    assert [(r["has"], r["embedding_version"]) for r in rows] == [(True, 1)]
    assert await tables_containing(pool, SECRET) == {}
    await assert_consistent(pool)
