"""Database faults under real `consolidation serve` processes.

- Sessions terminated mid-operation (``pg_terminate_backend``) on the test database.
- Postgres restarted mid-operation: a private embedded server (pgserver) that this test starts,
  stops and starts again with the same data directory; the machine's shared server is never
  touched. While it is down the API answers 503 with a JSON error; afterwards everything
  recovers by itself and every memory is consolidated exactly once.
"""

from __future__ import annotations

import contextlib
import signal
import tempfile
from collections.abc import AsyncIterator, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import orjson
import pytest

from consolidation import db, queue
from consolidation.testing.fake_llm import FakeLLMServer
from tests.support.engine import submit_after_ingest, topics
from tests.support.invariants import assert_consistent
from tests.support.proxy import TcpProxy
from tests.support.services import (
    Serve,
    ServiceProcess,
    Services,
    metric_total,
    variables,
    worker_env,
)
from tests.support.waiting import completed, wait_completed, wait_for

pytestmark = pytest.mark.acceptance


# One quick LLM retry and a short lease: database faults show up as transport trouble and
# stalled workers, and must be recovered from within a test's time.
FAULTS = {
    "LLM_MAX_RETRIES": "1",
    "LLM_BACKOFF_BASE_S": "0.05",
    "LLM_BACKOFF_MAX_S": "0.2",
    "LEASE_S": "2",
}


# Sessions of workers (named after their worker id) and their LISTEN connection; never ours.
TERMINATE_WORKER_SESSIONS = """
SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid()
  AND (application_name LIKE 'worker:%' OR query ILIKE 'LISTEN%')
"""


def answered_or_exited(fake: FakeLLMServer, process: ServiceProcess, passes: int) -> bool:
    """Whether the fake has answered ``passes`` passes, or ``process`` has exited meanwhile."""
    return fake.stats()["completed"] >= passes or process.proc.poll() is not None


async def test_a_worker_whose_sessions_are_terminated_mid_operation_finishes_it_exactly_once(
    pool: asyncpg.Pool, fake: FakeLLMServer, serve: Serve
) -> None:
    fake.control(latency_ms=60)
    op = await submit_after_ingest(pool, "b", topics(6, 6), max_attempts=50)
    worker = serve.worker("worker", **FAULTS)
    terminated = 0
    for answered in (3, 8, 13):
        await wait_for(
            partial(answered_or_exited, fake, worker, answered),
            what=f"{answered} passes to be answered",
        )
        terminated += await pool.fetchval(TERMINATE_WORKER_SESSIONS)
    assert terminated >= 3
    await wait_for(
        lambda: worker.proc.poll() is not None or completed(pool, op.id),
        timeout_s=90,
        what="the operation to complete despite its sessions being terminated",
    )
    assert worker.proc.poll() is None, "the worker must survive losing its sessions"
    census = await assert_consistent(pool)
    assert census.consolidated == 36 and census.failed == 0
    assert census.outcomes == 36 and census.sources == 36
    assert census.observations == 6  # one per topic: no duplicate


async def test_an_idle_worker_listens_again_after_its_listen_session_is_terminated(
    pool: asyncpg.Pool, serve: Serve
) -> None:
    worker = serve.worker("worker", **FAULTS, POLL_INTERVAL_S="3600")
    await worker.wait_event("worker_started")
    await wait_for(
        lambda: pool.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND query ILIKE 'LISTEN%'"
        ),
        what="the worker's LISTEN session",
    )
    assert await pool.fetchval(TERMINATE_WORKER_SESSIONS) >= 1
    op = await submit_after_ingest(pool, "b", topics(1, 2))
    # With an hour between polls, only a NOTIFY on a new LISTEN session can wake it.
    await worker.wait_event("operation_claimed", timeout_s=10, operation_id=str(op.id))


# --- a private Postgres, restarted mid-operation ------------------------------------------------


