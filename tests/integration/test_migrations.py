"""The schema builds from empty through Alembic, and upgrading again changes nothing."""

from __future__ import annotations

import asyncio

import asyncpg

from consolidation import db, store

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


async def test_recall_keeps_using_the_keys_as_tables_grow_past_their_statistics(
    pool: asyncpg.Pool,
) -> None:
    # A new database: the tables were analyzed empty. A session's cached plan for the recall is
    # made on the first calls, while the scope is still small; it must not be a sequential scan
    # that the session then keeps while the tables grow (autovacuum analyzes a minute later).
    await pool.execute("ANALYZE observations; ANALYZE observation_sources")
    await pool.execute("INSERT INTO banks (id) VALUES ('b')")
    seq_scans = """SELECT coalesce(sum(seq_scan), 0) FROM pg_stat_user_tables
                   WHERE relname IN ('observations', 'observation_sources')"""
    async with pool.acquire() as conn:
        for _ in range(8):  # past plpgsql's five custom plans: the generic plan is cached now
            await conn.fetch(store.RECALL, "b", ["s"], 20, "tea every morning")
        await conn.execute(
            """INSERT INTO observations (id, bank_id, scope, text)
               SELECT gen_random_uuid(), 'b', ARRAY['s'], 'note ' || i || ' about coffee'
               FROM generate_series(1, 2000) AS i"""
        )
        await conn.execute("SELECT pg_stat_force_next_flush()")
        before = await conn.fetchval(seq_scans)
        rows = await conn.fetch(store.RECALL, "b", ["s"], 20, "tea every morning")
        await conn.execute("SELECT pg_stat_force_next_flush()")
        after = await conn.fetchval(seq_scans)
    assert len(rows) == 20
    assert after == before
