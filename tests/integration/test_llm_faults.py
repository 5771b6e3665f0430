"""LLM faults through the fake OpenAI-compatible server over real HTTP, against a real Postgres.

Transient trouble (timeouts, slow answers, 5xx bursts, 429) never marks a memory failed: it is
retried, and when retries run out the attempt fails and the operation is retried later. An
unusable answer (invalid JSON, truncated, unknown refs, another scope's observation, empty,
oversized) is retried once, then isolated by splitting; nothing is written from it. The
operation row says what happened.
"""

from __future__ import annotations

import uuid
from typing import Any

import asyncpg
import orjson
import pytest
import structlog.testing
from prometheus_client import REGISTRY
from structlog.testing import capture_logs

from consolidation import queue
from consolidation.engine import OperationEnd, run_operation
from consolidation.llm.client import Consolidator
from consolidation.runtime import build_consolidator
from consolidation.settings import Settings, load_settings
from consolidation.testing.fake_llm import (
    BADJSON_MARKER,
    EMPTY_MARKER,
    POISON_MARKER,
    REPAIRABLE_MARKER,
    TRUNCATE_MARKER,
    FakeLLMConfig,
    FakeLLMServer,
)
from tests.support.engine import consolidate, http_llm, ingest, markers
from tests.support.invariants import assert_consistent
from tests.support.waiting import wait_for

TEN_MB = 10 * 1024 * 1024


def topic(person: str, n: int, tags: list[str]) -> list[dict[str, Any]]:
    return [
        {"text": f"{person} drinks green tea every morning, cup {i}", "tags": tags}
        for i in range(n)
    ]


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def run_claimed(pool: asyncpg.Pool, llm: Consolidator, config: Settings) -> OperationEnd:
    """Claim the due operation like a worker does and run that attempt to its end."""
    lease = await queue.claim(pool, "fault-worker", 30)
    assert lease is not None, "no operation was due"
    return await run_operation(pool, lease, llm, config)


async def operation_row(pool: asyncpg.Pool, operation_id: uuid.UUID) -> queue.Operation:
    return await queue.get_operation(pool, operation_id)


async def nothing_written(pool: asyncpg.Pool) -> bool:
    counts = await pool.fetchrow(
        """SELECT (SELECT count(*) FROM observations) AS observations,
                  (SELECT count(*) FROM observation_sources) AS sources,
                  (SELECT count(*) FROM observation_history) AS history,
                  (SELECT count(*) FROM consolidation_outcomes) AS outcomes"""
    )
    return all(v == 0 for v in counts.values())


# --- transient faults -------------------------------------------------------------------------


@pytest.mark.parametrize("statuses", [[500], [502, 503], [503, 500, 502]])
async def test_a_burst_of_5xx_within_the_retries_is_absorbed_and_counted(
    pool: asyncpg.Pool, fake: FakeLLMServer, statuses: list[int]
) -> None:
    fake.control(script=[{"status": s} for s in statuses])
    await ingest(pool, "b", topic("Ann", 3, ["ann"]))
    retries_before = metric("consolidation_llm_requests_total", outcome="retry")
    llm = http_llm(fake.url, max_retries=3)
    try:
        end = await consolidate(pool, "b", llm)
    finally:
        await llm.aclose()
    assert end.status == "completed", end.error
    assert end.summary.perf.llm_retries == len(statuses)
    assert end.summary.perf.llm_failures == 0 and end.summary.failed == 0
    assert metric("consolidation_llm_requests_total", outcome="retry") - retries_before == len(
        statuses
    )
    assert await markers(pool, "b") == {"consolidated": 3, "failed": 0, "pending": 0}
    await assert_consistent(pool)


