"""Cancelling an operation keeps and marks every pass it applied (DESIGN §2, Cancellation)."""

from __future__ import annotations

import asyncio

import asyncpg

from consolidation import db, queue
from consolidation.engine import OperationEnd, StopReason, StopSignal, run_operation
from consolidation.settings import Settings
from consolidation.testing.fake_llm import FakeLLMServer
from tests.support.engine import APPLY_GATE, grew, http_llm, ingest, topics, unretrieved_task_errors
from tests.support.invariants import assert_consistent
from tests.support.proxy import TcpProxy
from tests.support.waiting import wait_for

# An apply waiting at APPLY_GATE for the advisory lock the test holds.
AT_THE_GATE = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"

FULLY_JOURNALED_BUT_UNMARKED = """
SELECT count(*) FROM memories m
WHERE m.consolidated_at IS NULL AND m.consolidation_failed_at IS NULL
  AND NOT EXISTS (
      SELECT 1 FROM memory_scopes s
      WHERE s.memory_id = m.id
        AND NOT EXISTS (SELECT 1 FROM consolidation_outcomes o
                        WHERE o.memory_id = s.memory_id AND o.scope = s.scope))
"""


async def test_a_pass_applied_while_its_operation_is_cancelled_is_marked_and_counted(
    pool: asyncpg.Pool, database_url: str, fake: FakeLLMServer
) -> None:
    # The apply commits on the server, but its reply is held by the network when the cancel
    # lands: the engine never hears that it succeeded. The journal has the pass all the same,
    # so the cancelled operation must mark its memories and count them as processed. The
    # applies wait at a gate (an advisory lock the test holds) until the replies are held, so
    # one is sure to commit unheard: waiting for one sent during the hold could wait forever
    # once every group had its apply's reply outstanding.
    await ingest(pool, "b", topics(6, 3))
    await pool.execute(APPLY_GATE)
    fake.control(latency_ms=20)
    gate = await asyncpg.connect(database_url)
    async with TcpProxy.in_front_of(database_url) as proxy:
        engine_pool = await db.create_pool(proxy.url(database_url), min_size=1, max_size=12)
        llm = http_llm(fake.url)
        try:
            await gate.execute("SELECT pg_advisory_lock(4242)")
            lease = await queue.start_foreground(pool, "b", "test-worker", 30)
            stop = StopSignal()
            settings = Settings(llm_batch_size=1, group_parallelism=6)
            run = asyncio.create_task(run_operation(engine_pool, lease, llm, settings, stop=stop))
            await wait_for(lambda: pool.fetchval(AT_THE_GATE), what="an apply waiting at the gate")
            proxy.hold()
            await gate.execute("SELECT pg_advisory_unlock(4242)")
            journal = "SELECT count(*) FROM consolidation_outcomes"
            await wait_for(lambda: grew(pool, journal, 0), what="an apply committed unheard")
            stop.set(StopReason.CANCEL)
            proxy.release()
            end = await asyncio.wait_for(run, 30)
        finally:
            proxy.release()
            await gate.close()
            await llm.aclose()
            await engine_pool.close()
    assert end.status == "cancelled"
    assert await pool.fetchval(FULLY_JOURNALED_BUT_UNMARKED) == 0
    marked = await pool.fetchval(
        "SELECT count(*) FROM memories"
        " WHERE consolidated_at IS NOT NULL OR consolidation_failed_at IS NOT NULL"
    )
    result = await pool.fetchval("SELECT result FROM operations WHERE id = $1", lease.operation_id)
    assert marked > 0 and result["processed"] == marked
    await assert_consistent(pool, allow_pending=True)


async def test_cancels_delivered_again_and_again_to_many_operations_leave_no_applied_work_unmarked(
    pool: asyncpg.Pool, fake: FakeLLMServer
) -> None:
    # Twelve banks run at once; each is asked to cancel through every path a worker has: the
    # database row (seen by the lease keeper's heartbeats and by every wave close's progress
    # write) and the LISTEN path (StopSignal.set), the latter again and again until its run
    # ends. However often the cancel lands, each operation ends `cancelled` only after every
    # wave close and every apply already sent: nothing journaled for all its scopes is left
    # neither consolidated nor failed.
    banks = [f"bank-{i}" for i in range(12)]
    for bank in banks:
        await ingest(pool, bank, topics(8, 10))
    fake.control(latency_ms=3)
    settings = Settings(wave_size=20, llm_batch_size=1, group_parallelism=4, lease_s=0.3)
    llm = http_llm(fake.url)
    runs: list[asyncio.Task[OperationEnd]] = []
    with unretrieved_task_errors() as unretrieved:
        try:
            leases = [await queue.start_foreground(pool, bank, "test-worker", 30) for bank in banks]
            stops = [StopSignal() for _ in banks]
            runs = [
                asyncio.create_task(run_operation(pool, lease, llm, settings, stop=stop))
                for lease, stop in zip(leases, stops, strict=True)
            ]
            journal = (
                "SELECT count(DISTINCT m.bank_id) FROM consolidation_outcomes o"
                " JOIN memories m ON m.id = o.memory_id"
            )
            await wait_for(
                lambda: grew(pool, journal, len(banks) - 1), what="every bank's first applies"
            )
            for lease in leases:
                await queue.request_cancel(pool, lease.operation_id)
            pending = set(runs)
            while pending:
                for stop, run in zip(stops, runs, strict=True):
                    if run in pending:
                        stop.set(StopReason.CANCEL)
                _, pending = await asyncio.wait(pending, timeout=0.005)
            ends = [run.result() for run in runs]
        finally:
            for run in runs:
                run.cancel()
            await asyncio.gather(*runs, return_exceptions=True)
            await llm.aclose()
    assert unretrieved == []
    assert {end.status for end in ends} <= {"cancelled", "completed"}
    assert any(end.status == "cancelled" for end in ends)
    assert await pool.fetchval(FULLY_JOURNALED_BUT_UNMARKED) == 0
    for end, lease in zip(ends, leases, strict=True):
        marked = await pool.fetchval(
            "SELECT count(*) FROM memories WHERE bank_id = $1"
            " AND (consolidated_at IS NOT NULL OR consolidation_failed_at IS NOT NULL)",
            lease.bank_id,
        )
        assert end.summary.processed == marked  # what was marked is what was counted
    await assert_consistent(pool, allow_pending=True)
