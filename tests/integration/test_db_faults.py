"""Database faults against the engine and the worker in-process (real Postgres, fake LLM).

The process-level scenarios (sessions terminated under a running `consolidation serve`, a
private Postgres restarted mid-operation) are in tests/acceptance/test_db_faults.py.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import asyncpg
import pytest
import structlog
import structlog.testing

from consolidation import queue
from consolidation.engine import run_operation
from consolidation.settings import Settings, load_settings
from consolidation.testing.fake_llm import FakeLLMServer
from consolidation.worker import Worker
from tests.support.engine import grew, http_llm, ingest, set_read_only, topics
from tests.support.invariants import assert_consistent
from tests.support.waiting import wait_for

TERMINATE_OTHERS = """
SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid() AND application_name = $1
"""


BLOCKED_ON_LOCK = """
SELECT count(*) > 0 FROM pg_stat_activity
WHERE datname = current_database() AND application_name = $1 AND wait_event_type = 'Lock'
"""


@contextlib.asynccontextmanager
async def journal_locked(pool: asyncpg.Pool) -> AsyncIterator[None]:
    """Hold the journal locked: every apply of the engine blocks on it until the block ends."""
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute("LOCK TABLE consolidation_outcomes IN EXCLUSIVE MODE")
        yield


async def terminate_blocked(
    pool: asyncpg.Pool, application_name: str, done: asyncio.Event | None = None
) -> None:
    """Under :func:`journal_locked`: once an apply of the engine waits on the journal (or
    ``done`` is set), end the engine's sessions, so the fault is certain to land mid-statement
    and not only on idle connections."""
    await wait_for(
        lambda: (
            (done is not None and done.is_set()) or pool.fetchval(BLOCKED_ON_LOCK, application_name)
        ),
        what="an apply blocked on the journal",
    )
    await pool.fetchval(TERMINATE_OTHERS, application_name)


async def test_database_outages_hand_the_operation_back_without_spending_attempts(
    database_url: str, pool: asyncpg.Pool, fake: FakeLLMServer
) -> None:
    """Three outages of an operation allowed two attempts: each hands it back as it was (a
    warning, not an error), and the next attempt completes."""
    from consolidation import db

    await ingest(pool, "b", topics(3, 4))
    op = (await queue.submit(pool, "b", max_attempts=2)).operation
    engine_pool = await db.create_pool(
        database_url, min_size=1, max_size=4, application_name="engine-under-test"
    )
    llm = http_llm(fake.url)
    fake.control(latency_ms=10)
    settings = Settings(llm_batch_size=1, group_parallelism=2, retry_backoff_s=0)
    ends = []
    try:
        with structlog.testing.capture_logs() as logs:
            for _ in range(3):
                lease = await queue.claim(engine_pool, "w", 30)
                assert lease is not None and lease.attempt == 1
                # Locked before the run starts: a fast run could otherwise apply everything
                # before the lock is taken, and nothing would ever block on it.
                async with journal_locked(pool):
                    run = asyncio.create_task(run_operation(engine_pool, lease, llm, settings))
                    await terminate_blocked(pool, "engine-under-test")
                ends.append((await run).status)
        lease = await queue.claim(engine_pool, "w", 30)
        assert lease is not None
        end = await run_operation(engine_pool, lease, llm, settings)
    finally:
        await llm.aclose()
        await engine_pool.close()
    assert ends == ["pending"] * 3
    assert end.status == "completed"
    row = await pool.fetchrow("SELECT attempt, interruptions FROM operations WHERE id = $1", op.id)
    assert (row["attempt"], row["interruptions"]) == (1, 3)
    interrupted = [e for e in logs if e["event"] == "operation_interrupted"]
    assert len(interrupted) == 3 and {e["log_level"] for e in interrupted} == {"warning"}
    assert not [e for e in logs if e["log_level"] in ("error", "critical")]
    census = await assert_consistent(pool)
    assert census.consolidated == 12 and census.observations == 3


async def test_past_its_bound_a_database_outage_spends_attempts_so_the_operation_still_ends(
    database_url: str, pool: asyncpg.Pool, fake: FakeLLMServer
) -> None:
    from consolidation import db
    from consolidation.engine import MAX_INTERRUPTIONS

    await ingest(pool, "b", topics(2, 2))
    op = (await queue.submit(pool, "b", max_attempts=1)).operation
    await pool.execute(
        "UPDATE operations SET interruptions = $2 WHERE id = $1", op.id, MAX_INTERRUPTIONS
    )
    engine_pool = await db.create_pool(database_url, application_name="engine-under-test")
    llm = http_llm(fake.url)
    try:
        lease = await queue.claim(engine_pool, "w", 30)
        assert lease is not None
        async with journal_locked(pool):
            run = asyncio.create_task(run_operation(engine_pool, lease, llm, Settings()))
            await terminate_blocked(pool, "engine-under-test")
        end = await run
    finally:
        await llm.aclose()
        await engine_pool.close()
    assert end.status == "failed"
    row = await pool.fetchrow("SELECT status, error FROM operations WHERE id = $1", op.id)
    # The terminated session surfaces as whichever connection error asyncpg raised first.
    assert row["status"] == "failed"
    name = row["error"].split(":")[0]
    raised = getattr(asyncpg.exceptions, name, None) or getattr(builtins, name)
    assert issubclass(raised, db.DATABASE_DOWN), row["error"]


async def test_sessions_terminated_during_every_stage_of_a_pass_never_duplicate_or_lose_work(
    database_url: str, pool: asyncpg.Pool, fake: FakeLLMServer
) -> None:
    """Kill the engine's sessions again and again; each attempt resumes from the journal."""
    from consolidation import db

    await ingest(pool, "b", topics(5, 6))
    op = (await queue.submit(pool, "b", max_attempts=100)).operation
    engine_pool = await db.create_pool(
        database_url, min_size=2, max_size=6, application_name="engine-under-test"
    )
    llm = http_llm(fake.url)
    fake.control(latency_ms=15, jitter_ms=15)
    config = Settings(llm_batch_size=2, group_parallelism=3, retry_backoff_s=0)
    killed = 0

    journal = "SELECT count(*) FROM consolidation_outcomes"

    async def grew_or_done(done: asyncio.Event, than: int) -> bool:
        return done.is_set() or await grew(pool, journal, than)

    async def killer(done: asyncio.Event) -> None:
        nonlocal killed
        while not done.is_set():
            # Each round lets at least one more pass through (whatever the engine asked the
            # LLM meanwhile), then kills.
            applied = await pool.fetchval(journal)
            await wait_for(partial(grew_or_done, done, applied), what="a pass applied")
            if killed % 2:
                # Wherever the engine happens to be (often idle between statements).
                killed += 1
                await pool.fetchval(TERMINATE_OTHERS, "engine-under-test")
                continue
            killed += 1
            async with journal_locked(pool):
                await terminate_blocked(pool, "engine-under-test", done)

    attempts: list[str] = []
    errors: list[str] = []
    try:
        done = asyncio.Event()
        task = asyncio.create_task(killer(done))
        while len(attempts) < 60:
            try:
                lease = await queue.claim(engine_pool, "w", 30)
                if lease is None:
                    status = await pool.fetchval(
                        "SELECT status FROM operations WHERE id = $1", op.id
                    )
                    if status != "running":
                        break
                    # The attempt's final write was lost with its session: its lease would
                    # run out and a worker would reclaim it; do not wait 30 s for that.
                    await pool.execute(
                        "UPDATE operations SET lease_expires_at = now() WHERE id = $1", op.id
                    )
                    continue
                end = await run_operation(engine_pool, lease, llm, config)
                attempts.append(end.status)
                errors.append(end.error or "")
            except Exception as exc:  # the worker survives anything an attempt raises
                attempts.append(type(exc).__name__)
                errors.append(repr(exc))
        done.set()
        await task
    finally:
        await llm.aclose()
        await engine_pool.close()
    print(f"{killed} rounds of terminated sessions; attempts: {attempts}; errors: {errors}")
    assert killed >= 3 and len(attempts) >= 2, attempts
    # A session is never driven by two tasks at once: asyncpg refuses the second statement with
    # "cannot perform operation: another operation is in progress". (Its InternalClientError
    # "cannot switch to state 11; another operation (2) is in progress" is something else: an
    # idle pooled session the server terminated, handed out between asyncpg reading the FATAL
    # error and the end of the socket; it is a dropped session like the others.)
    assert not [e for e in errors if "cannot perform operation" in e], errors
    assert await pool.fetchval("SELECT status FROM operations WHERE id = $1", op.id) == "completed"
    census = await assert_consistent(pool)
    assert census.consolidated == 30 and census.outcomes == 30 and census.sources == 30
    assert census.observations == 5