async def test_5xx_past_the_retries_fails_the_attempt_marks_nothing_and_the_retry_completes(
    pool: asyncpg.Pool, fake: FakeLLMServer
) -> None:
    fake.control(fail_rate=1.0, fail_status=502)
    await ingest(pool, "b", topic("Bea", 4, ["bea"]))
    op = (await queue.submit(pool, "b", max_attempts=3)).operation
    llm = http_llm(fake.url, max_retries=2)
    config = Settings(retry_backoff_s=0)
    try:
        first = await run_claimed(pool, llm, config)
        row = await operation_row(pool, op.id)
        assert first.status == "pending" and row.status == "pending" and row.attempt == 1
        assert row.error is not None
        assert "LLMRetriesExhausted" in row.error and "502" in row.error
        assert "after 3 attempt(s)" in row.error
        assert await markers(pool, "b") == {"consolidated": 0, "failed": 0, "pending": 4}
        assert await nothing_written(pool)

        fake.control(fail_rate=0.0)
        second = await run_claimed(pool, llm, config)
    finally:
        await llm.aclose()
    assert second.status == "completed", second.error
    row = await operation_row(pool, op.id)
    assert row.status == "completed" and row.attempt == 2 and row.error is None
    assert row.result is not None and row.result["consolidated"] == 4
    assert await markers(pool, "b") == {"consolidated": 4, "failed": 0, "pending": 0}
    census = await assert_consistent(pool)
    assert census.observations == 1


async def test_a_pass_that_exhausts_its_retries_is_counted_in_the_stored_perf(
    pool: asyncpg.Pool, fake: FakeLLMServer
) -> None:
    fake.control(fail_rate=1.0, fail_status=503)
    await ingest(pool, "b", topic("Bo", 2, ["bo"]))
    op = (await queue.submit(pool, "b", max_attempts=2)).operation
    llm = http_llm(fake.url, max_retries=2)
    try:
        end = await run_claimed(pool, llm, Settings(retry_backoff_s=0))
    finally:
        await llm.aclose()
    assert end.status == "pending"
    row = await operation_row(pool, op.id)
    assert row.result is not None
    perf = row.result["perf"]
    assert fake.stats()["requests"] == 3
    assert perf["llm_calls"] == 1 and perf["llm_retries"] == 2, perf


async def test_answers_slower_than_the_llm_timeout_setting_fail_the_attempt_not_the_memories(
    pool: asyncpg.Pool, fake: FakeLLMServer
) -> None:
    fake.control(latency_ms=5_000)
    await ingest(pool, "b", topic("Cid", 3, ["cid"]))
    # A budget roomier than both tries: each is abandoned at the full timeout.
    settings = load_settings(
        llm_base_url=fake.url,
        llm_timeout_s=0.3,
        llm_retry_budget_s=5,
        llm_max_retries=1,
        llm_backoff_base_s=0.01,
        llm_backoff_max_s=0.02,
    )
    llm = build_consolidator(settings)
    try:
        end = await consolidate(pool, "b", llm)
    finally:
        await llm.aclose()
    assert end.status == "failed"  # a foreground operation has a single attempt
    assert end.error is not None and "no answer within 0.3s" in end.error
    assert "CONSOLIDATION_LLM_TIMEOUT_S" in end.error
    assert await markers(pool, "b") == {"consolidated": 0, "failed": 0, "pending": 3}
    assert await nothing_written(pool)
    # The client gave up on both requests (the fake notices the disconnect a moment later).
    await wait_for(lambda: fake.stats()["aborted"] == 2, what="both requests to be abandoned")
    assert fake.stats()["requests"] == 2


async def test_a_hanging_answer_is_abandoned_at_the_timeout_and_the_retry_is_used(
    pool: asyncpg.Pool, fake: FakeLLMServer
) -> None:
    fake.control(script=[{"hang": True}])
    await ingest(pool, "b", topic("Dee", 2, ["dee"]))
    llm = http_llm(fake.url, timeout_s=0.3, max_retries=2)
    try:
        end = await consolidate(pool, "b", llm)
    finally:
        await llm.aclose()
    assert end.status == "completed", end.error
    assert end.summary.perf.llm_retries == 1 and end.summary.failed == 0
    assert await markers(pool, "b") == {"consolidated": 2, "failed": 0, "pending": 0}


