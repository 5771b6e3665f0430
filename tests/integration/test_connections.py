"""The service's connections to Postgres: bounded by the lease, given back when idle, and named
so that a stalled worker can be fenced whatever its host name."""

from __future__ import annotations

from contextlib import AsyncExitStack

import asyncpg
import pytest

from consolidation import db, queue, runtime, store
from consolidation.settings import load_settings
from tests.integration.test_queue import expire
from tests.support.waiting import wait_for

SESSIONS_NAMED = """
SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND application_name = $1
"""


async def sessions_named(pool: asyncpg.Pool, name: str) -> int:
    count: int = await pool.fetchval(SESSIONS_NAMED, name)
    return count


async def test_the_services_pool_gives_a_bursts_connections_back_when_idle(
    pool: asyncpg.Pool, database_url: str
) -> None:
    settings = load_settings(database_url=database_url)
    async with runtime.open_runtime(settings) as rt, AsyncExitStack() as burst:
        held = [await burst.enter_async_context(rt.pool.acquire()) for _ in range(12)]
        assert await sessions_named(pool, rt.worker_id) == len(held)
        await burst.aclose()

        # Idle connections close after db.POOL_IDLE_S, down to the pool's floor of one.
        async def idle_ones_closed() -> bool:
            return await sessions_named(pool, rt.worker_id) <= 1

        await wait_for(
            idle_ones_closed,
            timeout_s=60,
            what="the pool to give its idle connections back",
        )
        assert await sessions_named(pool, rt.worker_id) == 1
        assert await rt.pool.fetchval("SELECT 1") == 1


async def test_a_statement_that_outlives_the_lease_is_cut_and_its_session_cleaned(
    database_url: str,
) -> None:
    timeouts = db.Timeouts.for_lease(1.0)
    bounded = await db.create_pool(database_url, min_size=1, max_size=2, timeouts=timeouts)
    try:
        assert await bounded.fetchval("SHOW idle_in_transaction_session_timeout") == "1s"
        assert await bounded.fetchval("SHOW statement_timeout") == "2s"
        with pytest.raises(TimeoutError):
            await bounded.fetchval("SELECT pg_sleep(60)")
        # The cancel reached the server: the connection serves the next statement.
        assert await bounded.fetchval("SELECT 1") == 1
    finally:
        await bounded.close()


LONG_HOST = "node-" + "x" * 120 + ".eu-west-3.compute.internal"


@pytest.mark.parametrize(
    "hostname",
    [LONG_HOST, "ワーカー.example", "tab\there", "h"],
    ids=["long", "non-ascii", "control", "short"],
)
def test_a_worker_id_is_an_application_name_postgres_keeps(hostname: str) -> None:
    worker_id = runtime.worker_identity("worker", hostname=hostname, pid=4_194_304)
    assert db.is_application_name(worker_id)
    assert worker_id.startswith("worker:") and worker_id.endswith(":4194304")
    if hostname == "h":
        assert worker_id == "worker:h:4194304"


def test_long_host_names_that_share_a_beginning_give_different_worker_ids() -> None:
    ids = {runtime.worker_identity("worker", hostname=LONG_HOST + s, pid=1) for s in "ab"}
    assert len(ids) == 2


async def test_a_stalled_worker_on_a_host_with_a_long_name_is_fenced(
    pool: asyncpg.Pool, database_url: str
) -> None:
    stalled_id = runtime.worker_identity("worker", hostname=LONG_HOST, pid=77)
    await queue.submit(pool, "b")
    lease = await queue.claim(pool, stalled_id, 30)
    assert lease is not None and lease.worker_id == stalled_id
    await expire(pool, lease)
    stalled_pool = await db.create_pool(database_url, application_name=stalled_id)
    try:
        stalled_conn = await stalled_pool.acquire()
        stalled_pid = stalled_conn.get_server_pid()
        assert await sessions_named(pool, stalled_id) == 1
        fenced = await queue.terminate_stalled_workers(pool, "worker:healthy:2", grace_s=0)
        assert fenced == [stalled_id]

        async def ended() -> bool:
            return not await pool.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = $1", stalled_pid
            )

        await wait_for(ended, what="the stalled worker's session to end")
    finally:
        stalled_pool.terminate()


async def test_a_pool_refuses_a_name_postgres_would_change(database_url: str) -> None:
    with pytest.raises(ValueError, match="application_name"):
        await db.create_pool(database_url, application_name="w" * 64)


async def test_a_foreground_runtime_starts_with_its_connections_open_and_warm(
    pool: asyncpg.Pool, database_url: str
) -> None:
    # replay's pool (runtime.foreground_pool): before the operation starts, one session per
    # group slot and two more are open, and each has run a group's first recall statement, so
    # the operation's first passes pay neither a new session nor its first recall.
    settings = load_settings(database_url=database_url, group_parallelism=3)
    size, warm = runtime.foreground_pool(settings.group_parallelism)
    assert (size, warm) == (7, 5)
    async with runtime.open_runtime(settings, pool_size=size, warm=warm) as rt:
        assert await sessions_named(pool, rt.worker_id) == warm
        async with AsyncExitStack() as held:
            sessions = [await held.enter_async_context(rt.pool.acquire()) for _ in range(warm)]
            prepared = [
                await conn.fetchval(
                    "SELECT count(*) FROM pg_prepared_statements WHERE statement = $1",
                    store.recall_statement(2, hybrid=False),
                )
                for conn in sessions
            ]
        assert prepared == [1] * warm
        assert await sessions_named(pool, rt.worker_id) == warm
