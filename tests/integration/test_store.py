"""consolidation/store.py against a real Postgres: what each of its functions promises."""

from __future__ import annotations

import dataclasses
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

from consolidation import queue, store
from consolidation.errors import LeaseLost, ValidationError
from consolidation.memories import parse_memories
from consolidation.queue import Lease
from consolidation.scopes import Scope
from consolidation.store import ObservationWrite, Outcome, PassWrite, RecallRequest

T0 = datetime(2024, 1, 1, tzinfo=UTC)


def memory(text: str, tags: list[str], **fields: Any) -> dict[str, Any]:
    return {"id": str(uuid.uuid4()), "text": text, "tags": tags, **fields}


async def ingest(pool: asyncpg.Pool, bank: str, *memories: dict[str, Any]) -> store.IngestResult:
    return await store.ingest_memories(pool, bank, parse_memories(list(memories)))


async def lease_of(pool: asyncpg.Pool, bank: str) -> Lease:
    """A running attempt of a consolidation of ``bank``, held by this test."""
    return await queue.start_foreground(pool, bank, "store-test", 60)


def not_ours(lease: Lease) -> Lease:
    return dataclasses.replace(lease, worker_id="someone-else")


async def observation(
    pool: asyncpg.Pool, bank: str, scope: Scope, text: str, updated_at: datetime = T0
) -> uuid.UUID:
    """An observation written directly, with the ``updated_at`` a recency test needs."""
    oid = uuid.uuid4()
    await pool.execute(
        "INSERT INTO observations (id, bank_id, scope, text, updated_at) VALUES ($1,$2,$3,$4,$5)",
        oid,
        bank,
        list(scope),
        text,
        updated_at,
    )
    return oid


def create(text: str, *memory_ids: uuid.UUID) -> ObservationWrite:
    return ObservationWrite((uuid.uuid4(),), text, memory_ids, create=True)


def pass_write(
    lease: Lease,
    scope: Scope,
    *observations: ObservationWrite,
    outcomes: tuple[Outcome, ...] = (),
) -> PassWrite:
    return PassWrite(lease.bank_id, scope, lease.operation_id, observations, outcomes)


async def table_counts(pool: asyncpg.Pool) -> dict[str, int]:
    tables = ("observations", "observation_sources", "observation_history")
    counts = {t: await pool.fetchval(f"SELECT count(*) FROM {t}") for t in tables}
    counts["consolidation_outcomes"] = await pool.fetchval(
        "SELECT count(*) FROM consolidation_outcomes"
    )
    return counts


# --- ingest_memories -----------------------------------------------------------------------


async def test_ingest_is_idempotent_on_id_and_writes_each_memorys_scopes(
    pool: asyncpg.Pool,
) -> None:
    combined = memory("Alice drinks tea", ["work", "alice"])
    per_tag = memory("Bob drinks coffee", ["work", "bob"], observation_scopes="per_tag")
    first = await ingest(pool, "b", combined, per_tag)
    assert first.inserted == 2
    assert first.ids == [uuid.UUID(combined["id"]), uuid.UUID(per_tag["id"])]

    fresh = memory("Carol walks", [])
    again = await ingest(pool, "b", {**combined, "text": "changed"}, per_tag, fresh)
    assert again.inserted == 1 and len(again.ids) == 3
    assert await pool.fetchval("SELECT text FROM memories WHERE id = $1", first.ids[0]) == (
        "Alice drinks tea"
    )
    rows = await pool.fetch("SELECT memory_id, scope FROM memory_scopes")
    scopes: dict[uuid.UUID, set[tuple[str, ...]]] = {}
    for r in rows:
        scopes.setdefault(r["memory_id"], set()).add(tuple(r["scope"]))
    assert scopes == {
        first.ids[0]: {("alice", "work")},
        first.ids[1]: {("bob",), ("work",)},
        again.ids[2]: {()},
    }


