"""The engine's contract end to end against a real Postgres and the fake LLM over real HTTP:
exactly-once, per-scope order, failure isolation, stops. How it schedules its work (call orders,
statement counts) is pinned apart, in test_engine_schedule.py."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest
import structlog.testing

from consolidation import queue, store
from consolidation.engine import StopSignal
from consolidation.llm.client import OfflineConsolidator
from consolidation.settings import Settings
from consolidation.testing.fake_llm import FakeLLMServer
from tests.support.engine import (
    APPLY_GATE,
    consolidate,
    http_llm,
    ingest,
    markers,
    observations_by_scope,
    run_next,
    topic,
    two_calls_while_the_first_apply_is_held,
    unretrieved_task_errors,
)
from tests.support.invariants import assert_consistent
from tests.support.waiting import wait_for


async def test_same_scope_calls_never_overlap_while_different_groups_do(
    pool: asyncpg.Pool, fake: FakeLLMServer
) -> None:
    fake.control(latency_ms=30)
    memories = [m for g in range(8) for m in topic(f"Person{g}", 6, [f"group-{g}"])]
    await ingest(pool, "b", memories)
    llm = http_llm(fake.url)
    try:
        end = await consolidate(
            pool, "b", llm, Settings(wave_size=100, llm_batch_size=2, group_parallelism=8)
        )
    finally:
        await llm.aclose()
    assert end.status == "completed", end.error
    stats = fake.stats()
    assert stats["requests"] == 8 * 3
    assert stats["max_in_flight_per_scope"] == 1
    assert stats["max_distinct_scopes_in_flight"] > 1


async def test_one_topic_over_several_batches_of_one_scope_ends_in_one_observation(
    pool: asyncpg.Pool, fake: FakeLLMServer
) -> None:
    ids = await ingest(pool, "b", topic("Alice", 10, ["alice"]))
    llm = http_llm(fake.url)
    try:
        end = await consolidate(pool, "b", llm, Settings(llm_batch_size=3))
    finally:
        await llm.aclose()
    assert end.status == "completed"
    assert fake.stats()["requests"] == 4
    rows = await pool.fetch(
        "SELECT o.id, array_agg(s.memory_id) AS sources FROM observations o"
        " JOIN observation_sources s ON s.observation_id = o.id GROUP BY o.id"
    )
    assert len(rows) == 1
    assert set(rows[0]["sources"]) == set(ids)
    perf = end.summary.perf
    assert perf.created == 3 and perf.updated == 7


def _interleaved(groups: int, per_group: int) -> list[dict[str, Any]]:
    """``groups`` tag groups whose memories alternate in time, one of each group in turn."""
    start = datetime(2026, 1, 1, tzinfo=UTC)
    return [
        {
            "text": f"Person{g} drinks green tea every morning, cup {i}",
            "tags": [f"group-{g}"],
            "occurred_at": (start + timedelta(minutes=i * groups + g)).isoformat(),
        }
        for i in range(per_group)
        for g in range(groups)
    ]


@pytest.mark.parametrize(("lookahead", "calls"), [(0, 24), (20, 8)])
async def test_memories_read_ahead_fill_small_groups_batches_in_each_scopes_order(
    pool: asyncpg.Pool, fake: FakeLLMServer, lookahead: int, calls: int
) -> None:
    # Four groups take turns: a wave of four holds one memory of each, so each batch would
    # carry one memory; read ahead, each group's batch is filled with its next memories.
    memories = _interleaved(4, 6)
    await ingest(pool, "b", memories)
    llm = http_llm(fake.url)
    config = Settings(wave_size=4, wave_lookahead=lookahead, llm_batch_size=3)
    try:
        end = await consolidate(pool, "b", llm, config)
    finally:
        await llm.aclose()
    assert end.status == "completed" and end.summary.consolidated == 24
    stats = fake.stats()
    assert stats["requests"] == calls
    seen: dict[tuple[str, ...], list[str]] = {}
    for call in stats["calls"]:
        seen.setdefault(tuple(call["scope"]), []).extend(call["fact_texts"])
    for g in range(4):
        assert seen[(f"group-{g}",)] == [m["text"] for m in memories if m["tags"] == [f"group-{g}"]]
    assert (await markers(pool, "b"))["consolidated"] == 24
    await assert_consistent(pool)


async def test_a_poisoned_memory_is_isolated_by_splitting_and_marked_failed(
    pool: asyncpg.Pool, fake: FakeLLMServer
) -> None:
    memories = topic("Bob", 8, ["bob"])
    memories[5]["text"] = "Bob drinks green tea [[poison]]"
    ids = await ingest(pool, "b", memories)
    llm = http_llm(fake.url)
    try:
        end = await consolidate(pool, "b", llm, Settings(llm_batch_size=8))
    finally:
        await llm.aclose()
    assert end.status == "completed"
    failed = await pool.fetch("SELECT id FROM memories WHERE consolidation_failed_at IS NOT NULL")
    assert [r["id"] for r in failed] == [ids[5]]
    assert await markers(pool, "b") == {"consolidated": 7, "failed": 1, "pending": 0}
    assert end.summary.perf.failed == 1 and end.summary.perf.splits >= 1
    # Nothing was written from an unusable answer: the poisoned fact is cited nowhere.
    assert (
        await pool.fetchval("SELECT count(*) FROM observation_sources WHERE memory_id = $1", ids[5])
        == 0
    )


async def test_an_llm_that_always_answers_503_fails_the_operation_and_marks_nothing_failed(
    pool: asyncpg.Pool, fake: FakeLLMServer
) -> None:
    fake.control(fail_rate=1.0, fail_status=503)
    await ingest(pool, "b", topic("Carol", 4, ["carol"]))
    llm = http_llm(fake.url, max_retries=2)
    try:
        end = await consolidate(pool, "b", llm)
    finally:
        await llm.aclose()
    assert end.status == "failed"  # a foreground operation has one attempt
    assert "TransientLLMError" in (end.error or "") or "503" in (end.error or "")
    assert fake.stats()["requests"] == 3  # first try + 2 retries
    assert await markers(pool, "b") == {"consolidated": 0, "failed": 0, "pending": 4}


async def test_a_401_fails_the_operation_at_once_with_a_clear_message(
    pool: asyncpg.Pool, fake: FakeLLMServer
) -> None:
    fake.control(api_key="right-key")
    await ingest(pool, "b", topic("Dan", 4, ["dan"]))
    llm = http_llm(fake.url, api_key="wrong-key")
    try:
        end = await consolidate(pool, "b", llm)
    finally:
        await llm.aclose()
    assert end.status == "failed"
    assert "401" in (end.error or "") and "CONSOLIDATION_LLM_API_KEY" in (end.error or "")
    assert fake.stats()["requests"] == 1
    assert await markers(pool, "b") == {"consolidated": 0, "failed": 0, "pending": 4}


@pytest.mark.parametrize(
    ("tags", "mode", "expected"),
    [
        (["b", "a"], None, [("a", "b")]),
        (["b", "a"], "combined", [("a", "b")]),
        (["b", "a"], "per_tag", [("a",), ("b",)]),
        ([], "per_tag", [()]),
        (["a", "b"], "all_combinations", [("a",), ("a", "b"), ("b",)]),
        (["a", "b"], "shared", [()]),
        (["a"], [["x", "y"], []], [(), ("x", "y")]),
    ],
)
async def test_every_observation_scopes_mode_writes_the_right_scopes(
    pool: asyncpg.Pool, tags: list[str], mode: Any, expected: list[tuple[str, ...]]
) -> None:
    memory: dict[str, Any] = {"text": "Erin plays the violin", "tags": tags}
    if mode is not None:
        memory["observation_scopes"] = mode
    (memory_id,) = await ingest(pool, "b", [memory])
    end = await consolidate(pool, "b", OfflineConsolidator())
    assert end.status == "completed"
    assert sorted((await observations_by_scope(pool, "b")).keys()) == expected
    outcomes = await pool.fetch(
        "SELECT scope FROM consolidation_outcomes WHERE memory_id = $1 ORDER BY scope", memory_id
    )
    assert sorted(tuple(r["scope"]) for r in outcomes) == expected
    assert await markers(pool, "b") == {"consolidated": 1, "failed": 0, "pending": 0}


async def test_overlapping_scopes_are_one_group_so_shared_scopes_stay_serial(
    pool: asyncpg.Pool, fake: FakeLLMServer
) -> None:
    fake.control(latency_ms=20)
    memories = [
        {
            "text": f"Frank note {i} about travel plans",
            "tags": ["x", f"y{i % 3}"],
            "observation_scopes": "per_tag",
        }
        for i in range(12)
    ]
    await ingest(pool, "b", memories)
    llm = http_llm(fake.url)
    try:
        end = await consolidate(pool, "b", llm, Settings(llm_batch_size=2, group_parallelism=8))
    finally:
        await llm.aclose()
    assert end.status == "completed"
    assert fake.stats()["max_in_flight_per_scope"] == 1


async def test_a_scoped_operation_only_consolidates_its_scopes(pool: asyncpg.Pool) -> None:
    from consolidation import queue
    from consolidation.engine import run_operation

    await ingest(pool, "b", topic("Gina", 2, ["gina"]) + topic("Hal", 2, ["hal"]))
    lease = await queue.start_foreground(pool, "b", "w", 30, scopes=[("gina",)])
    end = await run_operation(pool, lease, OfflineConsolidator(), Settings())
    assert end.status == "completed"
    assert list((await observations_by_scope(pool, "b")).keys()) == [("gina",)]
    assert await markers(pool, "b") == {"consolidated": 2, "failed": 0, "pending": 2}


async def test_a_shutdown_lets_a_pass_whose_call_is_under_way_finish_and_starts_nothing_new(
    pool: asyncpg.Pool, database_url: str, fake: FakeLLMServer
) -> None:
    # Three passes in a chain; pass 2's call is under way (early, 300 ms) while pass 1's apply
    # is held when the worker is told to shut down: pass 2 is a running pass, so it finishes
    # and applies (its call is not aborted); pass 3 never starts.
    fake.control(latency_ms=300)
    await ingest(pool, "b", topic("Alice", 3, ["alice"]))
    stop = StopSignal()
    end, _ = await two_calls_while_the_first_apply_is_held(
        pool, database_url, fake, Settings(llm_batch_size=1), stop=stop
    )
    assert end.error == "interrupted by shutdown"
    assert await pool.fetchval("SELECT count(*) FROM consolidation_outcomes") == 2
    stats = fake.stats()
    assert stats["requests"] == 2 and stats["aborted"] == 0


async def test_a_group_failing_for_good_in_a_later_wave_fails_the_operation_with_its_error(
    pool: asyncpg.Pool, database_url: str, fake: FakeLLMServer
) -> None:
    # Waves of 4, one memory per pass: wave 1 is one chain in "s"; wave 2's "p" memory is
    # answered 401 (a configuration error). Both groups start at once and their calls take
    # 200 ms, so the 401 comes while wave 1's first pass runs; its apply is held at the gate
    # until then. Wave 1's chain stops for it before its next pass: the operation must fail at
    # once with the 401 — not with the stop its sibling was told — and wave 1's apply is marked.
    await pool.execute(APPLY_GATE)
    fake.control(latency_ms=200, fail_when_contains="[[revoked]]", fail_when_status=401)
    order = ["s"] * 4 + ["p"] + ["s"] * 5
    ids = await ingest(
        pool,
        "b",
        [
            {
                "text": f"Note {i} about topic {tag}" + (" [[revoked]]" if tag == "p" else ""),
                "tags": [tag],
                "occurred_at": f"2026-01-01T00:00:{i:02d}Z",
            }
            for i, tag in enumerate(order)
        ],
    )
    op = (await queue.submit(pool, "b", max_attempts=3)).operation
    settings = Settings(wave_size=4, llm_batch_size=1)
    gate = await asyncpg.connect(database_url)
    llm = http_llm(fake.url)
    try:
        await gate.execute("SELECT pg_advisory_lock(4242)")
        run = asyncio.create_task(run_next(pool, llm, settings))
        await wait_for(lambda: fake.stats()["statuses"].get(401), what="wave 2's 401")
        await wait_for(
            lambda: pool.fetchval(
                "SELECT count(*) FROM pg_locks"
                " WHERE locktype = 'advisory' AND objid = 4242 AND NOT granted"
            ),
            what="wave 1's first apply at the gate",
        )
        await gate.execute("SELECT pg_advisory_unlock(4242)")
        end = await asyncio.wait_for(run, 30)
    finally:
        await gate.close()
        await llm.aclose()
    assert end.status == "failed", end.error
    assert end.error is not None and "LLMConfigError" in end.error and "401" in end.error
    row = await queue.get_operation(pool, op.id)
    assert (row.status, row.attempt, row.error) == ("failed", 1, end.error)
    assert fake.stats()["statuses"][401] == 1  # no retry of a configuration error
    marked = await pool.fetch("SELECT id FROM memories WHERE consolidated_at IS NOT NULL")
    assert [r["id"] for r in marked] == [ids[0]]
    await assert_consistent(pool, allow_pending=True)

    # The key fixed, the next operation finishes the bank and applies nothing twice.
    fake.control(fail_when_contains=None)
    await queue.submit(pool, "b")
    llm = http_llm(fake.url)
    try:
        again = await run_next(pool, llm, settings)
    finally:
        await llm.aclose()
    assert again.status == "completed", again.error
    census = await assert_consistent(pool)
    assert (census.consolidated, census.outcomes) == (10, 10)
    assert census.observations_per_scope == {("b", ("p",)): 1, ("b", ("s",)): 1}


async def test_markers_fenced_out_are_not_counted_as_done_and_the_lost_lease_is_a_warning(
    pool: asyncpg.Pool, fake: FakeLLMServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another worker takes the operation over just before the first wave's markers are
    # written: the fenced write marks nothing, and nothing may say it did — not the wave's log
    # line, not the summary, not the progress.
    await ingest(pool, "b", topic("Ann", 4, ["ann"]))
    commit = store.commit_wave_markers

    async def taken_over_first(p: asyncpg.Pool, lease: Any, *args: Any) -> Any:
        await p.execute(
            "UPDATE operations SET worker_id = 'another-worker' WHERE id = $1", lease.operation_id
        )
        return await commit(p, lease, *args)

    monkeypatch.setattr(store, "commit_wave_markers", taken_over_first)
    llm = http_llm(fake.url)
    try:
        with unretrieved_task_errors() as unretrieved, structlog.testing.capture_logs() as logs:
            end = await consolidate(pool, "b", llm)
    finally:
        await llm.aclose()
    assert unretrieved == []  # the close's LeaseLost is the run's error, observed
    assert end.status == "lost"
    assert (end.summary.processed, end.summary.consolidated, end.summary.waves) == (0, 0, 0)
    assert await markers(pool, "b") == {"consolidated": 0, "failed": 0, "pending": 4}
    lost = [e for e in logs if e["event"] == "lease_lost"]
    assert lost and all(e["log_level"] == "warning" for e in lost)
    assert not [e for e in logs if e["event"] == "wave" and e["consolidated"] > 0]
    progress = await pool.fetchval("SELECT progress FROM operations")
    assert not progress or progress.get("processed", 0) == 0
