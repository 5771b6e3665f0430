"""Every SQL statement about memories and observations (asyncpg). Operation state is in queue.py."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from consolidation import queue
from consolidation.errors import LeaseLost, NotFound, ValidationError
from consolidation.llm.prompts import FactInput
from consolidation.memories import NewMemory
from consolidation.queue import Lease
from consolidation.scopes import Scope, scope_from_db, scopes_from_db

# --- ingestion ---------------------------------------------------------------------------

CHECK_FOREIGN_IDS = """
SELECT id, bank_id FROM memories WHERE id = ANY($1::uuid[]) AND bank_id <> $2
"""

INSERT_BANK = "INSERT INTO banks (id) VALUES ($1) ON CONFLICT (id) DO NOTHING"

# One row per write scope in memory_scopes, inserted with the memory (only when the memory is new).
INSERT_MEMORIES = """
WITH given AS (
    SELECT * FROM jsonb_to_recordset($2::jsonb)
        AS t(id uuid, text text, tags jsonb, observation_scopes jsonb, scopes jsonb,
             occurred_at timestamptz, metadata jsonb)
), inserted AS (
    INSERT INTO memories (id, bank_id, text, tags, observation_scopes, occurred_at, metadata)
    SELECT g.id, $1, g.text, ARRAY(SELECT jsonb_array_elements_text(g.tags)),
           g.observation_scopes, g.occurred_at, g.metadata
    FROM given g
    ON CONFLICT (id) DO NOTHING
    RETURNING id
), scopes AS (
    INSERT INTO memory_scopes (memory_id, scope)
    SELECT g.id, ARRAY(SELECT jsonb_array_elements_text(s.scope))
    FROM given g JOIN inserted i ON i.id = g.id, jsonb_array_elements(g.scopes) AS s(scope)
)
SELECT id FROM inserted
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
    for attempt in (1, 2):
        try:
            async with _acquire(conn) as c, c.transaction():
                foreign = await c.fetch(CHECK_FOREIGN_IDS, ids, bank_id)
                if foreign:
                    problems = [
                        f"memory id {r['id']} already belongs to another bank" for r in foreign
                    ]
                    raise ValidationError("; ".join(problems), problems)
                await c.execute(INSERT_BANK, bank_id)
                # One JSON document rather than parallel arrays: tags and scopes are ragged lists.
                records = [_memory_record(m) for m in memories]
                rows = await c.fetch(INSERT_MEMORIES, bank_id, records)
            break
        except asyncpg.ForeignKeyViolationError:
            # The bank was deleted (DELETE /v1/banks/{bank}) while this waited for it: once more,
            # which starts the bank anew.
            if attempt == 2:
                raise
    return IngestResult(ids=ids, inserted=len(rows))