async def test_ingest_refuses_an_id_of_another_bank_and_writes_nothing(pool: asyncpg.Pool) -> None:
    taken = memory("Alice drinks tea", ["alice"])
    await ingest(pool, "b", taken)
    with pytest.raises(ValidationError, match="already belongs to another bank"):
        await ingest(pool, "other", memory("new", ["x"]), taken)
    assert await pool.fetchval("SELECT count(*) FROM memories") == 1
    assert not await store.bank_exists(pool, "other")


# --- fetch_wave / count_pending / bank_stats -----------------------------------------------


async def test_fetch_wave_walks_pending_memories_in_consolidation_order_a_page_at_a_time(
    pool: asyncpg.Pool,
) -> None:
    late = memory("late", ["t"], occurred_at="2024-03-01T00:00:00Z")
    undated = memory("undated", ["t"])  # ordered by created_at: now, after every date above
    early = memory("early", ["t"], occurred_at="2024-01-01T00:00:00Z")
    tied = [memory(f"tied {i}", ["t"], occurred_at="2024-02-01T00:00:00Z") for i in range(3)]
    await ingest(pool, "b", late, undated, early, *tied)
    await ingest(pool, "other", memory("another bank", ["t"]))
    tied_ids = sorted(uuid.UUID(m["id"]) for m in tied)
    expected = [uuid.UUID(early["id"]), *tied_ids, uuid.UUID(late["id"]), uuid.UUID(undated["id"])]

    seen: list[uuid.UUID] = []
    after = None
    while page := await store.fetch_wave(pool, "b", after, 2, None):
        assert len(page) <= 2
        seen += [m.id for m in page]
        after = (page[-1].order, page[-1].id)
    assert seen == expected

    first = (await store.fetch_wave(pool, "b", None, 1, None))[0]
    assert first.order == first.occurred_at == datetime(2024, 1, 1, tzinfo=UTC)
    assert first.text == "early" and first.scopes == (("t",),) and first.journaled == frozenset()


async def test_fetch_wave_and_count_pending_see_only_pending_memories_of_the_filtered_scopes(
    pool: asyncpg.Pool,
) -> None:
    a = [memory(f"a {i}", ["a"]) for i in range(3)]
    ab = memory("both", ["a", "b"], observation_scopes="per_tag")
    b = memory("b", ["b"])
    result = await ingest(pool, "b", *a, ab, b)
    done, failed, forgotten = result.ids[:3]
    await pool.execute("UPDATE memories SET consolidated_at = now() WHERE id = $1", done)
    await pool.execute("UPDATE memories SET consolidation_failed_at = now() WHERE id = $1", failed)
    await pool.execute("UPDATE memories SET forgotten_at = now() WHERE id = $1", forgotten)

    def ids(wave: list[store.WaveMemory]) -> set[uuid.UUID]:
        return {m.id for m in wave}

    assert ids(await store.fetch_wave(pool, "b", None, 10, None)) == set(result.ids[3:])
    assert ids(await store.fetch_wave(pool, "b", None, 10, [("b",)])) == set(result.ids[3:])
    assert ids(await store.fetch_wave(pool, "b", None, 10, [("a",)])) == {result.ids[3]}
    assert await store.fetch_wave(pool, "b", None, 10, [("a", "b")]) == []
    assert await store.count_pending(pool, "b", None) == 2
    assert await store.count_pending(pool, "b", [("a",)]) == 1
    assert await store.count_pending(pool, "b", [("a",), ("b",)]) == 2
    assert await store.count_pending(pool, "nobank", None) == 0

    stats = await store.bank_stats(pool, "b")
    assert (stats.pending, stats.consolidated, stats.failed, stats.observations) == (2, 1, 1, 0)
    assert stats.oldest_pending_age_s is not None and stats.oldest_pending_age_s >= 0
    assert await store.bank_stats(pool, "nobank") == store.BankStats(0, 0, 0, 0, None)


