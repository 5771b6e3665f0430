"""The sweeper enqueues what nobody triggered: one operation per stranded bank, one sweeper of the
fleet at a time, a doubling wait after failures."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from consolidation import queue, store
from consolidation.settings import Settings
from consolidation.sweeper import run_sweeper, sweep_once
from tests.support.engine import ingest

SETTINGS = Settings(retry_backoff_s=100)


async def live(pool: asyncpg.Pool) -> set[tuple[str, str]]:
    rows = await pool.fetch(
        "SELECT bank_id, kind FROM operations WHERE status IN ('pending', 'running')"
    )
    return {(r["bank_id"], r["kind"]) for r in rows}


async def failed_operations(pool: asyncpg.Pool, bank: str, ago_s: list[float]) -> None:
    """Operations of ``bank`` that failed ``ago_s`` seconds ago, oldest first."""
    for seconds in ago_s:
        await pool.execute(
            """INSERT INTO operations (id, bank_id, status, finished_at, created_at)
               VALUES (gen_random_uuid(), $1, 'failed', now() - make_interval(secs => $2),
                       now() - make_interval(secs => $2 + 1))""",
            bank,
            seconds,
        )


async def test_every_stranded_bank_gets_one_operation_and_busy_or_done_banks_none(
    pool: asyncpg.Pool,
) -> None:
    for bank in ("stranded", "queued", "busy", "done", "forgetting"):
        await ingest(pool, bank, [{"text": f"{bank} fact", "tags": ["t"]}])
    await queue.submit(pool, "queued")
    await queue.start_foreground(pool, "busy", "w", 30)
    await pool.execute("UPDATE memories SET consolidated_at = now() WHERE bank_id = 'done'")
    (memory_id,) = await pool.fetch("SELECT id FROM memories WHERE bank_id = 'forgetting'")
    forget_id = (await store.request_forget(pool, "forgetting", [memory_id["id"]]))[memory_id["id"]]
    # A forget whose operation failed for good: its memory waits, swept like a pending one.
    await pool.execute(
        "UPDATE operations SET status = 'failed', finished_at = now() - interval '1 hour'"
        " WHERE id = $1",
        forget_id,
    )
    before = await live(pool)

    swept = await sweep_once(pool, SETTINGS)
    assert {(s.bank_id, s.kind) for s in swept} == {
        ("stranded", "consolidate"),
        ("forgetting", "forget"),
    }
    assert await live(pool) == before | {("stranded", "consolidate"), ("forgetting", "forget")}
    # The forgotten memory's tombstone now names the live operation.
    (new_forget,) = [s.operation_id for s in swept if s.kind == "forget"]
    assert await store.request_forget(pool, "forgetting", [memory_id["id"]]) == {
        memory_id["id"]: new_forget
    }
    # Nothing left to sweep: a second sweep enqueues nothing.
    assert await sweep_once(pool, SETTINGS) == []


async def test_while_one_worker_sweeps_the_others_do_nothing(pool: asyncpg.Pool) -> None:
    await ingest(pool, "stranded", [{"text": "fact", "tags": []}])
    async with pool.acquire() as holder, holder.transaction():
        assert await holder.fetchval("SELECT pg_try_advisory_xact_lock($1)", queue.SWEEP_LOCK_KEY)
        assert await sweep_once(pool, SETTINGS) == []
        assert await live(pool) == set()
    assert len(await sweep_once(pool, SETTINGS)) == 1


async def test_sweepers_racing_enqueue_each_bank_once(pool: asyncpg.Pool) -> None:
    for i in range(20):
        await ingest(pool, f"bank-{i}", [{"text": "fact", "tags": []}])
    results = await asyncio.gather(*(sweep_once(pool, SETTINGS) for _ in range(8)))
    swept = [s.bank_id for result in results for s in result]
    assert sorted(swept) == sorted(f"bank-{i}" for i in range(20))
    assert await pool.fetchval("SELECT count(*) FROM operations") == 20


@pytest.mark.parametrize(
    ("failed_ago_s", "swept"),
    [
        ([99], False),  # one failure: wait 100 s
        ([101], True),
        ([500, 199], False),  # two in a row: 200 s
        ([500, 201], True),
        ([900, 800, 700, 399], False),  # four in a row: 800 s, capped at 600
        ([900, 800, 700, 601], True),
    ],
)
async def test_a_bank_whose_operations_keep_failing_waits_longer_each_time(
    pool: asyncpg.Pool, failed_ago_s: list[float], swept: bool
) -> None:
    await ingest(pool, "b", [{"text": "fact", "tags": []}])
    await failed_operations(pool, "b", failed_ago_s)
    assert bool(await sweep_once(pool, SETTINGS)) is swept


async def test_a_success_after_failures_resets_the_wait(pool: asyncpg.Pool) -> None:
    await ingest(pool, "b", [{"text": "fact", "tags": []}])
    await failed_operations(pool, "b", [900, 800])
    await pool.execute(
        "INSERT INTO operations (id, bank_id, status, finished_at, created_at)"
        " VALUES (gen_random_uuid(), 'b', 'completed', now() - interval '700 s',"
        "         now() - interval '701 s')"
    )
    await failed_operations(pool, "b", [150])  # one failure since: 100 s
    assert len(await sweep_once(pool, SETTINGS)) == 1


async def test_an_interval_of_zero_turns_the_sweeper_off(pool: asyncpg.Pool) -> None:
    await ingest(pool, "stranded", [{"text": "fact", "tags": []}])
    await asyncio.wait_for(run_sweeper(pool, Settings(sweep_interval_s=0)), 30)  # returns
    assert await live(pool) == set()