class PrivatePostgres:
    """An embedded Postgres in a temporary directory, stoppable and restartable in place."""

    def __init__(self) -> None:
        from pgserver.postgres_server import get_server

        self.dir = Path(tempfile.mkdtemp(prefix="consolidation-pg-"))
        self.server = get_server(self.dir, cleanup_mode="delete")
        self.url: str = self.server.get_uri()

    def stop(self, mode: str) -> None:
        # pgserver makes one function per program in its bin/ when imported: none is declared.
        from pgserver._commands import pg_ctl  # type: ignore[attr-defined]

        pg_ctl(["-w", "-m", mode, "stop"], pgdata=self.server.pgdata, user=self.server.system_user)

    def start(self) -> None:
        from pgserver.postgres_server import PostgresServer

        with PostgresServer._lock:
            self.server.ensure_postgres_running()

    def cleanup(self) -> None:
        """Stop the server and delete its directory, whatever state the test left it in."""
        from pgserver.utils import PostmasterInfo

        with contextlib.suppress(Exception):
            info = PostmasterInfo.read_from_pgdata(self.server.pgdata)
            if info is None or not info.is_running():
                self.start()  # pgserver only stops (then deletes) a server it sees running
        with contextlib.suppress(Exception):
            self.server.cleanup()


@pytest.fixture
def private_pg() -> Iterator[PrivatePostgres]:
    pg = PrivatePostgres()
    try:
        db.migrate_sync(pg.url)
        yield pg
    finally:
        pg.cleanup()


@contextlib.asynccontextmanager
async def open_pool(url: str) -> AsyncIterator[asyncpg.Pool]:
    pool = await db.create_pool(url, min_size=1, max_size=4)
    try:
        yield pool
    finally:
        await pool.close()