async def test_fetch_wave_reports_the_scopes_a_memory_is_already_journaled_in(
    pool: asyncpg.Pool,
) -> None:
    (mid,) = (await ingest(pool, "b", memory("x", ["a", "b"], observation_scopes="per_tag"))).ids
    lease = await lease_of(pool, "b")
    await store.apply_pass(
        pool, lease, pass_write(lease, ("a",), outcomes=(Outcome(mid, "skipped", ()),))
    )
    (wave,) = await store.fetch_wave(pool, "b", None, 10, None)
    assert wave.scopes == (("a",), ("b",)) and wave.journaled == frozenset({("a",)})


# --- recall --------------------------------------------------------------------------------


async def test_recall_ranks_full_text_matches_first_then_tops_up_with_the_most_recent(
    pool: asyncpg.Pool,
) -> None:
    await ingest(pool, "b", memory("seed", ["a"]))
    scope = ("a",)
    best = await observation(pool, "b", scope, "Alice drinks green tea with honey", T0)
    good = await observation(pool, "b", scope, "Alice likes tea", T0 + timedelta(hours=1))
    recent = await observation(pool, "b", scope, "Bob runs marathons", T0 + timedelta(hours=3))
    older = await observation(pool, "b", scope, "Carol paints", T0 + timedelta(hours=2))
    oldest = await observation(pool, "b", scope, "Dan sails", T0 - timedelta(hours=1))
    # Same words, other scopes (a superset, the empty scope) and another bank: never recalled.
    await observation(pool, "b", ("a", "b"), "Alice drinks green tea with honey")
    await observation(pool, "b", (), "Alice drinks green tea with honey")
    await ingest(pool, "other", memory("seed", ["a"]))
    await observation(pool, "other", scope, "Alice drinks green tea with honey")

    facts = ["Alice drinks green tea", "with honey"]
    recalled = await store.recall(pool, "b", scope, facts, 10)
    assert [r.id for r in recalled] == [best, good, recent, older, oldest]
    assert [r.id for r in await store.recall(pool, "b", scope, facts, 3)] == [best, good, recent]
    assert [r.id for r in await store.recall(pool, "b", scope, facts, 1)] == [best]
    # No fact shares a lexeme: recency alone.
    nothing = await store.recall(pool, "b", scope, ["zebra"], 2)
    assert [r.id for r in nothing] == [recent, older]
    assert await store.recall(pool, "b", ("z",), facts, 10) == []


async def test_recall_reports_each_observations_source_count(pool: asyncpg.Pool) -> None:
    ids = (await ingest(pool, "b", *(memory(f"m{i}", ["a"]) for i in range(3)))).ids
    lease = await lease_of(pool, "b")
    await store.apply_pass(pool, lease, pass_write(lease, ("a",), create("tea", *ids)))
    (recalled,) = await store.recall(pool, "b", ("a",), ["tea"], 5)
    assert recalled.text == "tea" and recalled.sources == 3


async def test_recall_many_answers_each_request_as_recall_would(pool: asyncpg.Pool) -> None:
    await ingest(pool, "b", memory("seed", ["a"]))
    for i in range(4):
        await observation(pool, "b", ("a",), f"tea note {i}", T0 + timedelta(minutes=i))
        await observation(pool, "b", ("c",), f"coffee note {i}", T0 + timedelta(minutes=i))
    requests = [
        RecallRequest(("a",), ("tea",), 2),
        RecallRequest(("c",), ("coffee",), 0),
        RecallRequest(("c",), ("coffee",), 3),
    ]
    many = await store.recall_many(pool, "b", requests)
    one_by_one = [await store.recall(pool, "b", r.scope, r.fact_texts, r.limit) for r in requests]
    assert many == one_by_one
    assert [len(r) for r in many] == [2, 0, 3]


# --- apply_pass ----------------------------------------------------------------------------


