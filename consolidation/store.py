"""Every SQL statement about memories and observations (asyncpg). Operation state is in queue.py."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from consolidation.errors import ValidationError
from consolidation.memories import NewMemory
from consolidation.scopes import Scope

SCOPE_SEP = "\x1f"


def scope_key(scope: Scope) -> str:
    """A scope as one string (tags joined by U+001F; '' is the shared scope)."""
    return SCOPE_SEP.join(scope)


def scope_from_key(key: str) -> Scope:
    return tuple(key.split(SCOPE_SEP)) if key else ()


# --- ingestion ---------------------------------------------------------------------------

CHECK_FOREIGN_IDS = """
SELECT id, bank_id FROM memories WHERE id = ANY($1::uuid[]) AND bank_id <> $2
"""

INSERT_BANK = "INSERT INTO banks (id) VALUES ($1) ON CONFLICT (id) DO NOTHING"

INSERT_MEMORIES = """
INSERT INTO memories (id, bank_id, text, tags, observation_scopes, scope_keys, occurred_at, metadata)
SELECT t.id, $1, t.text,
       ARRAY(SELECT jsonb_array_elements_text(t.tags)),
       t.observation_scopes,
       ARRAY(SELECT jsonb_array_elements_text(t.scope_keys)),
       t.occurred_at, t.metadata
FROM jsonb_to_recordset($2::jsonb)
     AS t(id uuid, text text, tags jsonb, observation_scopes jsonb, scope_keys jsonb,
          occurred_at timestamptz, metadata jsonb)
ON CONFLICT (id) DO NOTHING
RETURNING id
"""


@dataclass(frozen=True)
class IngestResult:
    ids: list[uuid.UUID]
    inserted: int


async def ingest_memories(
    conn: asyncpg.Connection | asyncpg.Pool, bank_id: str, memories: Sequence[NewMemory]
) -> IngestResult:
    """Insert validated memories into a bank in one transaction; re-sending an id is a no-op.

    An id that already belongs to another bank raises ValidationError and writes nothing.
    """
    ids = [m.id for m in memories]
    async with _acquire(conn) as c, c.transaction():
        foreign = await c.fetch(CHECK_FOREIGN_IDS, ids, bank_id)
        if foreign:
            problems = [f"memory id {r['id']} already belongs to another bank" for r in foreign]
            raise ValidationError("; ".join(problems), problems)
        await c.execute(INSERT_BANK, bank_id)
        # One JSON document rather than parallel arrays: tags and scopes are ragged lists.
        rows = await c.fetch(INSERT_MEMORIES, bank_id, [_memory_record(m) for m in memories])
    return IngestResult(ids=ids, inserted=len(rows))


def _memory_record(m: NewMemory) -> dict[str, Any]:
    return {
        "id": m.id,
        "text": m.text,
        "tags": list(m.tags),
        "observation_scopes": m.observation_scopes,
        "scope_keys": [scope_key(s) for s in m.scopes],
        "occurred_at": m.occurred_at,
        "metadata": m.metadata,
    }


# --- reading -------------------------------------------------------------------------------


@dataclass(frozen=True)
class BankStats:
    pending: int
    consolidated: int
    failed: int
    observations: int
    oldest_pending_age_s: float | None


BANK_STATS = """
SELECT
  (SELECT count(*) FROM memories
    WHERE bank_id = $1 AND consolidated_at IS NULL AND consolidation_failed_at IS NULL) AS pending,
  (SELECT count(*) FROM memories
    WHERE bank_id = $1 AND consolidated_at IS NOT NULL) AS consolidated,
  (SELECT count(*) FROM memories
    WHERE bank_id = $1 AND consolidation_failed_at IS NOT NULL) AS failed,
  (SELECT count(*) FROM observations WHERE bank_id = $1) AS observations,
  (SELECT extract(epoch FROM now() - min(created_at))::float8 FROM memories
    WHERE bank_id = $1 AND consolidated_at IS NULL AND consolidation_failed_at IS NULL)
    AS oldest_pending_age_s