async def test_a_worker_never_reclaims_an_operation_it_is_still_running(
    database_url: str, pool: asyncpg.Pool, fake: FakeLLMServer
) -> None:
    """The lease lapsed (the database was unreachable past it) while the attempt kept running:
    the same worker must not start a second attempt beside it; its heartbeat renews the lease,
    and shutdown hands the one attempt back."""
    await ingest(pool, "b", topics(2, 2))
    op = (await queue.submit(pool, "b", max_attempts=10)).operation
    # Every answer takes a minute: attempts stay in flight until they are stopped.
    fake.control(latency_ms=60_000)
    settings = load_settings(
        database_url=database_url,
        llm_base_url=fake.url,
        lease_s=3,
        poll_interval_s=0.05,
        shutdown_grace_s=0.2,
        retry_backoff_s=0,
        llm_batch_size=2,
        group_parallelism=1,
    )
    llm = http_llm(fake.url, timeout_s=120)
    shutdown = asyncio.Event()
    worker = Worker(settings, pool, database_url, llm, worker_id="worker-under-test")
    task = asyncio.create_task(worker.run(shutdown))
    try:
        await wait_for(lambda: fake.stats()["in_flight"] == 1, what="the first attempt's call")
        await pool.execute(
            "UPDATE operations SET lease_expires_at = now() - interval '1 second' WHERE id = $1",
            op.id,
        )
        await wait_for(
            lambda: pool.fetchval(
                "SELECT lease_expires_at > now() FROM operations WHERE id = $1", op.id
            ),
            what="the heartbeat to renew the lapsed lease",
        )
        row = await queue.get_operation(pool, op.id)
        assert (row.status, row.attempt) == ("running", 1)
        assert fake.stats()["requests"] == 1 and fake.stats()["aborted"] == 0
        shutdown.set()
        await asyncio.wait_for(task, timeout=30)
        row = await queue.get_operation(pool, op.id)
        # Graceful shutdown hands the attempt back without spending it.
        assert (row.status, row.attempt, row.error) == ("pending", 0, "interrupted by shutdown")
    finally:
        shutdown.set()
        await asyncio.gather(task, return_exceptions=True)
        await llm.aclose()


