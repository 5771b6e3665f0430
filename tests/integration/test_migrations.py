"""The schema builds from empty through Alembic, and upgrading again changes nothing."""

from __future__ import annotations

import asyncio

import asyncpg

from consolidation import db

TABLES = {
    "banks",
    "memories",
    "observations",
    "observation_sources",
    "observation_history",
    "consolidation_outcomes",
    "operations",
}
INDEXES = {
    "memories_pending_idx",
    "operations_one_running_per_bank",
    "operations_one_unscoped_pending_per_bank",
    "observations_scope_idx",
    "observations_search_idx",
}


async def _schema(url: str) -> tuple[set[str], set[str]]:
    conn = await asyncpg.connect(url)
    try:
        tables = {
            r["tablename"]
            for r in await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname='public'")
        }
        indexes = {
            r["indexname"]
            for r in await conn.fetch("SELECT indexname FROM pg_indexes WHERE schemaname='public'")
        }
        return tables, indexes
    finally:
        await conn.close()


async def test_migrations_build_the_schema_from_empty_and_are_idempotent(
    empty_database_url: str,
) -> None:
    assert db.current_revision(empty_database_url) is None
    await db.migrate(empty_database_url)
    tables, indexes = await _schema(empty_database_url)
    assert tables >= TABLES
    assert indexes >= INDEXES
    head = db.current_revision(empty_database_url)
    assert head is not None

    await db.migrate(empty_database_url)
    assert db.current_revision(empty_database_url) == head
    assert await _schema(empty_database_url) == (tables, indexes)


async def test_replicas_migrating_together_are_serialised(empty_database_url: str) -> None:
    await asyncio.gather(*(db.migrate(empty_database_url) for _ in range(4)))
    tables, _ = await _schema(empty_database_url)
    assert tables >= TABLES


async def test_database_allows_one_running_and_one_unscoped_pending_operation_per_bank(
    pool: asyncpg.Pool,
) -> None:
    await pool.execute("INSERT INTO banks (id) VALUES ('b')")
    insert = "INSERT INTO operations (id, bank_id, status, scope_filter) VALUES (gen_random_uuid(), 'b', $1, $2)"
    await pool.execute(insert, "running", None)
    try:
        await pool.execute(insert, "running", None)
        raise AssertionError("a second running operation for one bank was accepted")
    except asyncpg.UniqueViolationError:
        pass
    await pool.execute(insert, "pending", None)
    try:
        await pool.execute(insert, "pending", None)
        raise AssertionError("a second unscoped pending operation was accepted")
    except asyncpg.UniqueViolationError:
        pass
    # Scoped pending operations are not de-duplicated by the index.
    await pool.execute(insert, "pending", [["x"]])
    await pool.execute(insert, "pending", [["x"]])
