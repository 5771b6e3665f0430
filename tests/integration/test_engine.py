"""The engine end to end against a real Postgres and the fake LLM over real HTTP."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import asyncpg
import pytest

from consolidation import db, plainhttp, queue, store
from consolidation.engine import StopReason, StopSignal
from consolidation.fake_llm import FakeLLMServer
from consolidation.llm import OfflineConsolidator
from consolidation.settings import Settings
from tests.integration.engine_helpers import (
    consolidate,
    http_llm,
    ingest,
    markers,
    observations_by_scope,
    run_next,
    wait_for,
)
from tests.invariants import assert_consistent


def topic(person: str, n: int, tags: list[str], **extra: Any) -> list[dict[str, Any]]:
    return [
        {"text": f"{person} drinks green tea every morning, cup {i}", "tags": tags, **extra}
        for i in range(n)
    ]


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


@contextlib.asynccontextmanager
async def logged_pool(
    database_url: str, keep: Callable[[asyncpg.connection.LoggedQuery], Any] = lambda r: r.query
) -> AsyncIterator[tuple[asyncpg.Pool, list[Any]]]:
    """A pool whose connections append every statement they run (``keep`` of it: its text
    unless told otherwise) to the list it yields."""
    statements: list[Any] = []

    async def init(conn: asyncpg.Connection) -> None:
        await db._init_connection(conn)
        conn.add_query_logger(lambda record: statements.append(keep(record)))

    pool = await asyncpg.create_pool(database_url, init=init, min_size=1, max_size=10)
    try:
        yield pool, statements
    finally:
        await pool.close()


async def test_the_markers_of_a_wave_are_written_by_one_statement(
    database_url: str, fake: FakeLLMServer
) -> None:
    async with logged_pool(database_url) as (pool, statements):
        await ingest(pool, "b", [m for g in range(5) for m in topic(f"P{g}", 6, [f"t{g}"])])
        statements.clear()
        llm = http_llm(fake.url)
        try:
            end = await consolidate(pool, "b", llm, Settings(wave_size=10, llm_batch_size=4))
        finally:
            await llm.aclose()
    assert end.status == "completed" and end.summary.waves == 3
    marker_writes = [s for s in statements if "consolidated_at =" in s]
    assert len(marker_writes) == 3  # one executemany per wave, whatever the wave's size
    assert all(s.strip() == store.COMMIT_MARKER.strip() for s in marker_writes)


async def test_a_pass_gets_its_recall_from_the_previous_apply_of_its_group(
    database_url: str, fake: FakeLLMServer
) -> None:
    async with logged_pool(database_url) as (pool, statements):
        # One group: per_tag writes two scopes, so each batch makes two passes (2 x 4 in all).
        ids = await ingest(
            pool, "b", topic("Alice", 10, ["alice", "tea"], observation_scopes="per_tag")
        )
        statements.clear()
        llm = http_llm(fake.url)
        try:
            end = await consolidate(pool, "b", llm, Settings(llm_batch_size=3))
        finally:
            await llm.aclose()
        by_scope = await observations_by_scope(pool, "b")
        sources = await pool.fetch(
            "SELECT o.scope, array_agg(s.memory_id) AS memories FROM observations o"
            " JOIN observation_sources s ON s.observation_id = o.id GROUP BY o.scope"
        )
    assert end.status == "completed", end.error
    assert fake.stats()["requests"] == 8
    # Only the group's first pass recalls on its own, with the second pass's recall in the same
    # statement; the six others got theirs from an earlier apply, in the same statement.
    assert statements.count(store.recall_statement(2, hybrid=False)) == 1
    assert statements.count(store.RECALL) == 0
    assert statements.count(store.APPLY_PASS) == 8
    # And what they got was current: every later batch found the observation of its scope.
    assert {scope: len(texts) for scope, texts in by_scope.items()} == {("alice",): 1, ("tea",): 1}
    assert all(set(r["memories"]) == set(ids) for r in sources)


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


async def consolidate_notes(
    pool: asyncpg.Pool,
    fake: FakeLLMServer,
    order: list[str],
    settings: Settings,
    base_url: str | None = None,
    **llm: Any,
) -> Any:
    """One memory per tag of ``order``, in that consolidation order, consolidated over HTTP
    (``base_url``: the fake's unless given; ``llm``: options of the HTTP client)."""
    memories = [
        {
            "text": f"Note {i} about topic {tag}",
            "tags": [tag],
            "occurred_at": f"2026-01-01T00:00:{i:02d}Z",
        }
        for i, tag in enumerate(order)
    ]
    await ingest(pool, "b", memories)
    client = http_llm(base_url or fake.url, **llm)
    try:
        return await consolidate(pool, "b", client, settings)
    finally:
        await client.aclose()


async def test_waves_are_pipelined_but_a_scope_never_runs_twice_at_once_nor_out_of_order(
    pool: asyncpg.Pool, fake: FakeLLMServer
) -> None:
    # Waves of 4: scope "s" has a chain of three calls in wave 1 and one more in wave 2. The
    # other groups of wave 2 take free slots while wave 1's chain still runs; wave 2's "s"
    # group waits for wave 1's, and "s" sees its memories in consolidation order.
    fake.control(latency_ms=40)
    order = ["s", "s", "s", "a", "s", "b", "c", "d"]
    end = await consolidate_notes(
        pool, fake, order, Settings(wave_size=4, llm_batch_size=1, group_parallelism=8)
    )
    assert end.status == "completed" and end.summary.waves == 2
    stats = fake.stats()
    assert stats["max_in_flight_per_scope"] == 1
    calls = {call["fact_texts"][0]: call for call in stats["calls"]}
    s_calls = sorted((c for c in stats["calls"] if c["scope"] == ["s"]), key=lambda c: c["started"])
    assert [c["fact_texts"][0] for c in s_calls] == [
        f"Note {i} about topic s" for i in (0, 1, 2, 4)
    ]
    # Pipelined: wave 2's "b" did not wait for wave 1's last call to end.
    assert calls["Note 5 about topic b"]["started"] < calls["Note 2 about topic s"]["ended"]


async def test_a_groups_last_apply_brings_the_recall_of_the_next_waves_group_waiting_on_it(
    database_url: str, fake: FakeLLMServer
) -> None:
    # Waves of 4: scope "s" makes three passes in wave 1 and one in wave 2. Wave 2's "s" group
    # waits on wave 1's alone, so the last apply of wave 1's fetches its recall, after its own
    # writes and in its transaction: no recall statement of its own, and what it recalls
    # includes the observation that apply wrote.
    fake.control(latency_ms=40)
    async with logged_pool(database_url, keep=lambda r: (r.query, r.args)) as (pool, statements):
        order = ["s", "s", "s", "a", "s", "b", "c", "d"]
        end = await consolidate_notes(
            pool, fake, order, Settings(wave_size=4, llm_batch_size=1, group_parallelism=8)
        )
        assert await markers(pool, "b") == {"consolidated": 8, "failed": 0, "pending": 0}
        note_2 = await pool.fetchval("SELECT id FROM memories WHERE text = 'Note 2 about topic s'")
    assert end.status == "completed" and end.summary.waves == 2
    note_4 = "Note 4 about topic s"
    recalls = [args for query, args in statements if query == store.recall_statement(1, False)]
    assert len(recalls) == 4  # wave 1's "a", wave 2's "b", "c" and "d"; wave 1's "s" recalls two
    assert not any(note_4 in args for query, args in statements if query.startswith("SELECT 0"))
    (carrier,) = [
        args for query, args in statements if query == store.APPLY_PASS and note_4 in args
    ]
    assert [o["memory_id"] for o in carrier[0]["outcomes"]] == [note_2]
    (call,) = [c for c in fake.stats()["calls"] if list(c["fact_texts"]) == [note_4]]
    assert any("Note 2 about topic s" in text for text in call["observation_texts"])


async def test_a_freed_slot_goes_to_the_chain_that_continues_into_the_next_wave(
    pool: asyncpg.Pool, fake: FakeLLMServer
) -> None:
    # One slot, waves of 4, one call per memory. Wave 1: "s" (2 calls), then "a", "b"; wave 2:
    # "s" again (2 calls), then "c", "d". Once wave 1's "s" has its last answer it gives the
    # slot back for its apply, and "a" takes it; its continuation in wave 2 is ready when that
    # apply is done and takes the next slot freed, before "b", ready long before: its remaining
    # path is longer (2 calls against 1). Equal paths go in wave order. (Waiting in arrival
    # order, or fetching wave 2 only once no group of wave 1 waited, gave s s a b s s c d.)
    fake.control(latency_ms=30)
    order = ["s", "s", "a", "b", "s", "s", "c", "d"]
    end = await consolidate_notes(
        pool, fake, order, Settings(wave_size=4, llm_batch_size=1, group_parallelism=1)
    )
    assert end.status == "completed" and end.summary.waves == 2
    calls = sorted(fake.stats()["calls"], key=lambda c: c["started"])
    assert [c["scope"][0] for c in calls] == ["s", "s", "a", "s", "s", "b", "c", "d"]
    chain = [c for c in calls if c["scope"] == ["s"]]
    assert [c["fact_texts"][0] for c in chain] == [f"Note {i} about topic s" for i in (0, 1, 4, 5)]
    # Each pass of the chain updated the one observation, and saw the text it replaced: wave
    # 2's group fetched its first recall before it had a slot, but after wave 1's last apply.
    replaced = await pool.fetch(
        "SELECT previous_text FROM observation_history WHERE scope = '{s}' ORDER BY version"
    )
    assert [c["observation_texts"] for c in chain[1:]] == [[r["previous_text"]] for r in replaced]


# Each apply's outcomes, logged when they are written and after: an apply waits at the gate (an
# advisory lock the test holds) between the two.
APPLY_GATE = """
CREATE TABLE apply_log (at timestamptz NOT NULL, step text NOT NULL, tx bigint NOT NULL);
CREATE FUNCTION apply_gate() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO apply_log VALUES (clock_timestamp(), TG_WHEN, txid_current());
    IF TG_WHEN = 'BEFORE' THEN
        PERFORM pg_advisory_xact_lock_shared(4242);
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER apply_gate_before BEFORE INSERT ON consolidation_outcomes
    FOR EACH STATEMENT EXECUTE FUNCTION apply_gate();
CREATE TRIGGER apply_gate_after AFTER INSERT ON consolidation_outcomes
    FOR EACH STATEMENT EXECUTE FUNCTION apply_gate();
"""


async def two_calls_while_the_first_apply_is_held(
    pool: asyncpg.Pool,
    database_url: str,
    fake: FakeLLMServer,
    settings: Settings,
    stop: StopSignal | None = None,
) -> tuple[Any, list[dict[str, Any]]]:
    """Consolidate bank "b" with every apply held at the gate until the fake has seen two
    calls (which fails unless the second starts while the first apply waits) — and ``stop``
    set to a shutdown then, if given; returns the operation's end and the fake's first calls."""
    await pool.execute(APPLY_GATE)
    gate = await asyncpg.connect(database_url)
    llm = http_llm(fake.url)
    try:
        await gate.execute("SELECT pg_advisory_lock(4242)")
        run = asyncio.create_task(consolidate(pool, "b", llm, settings, stop=stop))
        calls = await wait_for(
            lambda: len(fake.stats()["calls"]) >= 2 and fake.stats()["calls"],
            what="a second call while the first apply is held",
        )
        assert await pool.fetchval("SELECT count(*) FROM consolidation_outcomes") == 0
        if stop is not None:
            stop.set(StopReason.SHUTDOWN)
        await gate.execute("SELECT pg_advisory_unlock(4242)")
        return await asyncio.wait_for(run, 30), calls
    finally:
        await gate.close()
        await llm.aclose()


async def test_a_pass_asks_the_llm_while_the_previous_applies_and_sees_what_it_wrote(
    pool: asyncpg.Pool, database_url: str, fake: FakeLLMServer
) -> None:
    # One scope, one memory per batch: three passes in a chain. Pass 1's apply is held at the
    # gate; pass 2's LLM call must start all the same, showing what pass 1 is writing, and no
    # apply may start before the one before it has ended.
    await ingest(pool, "b", topic("Alice", 3, ["alice"]))
    end, calls = await two_calls_while_the_first_apply_is_held(
        pool, database_url, fake, Settings(llm_batch_size=1)
    )
    assert end.status == "completed", end.error
    assert calls[0]["observation_texts"] == []
    # Pass 2 updated what pass 1 created (the topic ends in one observation): the text it
    # replaced is the one its prompt showed.
    created = await pool.fetchval(
        "SELECT previous_text FROM observation_history ORDER BY version LIMIT 1"
    )
    assert created is not None and calls[1]["observation_texts"] == [created]
    log = await pool.fetch("SELECT at, step, tx FROM apply_log ORDER BY at")
    steps = [(r["step"], r["tx"]) for r in log]
    assert len(steps) == 6
    # BEFORE and AFTER of one transaction, then the next: the applies never overlapped.
    assert [s for s, _ in steps] == ["BEFORE", "AFTER"] * 3
    assert all(steps[i][1] == steps[i + 1][1] for i in range(0, 6, 2))


async def test_a_group_gives_its_slot_back_before_its_last_apply(
    pool: asyncpg.Pool, database_url: str, fake: FakeLLMServer
) -> None:
    # One slot, two groups of one pass each. The first group's apply is held at the gate: the
    # second group's call must start meanwhile (the first has nothing left to ask the model,
    # and no later group waits on it).
    await ingest(pool, "b", topic("Alice", 1, ["alice"]) + topic("Bob", 1, ["bob"]))
    end, calls = await two_calls_while_the_first_apply_is_held(
        pool, database_url, fake, Settings(llm_batch_size=1, group_parallelism=1)
    )
    assert end.status == "completed", end.error
    assert {c["scope"][0] for c in calls} == {"alice", "bob"}
    assert fake.stats()["max_in_flight"] == 1  # one slot: never two calls at once


@pytest.mark.parametrize("transport", ["plainhttp", "aiohttp"])
async def test_the_next_llm_request_leaves_before_the_apply_of_the_pass_before_it(
    pool: asyncpg.Pool, fake: FakeLLMServer, monkeypatch: pytest.MonkeyPatch, transport: str
) -> None:
    # One slot, one memory per batch: "a" makes three passes, then "b" two. Once a pass has
    # its answer the next call starts (the next pass's, or the next group's first once the
    # last pass gives the slot back); its request must be on the wire before the pass's apply
    # is sent, which would otherwise go first and delay it. So every apply but the last finds
    # one request more sent than the applies before it have answered. The plain-http client
    # writes in the call's task; aiohttp (reached through a proxy) in a task of its own.
    events: list[str] = []
    apply_pass = store.apply_pass
    for name in ("http_proxy", "https_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    base_url = fake.url
    if transport == "plainhttp":
        send = plainhttp._Connection.send

        def sent(self: plainhttp._Connection, *args: Any) -> None:
            events.append("request")
            send(self, *args)

        monkeypatch.setattr(plainhttp._Connection, "send", sent)
    else:
        write_bytes = aiohttp.ClientRequest.write_bytes

        async def written(self: aiohttp.ClientRequest, *args: Any, **kwargs: Any) -> None:
            events.append("request")
            await write_bytes(self, *args, **kwargs)

        monkeypatch.setattr(aiohttp.ClientRequest, "write_bytes", written)
        # The fake takes a proxy's requests; llm.invalid never resolves.
        monkeypatch.setenv("HTTP_PROXY", fake.url.removesuffix("/v1"))
        base_url = "http://llm.invalid/v1"

    async def applied(*args: Any, **kwargs: Any) -> Any:
        events.append("apply")
        return await apply_pass(*args, **kwargs)

    monkeypatch.setattr(store, "apply_pass", applied)
    fake.control(latency_ms=50)  # "b" is ready on deck long before "a" is done
    order = ["a", "a", "a", "b", "b"]
    end = await consolidate_notes(
        pool,
        fake,
        order,
        Settings(llm_batch_size=1, group_parallelism=1),
        base_url,
        response_format="json_schema",
    )
    assert end.status == "completed", end.error
    calls = sorted(fake.stats()["calls"], key=lambda c: c["started"])
    assert [c["scope"][0] for c in calls] == order
    applies = [i for i, event in enumerate(events) if event == "apply"]
    assert len(applies) == 5
    sent_before = [events[:i].count("request") for i in applies]
    assert sent_before == [2, 3, 4, 5, 5], events


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


async def test_the_groups_holding_the_first_slots_recall_before_groups_on_deck_or_a_further_wave(
    pool: asyncpg.Pool, fake: FakeLLMServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two slots, waves of 4 one-call groups: at the start two groups get the slots and two go
    # on deck at once, and wave 2 could be fetched. The slot holders' first LLM calls wait on
    # their first recalls, so those go to the database alone; the deck's recalls and wave 2's
    # fetch follow once both are back. (Before: the fetch was sent first, the deck's recalls
    # beside the holders'.)
    events: list[tuple[str, str, str]] = []

    def recorded(name: str, describe: Any) -> Any:
        original = getattr(store, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            what = describe(*args)
            events.append(("start", name, what))
            try:
                return await original(*args, **kwargs)
            finally:
                events.append(("end", name, what))

        return call

    monkeypatch.setattr(
        store, "recall_many", recorded("recall_many", lambda _p, _b, wanted: wanted[0].scope[0])
    )
    monkeypatch.setattr(
        store, "fetch_wave", recorded("fetch_wave", lambda _p, _b, cursor, *_: str(cursor))
    )
    fake.control(latency_ms=20)
    order = ["a", "b", "c", "d", "e", "f", "g", "h"]
    # A form set, not probed: with "auto" the second slot's first call would wait for the
    # first one's answer, and the LLM's arrival order would not tell the slots' holders.
    end = await consolidate_notes(
        pool,
        fake,
        order,
        Settings(wave_size=4, llm_batch_size=1, group_parallelism=2),
        response_format="json_schema",
    )
    assert end.status == "completed" and end.summary.waves == 2

    first_calls = sorted(fake.stats()["calls"], key=lambda c: c["started"])[:2]
    holders = {c["scope"][0] for c in first_calls}
    holders_back = max(
        i for i, (when, name, what) in enumerate(events) if when == "end" and what in holders
    )
    first_fetch = events.index(("end", "fetch_wave", "None"))
    others = [
        (i, name, what)
        for i, (when, name, what) in enumerate(events)
        if when == "start" and i > first_fetch and what not in holders
    ]
    assert {what for _, name, what in others if name == "recall_many"} == set(order) - holders
    assert any(name == "fetch_wave" for _, name, _ in others)
    assert all(i > holders_back for i, _, _ in others), events