class FaultyPool:
    """The real pool, except that the first statement containing ``marker`` raises ``error``:
    how asyncpg fails on a pooled connection the server closed under it (observed while
    Postgres shut down: ``InternalClientError: cannot switch to state 11; another operation
    (2) is in progress``, and ``InterfaceError: ... the underlying connection is closed``)."""

    def __init__(self, pool: asyncpg.Pool, marker: str, error: Exception) -> None:
        self._pool = pool
        self._marker = marker
        self._error: Exception | None = error

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)

    def _maybe_fail(self, query: str) -> None:
        if self._error is not None and self._marker in query:
            error, self._error = self._error, None
            raise error

    async def fetchrow(self, query: str, *args: Any, **kwargs: Any) -> Any:
        self._maybe_fail(query)
        return await self._pool.fetchrow(query, *args, **kwargs)

    async def fetch(self, query: str, *args: Any, **kwargs: Any) -> Any:
        self._maybe_fail(query)
        return await self._pool.fetch(query, *args, **kwargs)


BROKEN_CONNECTION_ERRORS = [
    asyncpg.exceptions._base.InternalClientError(
        "cannot switch to state 11; another operation (2) is in progress"
    ),
    asyncpg.InterfaceError("cannot perform operation: connection is closed"),
]


async def test_the_worker_loop_survives_a_broken_connection_error_during_a_claim(
    database_url: str, pool: asyncpg.Pool, fake: FakeLLMServer
) -> None:
    await ingest(pool, "b", topics(1, 2))
    op = (await queue.submit(pool, "b")).operation
    settings = load_settings(
        database_url=database_url, llm_base_url=fake.url, poll_interval_s=0.05, lease_s=5
    )
    faulty = FaultyPool(pool, "FOR UPDATE SKIP LOCKED", BROKEN_CONNECTION_ERRORS[0])
    llm = http_llm(fake.url)
    shutdown = asyncio.Event()
    worker = Worker(settings, faulty, database_url, llm, worker_id="w")
    task = asyncio.create_task(worker.run(shutdown))
    try:

        async def completed_or_dead() -> bool:
            status = await pool.fetchval("SELECT status FROM operations WHERE id = $1", op.id)
            return task.done() or status == "completed"

        await wait_for(completed_or_dead, what="the operation to complete or the worker to die")
        assert not task.done(), f"the worker loop died: {task.exception()!r}"
    finally:
        shutdown.set()
        await asyncio.gather(task, return_exceptions=True)
        await llm.aclose()


