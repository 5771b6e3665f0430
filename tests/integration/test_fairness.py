"""Fairness between banks: past its time slice, an operation with others waiting gives its slot
up at a wave's close and comes back under the same id, its progress continued."""

from __future__ import annotations

from typing import Any

import asyncpg

from consolidation import queue, store
from consolidation.engine import run_operation
from consolidation.settings import Settings
from consolidation.testing.fake_llm import FakeLLMServer
from tests.support.engine import http_llm, ingest, markers, run_next, topics
from tests.support.invariants import assert_consistent

# Three full waves of four memories of one scope: a wave's group waits for the previous wave's
# (one scope's memories are applied in order), so a wave's close comes before the next starts.
CONFIG = Settings(wave_size=4, llm_batch_size=2, retry_backoff_s=0)
BIG = topics(1, 12)


async def operation(pool: asyncpg.Pool, operation_id: Any) -> asyncpg.Record:
    row = await pool.fetchrow("SELECT * FROM operations WHERE id = $1", operation_id)
    assert row is not None
    return row


async def test_past_its_slice_an_operation_yields_to_a_waiting_bank_and_continues_its_result(
    pool: asyncpg.Pool, fake: FakeLLMServer
) -> None:
    await ingest(pool, "big", BIG)
    big = (await queue.submit(pool, "big")).operation
    await ingest(pool, "small", topics(1, 2))
    small = (await queue.submit(pool, "small")).operation
    fake.control(latency_ms=300)  # a wave's close (milliseconds) ends before the next pass
    llm = http_llm(fake.url)
    try:
        first = await run_next(pool, llm, CONFIG, slice_s=0)
        assert first.status == "pending" and first.error is None
        row = await operation(pool, big.id)
        # Handed back after its first wave: no attempt spent, its result kept, due now.
        assert row["status"] == "pending" and row["attempt"] == 0
        # At the first wave's close: the passes then running (the next wave's, pipelined) finish,
        # nothing new starts.
        processed = row["result"]["processed"]
        assert row["result"]["slices"] == 1 and 4 <= processed < 12
        assert row["run_after"] > (await operation(pool, small.id))["run_after"]
        assert (await markers(pool, "big"))["consolidated"] == processed

        # The waiting bank gets the slot; then the big one continues under its id.
        assert (await run_next(pool, llm, CONFIG, slice_s=0)).status == "completed"
        assert (await operation(pool, small.id))["status"] == "completed"
        last = await run_next(pool, llm, CONFIG, slice_s=0)
    finally:
        await llm.aclose()
    assert last.status == "completed"
    row = await operation(pool, big.id)
    assert row["status"] == "completed" and row["attempt"] == 1
    result = row["result"]
    assert result["slices"] == 1 and result["processed"] == 12 and result["total"] == 12
    assert result["consolidated"] == 12
    assert result["perf"]["llm_calls"] == 6  # both attempts' passes, merged
    await assert_consistent(pool)


async def test_an_operation_past_its_slice_keeps_its_slot_when_nobody_waits(
    pool: asyncpg.Pool, fake: FakeLLMServer
) -> None:
    await ingest(pool, "big", BIG)
    await ingest(pool, "busy", topics(1, 2))
    big = (await queue.submit(pool, "big")).operation
    # Waiting, but for a bank that is already running: a slot given up would not go to it.
    await queue.start_foreground(pool, "busy", "someone", 30)
    await queue.submit(pool, "busy")
    llm = http_llm(fake.url)
    try:
        end = await run_next(pool, llm, CONFIG, slice_s=0)
    finally:
        await llm.aclose()
    assert end.status == "completed"
    row = await operation(pool, big.id)
    assert row["attempt"] == 1 and row["result"]["slices"] == 0


async def test_a_forget_of_its_own_bank_takes_the_slot_of_an_operation_past_its_slice(
    pool: asyncpg.Pool, fake: FakeLLMServer
) -> None:
    ids = await ingest(pool, "big", BIG)
    big = (await queue.submit(pool, "big")).operation
    lease = await queue.claim(pool, "w", 30)
    assert lease is not None and lease.operation_id == big.id
    await store.request_forget(pool, "big", [ids[-1]])  # asked while the bank is busy
    fake.control(latency_ms=300)  # a wave's close (milliseconds) ends before the next pass
    llm = http_llm(fake.url)
    try:
        yielded = await run_operation(pool, lease, llm, CONFIG, slice_s=0)
        assert yielded.status == "pending"
        forget = await run_next(pool, llm, CONFIG, slice_s=0)
        assert forget.status == "completed" and forget.summary.total == 1
        assert (await run_next(pool, llm, CONFIG, slice_s=0)).status == "completed"
    finally:
        await llm.aclose()
    row = await operation(pool, big.id)
    assert row["status"] == "completed" and row["result"]["processed"] == 11
    await assert_consistent(pool)


async def test_a_newer_operation_of_the_bank_is_absorbed_by_the_one_that_yields(
    pool: asyncpg.Pool, fake: FakeLLMServer
) -> None:
    await ingest(pool, "big", topics(3, 4))
    big = (await queue.submit(pool, "big")).operation
    await ingest(pool, "small", topics(1, 2))
    await queue.submit(pool, "small")
    lease = await queue.claim(pool, "w", 30)
    assert lease is not None and lease.operation_id == big.id
    # While it runs, an ingestion submits a second operation for the bank, with a priority.
    newer = (await queue.submit(pool, "big", priority=5)).operation
    assert (await queue.submit(pool, "big")).operation.id == newer.id
    status = await queue.yield_operation(pool, lease, {"slices": 1, "processed": 4})
    assert status == "pending"
    row = await operation(pool, big.id)
    assert row["status"] == "pending" and row["priority"] == 5
    absorbed = await operation(pool, newer.id)
    assert absorbed["status"] == "cancelled" and str(big.id) in absorbed["error"]
    claimed = await queue.claim(pool, "w", 30)
    assert claimed is not None and claimed.operation_id == big.id
    assert claimed.resumed == {"slices": 1, "processed": 4}


async def test_a_cancel_asked_before_the_hand_back_ends_the_operation(
    pool: asyncpg.Pool,
) -> None:
    await ingest(pool, "big", topics(1, 2))
    big = (await queue.submit(pool, "big")).operation
    lease = await queue.claim(pool, "w", 30)
    assert lease is not None
    await queue.request_cancel(pool, big.id)
    assert await queue.yield_operation(pool, lease, {"slices": 1}) == "cancelled"
    row = await operation(pool, big.id)
    assert row["status"] == "cancelled" and row["finished_at"] is not None
