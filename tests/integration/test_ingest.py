"""Ingestion: validated, idempotent on id, all-or-nothing."""

from __future__ import annotations

import uuid

import asyncpg
import pytest

from consolidation import store
from consolidation.errors import ValidationError
from consolidation.memories import parse_memories
from consolidation.scopes import write_scopes


async def test_ingest_stores_memories_with_their_write_scopes(pool: asyncpg.Pool) -> None:
    memories = parse_memories(
        [
            {"text": "Alice likes tea", "tags": ["alice", "prefs"]},
            {"text": "Bob likes coffee", "tags": ["bob"], "observation_scopes": "per_tag"},
            {"text": "Shared fact", "observation_scopes": "shared", "occurred_at": "2026-01-01"},
        ]
    )
    result = await store.ingest_memories(pool, "bank-1", memories)
    assert result.inserted == 3
    rows = await pool.fetch(
        "SELECT m.id, m.text, m.tags, m.occurred_at,"
        " ARRAY(SELECT array_to_string(s.scope, ',') FROM memory_scopes s"
        "       WHERE s.memory_id = m.id ORDER BY s.scope) AS scopes"
        " FROM memories m ORDER BY m.text"
    )
    by_text = {r["text"]: r for r in rows}
    assert by_text["Alice likes tea"]["scopes"] == ["alice,prefs"]
    assert by_text["Bob likes coffee"]["scopes"] == ["bob"]
    assert by_text["Shared fact"]["scopes"] == [""]
    assert by_text["Shared fact"]["occurred_at"].year == 2026
    stats = await store.bank_stats(pool, "bank-1")
    assert (stats.pending, stats.consolidated, stats.failed, stats.observations) == (3, 0, 0, 0)


async def test_ingesting_the_same_id_twice_is_idempotent(pool: asyncpg.Pool) -> None:
    memory_id = str(uuid.uuid4())
    batch = parse_memories([{"id": memory_id, "text": "once"}])
    first = await store.ingest_memories(pool, "b", batch)
    second = await store.ingest_memories(
        pool, "b", parse_memories([{"id": memory_id, "text": "once"}])
    )
    assert first.inserted == 1 and second.inserted == 0
    assert second.ids == [uuid.UUID(memory_id)]
    assert await pool.fetchval("SELECT count(*) FROM memories") == 1


async def test_an_id_of_another_bank_is_rejected_and_nothing_is_written(pool: asyncpg.Pool) -> None:
    memory_id = str(uuid.uuid4())
    await store.ingest_memories(pool, "a", parse_memories([{"id": memory_id, "text": "x"}]))
    batch = parse_memories([{"text": "new one"}, {"id": memory_id, "text": "x"}])
    with pytest.raises(ValidationError, match="another bank"):
        await store.ingest_memories(pool, "b", batch)
    assert await pool.fetchval("SELECT count(*) FROM memories") == 1


@pytest.mark.parametrize(
    ("memory", "reason"),
    [
        ({"text": ""}, "text must be a non-empty string"),
        ({"text": "x" * 8001}, "at most 8000"),
        ({"text": "x", "tags": [f"t{i}" for i in range(33)]}, "at most 32 tags"),
        ({"text": "x", "tags": ["t" * 129]}, "longer than 128"),
        ({"text": "x", "tags": list("abcdefg"), "observation_scopes": "all_combinations"}, "6"),
        ({"text": "x", "observation_scopes": "sometimes"}, "observation_scopes"),
        ({"text": "x", "occurred_at": "yesterday"}, "ISO-8601"),
        ({"text": "x", "id": "not-a-uuid"}, "UUID"),
        ({"text": "x", "colour": "red"}, "unknown field"),
    ],
)
def test_invalid_memories_are_rejected_with_a_reason(
    memory: dict[str, object], reason: str
) -> None:
    with pytest.raises(ValidationError) as excinfo:
        parse_memories([memory])
    assert any(reason in p for p in excinfo.value.problems), excinfo.value.problems


def test_a_batch_reports_every_bad_item_with_its_index() -> None:
    with pytest.raises(ValidationError) as excinfo:
        parse_memories([{"text": "ok"}, {"text": ""}, {"text": "ok"}, {"tags": "x"}])
    joined = " | ".join(excinfo.value.problems)
    assert "memories[1]" in joined and "memories[3]" in joined and "memories[0]" not in joined


def test_all_combinations_writes_every_non_empty_subset() -> None:
    assert write_scopes(["b", "a"], "all_combinations") == (("a",), ("a", "b"), ("b",))


@pytest.mark.parametrize(
    ("memory", "reason"),
    [
        ({"text": "x", "tags": ["a\x1fb"]}, "control characters"),
        ({"text": "x", "observation_scopes": [["a\x1fb"]]}, "control characters"),
        ({"text": "x", "metadata": {"k": "\x00"}}, "NUL"),
        ({"text": "x", "metadata": {"k": "y" * 20_000}}, "at most 16384"),
        ({"text": "x", "occurred_at": "0001-01-01T00:00:00+14:00"}, "years"),
        ({"text": "x", "occurred_at": "9999-12-31T23:59:59-14:00"}, "years"),
    ],
)
def test_values_postgres_could_store_but_not_give_back_are_rejected(
    memory: dict[str, object], reason: str
) -> None:
    with pytest.raises(ValidationError) as excinfo:
        parse_memories([memory])
    assert any(reason in p for p in excinfo.value.problems), excinfo.value.problems