async def heartbeat_fault_keeps_the_lease(
    pool: asyncpg.Pool, fake: FakeLLMServer, error: Exception
) -> None:
    """Fail one heartbeat with ``error`` while another worker polls for abandoned work: the
    operation must keep its lease and complete."""
    await ingest(pool, "b", topics(1, 12))
    lease_s = 1.5
    lease = await queue.start_foreground(pool, "b", "w", lease_s)
    fake.control(latency_ms=500)  # six passes: the operation outlives its lease twice over
    faulty = FaultyPool(pool, "lease_expires_at = now()", error)
    llm = http_llm(fake.url)
    config = Settings(llm_batch_size=2, lease_s=lease_s)
    run = asyncio.create_task(run_operation(faulty, lease, llm, config))
    taken_over = None
    try:
        while not run.done() and taken_over is None:
            taken_over = await queue.claim(pool, "other-worker", 30)
            await asyncio.wait({run}, timeout=0.1)
        end = await run
    finally:
        await llm.aclose()
    assert taken_over is None, "the live operation's lease ran out and another worker took it"
    assert end.status == "completed", end.error


async def test_one_heartbeat_lost_with_its_session_does_not_lose_the_lease(
    pool: asyncpg.Pool, fake: FakeLLMServer
) -> None:
    error = asyncpg.exceptions.ConnectionDoesNotExistError(
        "connection was closed in the middle of operation"
    )
    await heartbeat_fault_keeps_the_lease(pool, fake, error)


@pytest.mark.parametrize(
    "error", BROKEN_CONNECTION_ERRORS, ids=["InternalClientError", "InterfaceError"]
)
async def test_one_heartbeat_failing_on_a_broken_connection_does_not_lose_the_lease(
    pool: asyncpg.Pool, fake: FakeLLMServer, error: Exception
) -> None:
    await heartbeat_fault_keeps_the_lease(pool, fake, error)


# --- outages past the lease, a read-only database ------------------------------------------