async def test_apply_pass_creates_observations_with_their_sources_and_journals_outcomes(
    pool: asyncpg.Pool,
) -> None:
    m1, m2, m3 = (await ingest(pool, "b", *(memory(f"m{i}", ["a"]) for i in range(3)))).ids
    lease = await lease_of(pool, "b")
    tea, walks = create("Alice drinks tea", m1, m2), create("Alice walks", m2)
    outcomes = (
        Outcome(m1, "created", tea.ids),
        Outcome(m2, "multiple", tea.ids + walks.ids),
        Outcome(m3, "skipped", ()),
    )
    returned = await store.apply_pass(
        pool, lease, pass_write(lease, ("a",), tea, walks, outcomes=outcomes)
    )
    assert returned is None

    rows = await store.list_observations(pool, "b")
    by_id = {r.id: r for r in rows}
    assert set(by_id) == {tea.ids[0], walks.ids[0]}
    assert by_id[tea.ids[0]].source_memory_ids == sorted([m1, m2])
    assert by_id[tea.ids[0]].scope == ("a",) and by_id[tea.ids[0]].version == 1
    journal = await store.journal_of(pool, lease.operation_id, [m1, m2, m3])
    assert sorted(journal) == sorted(
        [(m1, ("a",), "created"), (m2, ("a",), "multiple"), (m3, ("a",), "skipped")]
    )
    assert await pool.fetchval("SELECT count(*) FROM observation_history") == 0
    operations = await pool.fetchval(
        "SELECT count(*) FROM observation_sources WHERE operation_id = $1", lease.operation_id
    )
    assert operations == 3


async def test_apply_pass_updates_and_merges_keeping_history_and_every_source(
    pool: asyncpg.Pool,
) -> None:
    m1, m2, m3, m4 = (await ingest(pool, "b", *(memory(f"m{i}", ["a"]) for i in range(4)))).ids
    lease = await lease_of(pool, "b")
    keep, gone, edit = create("tea", m1), create("green tea", m2), create("walks", m3)
    await store.apply_pass(pool, lease, pass_write(lease, ("a",), keep, gone, edit))

    update = ObservationWrite(edit.ids, "walks daily", (m4,), create=False)
    merge = ObservationWrite(keep.ids + gone.ids, "drinks green tea", (m4,), create=False)
    await store.apply_pass(pool, lease, pass_write(lease, ("a",), update, merge))

    rows = {r.id: r for r in await store.list_observations(pool, "b")}
    assert set(rows) == {keep.ids[0], edit.ids[0]}
    assert (rows[edit.ids[0]].text, rows[edit.ids[0]].version) == ("walks daily", 2)
    assert rows[edit.ids[0]].source_memory_ids == sorted([m3, m4])
    assert (rows[keep.ids[0]].text, rows[keep.ids[0]].version) == ("drinks green tea", 2)
    assert rows[keep.ids[0]].source_memory_ids == sorted([m1, m2, m4])
    history = await pool.fetch(
        "SELECT observation_id, action, version, previous_text, new_text, merged_into, memory_ids"
        " FROM observation_history ORDER BY id"
    )
    assert [tuple(h.values()) for h in history] == [
        (edit.ids[0], "updated", 2, "walks", "walks daily", None, [m4]),
        (keep.ids[0], "merged", 2, "tea", "drinks green tea", None, [m4]),
        (gone.ids[0], "merged_away", 1, "green tea", None, keep.ids[0], [m4]),
    ]


async def test_apply_pass_returns_the_next_recall_as_it_stands_after_its_writes(
    pool: asyncpg.Pool,
) -> None:
    (m1,) = (await ingest(pool, "b", memory("m", ["a"]))).ids
    lease = await lease_of(pool, "b")
    tea = create("Alice drinks tea", m1)
    recalled = await store.apply_pass(
        pool, lease, pass_write(lease, ("a",), tea), RecallRequest(("a",), ("tea",), 5)
    )
    assert recalled is not None and [(r.id, r.sources) for r in recalled] == [(tea.ids[0], 1)]
    assert (
        await store.apply_pass(
            pool, lease, pass_write(lease, ("a",)), RecallRequest(("a",), ("tea",), 0)
        )
        == []
    )