async def assert_database_unavailable(
    http: httpx.AsyncClient, method: str, path: str, **kw: Any
) -> None:
    response = await http.request(method, path, **kw)
    assert response.status_code == 503, (path, response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json")
    assert response.json()["error"]["code"] == "database_unavailable"


async def test_postgres_restarted_mid_operation_the_api_says_503_and_everything_recovers(
    private_pg: PrivatePostgres,
    fake: FakeLLMServer,
    services: Services,
) -> None:
    fake.control(latency_ms=80)
    async with open_pool(private_pg.url) as pool:
        op = await submit_after_ingest(pool, "b", topics(4, 8), max_attempts=50)
    service = services.start("service", worker_env(private_pg.url, fake.url, **variables(**FAULTS)))
    base_url = await service.api_url()
    await restart_postgres_twice_and_recover(service, private_pg, fake, base_url, op.id)
    async with open_pool(private_pg.url) as pool:
        census = await assert_consistent(pool)
    assert census.outcomes == 32 and census.sources == 32
    assert census.observations == 4  # one per topic: no duplicate


async def restart_postgres_twice_and_recover(
    service: ServiceProcess,
    private_pg: PrivatePostgres,
    fake: FakeLLMServer,
    base_url: str,
    operation_id: Any,
) -> None:
    op_path = f"/v1/operations/{operation_id}"
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
        assert (await http.get("/readyz")).status_code == 200
        # Down twice: a clean fast shutdown, then a crash (immediate: WAL recovery on start).
        for answered, mode in ((3, "fast"), (9, "immediate")):
            await wait_for(
                partial(answered_or_exited, fake, service, answered),
                what=f"{answered} passes to be answered",
            )
            private_pg.stop(mode)
            # Alive: the outage is younger than a lease (after that, /healthz fails too).
            assert (await http.get("/healthz")).status_code == 200
            await assert_database_unavailable(http, "GET", "/readyz")
            await assert_database_unavailable(http, "GET", "/v1/banks/b/stats")
            await assert_database_unavailable(http, "GET", op_path)
            await assert_database_unavailable(
                http, "POST", "/v1/banks/b/memories", json={"memories": [{"text": "x"}]}
            )
            assert service.proc.poll() is None, (
                "the service must not exit while the database is down"
            )
            private_pg.start()

            async def ready() -> bool:
                return (await http.get("/readyz")).status_code == 200

            await wait_for(ready, what="readiness to recover by itself")

        async def completed() -> bool:
            response = await http.get(op_path)
            return response.status_code == 200 and response.json()["status"] == "completed"

        await wait_for(completed, timeout_s=90, what="the operation to complete")
        stats = (await http.get("/v1/banks/b/stats")).json()
        assert stats["pending"] == 0 and stats["failed"] == 0 and stats["consolidated"] == 32


# --- a path to the database that goes silent (half-open connections) -----------------------------


async def test_a_worker_cut_off_by_a_silent_partition_frees_its_slot_and_fails_healthz_until_it_heals(
    pool: asyncpg.Pool, database_url: str, fake: FakeLLMServer, serve: Serve
) -> None:
    """A proxy stops forwarding with every socket left open: no error ever reaches the worker.
    Bounded statements free its slot while the partition lasts, /healthz fails after a lease of
    silence and recovers after, and a replica on a healthy path finishes the operation once."""
    fake.control(latency_ms=60)
    op = await submit_after_ingest(pool, "b", topics(4, 8), max_attempts=50)
    async with TcpProxy.in_front_of(database_url) as proxy:
        cut_off = serve("cut-off", database_url=proxy.url(database_url), **FAULTS)
        base_url = await cut_off.api_url()
        async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:
            await cut_off.wait_event("operation_claimed", operation_id=str(op.id))
            await wait_for(lambda: fake.stats()["completed"] >= 3, what="3 passes answered")
            assert (await http.get("/healthz")).status_code == 200
            proxy.freeze()

            async def unhealthy() -> bool:
                response = await http.get("/healthz")
                if response.status_code == 200:
                    return False
                assert response.status_code == 503, response.text
                assert response.json()["error"]["code"] == "database_unreachable"
                return True

            await wait_for(unhealthy, what="/healthz to fail while the database is silent")

            async def slot_freed() -> bool:
                running = await metric_total([base_url], "consolidation_operations_running")
                return running == 0

            await wait_for(slot_freed, timeout_s=60, what="the cut-off worker to free its slot")
            assert proxy.connections > 0, "the partition must still hold its sockets open"

            healthy = serve.worker("healthy", **FAULTS)
            await wait_completed(
                pool, op.id, timeout_s=90, what="the healthy replica to finish the operation"
            )
            assert (await unhealthy()) is True, "still cut off: /healthz must still fail"
            proxy.thaw()

            async def healthy_again() -> bool:
                return (await http.get("/healthz")).status_code == 200

            await wait_for(healthy_again, what="/healthz to recover once the path heals")
            assert cut_off.proc.poll() is None and healthy.proc.poll() is None
    finished = await queue.get_operation(pool, op.id)
    assert finished.worker_id is not None and finished.worker_id.startswith("worker:")
    # Taken over after the partition without spending an attempt (it used to spend one).
    assert finished.attempt == 1
    assert await pool.fetchval("SELECT reclaims FROM operations WHERE id = $1", op.id) >= 1
    census = await assert_consistent(pool)
    assert census.consolidated == 32 and census.failed == 0
    assert census.outcomes == 32 and census.sources == 32
    assert census.observations == 4  # one per topic: no duplicate


async def test_every_line_a_serve_process_writes_during_a_database_outage_is_one_json_object(
    database_url: str, serve: Serve
) -> None:
    """asyncpg logs through the standard library, with a traceback, when its pool cannot restore
    its floor connection; that record too must be one JSON line, traceback included."""
    async with TcpProxy.in_front_of(database_url) as proxy:
        service = serve("service", database_url=proxy.url(database_url), **FAULTS)
        base_url = await service.api_url()
        await service.wait_event("worker_started")
        proxy.sever()
        record = await service.wait_event("Failed to restore the pool connection floor; retrying")
        assert record["logger"] == "asyncpg.pool" and record["level"] == "warning"
        assert record["exception"][0]["frames"], "the traceback is part of the JSON record"
        proxy.restore()
        async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:

            async def ready() -> bool:
                return (await http.get("/readyz")).status_code == 200

            await wait_for(ready, what="readiness to recover")
        service.signal(signal.SIGTERM)
        # Not service.wait_exit(): the proxy lives in this event loop, which must keep running.
        await wait_for(lambda: service.proc.poll() is not None, what="the service to exit")
        assert service.proc.returncode == 0
    lines = service.log_path.read_bytes().splitlines()
    assert lines
    for line in lines:
        assert isinstance(orjson.loads(line), dict), line