async def test_outages_past_the_lease_spend_no_attempt_and_the_log_says_what_happened(
    database_url: str, pool: asyncpg.Pool, fake: FakeLLMServer
) -> None:
    """Two outages, each longer than the lease, under a worker, with max_attempts=2: each time
    the attempt's end cannot be written, its lease runs out and the worker takes the operation
    over when the database is back. No attempt is spent (it used to go 1 → 2 → 3), both are
    counted, and no log line claims a hand-back that was never stored."""
    from consolidation import db
    from tests.support.proxy import TcpProxy

    await ingest(pool, "b", topics(4, 10))
    op = (await queue.submit(pool, "b", max_attempts=2)).operation
    fake.control(latency_ms=50)
    journal = "SELECT count(*) FROM consolidation_outcomes"
    async with TcpProxy.in_front_of(database_url) as proxy:
        url = proxy.url(database_url)
        settings = load_settings(
            database_url=url,
            llm_base_url=fake.url,
            lease_s=2,
            poll_interval_s=0.05,
            retry_backoff_s=0,
            llm_batch_size=1,
            group_parallelism=1,
        )
        worker_pool = await db.create_pool(url, timeouts=db.Timeouts.for_lease(2))
        llm = http_llm(fake.url)
        shutdown = asyncio.Event()
        worker = Worker(settings, worker_pool, url, llm, worker_id="worker-under-test")
        task = asyncio.create_task(worker.run(shutdown))
        try:
            with structlog.testing.capture_logs() as logs:
                for outage in (1, 2):
                    applied = await pool.fetchval(journal)
                    await wait_for(partial(grew, pool, journal, applied), what="a pass")
                    proxy.sever()
                    await wait_for(lambda: not worker.slots, what="the attempt to give up")
                    proxy.restore()
                    await wait_for(
                        partial(
                            pool.fetchval,
                            "SELECT reclaims = $2 AND status = 'running' FROM operations "
                            "WHERE id = $1",
                            op.id,
                            outage,
                        ),
                        what=f"the takeover after outage {outage}",
                    )
                await wait_for(
                    lambda: pool.fetchval(
                        "SELECT status = 'completed' FROM operations WHERE id = $1", op.id
                    ),
                    what="the operation to complete",
                )
        finally:
            shutdown.set()
            await asyncio.gather(task, return_exceptions=True)
            await llm.aclose()
            await worker_pool.close()
    row = await pool.fetchrow(
        "SELECT attempt, interruptions, reclaims, last_error FROM operations WHERE id = $1", op.id
    )
    assert (row["attempt"], row["interruptions"], row["reclaims"]) == (1, 2, 2)
    assert "without spending an attempt" in row["last_error"]
    events = [e["event"] for e in logs]
    assert events.count("operation_end_unrecorded") == 2
    # A hand-back is logged only once stored; these were not (the database was down).
    assert "operation_interrupted" not in events
    claimed = [e for e in logs if e["event"] == "operation_claimed"]
    assert [(e["attempt"], e["reclaimed"]) for e in claimed] == [(1, False), (1, True), (1, True)]
    assert not [e for e in logs if e["log_level"] in ("error", "critical")]
    census = await assert_consistent(pool)
    assert census.consolidated == 40 and census.observations == 4


async def test_a_database_turned_read_only_hands_the_operation_back_as_an_interruption(
    database_url: str, pool: asyncpg.Pool, fake: FakeLLMServer
) -> None:
    from consolidation import db

    await ingest(pool, "b", topics(3, 6))
    op = (await queue.submit(pool, "b", max_attempts=1)).operation
    engine_pool = await db.create_pool(database_url, application_name="engine-under-test")
    llm = http_llm(fake.url)
    fake.control(latency_ms=20)
    settings = Settings(llm_batch_size=1, group_parallelism=1, retry_backoff_s=0, lease_s=30)
    journal = "SELECT count(*) FROM consolidation_outcomes"
    try:
        with structlog.testing.capture_logs() as logs:
            lease = await queue.claim(engine_pool, "w", 30)
            assert lease is not None
            run = asyncio.create_task(run_operation(engine_pool, lease, llm, settings))
            await wait_for(lambda: grew(pool, journal, 0), what="a pass applied")
            await set_read_only(pool, database_url, True)
            await engine_pool.expire_connections()  # the next statements open read-only sessions
            await wait_for(
                lambda: any(e["event"] == "operation_end_retrying" for e in logs),
                what="the end write to be refused",
            )
            await set_read_only(pool, database_url, False)
            await engine_pool.expire_connections()
            end = await run
        assert end.status == "pending"
        lease = await queue.claim(engine_pool, "w", 30)
        assert lease is not None and lease.attempt == 1
        assert (await run_operation(engine_pool, lease, llm, settings)).status == "completed"
    finally:
        await set_read_only(pool, database_url, False)
        await llm.aclose()
        await engine_pool.close()
    row = await pool.fetchrow(
        "SELECT attempt, interruptions, last_error FROM operations WHERE id = $1", op.id
    )
    assert (row["attempt"], row["interruptions"]) == (1, 1)
    assert "ReadOnlySQLTransactionError" in row["last_error"]
    interrupted = [e for e in logs if e["event"] == "operation_interrupted"]
    assert len(interrupted) == 1 and interrupted[0]["log_level"] == "warning"
    assert not [e for e in logs if e["log_level"] in ("error", "critical")]
    census = await assert_consistent(pool)
    assert census.consolidated == 18 and census.observations == 3