async def test_a_429_retry_after_is_honoured_and_visible_in_metrics(
    pool: asyncpg.Pool, fake: FakeLLMServer
) -> None:
    fake.control(script=[{"status": 429, "retry_after": 0.4}, {"status": 429}])
    await ingest(pool, "b", topic("Eve", 2, ["eve"]))
    honoured_before = metric("consolidation_llm_retry_after_honoured_total")
    # Backoff is capped at 100 ms, so only the header can explain a longer pause.
    llm = http_llm(fake.url, max_retries=3, backoff_base_s=0.01, backoff_max_s=0.1)
    try:
        end = await consolidate(pool, "b", llm)
    finally:
        await llm.aclose()
    assert end.status == "completed", end.error
    assert end.summary.perf.llm_retries == 2
    # The first 429 asked for 0.4 s; the second had no header, so backoff decided it.
    assert metric("consolidation_llm_retry_after_honoured_total") - honoured_before == 1
    calls = fake.stats()["calls"]
    assert [c["status"] for c in calls] == [429, 429, 200]
    assert calls[1]["started"] - calls[0]["ended"] >= 0.4 - 0.02
    assert await markers(pool, "b") == {"consolidated": 2, "failed": 0, "pending": 0}


async def test_a_transient_fault_mid_operation_keeps_applied_work_and_the_retry_duplicates_nothing(
    pool: asyncpg.Pool, fake: FakeLLMServer
) -> None:
    # Two passes are answered, then the third fails every try.
    fake.control(script=[{"pass": True}, {"pass": True}, {"status": 503}, {"status": 503}])
    memories = [m for t in range(4) for m in topic(f"P{t}", 2, [f"t{t}"])]
    await ingest(pool, "b", memories)
    op = (await queue.submit(pool, "b", max_attempts=3)).operation
    llm = http_llm(fake.url, max_retries=1)
    config = Settings(llm_batch_size=2, group_parallelism=1, retry_backoff_s=0)
    try:
        first = await run_claimed(pool, llm, config)
        assert first.status == "pending"
        row = await operation_row(pool, op.id)
        assert row.error is not None and "503" in row.error
        assert row.result is not None and row.result["consolidated"] == 4
        assert await markers(pool, "b") == {"consolidated": 4, "failed": 0, "pending": 4}
        await assert_consistent(pool, allow_pending=True)

        fake.reset()
        second = await run_claimed(pool, llm, config)
    finally:
        await llm.aclose()
    assert second.status == "completed", second.error
    # Only the two unfinished topics went back to the LLM.
    assert fake.stats()["requests"] == 2
    assert await markers(pool, "b") == {"consolidated": 8, "failed": 0, "pending": 0}
    census = await assert_consistent(pool)
    assert census.observations == 4 and census.sources == 8 and census.outcomes == 8


# --- unusable answers -------------------------------------------------------------------------


async def one_batch_with_a_marked_memory(
    pool: asyncpg.Pool, fake: FakeLLMServer, marker: str, index: int
) -> tuple[list[Any], queue.Operation, OperationEnd]:
    """Eight near-identical memories in one batch, the ``index``-th carrying ``marker``, run as
    an operation's only attempt: the memory ids, the operation and how it ended."""
    memories = topic("Fay", 8, ["fay"])
    memories[index]["text"] = f"Fay drinks green tea, cup {index} {marker}"
    ids = await ingest(pool, "b", memories)
    op = (await queue.submit(pool, "b", max_attempts=1)).operation
    llm = http_llm(fake.url)
    try:
        end = await run_claimed(pool, llm, Settings(llm_batch_size=8))
    finally:
        await llm.aclose()
    return ids, op, end


