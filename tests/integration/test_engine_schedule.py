"""How the engine schedules its work, pinned: exact call orders, overlaps and statement counts.

These hold for the engine's current scheduling, not for its contract (test_engine.py): a change
of schedule changes only these tests.
"""

from __future__ import annotations

from typing import Any

import asyncpg
import pytest

from consolidation import store
from consolidation.settings import Settings
from consolidation.testing.fake_llm import FakeLLMServer
from tests.support.engine import (
    consolidate,
    consolidate_notes,
    http_llm,
    ingest,
    logged_pool,
    markers,
    observations_by_scope,
    topic,
    two_calls_while_the_first_apply_is_held,
)

pytestmark = pytest.mark.schedule


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
    assert len(marker_writes) == 3  # one statement per wave, whatever the wave's size
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


async def test_group_slots_past_the_llm_cap_do_not_let_short_groups_cut_into_a_chain(
    pool: asyncpg.Pool, fake: FakeLLMServer
) -> None:
    # Three group slots, a client that sends one request at a time. "s" is a chain of three
    # calls, "a" and "b" one each. Were all three groups given a slot, their calls would queue
    # at the client's cap first come first served: s, then a and b while s applies, then the
    # rest of s alone (s a b s s). The slots are capped at the client's one, so the longest
    # path keeps it to its end.
    fake.control(latency_ms=30)
    order = ["s", "s", "s", "a", "b"]
    end = await consolidate_notes(
        pool, fake, order, Settings(llm_batch_size=1, group_parallelism=3), max_concurrent=1
    )
    assert end.status == "completed"
    calls = sorted(fake.stats()["calls"], key=lambda c: c["started"])
    assert [c["scope"][0] for c in calls] == ["s", "s", "s", "a", "b"]


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