async def test_apply_pass_writes_nothing_when_the_lease_is_not_ours(pool: asyncpg.Pool) -> None:
    (m1,) = (await ingest(pool, "b", memory("m", ["a"]))).ids
    lease = await lease_of(pool, "b")
    write = pass_write(lease, ("a",), create("tea", m1), outcomes=(Outcome(m1, "created", ()),))
    before = await table_counts(pool)
    for stranger in (not_ours(lease), dataclasses.replace(lease, attempt=lease.attempt + 1)):
        with pytest.raises(LeaseLost):
            await store.apply_pass(pool, stranger, write)
    assert await table_counts(pool) == before


async def test_apply_pass_refuses_a_change_to_an_observation_outside_its_scope(
    pool: asyncpg.Pool,
) -> None:
    (m1,) = (await ingest(pool, "b", memory("m", ["a"]))).ids
    lease = await lease_of(pool, "b")
    other = create("coffee", m1)
    await store.apply_pass(pool, lease, pass_write(lease, ("c",), other))
    before = await table_counts(pool)
    change = ObservationWrite(other.ids, "tea", (m1,), create=False)
    with pytest.raises(store.StaleObservation):
        await store.apply_pass(pool, lease, pass_write(lease, ("a",), create("new", m1), change))
    assert await table_counts(pool) == before


# --- commit_wave_markers -------------------------------------------------------------------


async def test_commit_wave_markers_counts_what_it_marked_and_never_marks_twice(
    pool: asyncpg.Pool,
) -> None:
    ids = (await ingest(pool, "b", *(memory(f"m{i}", ["a"]) for i in range(5)))).ids
    lease = await lease_of(pool, "b")
    assert await store.commit_wave_markers(pool, lease, [], {}) == store.Marked(0, 0)
    marked = await store.commit_wave_markers(pool, lease, ids[:2], {ids[2]: "bad answer"})
    assert marked == store.Marked(consolidated=2, failed=1)
    again = await store.commit_wave_markers(pool, lease, ids[:3], {ids[3]: "bad"})
    assert again == store.Marked(consolidated=0, failed=1)
    reasons = dict(
        await pool.fetch(
            "SELECT id, consolidation_failed_reason FROM memories"
            " WHERE consolidation_failed_at IS NOT NULL"
        )
    )
    assert reasons == {ids[2]: "bad answer", ids[3]: "bad"}
    assert await store.count_pending(pool, "b", None) == 1


async def test_commit_wave_markers_marks_nothing_when_the_lease_is_not_ours(
    pool: asyncpg.Pool,
) -> None:
    ids = (await ingest(pool, "b", *(memory(f"m{i}", ["a"]) for i in range(3)))).ids
    lease = await lease_of(pool, "b")
    with pytest.raises(LeaseLost):
        await store.commit_wave_markers(pool, not_ours(lease), ids[:2], {ids[2]: "bad"})
    assert await store.count_pending(pool, "b", None) == 3


# --- list_observations ---------------------------------------------------------------------


async def test_list_observations_pages_by_id_and_filters_by_exact_scope(pool: asyncpg.Pool) -> None:
    await ingest(pool, "b", memory("seed", ["a"]))
    in_a = sorted([await observation(pool, "b", ("a",), f"a {i}") for i in range(5)])
    await observation(pool, "b", ("a", "b"), "a and b")
    await ingest(pool, "other", memory("seed", ["a"]))
    await observation(pool, "other", ("a",), "other bank")

    pages: list[list[uuid.UUID]] = []
    after = None
    while page := await store.list_observations(pool, "b", scope=("a",), after=after, limit=2):
        pages.append([r.id for r in page])
        after = page[-1].id
    assert pages == [in_a[:2], in_a[2:4], in_a[4:]]
    assert len(await store.list_observations(pool, "b")) == 6
    assert [r.text for r in await store.list_observations(pool, "b", scope=("a", "b"))] == [
        "a and b"
    ]
    assert await store.list_observations(pool, "b", scope=("b",)) == []