@pytest.mark.parametrize("marker", [BADJSON_MARKER, TRUNCATE_MARKER, POISON_MARKER, EMPTY_MARKER])
async def test_an_unusable_answer_is_isolated_by_splitting_and_nothing_is_written_from_it(
    pool: asyncpg.Pool, fake: FakeLLMServer, marker: str
) -> None:
    ids, op, end = await one_batch_with_a_marked_memory(pool, fake, marker, 3)
    assert end.status == "completed", end.error
    failed = await pool.fetch("SELECT id FROM memories WHERE consolidation_failed_at IS NOT NULL")
    assert [r["id"] for r in failed] == [ids[3]]
    assert await markers(pool, "b") == {"consolidated": 7, "failed": 1, "pending": 0}
    for table in ("observation_sources", "consolidation_outcomes"):
        assert (
            await pool.fetchval(f"SELECT count(*) FROM {table} WHERE memory_id = $1", ids[3]) == 0
        ), table
    assert (
        await pool.fetchval(
            "SELECT count(*) FROM observation_history WHERE $1 = ANY(memory_ids)", ids[3]
        )
        == 0
    )
    # The stored result says what happened.
    row = await operation_row(pool, op.id)
    assert row.status == "completed" and row.result is not None
    perf = row.result["perf"]
    assert row.result["failed"] == 1 and row.result["consolidated"] == 7
    # 8 → 4 → 2 → 1: each unusable pass was tried twice before its batch was halved; each
    # retry showed the model its answer and the problems (unless there was no answer to show).
    assert perf["failed"] == 1 and perf["splits"] == 3 and perf["llm_failures"] == 8
    assert perf["llm_repairs"] == (0 if marker == EMPTY_MARKER else 4)
    assert perf["llm_repaired"] == 0
    await assert_consistent(pool)


async def test_one_unusable_answer_is_retried_once_without_splitting(
    pool: asyncpg.Pool, fake: FakeLLMServer
) -> None:
    fake.control(script=[{"content": '{"creates": [{"text": "x", "facts": ["f42"]}]}'}])
    await ingest(pool, "b", topic("Gus", 4, ["gus"]))
    llm = http_llm(fake.url)
    try:
        end = await consolidate(pool, "b", llm, Settings(llm_batch_size=4))
    finally:
        await llm.aclose()
    assert end.status == "completed"
    perf = end.summary.perf
    assert perf.llm_failures == 1 and perf.splits == 0 and perf.llm_calls == 2
    assert await markers(pool, "b") == {"consolidated": 4, "failed": 0, "pending": 0}


async def test_an_answer_citing_another_scopes_observation_is_rejected_and_writes_nothing(
    pool: asyncpg.Pool, fake: FakeLLMServer
) -> None:
    await ingest(pool, "b", topic("Hal", 1, ["hal"]))
    llm = http_llm(fake.url)
    try:
        assert (await consolidate(pool, "b", llm)).status == "completed"
        other = await pool.fetchrow("SELECT id, text, version FROM observations")
        # A memory of another scope; the model names the first scope's observation, by a ref
        # the request does not have and then by its raw id.
        (target,) = await ingest(pool, "b", topic("Ivy", 1, ["ivy"]))
        fake.control(
            script=[
                {
                    "content": orjson.dumps(
                        {"updates": [{"observation": "o1", "text": "hijacked", "facts": ["f1"]}]}
                    ).decode()
                },
                {
                    "content": orjson.dumps(
                        {
                            "updates": [
                                {
                                    "observation": str(other["id"]),
                                    "text": "hijacked",
                                    "facts": ["f1"],
                                }
                            ]
                        }
                    ).decode()
                },
            ]
        )
        end = await consolidate(pool, "b", llm)
    finally:
        await llm.aclose()
    assert end.status == "completed"
    assert end.summary.failed == 1 and end.summary.perf.llm_failures == 2
    assert await pool.fetchval(
        "SELECT consolidation_failed_at IS NOT NULL FROM memories WHERE id = $1", target
    )
    after = await pool.fetchrow("SELECT id, text, version FROM observations")
    assert dict(after) == dict(other)
    assert await pool.fetchval("SELECT count(*) FROM observations") == 1
    assert await pool.fetchval("SELECT count(*) FROM observation_history") == 0
    await assert_consistent(pool)


