"""`consolidation forget BANK MEMORY_ID…` as a real process: all or nothing, one-line errors."""

from __future__ import annotations

import uuid

import asyncpg

from tests.integration.test_cli_ingest import run_cli
from tests.support.engine import ingest


async def flagged(pool: asyncpg.Pool) -> int:
    return int(await pool.fetchval("SELECT count(*) FROM memories WHERE forgotten_at IS NOT NULL"))


async def test_forget_records_every_memory_and_prints_its_operation(
    pool: asyncpg.Pool, database_url: str
) -> None:
    ids = await ingest(pool, "b", [{"text": "one"}, {"text": "two"}, {"text": "three"}])
    env = {"CONSOLIDATION_DATABASE_URL": database_url}
    done = run_cli("forget", "b", str(ids[0]), str(ids[2]), env=env)
    assert done.returncode == 0, done.stderr
    operation_id = await pool.fetchval("SELECT id FROM operations WHERE kind = 'forget'")
    assert done.stdout.count(f"forgotten by operation {operation_id}") == 2
    assert await flagged(pool) == 2
    again = run_cli("forget", "b", str(ids[0]), env=env)
    assert again.returncode == 0 and str(operation_id) in again.stdout


async def test_forget_with_an_unknown_or_malformed_id_forgets_nothing(
    pool: asyncpg.Pool, database_url: str
) -> None:
    ids = await ingest(pool, "b", [{"text": "one"}])
    env = {"CONSOLIDATION_DATABASE_URL": database_url}
    unknown = uuid.uuid4()
    failed = run_cli("forget", "b", str(ids[0]), str(unknown), env=env)
    assert failed.returncode == 1
    assert failed.stderr.strip().count("\n") == 0 and str(unknown) in failed.stderr
    malformed = run_cli("forget", "b", "not-an-id", env=env)
    assert malformed.returncode == 2 and "'not-an-id'" in malformed.stderr
    missing_bank = run_cli("forget", "nope", str(ids[0]), env=env)
    assert missing_bank.returncode == 1 and "does not exist" in missing_bank.stderr
    assert await flagged(pool) == 0
    assert await pool.fetchval("SELECT count(*) FROM operations") == 0