"""


async def bank_stats(conn: asyncpg.Connection | asyncpg.Pool, bank_id: str) -> BankStats:
    row = await conn.fetchrow(BANK_STATS, bank_id)
    return BankStats(**dict(row))


async def bank_exists(conn: asyncpg.Connection | asyncpg.Pool, bank_id: str) -> bool:
    return bool(await conn.fetchval("SELECT EXISTS (SELECT 1 FROM banks WHERE id = $1)", bank_id))


@dataclass(frozen=True)
class ObservationRow:
    id: uuid.UUID
    scope: Scope
    text: str
    source_memory_ids: list[uuid.UUID]
    updated_at: datetime
    version: int


LIST_OBSERVATIONS = """
SELECT o.id, o.scope, o.text, o.updated_at, o.version,
       ARRAY(SELECT s.memory_id FROM observation_sources s
             WHERE s.observation_id = o.id ORDER BY s.memory_id) AS source_memory_ids
FROM observations o
WHERE o.bank_id = $1
  AND ($2::text[] IS NULL OR o.scope = $2::text[])
  AND ($3::uuid IS NULL OR o.id > $3::uuid)
ORDER BY o.id
LIMIT $4
"""


async def list_observations(
    conn: asyncpg.Connection | asyncpg.Pool,
    bank_id: str,
    *,
    scope: Scope | None = None,
    after: uuid.UUID | None = None,
    limit: int = 100,
) -> list[ObservationRow]:
    """Observations of a bank (optionally one scope), keyset-paginated by id."""
    rows = await conn.fetch(
        LIST_OBSERVATIONS, bank_id, list(scope) if scope is not None else None, after, limit
    )
    return [
        ObservationRow(
            id=r["id"],
            scope=tuple(r["scope"]),
            text=r["text"],
            source_memory_ids=list(r["source_memory_ids"]),
            updated_at=r["updated_at"],
            version=r["version"],
        )
        for r in rows
    ]


async def recover_failed(conn: asyncpg.Connection | asyncpg.Pool, bank_id: str) -> int:
    """Clear failed markers so those memories are consolidated again; returns how many."""
    status = await conn.execute(
        "UPDATE memories SET consolidation_failed_at = NULL"
        " WHERE bank_id = $1 AND consolidation_failed_at IS NOT NULL",
        bank_id,
    )
    return int(status.split()[-1])


RESET_BANK = [
    "DELETE FROM consolidation_outcomes o USING memories m"
    " WHERE o.memory_id = m.id AND m.bank_id = $1",
    "DELETE FROM observation_history WHERE bank_id = $1",
    "DELETE FROM observations WHERE bank_id = $1",
    "UPDATE memories SET consolidated_at = NULL, consolidation_failed_at = NULL"
    " WHERE bank_id = $1 AND (consolidated_at IS NOT NULL OR consolidation_failed_at IS NOT NULL)",
]


async def reset_bank(conn: asyncpg.Connection | asyncpg.Pool, bank_id: str) -> None:
    """Forget every consolidation result of a bank (markers, journal, observations)."""
    async with _acquire(conn) as c, c.transaction():
        for statement in RESET_BANK:
            await c.execute(statement, bank_id)


# --- helpers -------------------------------------------------------------------------------


class _acquire:
    """``async with`` over either a pool (acquire a connection) or a connection (use it)."""

    def __init__(self, conn: asyncpg.Connection | asyncpg.Pool) -> None:
        self._source = conn
        self._conn: Any = None

    async def __aenter__(self) -> asyncpg.Connection:
        if isinstance(self._source, asyncpg.Pool):
            self._conn = await self._source.acquire()
            return self._conn
        return self._source

    async def __aexit__(self, *exc: object) -> None:
        if self._conn is not None:
            await self._source.release(self._conn)


def scope_keys(scopes: Iterable[Scope]) -> list[str]:
    return [scope_key(s) for s in scopes]
