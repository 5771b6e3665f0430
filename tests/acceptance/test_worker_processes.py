"""Workers as real processes: crashes, pauses past the lease, shutdown, many replicas."""

from __future__ import annotations

import signal
from typing import Any

import asyncpg
import pytest

from consolidation.testing.fake_llm import FakeLLMServer
from tests.support.engine import grew, markers, submit_after_ingest, topics
from tests.support.services import Serve
from tests.support.waiting import wait_completed, wait_for

pytestmark = pytest.mark.acceptance


async def snapshot(pool: asyncpg.Pool) -> dict[str, Any]:
    """Everything an operation can write."""
    tables = {
        "observations": "SELECT id, scope, text, version, updated_at FROM observations ORDER BY id",
        "sources": "SELECT * FROM observation_sources ORDER BY observation_id, memory_id",
        "history": "SELECT * FROM observation_history ORDER BY id",
        "outcomes": "SELECT * FROM consolidation_outcomes ORDER BY memory_id, scope",
        "memories": "SELECT id, consolidated_at, consolidation_failed_at FROM memories ORDER BY id",
        "operations": "SELECT * FROM operations ORDER BY id",
    }
    return {name: [dict(r) for r in await pool.fetch(sql)] for name, sql in tables.items()}


async def assert_consolidated_exactly_once(
    pool: asyncpg.Pool, topics_count: int, memories: int
) -> None:
    assert await markers(pool, "b") == {"consolidated": memories, "failed": 0, "pending": 0}
    # One observation per topic: a duplicate would show as a second one in some scope.
    assert await pool.fetchval("SELECT count(*) FROM observations") == topics_count
    assert await pool.fetchval("SELECT count(DISTINCT scope) FROM observations") == topics_count
    assert await pool.fetchval("SELECT count(*) FROM consolidation_outcomes") == memories
    assert await pool.fetchval("SELECT count(*) FROM observation_sources") == memories


async def operation(pool: asyncpg.Pool, operation_id: Any) -> asyncpg.Record:
    row = await pool.fetchrow("SELECT * FROM operations WHERE id = $1", operation_id)
    assert row is not None
    return row


async def test_sigkill_mid_wave_then_another_worker_completes_without_duplicates(
    pool: asyncpg.Pool, fake: FakeLLMServer, serve: Serve
) -> None:
    fake.control(latency_ms=100)
    op = await submit_after_ingest(pool, "b", topics(4, 6))
    first = serve.worker("first", LEASE_S="1")
    await wait_for(lambda: fake.stats()["completed"] >= 5, what="some passes to be answered")
    first.signal(signal.SIGKILL)
    first.wait_exit()
    assert (await markers(pool, "b"))["pending"] > 0

    serve.worker("second", LEASE_S="1")
    await wait_completed(pool, op.id)
    row = await operation(pool, op.id)
    # Taken over from the killed worker without spending an attempt.
    assert (row["attempt"], row["reclaims"]) == (1, 1) and row["worker_id"].startswith("worker:")
    await assert_consolidated_exactly_once(pool, 4, 24)


async def test_a_worker_paused_past_its_lease_writes_nothing_after_another_took_over(
    pool: asyncpg.Pool, fake: FakeLLMServer, serve: Serve
) -> None:
    fake.control(latency_ms=100)
    op = await submit_after_ingest(pool, "b", topics(4, 6))
    paused = serve.worker("paused", LEASE_S="1")
    await paused.wait_event("operation_claimed")
    await wait_for(lambda: fake.stats()["completed"] >= 3, what="some passes to be answered")
    paused.signal(signal.SIGSTOP)

    other = serve.worker("other", LEASE_S="1")
    await wait_completed(pool, op.id)
    await assert_consolidated_exactly_once(pool, 4, 24)
    before = await snapshot(pool)

    paused.signal(signal.SIGCONT)
    await paused.wait_event("operation_finished", status="lost")
    assert await snapshot(pool) == before

    for service in (paused, other):
        service.signal(signal.SIGTERM)
        assert service.wait_exit() == 0


