"""`consolidation replay` as a real process: crash between apply and markers, cancel mid-wave."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

import asyncpg
import orjson

from consolidation import queue
from consolidation.testing.fake_llm import FakeLLMServer
from tests.support.engine import grew, ingest, markers
from tests.support.waiting import wait_for


def start_replay(database_url: str, llm_url: str, *args: str, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "consolidation.cli", "replay", "b", *args],
        env={
            **os.environ,
            "CONSOLIDATION_DATABASE_URL": database_url,
            "CONSOLIDATION_LLM_BASE_URL": llm_url,
            "CONSOLIDATION_LLM_MAX_RETRIES": "0",
            "CONSOLIDATION_LOG_FORMAT": "json",
            "CONSOLIDATION_LOG_LEVEL": "WARNING",
            **env,
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def alice(n: int) -> list[dict[str, Any]]:
    return [{"text": f"Alice drinks green tea, note {i}", "tags": ["alice"]} for i in range(n)]


def facts_sent(fake: FakeLLMServer) -> list[str]:
    return [
        t for call in fake.stats()["calls"] if call["status"] == 200 for t in call["fact_texts"]
    ]


async def test_a_crash_between_apply_and_markers_then_a_rerun_duplicates_nothing(
    pool: asyncpg.Pool, database_url: str, fake: FakeLLMServer
) -> None:
    await ingest(pool, "b", alice(8))
    # Batches of 2 in one scope run serially: two answers are applied, the third call hangs.
    fake.control(script=[{"pass": True}, {"pass": True}, {"hang": True}])
    proc = start_replay(
        database_url, fake.url, CONSOLIDATION_LLM_BATCH_SIZE="2", CONSOLIDATION_LEASE_S="1"
    )
    try:
        await wait_for(lambda: fake.stats()["requests"] >= 3, what="the third LLM call")
        # The third call starts once the second answer is in, while the second pass applies.
        await wait_for(
            lambda: grew(pool, "SELECT count(*) FROM consolidation_outcomes", 3),
            what="the second pass's apply",
        )
        journaled = await pool.fetchval("SELECT count(*) FROM consolidation_outcomes")
        assert journaled == 4  # and no more: the third call hangs
        assert (await markers(pool, "b"))["consolidated"] == 0  # the wave never finished
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    first_run_facts = facts_sent(fake)
    assert len(first_run_facts) == 4

    fake.reset()
    # The dead process's lease (1 s) must run out before another replay may take the bank over.
    await wait_for(
        lambda: pool.fetchval(
            "SELECT lease_expires_at < now() FROM operations WHERE status = 'running'"
        ),
        what="the crashed operation's lease to expire",
    )
    rerun = start_replay(database_url, fake.url, "--json", CONSOLIDATION_LLM_BATCH_SIZE="2")
    out, err = rerun.communicate(timeout=120)
    assert rerun.returncode == 0, err
    op = orjson.loads(out)
    assert op["status"] == "completed" and op["result"]["recovered"] == 4

    second_run_facts = facts_sent(fake)
    assert not set(first_run_facts) & set(second_run_facts)  # no journaled pair sent again
    assert len(second_run_facts) == 4
    assert await markers(pool, "b") == {"consolidated": 8, "failed": 0, "pending": 0}
    assert await pool.fetchval("SELECT count(*) FROM observations") == 1
    assert await pool.fetchval("SELECT count(*) FROM observation_sources") == 8
    assert await pool.fetchval("SELECT count(*) FROM consolidation_outcomes") == 8


async def test_cancelling_a_replay_mid_wave_keeps_applied_work_marked_and_the_rest_pending(
    pool: asyncpg.Pool, database_url: str, fake: FakeLLMServer
) -> None:
    await ingest(pool, "b", alice(8))
    fake.control(script=[{"pass": True}, {"pass": True}, {"hang": True}])
    proc = start_replay(database_url, fake.url, "--json", CONSOLIDATION_LLM_BATCH_SIZE="2")
    try:
        await wait_for(lambda: fake.stats()["requests"] >= 3, what="the third LLM call")
        # The third call starts once the second answer is in, while the second pass applies.
        await wait_for(
            lambda: grew(pool, "SELECT count(*) FROM consolidation_outcomes", 3),
            what="the second pass's apply",
        )
        operation_id = await pool.fetchval("SELECT id FROM operations WHERE status = 'running'")
        cancelled = await queue.request_cancel(pool, operation_id)
        assert cancelled.status == "running"  # a running operation is asked, then stops
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err
    op = orjson.loads(out)
    assert op["status"] == "cancelled"
    await wait_for(lambda: fake.stats()["aborted"] == 1, what="the in-flight request to abort")
    assert await markers(pool, "b") == {"consolidated": 4, "failed": 0, "pending": 4}
    assert op["result"]["consolidated"] == 4


async def test_ctrl_c_cancels_a_replay_the_same_way(
    pool: asyncpg.Pool, database_url: str, fake: FakeLLMServer
) -> None:
    await ingest(pool, "b", alice(4))
    fake.control(script=[{"pass": True}, {"hang": True}])
    proc = start_replay(database_url, fake.url, "--json", CONSOLIDATION_LLM_BATCH_SIZE="2")
    try:
        await wait_for(lambda: fake.stats()["requests"] >= 2, what="the second LLM call")
        await wait_for(
            lambda: grew(pool, "SELECT count(*) FROM consolidation_outcomes", 1),
            what="the first pass's apply",
        )
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err
    assert orjson.loads(out)["status"] == "cancelled"
    assert await markers(pool, "b") == {"consolidated": 2, "failed": 0, "pending": 2}