def _memory_record(m: NewMemory) -> dict[str, Any]:
    return {
        "id": m.id,
        "text": m.text,
        "tags": list(m.tags),
        "observation_scopes": m.observation_scopes,
        "scopes": m.scopes,
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


# One bank's stats from one pass over its memories; also the rows of the bank list. Memories
# asked to be forgotten (forgotten_at) count nowhere: they are on their way out.
BANKS_WITH_STATS = """
SELECT b.id, b.created_at, m.pending, m.consolidated, m.failed, m.oldest_pending_age_s,
       (SELECT count(*) FROM observations o WHERE o.bank_id = b.id) AS observations
FROM banks b
CROSS JOIN LATERAL (
    SELECT count(*) FILTER (WHERE pending) AS pending,
           count(*) FILTER (WHERE consolidated_at IS NOT NULL) AS consolidated,
           count(*) FILTER (WHERE consolidation_failed_at IS NOT NULL) AS failed,
           extract(epoch FROM now() - min(created_at) FILTER (WHERE pending))::float8
               AS oldest_pending_age_s
    FROM (SELECT created_at, consolidated_at, consolidation_failed_at,
                 consolidated_at IS NULL AND consolidation_failed_at IS NULL AS pending
          FROM memories WHERE bank_id = b.id AND forgotten_at IS NULL) bank_memories
) m
"""

BANK_STATS = BANKS_WITH_STATS + "WHERE b.id = $1"

LIST_BANKS = BANKS_WITH_STATS + "WHERE ($1::text IS NULL OR b.id > $1) ORDER BY b.id LIMIT $2"


def _bank_stats(row: asyncpg.Record | None) -> BankStats:
    if row is None:
        return BankStats(0, 0, 0, 0, None)
    return BankStats(
        pending=row["pending"],
        consolidated=row["consolidated"],
        failed=row["failed"],
        observations=row["observations"],
        oldest_pending_age_s=row["oldest_pending_age_s"],
    )


async def bank_stats(conn: asyncpg.Connection | asyncpg.Pool, bank_id: str) -> BankStats:
    """Memory counts by state, observations, and the oldest pending memory's age (zeros for a
    bank that does not exist)."""
    return _bank_stats(await conn.fetchrow(BANK_STATS, bank_id))


@dataclass(frozen=True)
class BankRow:
    id: str
    created_at: datetime
    stats: BankStats


async def list_banks(
    conn: asyncpg.Connection | asyncpg.Pool, *, after: str | None = None, limit: int = 100
) -> list[BankRow]:
    """Banks ordered by id with their stats, keyset-paginated (``after`` the last id seen)."""
    rows = await conn.fetch(LIST_BANKS, after, limit)
    return [BankRow(id=r["id"], created_at=r["created_at"], stats=_bank_stats(r)) for r in rows]


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


def observation_row(r: asyncpg.Record) -> ObservationRow:
    """An observation as read with its sources (``LIST_OBSERVATIONS``' columns)."""
    return ObservationRow(
        id=r["id"],
        scope=scope_from_db(r["scope"]),
        text=r["text"],
        source_memory_ids=list(r["source_memory_ids"]),
        updated_at=r["updated_at"],
        version=r["version"],
    )


async def list_observations(
    conn: asyncpg.Connection | asyncpg.Pool,
    bank_id: str,
    *,
    scope: Scope | None = None,
    after: uuid.UUID | None = None,
    limit: int = 100,
) -> list[ObservationRow]:
    """Observations of a bank (optionally one scope), keyset-paginated by id."""
    rows = await conn.fetch(LIST_OBSERVATIONS, bank_id, scope, after, limit)
    return [observation_row(r) for r in rows]


async def recover_failed(conn: asyncpg.Connection | asyncpg.Pool, bank_id: str) -> int:
    """Clear failed markers so those memories are consolidated again; returns how many."""
    status = await conn.execute(
        "UPDATE memories SET consolidation_failed_at = NULL"
        " WHERE bank_id = $1 AND consolidation_failed_at IS NOT NULL",
        bank_id,
    )
    return int(status.split()[-1])


@dataclass(frozen=True)
class FailedMemory:
    id: uuid.UUID
    text: str
    tags: tuple[str, ...]
    failed_at: datetime
    reason: str | None


# Most recent failures first, keyset-paginated on (consolidation_failed_at, id).
LIST_FAILED = """
SELECT id, text, tags, consolidation_failed_at, consolidation_failed_reason
FROM memories
WHERE bank_id = $1 AND consolidation_failed_at IS NOT NULL
  AND ($2::timestamptz IS NULL OR (consolidation_failed_at, id) < ($2::timestamptz, $3::uuid))
ORDER BY consolidation_failed_at DESC, id DESC
LIMIT $4
"""


async def list_failed_memories(
    conn: asyncpg.Connection | asyncpg.Pool,
    bank_id: str,
    *,
    before: tuple[datetime, uuid.UUID] | None = None,
    limit: int = 100,
) -> list[FailedMemory]:
    """A bank's memories marked failed, with the reason the engine recorded, newest first."""
    failed_at, last_id = before if before is not None else (None, None)
    rows = await conn.fetch(LIST_FAILED, bank_id, failed_at, last_id, limit)
    return [
        FailedMemory(
            id=r["id"],
            text=r["text"],
            tags=tuple(r["tags"]),
            failed_at=r["consolidation_failed_at"],
            reason=r["consolidation_failed_reason"],
        )
        for r in rows
    ]


async def list_scopes(
    conn: asyncpg.Connection | asyncpg.Pool, bank_id: str, limit: int
) -> list[tuple[Scope, int]]:
    """The scopes of a bank's observations with how many each has, in scope order."""
    rows = await conn.fetch(
        "SELECT scope, count(*) AS n FROM observations WHERE bank_id = $1"
        " GROUP BY scope ORDER BY scope LIMIT $2",
        bank_id,
        limit,
    )
    return [(scope_from_db(r["scope"]), r["n"]) for r in rows]


@dataclass(frozen=True)
class MemoryText:
    id: uuid.UUID
    text: str
    tags: tuple[str, ...]


async def memory_texts(
    conn: asyncpg.Connection | asyncpg.Pool, bank_id: str, ids: Sequence[uuid.UUID]
) -> dict[uuid.UUID, MemoryText]:
    """Text and tags of the given memories of one bank (ids of other banks are left out)."""
    rows = await conn.fetch(
        "SELECT id, text, tags FROM memories WHERE bank_id = $1 AND id = ANY($2::uuid[])",
        bank_id,
        list(ids),
    )
    return {r["id"]: MemoryText(r["id"], r["text"], tuple(r["tags"])) for r in rows}


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


# --- forgetting a memory (the request) ----------------------------------------------------

FORGET_LOCK = """
SELECT id FROM memories WHERE bank_id = $1 AND id = ANY($2::uuid[]) ORDER BY id FOR UPDATE
"""

FORGET_TARGETS = """
SELECT i.id, m.id IS NOT NULL AS present, m.forgotten_at IS NOT NULL AS asked,
       t.operation_id, o.status AS operation_status
FROM unnest($2::uuid[]) AS i(id)
LEFT JOIN memories m ON m.id = i.id AND m.bank_id = $1
LEFT JOIN forgotten_memories t ON t.memory_id = i.id AND t.bank_id = $1
LEFT JOIN operations o ON o.id = t.operation_id
"""

MARK_FORGOTTEN = """
WITH marked AS (
    UPDATE memories SET forgotten_at = now()
    WHERE id = ANY($2::uuid[]) AND forgotten_at IS NULL
)
INSERT INTO forgotten_memories (memory_id, bank_id, operation_id)
SELECT unnest($2::uuid[]), $1, $3
ON CONFLICT (memory_id) DO UPDATE
SET bank_id = EXCLUDED.bank_id, operation_id = EXCLUDED.operation_id, requested_at = now(),
    completed_at = NULL
"""


async def request_forget(
    conn: asyncpg.Connection | asyncpg.Pool,
    bank_id: str,
    memory_ids: Sequence[uuid.UUID],
    *,
    max_attempts: int = 5,
) -> dict[uuid.UUID, uuid.UUID]:
    """Ask for memories of a bank to be forgotten; returns the forget operation of each.

    Only records the intent, in one short transaction: the memories are left out of waves,
    counts and stats at once, and the bank's forget operation (enqueued, or joined) deletes them
    and what was derived from them. Idempotent: a memory already asked for, or already forgotten,
    answers the operation that does (or did) it. Raises NotFound, naming every id that is not a
    memory of the bank (or the bank, when it does not exist), and then records nothing.
    """
    ids = list(dict.fromkeys(memory_ids))
    async with _acquire(conn) as c, c.transaction():
        # The bank row before the memories': a deletion of the bank takes them in that order.
        if await c.fetchval("SELECT 1 FROM banks WHERE id = $1 FOR KEY SHARE", bank_id) is None:
            raise NotFound(f"bank {bank_id!r} does not exist")
        await c.execute(FORGET_LOCK, bank_id, ids)
        rows = await c.fetch(FORGET_TARGETS, bank_id, ids)
        unknown = [r["id"] for r in rows if not r["present"] and r["operation_id"] is None]
        if unknown:
            listed = ", ".join(str(i) for i in unknown)
            raise NotFound(f"bank {bank_id!r} has no memory {listed}")
        answer: dict[uuid.UUID, uuid.UUID] = {}
        to_mark: list[uuid.UUID] = []
        for r in rows:
            live = r["operation_status"] in ("pending", "running")
            if not r["present"] or (r["asked"] and live):
                answer[r["id"]] = r["operation_id"]
            else:
                to_mark.append(r["id"])
        if to_mark:
            op = await queue.submit_forget(c, bank_id, max_attempts=max_attempts)
            await c.execute(MARK_FORGOTTEN, bank_id, to_mark, op.id)
            answer.update(dict.fromkeys(to_mark, op.id))
    return {i: answer[i] for i in ids}


# --- forgetting a memory (the operation) --------------------------------------------------

FORGOTTEN_OF_BANK = """
SELECT id FROM memories WHERE bank_id = $1 AND forgotten_at IS NOT NULL ORDER BY id
"""


async def forgotten_of_bank(
    conn: asyncpg.Connection | asyncpg.Pool, bank_id: str
) -> list[uuid.UUID]:
    """The memories of a bank asked to be forgotten and not deleted yet."""
    return [r["id"] for r in await conn.fetch(FORGOTTEN_OF_BANK, bank_id)]


@dataclass(frozen=True)
class AffectedObservation:
    """An observation that cites a memory being forgotten, with its other sources in
    consolidation order."""

    id: uuid.UUID
    scope: Scope
    remaining: tuple[uuid.UUID, ...]


AFFECTED_OBSERVATIONS = """
SELECT o.id, o.scope,
       ARRAY(SELECT s.memory_id
             FROM observation_sources s JOIN memories m ON m.id = s.memory_id
             WHERE s.observation_id = o.id AND s.memory_id <> ALL($2::uuid[])
             ORDER BY m.consolidation_order, m.id) AS remaining
FROM observations o
WHERE o.bank_id = $1
  AND o.id IN (SELECT s.observation_id FROM observation_sources s
               WHERE s.memory_id = ANY($2::uuid[]))
ORDER BY o.id
"""


async def affected_observations(
    conn: asyncpg.Connection | asyncpg.Pool, bank_id: str, forgotten: Sequence[uuid.UUID]
) -> list[AffectedObservation]:
    """The observations of a bank that cite any of ``forgotten``."""
    rows = await conn.fetch(AFFECTED_OBSERVATIONS, bank_id, list(forgotten))
    return [
        AffectedObservation(r["id"], scope_from_db(r["scope"]), tuple(r["remaining"])) for r in rows
    ]


async def memory_facts(
    conn: asyncpg.Connection | asyncpg.Pool, memory_ids: Sequence[uuid.UUID]
) -> dict[uuid.UUID, FactInput]:
    """Memories as a pass shows them to the model."""
    rows = await conn.fetch(
        "SELECT id, text, tags, occurred_at FROM memories WHERE id = ANY($1::uuid[])",
        list(memory_ids),
    )
    return {
        r["id"]: FactInput(r["id"], r["text"], tuple(r["tags"]), r["occurred_at"]) for r in rows
    }


@dataclass(frozen=True)
class DerivedObservation:
    """An observation re-derived from the remaining sources of one being replaced."""

    id: uuid.UUID
    text: str
    memory_ids: tuple[uuid.UUID, ...]
    embedding: str | None = None  # with embeddings: the vector of ``text``


class ForgetIncomplete(Exception):
    """An observation citing a memory to forget still has another source: it was not re-derived
    (the attempt fails and is retried, which re-derives it)."""


REDERIVE = "SELECT consolidation_rederive_v1($1::jsonb)"
FORGET = "SELECT consolidation_forget_v1($1::jsonb)"


def _fenced_payload(lease: Lease) -> dict[str, Any]:
    return {
        "operation_id": lease.operation_id,
        "worker_id": lease.worker_id,
        "attempt": lease.attempt,
        "bank_id": lease.bank_id,
    }


async def _call_fenced(pool: asyncpg.Pool, statement: str, payload: dict[str, Any]) -> Any:
    try:
        return await pool.fetchval(statement, payload)
    except asyncpg.PostgresError as exc:
        _raise_typed(exc)
        raise


async def replace_observation(
    pool: asyncpg.Pool,
    lease: Lease,
    observation_id: uuid.UUID,
    forgotten: Sequence[uuid.UUID],
    derived: Sequence[DerivedObservation],
    *,
    embeddings: bool = False,
) -> dict[str, int]:
    """Replace an observation citing ``forgotten`` memories by ``derived`` (made from its other
    sources alone), deleting it and its lineage's history, in ONE fenced transaction
    (consolidation_rederive_v1); with ``embeddings``, each stored with its vector. Idempotent.
    Raises LeaseLost or StaleObservation."""
    payload = {
        **_fenced_payload(lease),
        "observation_id": observation_id,
        "forgotten": list(forgotten),
        "embeddings": embeddings,
        "creates": [
            {"id": d.id, "text": d.text, "memory_ids": d.memory_ids, "embedding": d.embedding}
            for d in derived
        ],
    }
    counts: dict[str, int] = await _call_fenced(pool, REDERIVE, payload)
    return counts


async def complete_forget(
    pool: asyncpg.Pool, lease: Lease, memory_ids: Sequence[uuid.UUID]
) -> dict[str, int]:
    """Delete memories asked to be forgotten and the observations left citing only them, in ONE
    fenced transaction (consolidation_forget_v1). Idempotent. Raises LeaseLost or
    ForgetIncomplete."""
    payload = {**_fenced_payload(lease), "memory_ids": list(memory_ids)}
    counts: dict[str, int] = await _call_fenced(pool, FORGET, payload)
    return counts


# --- deleting a bank ------------------------------------------------------------------------


@dataclass(frozen=True)
class BankCounts:
    """What deleting a bank removes (or would remove)."""

    memories: int
    observations: int
    observation_sources: int
    observation_history: int
    consolidation_outcomes: int
    operations: int
    operations_cancelled: int  # the pending and running ones among operations


BANK_COUNTS = """
SELECT
  (SELECT count(*) FROM memories WHERE bank_id = $1) AS memories,
  (SELECT count(*) FROM observations WHERE bank_id = $1) AS observations,
  (SELECT count(*) FROM observation_sources s JOIN observations o ON o.id = s.observation_id
    WHERE o.bank_id = $1) AS observation_sources,
  (SELECT count(*) FROM observation_history WHERE bank_id = $1) AS observation_history,
  (SELECT count(*) FROM consolidation_outcomes c JOIN memories m ON m.id = c.memory_id
    WHERE m.bank_id = $1) AS consolidation_outcomes,
  (SELECT count(*) FROM operations WHERE bank_id = $1) AS operations,
  (SELECT count(*) FROM operations WHERE bank_id = $1 AND status IN ('pending', 'running'))
    AS operations_cancelled
"""


async def delete_bank(
    conn: asyncpg.Connection | asyncpg.Pool, bank_id: str, *, dry_run: bool
) -> BankCounts:
    """Delete a bank and everything in it, in one transaction: its pending and running
    operations are cancelled first (their workers are told, and fenced out anyway), then every
    row goes. ``dry_run`` only counts. Raises NotFound."""
    async with _acquire(conn) as c, c.transaction():
        # Operations first: a pass being applied holds its operation row (the fence) and then
        # the bank row (foreign keys); taking them in the same order cannot deadlock with it.
        cancelled = 0 if dry_run else await queue.cancel_bank_operations(c, bank_id)
        if await c.fetchval("SELECT 1 FROM banks WHERE id = $1 FOR UPDATE", bank_id) is None:
            raise NotFound(f"bank {bank_id!r} does not exist")
        counts = BankCounts(**dict(await c.fetchrow(BANK_COUNTS, bank_id)))
        if dry_run:
            return counts
        await c.execute("DELETE FROM banks WHERE id = $1", bank_id)
    return dataclasses.replace(counts, operations_cancelled=cancelled)


# --- the backlog, fleet-wide (/metrics) -------------------------------------------------------


@dataclass(frozen=True)
class Backlog:
    pending: int
    failed: int
    oldest_pending_age_s: float | None
    # (bank, pending memories, age of its oldest pending memory), oldest first, at most top_n.
    oldest_banks: list[tuple[str, int, float]]


# One pass over the pending memories (the partial index memories_pending_idx) and one over the
# failed ones (memories_failed_idx).
BACKLOG = """
WITH pending AS (
    SELECT bank_id, count(*) AS n, min(created_at) AS oldest
    FROM memories
    WHERE consolidated_at IS NULL AND consolidation_failed_at IS NULL AND forgotten_at IS NULL
    GROUP BY bank_id
)
SELECT (SELECT COALESCE(sum(n), 0) FROM pending)::bigint AS pending,
       (SELECT count(*) FROM memories
         WHERE consolidation_failed_at IS NOT NULL AND forgotten_at IS NULL) AS failed,
       (SELECT extract(epoch FROM now() - min(oldest))::float8 FROM pending)
         AS oldest_pending_age_s,
       ARRAY(SELECT bank_id FROM pending ORDER BY oldest, bank_id LIMIT $1) AS banks,
       ARRAY(SELECT n FROM pending ORDER BY oldest, bank_id LIMIT $1) AS counts,
       ARRAY(SELECT extract(epoch FROM now() - oldest)::float8 FROM pending
             ORDER BY oldest, bank_id LIMIT $1) AS ages
"""


async def backlog(conn: asyncpg.Connection | asyncpg.Pool, top_n: int) -> Backlog:
    """Pending and failed memories of every bank, the oldest pending memory's age, and the
    ``top_n`` banks whose oldest pending memory is oldest."""
    r = await conn.fetchrow(BACKLOG, top_n)
    return Backlog(
        pending=r["pending"],
        failed=r["failed"],
        oldest_pending_age_s=r["oldest_pending_age_s"],
        oldest_banks=list(zip(r["banks"], r["counts"], r["ages"], strict=True)),
    )


# --- the engine: waves, recall, apply, markers -------------------------------------------


@dataclass(frozen=True)
class WaveMemory:
    """A pending memory as a wave sees it, with the scopes the journal already has."""

    id: uuid.UUID
    text: str
    tags: tuple[str, ...]
    occurred_at: datetime | None
    order: datetime
    scopes: tuple[Scope, ...]
    journaled: frozenset[Scope]


# Keyset pagination in consolidation order: each operation walks the pending memories once, so
# memories left pending on purpose (a scoped operation's other scopes) are not fetched again. A
# memory asked to be forgotten is never fetched.
FETCH_WAVE = """
SELECT m.id, m.text, m.tags, m.occurred_at, m.consolidation_order,
       (SELECT jsonb_agg(s.scope) FROM memory_scopes s WHERE s.memory_id = m.id) AS scopes,
       (SELECT jsonb_agg(o.scope) FROM consolidation_outcomes o WHERE o.memory_id = m.id)
           AS journaled
FROM memories m
WHERE m.bank_id = $1
  AND m.consolidated_at IS NULL AND m.consolidation_failed_at IS NULL AND m.forgotten_at IS NULL
  AND (m.consolidation_order, m.id) > ($2::timestamptz, $3::uuid)
  AND ($5::jsonb IS NULL OR EXISTS (
      SELECT 1 FROM memory_scopes s
      WHERE s.memory_id = m.id AND s.scope IN (SELECT ARRAY(SELECT jsonb_array_elements_text(f))
                                               FROM jsonb_array_elements($5::jsonb) AS f)))
ORDER BY m.consolidation_order, m.id
LIMIT $4
"""

WAVE_START = (datetime.fromisoformat("0001-01-01T00:00:00+00:00"), uuid.UUID(int=0))


async def fetch_wave(
    conn: asyncpg.Connection | asyncpg.Pool,
    bank_id: str,
    after: tuple[datetime, uuid.UUID] | None,
    limit: int,
    scope_filter: Sequence[Scope] | None,
) -> list[WaveMemory]:
    """The next ``limit`` pending memories after ``after`` in consolidation order."""
    order, last_id = after or WAVE_START
    rows = await conn.fetch(FETCH_WAVE, bank_id, order, last_id, limit, scope_filter)
    return [
        WaveMemory(
            id=r["id"],
            text=r["text"],
            tags=tuple(r["tags"]),
            occurred_at=r["occurred_at"],
            order=r["consolidation_order"],
            scopes=scopes_from_db(r["scopes"]),
            journaled=frozenset(scopes_from_db(r["journaled"])),
        )
        for r in rows
    ]


COUNT_PENDING = """
SELECT count(*) FROM memories m
WHERE m.bank_id = $1 AND m.consolidated_at IS NULL AND m.consolidation_failed_at IS NULL
  AND m.forgotten_at IS NULL
  AND ($2::jsonb IS NULL OR EXISTS (
      SELECT 1 FROM memory_scopes s
      WHERE s.memory_id = m.id AND s.scope IN (SELECT ARRAY(SELECT jsonb_array_elements_text(f))
                                               FROM jsonb_array_elements($2::jsonb) AS f)))
"""


async def count_pending(
    conn: asyncpg.Connection | asyncpg.Pool, bank_id: str, scope_filter: Sequence[Scope] | None
) -> int:
    return int(await conn.fetchval(COUNT_PENDING, bank_id, scope_filter))


async def bank_mission(conn: asyncpg.Connection | asyncpg.Pool, bank_id: str) -> str | None:
    mission: str | None = await conn.fetchval("SELECT mission FROM banks WHERE id = $1", bank_id)
    return mission


@dataclass(frozen=True)
class RecalledObservation:
    id: uuid.UUID
    text: str
    sources: int
    updated_at: datetime


# The query is consolidation/sql/consolidation_recall_v1.sql, shared by the two ways a pass gets
# its observations: this statement, and the apply of the group's previous pass (APPLY_PASS).
RECALL = (
    "SELECT obs_id, obs_text, obs_updated_at, obs_sources"
    " FROM consolidation_recall_v1($1, $2, $3, $4)"
)


# With embeddings: full text and cosine similarity to the facts' vectors, the two rankings
# interleaved per fact (consolidation/sql/consolidation_recall_hybrid_v1.sql).
RECALL_HYBRID = (
    "SELECT obs_id, obs_text, obs_updated_at, obs_sources"
    " FROM consolidation_recall_hybrid_v1($1, $2, $3, $4, $5)"
)


async def recall(
    conn: asyncpg.Connection | asyncpg.Pool,
    bank_id: str,
    scope: Scope,
    fact_texts: Sequence[str],
    limit: int,
    fact_vectors: Sequence[str | None] | None = None,
) -> list[RecalledObservation]:
    """The observations of one scope a pass should see (DESIGN §2, Recall). ``fact_vectors``
    (pgvector text form, None for a fact without one) switches to hybrid ranking; None keeps
    the full-text recall."""
    vectors = None if fact_vectors is None else tuple(fact_vectors)
    request = RecallRequest(scope, tuple(fact_texts), limit, vectors)
    return (await recall_many(conn, bank_id, [request]))[0]


def recall_statement(count: int, hybrid: bool) -> str:
    """ONE statement returning ``count`` recalls (a group's first pass fetches its own and its
    next pass's), each row tagged with the recall it belongs to and its place in it."""
    function, arity = (
        ("consolidation_recall_hybrid_v1", 5) if hybrid else ("consolidation_recall_v1", 4)
    )
    parts = []
    for k in range(count):
        params = ", ".join(f"${k * arity + i + 1}" for i in range(arity))
        parts.append(
            f"SELECT {k} AS k, r.n, r.obs_id, r.obs_text, r.obs_updated_at, r.obs_sources"
            f" FROM {function}({params}) WITH ORDINALITY"
            " AS r(obs_id, obs_text, obs_updated_at, obs_sources, n)"
        )
    return " UNION ALL ".join(parts) + " ORDER BY k, n"


async def recall_many(
    conn: asyncpg.Connection | asyncpg.Pool, bank_id: str, requests: Sequence[RecallRequest]
) -> list[list[RecalledObservation]]:
    """The recalls of several passes' requests (:func:`recall` each), in ONE statement. With
    embeddings (``fact_vectors`` set) all of them are hybrid."""
    wanted = [(i, r) for i, r in enumerate(requests) if r.limit > 0]
    found: list[list[RecalledObservation]] = [[] for _ in requests]
    if not wanted:
        return found
    hybrid = any(r.fact_vectors is not None for _, r in wanted)
    args: list[Any] = []
    for _, r in wanted:
        args += [bank_id, *_recall_args(r, hybrid)]
    rows = await conn.fetch(recall_statement(len(wanted), hybrid), *args)
    for row in rows:
        found[wanted[row["k"]][0]].append(
            RecalledObservation(
                row["obs_id"], row["obs_text"], int(row["obs_sources"]), row["obs_updated_at"]
            )
        )
    return found


async def warm(pool: asyncpg.Pool, connections: int, *, hybrid: bool = False) -> None:
    """Have ``connections`` of the pool's sessions ready for an operation: each runs a group's
    first recall statement once, with nothing to recall. A new session's first recall costs
    about ten times a warm one (the server loads its catalogs and compiles the recall
    function; asyncpg prepares the statement): paid here, at once, instead of by the first
    passes of the operation, whose LLM calls wait on it (docs/benchmarks.md, "What was tried")."""
    args = ["", *_recall_args(RecallRequest((), (), 0), hybrid)] * 2
    statement = recall_statement(2, hybrid)
    async with contextlib.AsyncExitStack() as held:
        # One after the other: a pool opened with min_size=connections has them open already.
        sessions = [await held.enter_async_context(pool.acquire()) for _ in range(connections)]
        await asyncio.gather(*(conn.fetch(statement, *args) for conn in sessions))


def _recalled(rows: Sequence[asyncpg.Record]) -> list[RecalledObservation]:
    return [RecalledObservation(r[0], r[1], int(r[3]), r[2]) for r in rows]


@dataclass(frozen=True)
class RecallRequest:
    """What a pass recalls by: its scope and its facts' texts (DESIGN §2, Recall), and with
    embeddings their vectors (pgvector text form, None for a text the endpoint refused)."""

    scope: Scope
    fact_texts: tuple[str, ...]
    limit: int
    fact_vectors: tuple[str | None, ...] | None = None


@dataclass(frozen=True)
class ObservationWrite:
    """One observation a pass writes. ``create``: ``ids`` holds the new observation's id;
    otherwise an update (one id) or a merge: ``ids[0]`` is kept, ``ids[1:]`` merge into it."""

    ids: tuple[uuid.UUID, ...]
    text: str
    memory_ids: tuple[uuid.UUID, ...]
    create: bool
    embedding: str | None = None  # the vector of ``text`` (pgvector text form), with embeddings


@dataclass(frozen=True)
class Outcome:
    memory_id: uuid.UUID
    action: str
    observation_ids: tuple[uuid.UUID, ...]


@dataclass(frozen=True)
class PassWrite:
    """Everything one successful pass writes, in one transaction."""

    bank_id: str
    scope: Scope
    operation_id: uuid.UUID
    observations: tuple[ObservationWrite, ...]
    outcomes: tuple[Outcome, ...]


class StaleObservation(Exception):
    """An observation the answer refers to is gone or not in the pass's bank and scope."""


# The writes of a pass and the next pass's recall: consolidation/sql/consolidation_apply_pass_v1.sql,
# one round trip, one implicit transaction, fenced first.
APPLY_PASS = (
    "SELECT obs_id, obs_text, obs_updated_at, obs_sources"
    " FROM consolidation_apply_pass_v1($1::jsonb, $2, $3, $4)"
)
# With embeddings (consolidation_apply_pass_v2.sql): the same writes, each observation written
# with the vector of its text, and the next pass's recall hybrid.
APPLY_PASS_HYBRID = (
    "SELECT obs_id, obs_text, obs_updated_at, obs_sources"
    " FROM consolidation_apply_pass_v2($1::jsonb, $2, $3, $4, $5)"
)
FENCE_LOST = "CN001"
NOT_IN_SCOPE = "CN002"
FORGET_INCOMPLETE = "CN003"


async def apply_pass(
    pool: asyncpg.Pool,
    lease: Lease,
    write: PassWrite,
    recall_next: RecallRequest | None = None,
    *,
    embeddings: bool = False,
) -> list[RecalledObservation] | None:
    """Apply one pass in ONE transaction that first checks the operation's fence; with
    ``recall_next``, also return that recall as it stands after this pass's writes. With
    ``embeddings``, the observations are stored with their ``embedding`` and the recall is the
    hybrid one (by ``recall_next.fact_vectors``).

    Raises LeaseLost (nothing written) or StaleObservation (nothing written).
    """
    payload = {
        "operation_id": write.operation_id,
        "worker_id": lease.worker_id,
        "attempt": lease.attempt,
        "bank_id": write.bank_id,
        "scope": write.scope,
        "creates": [_observation_json(w, embeddings) for w in write.observations if w.create],
        "changes": [_observation_json(w, embeddings) for w in write.observations if not w.create],
        "outcomes": [
            {"memory_id": o.memory_id, "action": o.action, "observation_ids": o.observation_ids}
            for o in write.outcomes
        ],
    }
    args: tuple[Any, ...]
    statement = APPLY_PASS_HYBRID if embeddings else APPLY_PASS
    if recall_next is None or recall_next.limit <= 0:
        args = (None, 0, None, None) if embeddings else (None, 0, None)
    else:
        args = _recall_args(recall_next, embeddings)
    try:
        rows = await pool.fetch(statement, payload, *args)
    except asyncpg.PostgresError as exc:
        _raise_typed(exc)
        raise
    if recall_next is None:
        return None
    return _recalled(rows)


def _recall_args(request: RecallRequest, hybrid: bool) -> tuple[Any, ...]:
    """A recall's arguments after the bank: scope, limit and the facts, as the full-text
    function takes them (one text) or the hybrid one (texts and their vectors)."""
    if not hybrid:
        return (request.scope, request.limit, "\n".join(request.fact_texts))
    vectors = request.fact_vectors or (None,) * len(request.fact_texts)
    return (request.scope, request.limit, list(request.fact_texts), list(vectors))


def _raise_typed(exc: asyncpg.PostgresError) -> None:
    """The typed exception for an error the database functions raise on purpose, if it is one."""
    if exc.sqlstate == FENCE_LOST:
        raise LeaseLost(str(exc)) from None
    if exc.sqlstate == NOT_IN_SCOPE:
        raise StaleObservation(str(exc)) from None
    if exc.sqlstate == FORGET_INCOMPLETE:
        raise ForgetIncomplete(str(exc)) from None


def _observation_json(write: ObservationWrite, embeddings: bool) -> dict[str, Any]:
    item: dict[str, Any] = {"ids": write.ids, "text": write.text, "memory_ids": write.memory_ids}
    if embeddings:
        item["embedding"] = write.embedding
    return item


JOURNAL_OF = """
SELECT memory_id, scope, action FROM consolidation_outcomes
WHERE operation_id = $1 AND memory_id = ANY($2::uuid[])
"""


async def journal_of(
    conn: asyncpg.Connection | asyncpg.Pool,
    operation_id: uuid.UUID,
    memory_ids: Sequence[uuid.UUID],
) -> list[tuple[uuid.UUID, Scope, str]]:
    """The journal rows ``operation_id`` wrote for these memories: (memory, scope, action)."""
    rows = await conn.fetch(JOURNAL_OF, operation_id, memory_ids)
    return [(r["memory_id"], scope_from_db(r["scope"]), r["action"]) for r in rows]


# Fenced (consolidation_holds_lease_v1, checked once): a worker that lost its lease marks nothing,
# and hears so. One statement, one round trip, whatever the wave's size; it reports what it marked.
COMMIT_MARKER = """
WITH fence AS MATERIALIZED (SELECT consolidation_holds_lease_v1($1, $2, $3) AS held),
marked AS (
    UPDATE memories m
    SET consolidated_at = CASE WHEN w.ok THEN now() END,
        consolidation_failed_at = CASE WHEN w.ok THEN NULL ELSE now() END,
        consolidation_failed_reason = w.reason
    FROM unnest($4::uuid[], $5::boolean[], $6::text[]) AS w(id, ok, reason)
    WHERE m.id = w.id AND m.consolidated_at IS NULL AND m.consolidation_failed_at IS NULL
      AND (SELECT held FROM fence)
    RETURNING w.ok
)
SELECT (SELECT held FROM fence) AS held,
       count(*) FILTER (WHERE ok) AS consolidated,
       count(*) FILTER (WHERE NOT ok) AS failed
FROM marked
"""


@dataclass(frozen=True)
class Marked:
    """How many memories a wave's marker write marked consolidated and failed."""

    consolidated: int
    failed: int


async def commit_wave_markers(
    pool: asyncpg.Pool,
    lease: Lease,
    consolidated: Sequence[uuid.UUID],
    failed: Mapping[uuid.UUID, str],
) -> Marked:
    """Mark a wave's finished memories (``failed`` maps each to its reason): ONE statement, one
    round trip; returns what it marked (a memory already marked is not counted). Raises
    LeaseLost when the attempt is no longer ours (nothing is marked)."""
    if not consolidated and not failed:
        return Marked(0, 0)
    ids = [*consolidated, *failed]
    oks = [True] * len(consolidated) + [False] * len(failed)
    reasons = [None] * len(consolidated) + list(failed.values())
    row = await pool.fetchrow(
        COMMIT_MARKER, lease.operation_id, lease.worker_id, lease.attempt, ids, oks, reasons
    )
    assert row is not None
    if not row["held"]:
        raise LeaseLost(
            f"operation {lease.operation_id} attempt {lease.attempt} is no longer ours: "
            "its wave's markers were not written"
        )
    return Marked(row["consolidated"], row["failed"])


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