async def test_sigterm_hands_the_operation_back_without_spending_an_attempt(
    pool: asyncpg.Pool, fake: FakeLLMServer, serve: Serve
) -> None:
    fake.control(latency_ms=150)
    op = await submit_after_ingest(pool, "b", topics(4, 6))
    first = serve.worker("first", SHUTDOWN_GRACE_S="10")
    await wait_for(lambda: fake.stats()["completed"] >= 3, what="some passes to be answered")
    first.signal(signal.SIGTERM)
    assert first.wait_exit() == 0
    row = await operation(pool, op.id)
    assert row["status"] == "pending" and row["attempt"] == 0
    assert row["error"] == "interrupted by shutdown"
    # Passes that were in flight finished within the grace period and their work was marked.
    state = await markers(pool, "b")
    assert state["consolidated"] > 0 and state["pending"] > 0
    assert fake.stats()["aborted"] == 0

    serve.worker("second", SHUTDOWN_GRACE_S="10")
    await wait_completed(pool, op.id)
    assert (await operation(pool, op.id))["attempt"] == 1
    await assert_consolidated_exactly_once(pool, 4, 24)


async def test_sigterm_past_the_grace_period_cancels_in_flight_calls_and_still_hands_back(
    pool: asyncpg.Pool, fake: FakeLLMServer, serve: Serve
) -> None:
    fake.control(script=[{"pass": True}, {"hang": True}])
    op = await submit_after_ingest(pool, "b", topics(1, 6))
    worker = serve.worker("worker", SHUTDOWN_GRACE_S="0.5")
    await wait_for(lambda: fake.stats()["requests"] >= 2, what="the hanging call")
    # The second call starts once the first answer is in, while the first pass applies.
    await wait_for(
        lambda: grew(pool, "SELECT count(*) FROM consolidation_outcomes", 1),
        what="the first pass's apply",
    )
    worker.signal(signal.SIGTERM)
    assert worker.wait_exit() == 0
    await wait_for(lambda: fake.stats()["aborted"] == 1, what="the hanging call to be aborted")
    row = await operation(pool, op.id)
    assert row["status"] == "pending" and row["attempt"] == 0
    assert await markers(pool, "b") == {"consolidated": 2, "failed": 0, "pending": 4}


async def test_an_idle_worker_is_woken_by_notify_not_by_polling(
    pool: asyncpg.Pool, serve: Serve
) -> None:
    worker = serve.worker("worker", POLL_INTERVAL_S="3600")
    await worker.wait_event("worker_started")
    op = await submit_after_ingest(pool, "b", topics(1, 2))
    # With an hour between polls, only the NOTIFY can have woken it.
    await worker.wait_event("operation_claimed", timeout_s=30, operation_id=str(op.id))


async def test_three_workers_and_a_dozen_banks_run_every_operation_exactly_once(
    pool: asyncpg.Pool, fake: FakeLLMServer, serve: Serve
) -> None:
    fake.control(latency_ms=40)
    workers = [serve.worker(f"w{i}", WORKER_CONCURRENCY="2") for i in range(3)]
    for worker in workers:
        await worker.wait_event("worker_started")
    banks = [f"bank-{i}" for i in range(12)]
    operations = []
    for bank in banks:
        memories = [{"text": f"{bank} fact {i}", "tags": ["t"]} for i in range(6)]
        operations.append((await submit_after_ingest(pool, bank, memories)).id)
    await wait_for(
        lambda: pool.fetchval("SELECT count(*) = 12 FROM operations WHERE status = 'completed'"),
        what="all twelve operations to complete",
    )
    rows = await pool.fetch("SELECT id, attempt, worker_id FROM operations")
    assert sorted(r["id"] for r in rows) == sorted(operations)
    assert all(r["attempt"] == 1 for r in rows)
    claims = [e["operation_id"] for w in workers for e in w.events("operation_claimed")]
    assert sorted(claims) == sorted(str(o) for o in operations)  # each claimed exactly once
    assert len({r["worker_id"] for r in rows}) >= 2
    # Calls for one (bank, scope) never overlapped, so no bank ever had two running workers.
    assert fake.stats()["max_in_flight_per_scope"] == 1
    assert await pool.fetchval("SELECT count(*) FROM consolidation_outcomes") == 72
    assert await pool.fetchval("SELECT count(*) FROM memories WHERE consolidated_at IS NULL") == 0