async def test_a_10_mb_valid_answer_is_consolidated(
    pool: asyncpg.Pool, fake: FakeLLMServer
) -> None:
    fake.control(pad_bytes=TEN_MB)
    await ingest(pool, "b", topic("Jon", 3, ["jon"]))
    llm = http_llm(fake.url, timeout_s=60)
    try:
        end = await consolidate(pool, "b", llm)
    finally:
        await llm.aclose()
    assert end.status == "completed", end.error
    assert await markers(pool, "b") == {"consolidated": 3, "failed": 0, "pending": 0}
    assert await pool.fetchval("SELECT max(length(text)) FROM observations") < 4_000


@pytest.mark.parametrize(
    "content",
    [
        "x" * TEN_MB,
        '{"creates": [{"text": "' + "y" * TEN_MB + '", "facts": ["f1"]}]}',
    ],
    ids=["10MB-not-json", "10MB-text"],
)
async def test_a_10_mb_unusable_answer_is_isolated_and_its_error_stays_small(
    pool: asyncpg.Pool, fake: FakeLLMServer, content: str
) -> None:
    fake.control(script=[{"content": content}, {"content": content}])
    ids = await ingest(pool, "b", topic("Kim", 1, ["kim"]))
    op = (await queue.submit(pool, "b", max_attempts=1)).operation
    llm = http_llm(fake.url, timeout_s=60)
    try:
        end = await run_claimed(pool, llm, Settings())
    finally:
        await llm.aclose()
    assert end.status == "completed"
    assert await markers(pool, "b") == {"consolidated": 0, "failed": 1, "pending": 0}
    assert await pool.fetchval(
        "SELECT consolidation_failed_at IS NOT NULL FROM memories WHERE id = $1", ids[0]
    )
    assert await nothing_written(pool)
    stored = await pool.fetchval(
        "SELECT length(result::text) + length(coalesce(error, '')) + length(progress::text)"
        " FROM operations WHERE id = $1",
        op.id,
    )
    assert stored < 10_000


# --- repairs ----------------------------------------------------------------------------------


async def test_an_unusable_answer_is_repaired_by_showing_the_model_its_problems(
    pool: asyncpg.Pool, fake: FakeLLMServer
) -> None:
    _, op, end = await one_batch_with_a_marked_memory(pool, fake, REPAIRABLE_MARKER, 5)
    assert end.status == "completed", end.error
    perf = end.summary.perf
    assert (perf.llm_calls, perf.llm_failures, perf.splits, perf.failed) == (2, 1, 0, 0)
    assert (perf.llm_repairs, perf.llm_repaired) == (1, 1)
    first, repair = fake.stats()["calls"]
    assert first["roles"] == ["system", "user"]
    assert repair["roles"] == ["system", "user", "assistant", "user"]
    assert "f9999" in repair["turns"][0]
    assert "unknown fact ref 'f9999'" in repair["turns"][1]
    assert repair["fact_texts"] == first["fact_texts"]
    row = await operation_row(pool, op.id)
    assert row.result is not None
    assert (row.result["perf"]["llm_repairs"], row.result["perf"]["llm_repaired"]) == (1, 1)
    assert await markers(pool, "b") == {"consolidated": 8, "failed": 0, "pending": 0}
    await assert_consistent(pool)


# --- real servers' dialects -------------------------------------------------------------------


async def consolidate_then_close(
    pool: asyncpg.Pool, llm: Consolidator, config: Settings | None = None
) -> OperationEnd:
    """One foreground operation on bank ``b`` with ``llm``, which is closed afterwards."""
    try:
        return await consolidate(pool, "b", llm, config)
    finally:
        await llm.aclose()


def bank_of(topics: int, per_topic: int) -> list[dict[str, Any]]:
    return [m for t in range(topics) for m in topic(f"P{t}", per_topic, [f"t{t}"])]


