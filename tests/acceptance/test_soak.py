"""Soak: ingestion and consolidation on several banks at once, through two `consolidation serve`
processes on loopback, with random cancels, scoped requests, LLM 503s and 429s (Retry-After),
and one worker killed (SIGKILL) and restarted half-way. At the end the journal, the markers and
the observations agree exactly: every memory consolidated once, one observation per scope.

Bounded: SOAK_SECONDS of load (default 20, which already reaches every path below: the kill,
the reclaim, scoped requests, cancels, 429s; longer runs set more), a seeded
random schedule and deadlines on every wait. The seed is fixed (SOAK_SEED, default 20261123) so
that a failure can be replayed; it is printed with the run's figures, and a search for new
schedules sets another one.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import time
from collections.abc import Iterator
from typing import Any

import asyncpg
import httpx
import pytest

from consolidation.memories import parse_memory
from consolidation.testing.fake_llm import FakeLLMConfig, FakeLLMServer
from tests.support.invariants import assert_consistent
from tests.support.services import Services, metric_total
from tests.support.waiting import wait_drained, wait_for

pytestmark = pytest.mark.acceptance

SOAK_SECONDS = float(os.environ.get("SOAK_SECONDS", "20"))
SOAK_SEED = int(os.environ.get("SOAK_SEED", "20261123"))
BANKS = [f"soak-{i}" for i in range(5)]
TOPICS = [f"t{i}" for i in range(4)]


@pytest.fixture
def fake() -> Iterator[FakeLLMServer]:
    # Some calls get a 429 asking for a 0.2 s pause; retries absorb them.
    config = FakeLLMConfig(
        latency_ms=25, jitter_ms=25, fail_rate=0.03, fail_status=429, retry_after_s=0.2
    )
    with FakeLLMServer(config) as server:
        yield server


def env(database_url: str, llm_url: str) -> dict[str, str]:
    return {
        "CONSOLIDATION_DATABASE_URL": database_url,
        "CONSOLIDATION_LLM_BASE_URL": llm_url,
        "CONSOLIDATION_LLM_BATCH_SIZE": "4",
        "CONSOLIDATION_WAVE_SIZE": "24",
        "CONSOLIDATION_LLM_MAX_RETRIES": "3",
        "CONSOLIDATION_LLM_BACKOFF_BASE_S": "0.05",
        "CONSOLIDATION_LLM_BACKOFF_MAX_S": "0.2",
        "CONSOLIDATION_WORKER_CONCURRENCY": "2",
        "CONSOLIDATION_GROUP_PARALLELISM": "4",
        "CONSOLIDATION_LEASE_S": "2",
        "CONSOLIDATION_POLL_INTERVAL_S": "0.2",
        "CONSOLIDATION_RETRY_BACKOFF_S": "0",
        "CONSOLIDATION_MAX_ATTEMPTS": "20",
        "CONSOLIDATION_SHUTDOWN_GRACE_S": "5",
        "CONSOLIDATION_AUTO_CONSOLIDATE": "true",
    }


def memory(rnd: random.Random, bank: str, n: int) -> dict[str, Any]:
    """Texts of one bank all resemble each other, so the offline policy keeps exactly one
    observation per scope: a second one can only come from work applied twice."""
    a, b = rnd.sample(TOPICS, 2)
    text = f"{bank} person drinks green tea every morning with friends, note {n}"
    kind = rnd.random()
    if kind < 0.7:
        return {"text": text, "tags": [a]}
    if kind < 0.85:
        return {"text": text, "tags": [a, b], "observation_scopes": "per_tag"}
    if kind < 0.95:
        return {"text": text, "tags": [a], "observation_scopes": "shared"}
    return {"text": text, "tags": [a, b], "observation_scopes": "all_combinations"}


async def test_soak_journal_markers_and_observations_agree_after_cancels_and_a_killed_worker(
    pool: asyncpg.Pool,
    database_url: str,
    fake: FakeLLMServer,
    services: Services,
) -> None:
    print(f"\nsoak: SOAK_SECONDS={SOAK_SECONDS} SOAK_SEED={SOAK_SEED}")
    rnd = random.Random(SOAK_SEED)
    first = services.start("a", env(database_url, fake.url))
    second = services.start("b", env(database_url, fake.url))
    urls = {"a": await first.api_url(), "b": await second.api_url()}
    live = ["a", "b"]
    sent: dict[str, list[dict[str, Any]]] = {bank: [] for bank in BANKS}
    ids: set[str] = set()
    counts = {"ingests": 0, "scoped": 0, "cancels": 0}
    killed = restarted = False
    interrupted = None
    killed_at = 0.0
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=30) as http:
        n = 0
        while (elapsed := time.monotonic() - started) < SOAK_SECONDS:
            if not killed and elapsed > 0.4 * SOAK_SECONDS:
                # Killed while it owns a running operation, so another worker must reclaim it;
                # the load goes on until it does.
                interrupted = await pool.fetchval(
                    "SELECT id FROM operations WHERE status = 'running' AND worker_id = $1",
                    f"worker:{socket.gethostname()}:{second.proc.pid}",
                )
                if interrupted is not None:
                    live.remove("b")
                    second.signal(signal.SIGKILL)
                    second.wait_exit()
                    killed = True
                    killed_at = elapsed
            if killed and not restarted and elapsed > max(0.6 * SOAK_SECONDS, killed_at + 2):
                second = services.start("b2", env(database_url, fake.url))
                urls["b"] = await second.api_url()
                live.append("b")
                restarted = True
            base = urls[rnd.choice(live)]
            bank = rnd.choice(BANKS)
            batch = [memory(rnd, bank, n + i) for i in range(rnd.randint(1, 6))]
            n += len(batch)
            response = await http.post(f"{base}/v1/banks/{bank}/memories", json={"memories": batch})
            assert response.status_code == 201, response.text
            ids.update(response.json()["ids"])
            sent[bank] += batch
            counts["ingests"] += 1
            roll = rnd.random()
            if roll < 0.1:
                response = await http.post(
                    f"{base}/v1/banks/{bank}/consolidations",
                    json={"scopes": [[rnd.choice(TOPICS)]], "priority": rnd.randint(-5, 5)},
                )
                assert response.status_code == 202, response.text
                counts["scoped"] += 1
            elif roll < 0.25:
                victim = await pool.fetchval(
                    "SELECT id FROM operations WHERE status IN ('pending', 'running')"
                    " ORDER BY random() LIMIT 1"
                )
                if victim is not None:
                    response = await http.post(f"{base}/v1/operations/{victim}/cancel")
                    assert response.status_code == 202, response.text
                    counts["cancels"] += 1

        assert killed, "worker b never owned a running operation to be killed in"
        if not restarted:  # killed late in a short run: restart it now
            second = services.start("b2", env(database_url, fake.url))
            urls["b"] = await second.api_url()
        # Load is over: one last unscoped consolidation per bank picks up whatever cancels left.
        for bank in BANKS:
            response = await http.post(f"{urls['a']}/v1/banks/{bank}/consolidations", json={})
            assert response.status_code == 202, response.text

        await wait_drained(pool, idle=True, timeout_s=120)
        print(f"soak: {len(ids)} memories, {counts}, killed and restarted one worker")

        census = await assert_consistent(pool)
        assert census.memories == len(ids) and census.consolidated == len(ids)
        assert census.failed == 0
        scopes = {
            (bank, scope)
            for bank, memories in sent.items()
            for m in memories
            for scope in parse_memory(m).scopes
        }
        expected_outcomes = sum(
            len(parse_memory(m).scopes) for memories in sent.values() for m in memories
        )
        assert census.outcomes == expected_outcomes
        assert census.sources == expected_outcomes  # each (memory, scope) cited exactly once
        assert census.observations_per_scope == dict.fromkeys(scopes, 1)
        statuses = dict(await pool.fetch("SELECT status, count(*) FROM operations GROUP BY status"))
        print(f"soak: operations by status {statuses}")
        reclaimed = await pool.fetchrow(
            "SELECT status, attempt, reclaims FROM operations WHERE id = $1", interrupted
        )
        print(f"soak: the operation worker b was killed in ended {dict(reclaimed)}")
        # Taken over without spending an attempt (a killed worker says nothing of the operation).
        assert reclaimed["status"] == "cancelled" or reclaimed["reclaims"] >= 1
        assert set(statuses) <= {"completed", "cancelled", "failed"}
        # An attempt may fail and be superseded by a newer pending operation; nothing else fails.
        failed = await pool.fetch(
            "SELECT id, error FROM operations WHERE status = 'failed'"
            " AND error NOT LIKE '%superseded by pending operation%'"
        )
        assert not failed, [dict(r) for r in failed]

        # A 429 with Retry-After is honoured and shows in /metrics of the process that saw it.
        metric = "consolidation_llm_retry_after_honoured_total"
        live_urls = [urls["a"], urls["b"]]
        before = await metric_total(live_urls, metric)
        fake.control(fail_rate=0.0, script=[{"status": 429, "retry_after": 0.3}])
        response = await http.post(
            f"{urls['a']}/v1/banks/metrics-probe/memories", json={"memories": [{"text": "probe"}]}
        )
        assert response.status_code == 201

        async def counted() -> bool:
            return await metric_total(live_urls, metric) >= before + 1

        await wait_for(counted, what="the honoured Retry-After to be counted in /metrics")

    for service in (first, second):
        service.signal(signal.SIGTERM)
        assert service.wait_exit() == 0
