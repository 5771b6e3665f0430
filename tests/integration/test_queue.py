"""Operation state in Postgres: submit, claim, fence, retry, cancel, fencing stalled workers."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from consolidation import db, queue
from consolidation.errors import LeaseLost
from tests.support.waiting import wait_for


async def expire(pool: asyncpg.Pool, lease: queue.Lease) -> None:
    await pool.execute(
        "UPDATE operations SET lease_expires_at = now() - interval '1 minute' WHERE id = $1",
        lease.operation_id,
    )


async def test_an_unscoped_submit_joins_the_pending_one(pool: asyncpg.Pool) -> None:
    first = await queue.submit(pool, "b")
    second = await queue.submit(pool, "b")
    scoped = await queue.submit(pool, "b", scopes=[("x",)])
    assert not first.deduplicated and second.deduplicated
    assert second.operation.id == first.operation.id
    assert not scoped.deduplicated and scoped.operation.id != first.operation.id


async def test_claim_takes_due_work_by_priority_and_one_bank_at_a_time(pool: asyncpg.Pool) -> None:
    low = (await queue.submit(pool, "a")).operation
    high = (await queue.submit(pool, "b", priority=5)).operation
    also_b = (await queue.submit(pool, "b", scopes=[("x",)])).operation
    first = await queue.claim(pool, "w1", 30)
    second = await queue.claim(pool, "w2", 30)
    third = await queue.claim(pool, "w3", 30)
    assert first is not None and first.operation_id == high.id and first.attempt == 1
    assert second is not None and second.operation_id == low.id
    assert third is None  # bank b's scoped operation waits for the running one
    assert also_b.status == "pending"


async def test_an_expired_lease_is_reclaimed_and_the_old_owner_is_fenced(
    pool: asyncpg.Pool,
) -> None:
    await queue.submit(pool, "b")
    old = await queue.claim(pool, "w1", 30)
    assert old is not None
    assert await queue.claim(pool, "w2", 30) is None
    await expire(pool, old)
    new = await queue.claim(pool, "w2", 30)
    assert new is not None and new.operation_id == old.operation_id and new.reclaimed
    assert new.attempt == 1  # a takeover spends no attempt (up to MAX_FREE_RECLAIMS)
    for write in (
        queue.heartbeat(pool, old, 30),
        queue.record_progress(pool, old, {"x": 1}),
        queue.finish(pool, old, "completed"),
    ):
        with pytest.raises(LeaseLost):
            await write
    await queue.finish(pool, new, "completed", result={"ok": True})
    op = await queue.get_operation(pool, new.operation_id)
    assert op.status == "completed" and op.result == {"ok": True}


async def test_release_backs_off_and_a_refund_keeps_the_attempt(pool: asyncpg.Pool) -> None:
    await queue.submit(pool, "b")
    lease = await queue.claim(pool, "w", 30)
    assert lease is not None
    assert (
        await queue.release(pool, lease, delay_s=3600, error="boom", refund_attempt=False)
        == "pending"
    )
    op = await queue.get_operation(pool, lease.operation_id)
    assert op.attempt == 1 and op.error == "boom"
    assert await queue.claim(pool, "w", 30) is None  # not due for an hour
    await pool.execute("UPDATE operations SET run_after = now()")
    again = await queue.claim(pool, "w", 30)
    assert again is not None and again.attempt == 2
    await queue.release(pool, again, delay_s=0, error="shutdown", refund_attempt=True)
    assert (await queue.get_operation(pool, again.operation_id)).attempt == 1


async def test_takeovers_spend_no_attempt_until_their_bound_and_attempts_never_exceed_the_max(
    pool: asyncpg.Pool,
) -> None:
    """An operation whose workers keep losing their lease (an outage past it, a crash loop): the
    first MAX_FREE_RECLAIMS takeovers are free, later ones spend attempts, and with none left it
    ends ``failed`` saying so instead of running attempt max_attempts + 1."""
    op = (await queue.submit(pool, "b", max_attempts=2)).operation
    lease = await queue.claim(pool, "w0", 30)
    assert lease is not None
    seen = [(lease.attempt, lease.reclaimed)]
    free = queue.MAX_FREE_RECLAIMS
    for n in range(1, free + 2):
        await expire(pool, lease)
        assert await queue.end_exhausted_reclaims(pool) == []
        taken = await queue.claim(pool, f"w{n}", 30)
        assert taken is not None
        lease = taken
        seen.append((lease.attempt, lease.reclaimed))
    assert seen == [(1, False)] + [(1, True)] * free + [(2, True)]
    row = await pool.fetchrow(
        "SELECT attempt, reclaims, interruptions, status FROM operations WHERE id = $1", op.id
    )
    assert dict(row) == {
        "attempt": 2,
        "reclaims": free + 1,
        "interruptions": free,
        "status": "running",
    }
    # The next lapse has no attempt left to take over with: no claim runs it, the sweep ends it.
    assert await queue.claim(pool, "w-next", 30) is None
    await expire(pool, lease)
    ended = await queue.end_exhausted_reclaims(pool)
    assert [e.operation_id for e in ended] == [op.id]
    final = await queue.get_operation(pool, op.id)
    assert final.status == "failed" and final.attempt == 2
    assert final.error is not None and "no attempts left (2 of 2)" in final.error
    assert final.last_error == final.error and final.last_error_at is not None


async def test_a_worker_never_ends_as_exhausted_an_operation_it_still_runs(
    pool: asyncpg.Pool,
) -> None:
    await queue.submit(pool, "b", max_attempts=1)
    lease = await queue.claim(pool, "w", 30)
    assert lease is not None
    await pool.execute("UPDATE operations SET reclaims = $1", queue.MAX_FREE_RECLAIMS)
    await expire(pool, lease)
    assert await queue.end_exhausted_reclaims(pool, [lease.operation_id]) == []
    await queue.heartbeat(pool, lease, 30)  # still ours


async def test_the_last_error_stays_while_the_next_attempt_waits_and_runs(
    pool: asyncpg.Pool,
) -> None:
    await queue.submit(pool, "b", max_attempts=2)
    lease = await queue.claim(pool, "w", 30)
    assert lease is not None
    await queue.release(pool, lease, delay_s=60, error="boom", refund_attempt=False)
    waiting = await queue.get_operation(pool, lease.operation_id)
    assert waiting.status == "pending" and waiting.last_error == "boom"
    assert waiting.last_error_at is not None and waiting.run_after > waiting.last_error_at
    body = waiting.to_json()
    assert body["last_error"] == "boom" and body["last_error_at"] and body["run_after"]
    await pool.execute("UPDATE operations SET run_after = now()")
    again = await queue.claim(pool, "w", 30)
    assert again is not None and again.attempt == 2
    # A shutdown's hand-back is no error: the error before it stays.
    await queue.release(
        pool, again, delay_s=0, error="interrupted by shutdown", refund_attempt=True
    )
    assert (await queue.get_operation(pool, lease.operation_id)).last_error == "boom"
    again = await queue.claim(pool, "w", 30)
    assert again is not None and again.attempt == 2
    running = await queue.get_operation(pool, lease.operation_id)
    assert running.error is None and running.last_error == "boom"
    assert running.last_error_at == waiting.last_error_at
    await queue.finish(pool, again, "completed", result={})
    done = await queue.get_operation(pool, lease.operation_id)
    assert done.error is None and done.last_error == "boom"


async def test_a_retry_is_superseded_by_a_newer_pending_operation(pool: asyncpg.Pool) -> None:
    await queue.submit(pool, "b")
    lease = await queue.claim(pool, "w", 30)
    assert lease is not None
    newer = (await queue.submit(pool, "b")).operation
    status = await queue.release(pool, lease, delay_s=0, error="boom", refund_attempt=False)
    assert status == "failed"
    op = await queue.get_operation(pool, lease.operation_id)
    assert str(newer.id) in (op.error or "")


async def test_cancel_ends_a_pending_operation_at_once_and_flags_a_running_one(
    pool: asyncpg.Pool,
) -> None:
    pending = (await queue.submit(pool, "a")).operation
    assert (await queue.request_cancel(pool, pending.id)).status == "cancelled"
    await queue.submit(pool, "b")
    lease = await queue.claim(pool, "w", 30)
    assert lease is not None
    assert (await queue.request_cancel(pool, lease.operation_id)).status == "running"
    assert await queue.heartbeat(pool, lease, 30) is True  # the worker learns it on its heartbeat


async def test_a_worker_frozen_inside_a_transaction_is_fenced_so_its_work_can_be_reclaimed(
    pool: asyncpg.Pool, database_url: str
) -> None:
    await queue.submit(pool, "b")
    lease = await queue.claim(pool, "worker:frozen:1", 30)
    assert lease is not None
    await expire(pool, lease)
    frozen_pool = await db.create_pool(database_url, application_name="worker:frozen:1")
    conn = await frozen_pool.acquire()
    try:
        transaction = conn.transaction()
        await transaction.start()
        # Hold the row FOR SHARE, as an apply in progress does.
        await conn.execute("SELECT 1 FROM operations WHERE id = $1 FOR SHARE", lease.operation_id)
        assert await queue.claim(pool, "worker:healthy:2", 30) is None  # row skipped: locked
        fenced = await queue.terminate_stalled_workers(pool, "worker:healthy:2", grace_s=0)
        assert fenced == ["worker:frozen:1"]
        # Termination is asynchronous: the row is free once the frozen session has gone.
        reclaimed = await wait_for(
            lambda: queue.claim(pool, "worker:healthy:2", 30), what="the reclaim"
        )
        assert reclaimed.attempt == 1 and reclaimed.reclaimed
    finally:
        frozen_pool.terminate()


async def _waiting_for_a_lock(pool: asyncpg.Pool, pid: int) -> bool:
    waiting_on: str | None = await pool.fetchval(
        "SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1", pid
    )
    return waiting_on == "Lock"


async def test_a_heartbeat_and_a_progress_report_at_once_never_deadlock(
    pool: asyncpg.Pool,
) -> None:
    # A worker's heartbeat and its progress report update the operation row on two connections
    # at once. Were each to take a share lock on the row (the fence) before the row lock, each
    # would wait for the other's: Postgres would break the deadlock by failing one, and the
    # operation with it. A third holder of a share lock makes them meet every time.
    await queue.submit(pool, "b")
    lease = await queue.claim(pool, "w1", 30)
    assert lease is not None
    async with pool.acquire() as reader, pool.acquire() as first, pool.acquire() as second:
        pids = [await c.fetchval("SELECT pg_backend_pid()") for c in (first, second)]
        async with reader.transaction():
            await reader.execute(
                "SELECT 1 FROM operations WHERE id = $1 FOR SHARE", lease.operation_id
            )
            progress = asyncio.create_task(queue.record_progress(first, lease, {"done": 1}))
            await wait_for(lambda: _waiting_for_a_lock(pool, pids[0]), what="progress waits")
            beat = asyncio.create_task(queue.heartbeat(second, lease, 30))
            await wait_for(lambda: _waiting_for_a_lock(pool, pids[1]), what="heartbeat waits")
        # The reader's transaction is over: both writes go through, one after the other.
        async with asyncio.timeout(30):
            done = await asyncio.gather(progress, beat, return_exceptions=True)
    # gather gives a list (typeshed says a tuple).
    assert list(done) == [False, False]
    op = await queue.get_operation(pool, lease.operation_id)
    assert op.status == "running" and op.progress == {"done": 1}