async def test_a_llama_cpp_python_endpoint_refuses_each_first_call_once_then_gets_a_schema(
    pool: asyncpg.Pool,
) -> None:
    await ingest(pool, "b", bank_of(10, 4))
    with FakeLLMServer(FakeLLMConfig(dialect="llama-cpp-python", latency_ms=20)) as fake:
        llm = build_consolidator(load_settings(llm_base_url=fake.url))
        end = await consolidate_then_close(pool, llm, Settings(group_parallelism=8))
        calls = fake.stats()["calls"]
    assert end.status == "completed", end.error
    assert end.summary.failed == 0 and end.summary.perf.splits == 0
    # The first calls go together (eight groups); each refused one is resent with the next form.
    assert 1 <= [c["status"] for c in calls].count(500) <= 8
    assert {(c["response_format"], c["schema"]) for c in calls if c["status"] == 200} == {
        ("json_object", True)
    }
    assert await markers(pool, "b") == {"consolidated": 40, "failed": 0, "pending": 0}
    await assert_consistent(pool)


async def test_an_openai_reasoning_model_refusing_max_tokens_gets_max_completion_tokens(
    pool: asyncpg.Pool,
) -> None:
    # OpenAI's o-series and gpt-5 answer max_tokens with a 400 naming max_completion_tokens: the
    # endpoint's dialect, not the memories' fault; nothing is split or marked failed.
    await ingest(pool, "b", bank_of(10, 4))
    with FakeLLMServer(FakeLLMConfig(dialect="openai-reasoning", latency_ms=20)) as fake:
        llm = build_consolidator(load_settings(llm_base_url=fake.url))
        with structlog.testing.capture_logs() as logs:
            end = await consolidate_then_close(pool, llm, Settings(group_parallelism=8))
        calls = fake.stats()["calls"]
    assert end.status == "completed", end.error
    assert end.summary.failed == 0 and end.summary.perf.splits == 0
    assert end.summary.perf.llm_failures == 0
    refused = [c for c in calls if c["status"] == 400]
    assert refused and {c["token_field"] for c in refused} == {"max_tokens"}
    assert {c["token_field"] for c in calls if c["status"] == 200} == {"max_completion_tokens"}
    assert len([e for e in logs if e["event"] == "llm_max_tokens_field"]) == 1
    assert await markers(pool, "b") == {"consolidated": 40, "failed": 0, "pending": 0}
    await assert_consistent(pool)


async def test_an_explicit_json_schema_the_endpoint_refuses_fails_the_operation_at_once(
    pool: asyncpg.Pool,
) -> None:
    await ingest(pool, "b", bank_of(3, 2))
    op = (await queue.submit(pool, "b", max_attempts=5)).operation
    with FakeLLMServer(FakeLLMConfig(dialect="llama-cpp-python")) as fake:
        llm = build_consolidator(
            load_settings(llm_base_url=fake.url, llm_response_format="json_schema")
        )
        try:
            end = await run_claimed(pool, llm, Settings())
        finally:
            await llm.aclose()
    assert end.status == "failed"
    row = await operation_row(pool, op.id)
    assert row.status == "failed" and row.attempt == 1
    assert row.error is not None and "LLMConfigError" in row.error
    assert "CONSOLIDATION_LLM_RESPONSE_FORMAT=auto" in row.error
    assert await markers(pool, "b") == {"consolidated": 0, "failed": 0, "pending": 6}
    assert await nothing_written(pool)


async def test_a_reasoning_models_think_blocks_are_stripped(pool: asyncpg.Pool) -> None:
    await ingest(pool, "b", bank_of(3, 3))
    with FakeLLMServer(FakeLLMConfig(think=True, reasoning_content=True)) as fake:
        llm = http_llm(fake.url)
        end = await consolidate_then_close(pool, llm)
    assert end.status == "completed", end.error
    assert end.summary.perf.llm_failures == 0 and end.summary.failed == 0
    assert await markers(pool, "b") == {"consolidated": 9, "failed": 0, "pending": 0}


