"""The knowledge lifecycle with real `consolidation serve` processes: a forget killed with SIGKILL
half-way is finished by another worker and leaves no trace (not in a table, not in a log), and
an operation that failed while the LLM was down is swept again, so the bank drains by itself."""

from __future__ import annotations

import signal
from typing import Any

import asyncpg
import pytest

from consolidation import queue
from consolidation.testing.fake_llm import FakeLLMServer
from tests.integration.test_cli_ingest import run_cli
from tests.support.engine import ingest, markers, submit_after_ingest
from tests.support.invariants import assert_consistent, tables_containing
from tests.support.services import Serve
from tests.support.waiting import wait_completed, wait_drained, wait_for

pytestmark = pytest.mark.acceptance

SECRET = "zebraquartz"


async def test_a_forget_killed_half_way_is_finished_by_another_worker_and_leaves_no_trace(
    pool: asyncpg.Pool, database_url: str, fake: FakeLLMServer, serve: Serve
) -> None:
    memories: list[dict[str, Any]] = [
        {"text": f"Person{t} drinks green tea every morning, note {i}", "tags": [f"topic-{t}"]}
        for t in range(6)
        for i in range(3)
    ]
    for t in range(6):
        memories[3 * t]["text"] += f" with {SECRET} honey"
    ids = await ingest(pool, "b", memories)
    settings = {"LEASE_S": "1", "GROUP_PARALLELISM": "1", "SWEEP_INTERVAL_S": "0"}
    first = serve.worker("first", **settings)
    await wait_completed(pool, (await queue.submit(pool, "b")).operation.id)
    assert len(await tables_containing(pool, SECRET)) >= 2

    fake.reset()
    fake.control(latency_ms=300)
    secrets = [str(ids[3 * t]) for t in range(6)]
    asked = run_cli("forget", "b", *secrets, env={"CONSOLIDATION_DATABASE_URL": database_url})
    assert asked.returncode == 0, asked.stderr
    forget_id = await pool.fetchval("SELECT id FROM operations WHERE kind = 'forget'")
    # Two of the six shared observations re-derived (and replaced), then the worker dies.
    await wait_for(lambda: fake.stats()["completed"] >= 2, what="two re-derivations")
    first.signal(signal.SIGKILL)
    first.wait_exit()
    assert await pool.fetchval("SELECT count(*) FROM memories WHERE forgotten_at IS NOT NULL") == 6
    assert "observations" in await tables_containing(pool, SECRET)

    second = serve.worker("second", **settings)
    await wait_completed(pool, forget_id)
    operation = await queue.get_operation(pool, forget_id)
    # Taken over from the killed worker without spending an attempt.
    assert operation.attempt == 1 and operation.result is not None
    assert await pool.fetchval("SELECT reclaims FROM operations WHERE id = $1", forget_id) == 1
    assert operation.result["forgotten"] == 6

    assert await tables_containing(pool, SECRET) == {}
    for service in (first, second):
        assert SECRET not in service.log_path.read_text()
    assert SECRET not in asked.stdout + asked.stderr
    census = await assert_consistent(pool)
    assert census.memories == 12 and census.observations == 6 and census.sources == 12
    second.signal(signal.SIGTERM)
    assert second.wait_exit() == 0


async def test_a_bank_whose_operation_failed_while_the_llm_was_down_drains_once_it_is_back(
    pool: asyncpg.Pool, fake: FakeLLMServer, serve: Serve
) -> None:
    fake.control(fail_rate=1.0, fail_status=503)
    memories = [{"text": f"fact {i}", "tags": [f"t{i % 2}"]} for i in range(6)]
    failing = await submit_after_ingest(pool, "b", memories, max_attempts=2)
    worker = serve.worker("worker", MAX_ATTEMPTS="2", RETRY_BACKOFF_S="0.2", SWEEP_INTERVAL_S="0.3")
    await wait_for(
        lambda: pool.fetchval("SELECT status = 'failed' FROM operations WHERE id = $1", failing.id),
        what="the operation to fail for good",
    )
    assert await markers(pool, "b") == {"consolidated": 0, "failed": 0, "pending": 6}

    fake.control(fail_rate=0.0)  # the provider is back; nobody asks for anything
    await wait_drained(pool, what="the bank to drain")
    assert await markers(pool, "b") == {"consolidated": 6, "failed": 0, "pending": 0}
    swept = worker.events("sweeper_enqueued")
    assert swept and all(e["bank_id"] == "b" and e["kind"] == "consolidate" for e in swept)
    await wait_for(
        lambda: pool.fetchval(
            "SELECT count(*) = 1 FROM operations WHERE status = 'completed' AND id <> $1",
            failing.id,
        ),
        what="the swept operation to complete",
    )
    await assert_consistent(pool)
    worker.signal(signal.SIGTERM)
    assert worker.wait_exit() == 0