async def test_system_role_user_works_with_a_template_that_drops_the_system_message(
    pool: asyncpg.Pool,
) -> None:
    await ingest(pool, "b", bank_of(2, 3))
    with FakeLLMServer(FakeLLMConfig(drop_system=True)) as fake:
        llm = build_consolidator(load_settings(llm_base_url=fake.url, llm_system_role="user"))
        end = await consolidate_then_close(pool, llm)
        calls = fake.stats()["calls"]
    assert end.status == "completed", end.error
    assert end.summary.perf.llm_failures == 0
    assert {tuple(c["roles"]) for c in calls} == {("user",)}
    assert await markers(pool, "b") == {"consolidated": 6, "failed": 0, "pending": 0}


async def test_an_answer_cut_by_max_tokens_is_logged_as_such(pool: asyncpg.Pool) -> None:
    memories = [{"text": "Uma " + "collects rare stamps from old letters, " * 12, "tags": ["u"]}]
    await ingest(pool, "b", memories)
    with FakeLLMServer() as fake:
        llm = build_consolidator(load_settings(llm_base_url=fake.url, llm_max_tokens=64))
        with capture_logs() as logs:
            end = await consolidate_then_close(pool, llm)
        calls = fake.stats()["calls"]
    assert end.status == "completed" and end.summary.failed == 1
    # The repair asked for twice the tokens; the cap held it at 64.
    assert [c["max_tokens"] for c in calls] == [64, 64]
    (failed,) = [e for e in logs if e["event"] == "memory_failed"]
    assert "cut off by max_tokens=64" in failed["reason"]
    assert "CONSOLIDATION_LLM_MAX_TOKENS=64" in failed["reason"]


# --- endpoint faults that look like answers ---------------------------------------------------


async def test_a_200_html_page_fails_the_attempt_marks_nothing_and_the_retry_completes(
    pool: asyncpg.Pool, fake: FakeLLMServer
) -> None:
    await ingest(pool, "b", bank_of(10, 4))
    op = (await queue.submit(pool, "b", max_attempts=3)).operation
    fake.control(envelope="html")
    llm = http_llm(fake.url, max_retries=2)
    config = Settings(retry_backoff_s=0)
    try:
        first = await run_claimed(pool, llm, config)
        row = await operation_row(pool, op.id)
        assert first.status == "pending" and row.status == "pending"
        assert row.error is not None and "LLMRetriesExhausted" in row.error
        assert "not a chat completion" in row.error and "502 Bad Gateway" in row.error
        assert first.summary.perf.splits == 0 and first.summary.perf.llm_failures == 0
        assert await markers(pool, "b") == {"consolidated": 0, "failed": 0, "pending": 40}
        assert await nothing_written(pool)

        fake.control(envelope="completion")
        second = await run_claimed(pool, llm, config)
    finally:
        await llm.aclose()
    assert second.status == "completed", second.error
    assert second.summary.failed == 0
    assert await markers(pool, "b") == {"consolidated": 40, "failed": 0, "pending": 0}
    await assert_consistent(pool)


async def test_a_hanging_endpoint_fails_the_attempt_when_the_retry_budget_is_spent(
    pool: asyncpg.Pool, fake: FakeLLMServer
) -> None:
    fake.control(script=[{"hang": True}] * 50)
    await ingest(pool, "b", topic("Ola", 2, ["ola"]))
    # The default budget is twice the timeout: two tries, not the five LLM_MAX_RETRIES allows.
    settings = load_settings(
        llm_base_url=fake.url, llm_timeout_s=0.3, llm_max_retries=4, llm_backoff_max_s=0.01
    )
    llm = build_consolidator(settings)
    end = await consolidate_then_close(pool, llm)
    assert end.status == "failed"
    assert end.error is not None and "retry budget of 0.6s spent" in end.error
    assert "after 2 attempt(s)" in end.error
    assert await markers(pool, "b") == {"consolidated": 0, "failed": 0, "pending": 2}
