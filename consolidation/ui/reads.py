"""What the dashboard reads beyond store.py and queue.py: an operation's lease, the fleet's
workers and its last error, memory activity over time and observation search. Read-only SQL."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

import asyncpg

from consolidation import queue, store
from consolidation.queue import Operation
from consolidation.scopes import Scope
from consolidation.store import ObservationRow

MAX_QUERY_CHARS = 200


@dataclass(frozen=True)
class OperationView:
    """An operation with what explains where it stands: its lease (read for one operation's
    page) and the error to show."""

    op: Operation
    lease_expires_at: datetime | None = None

    @property
    def error(self) -> str | None:
        """An ended operation's final error; a live one's latest attempt's, kept while the next
        waits or runs."""
        if self.op.status in queue.TERMINAL:
            return self.op.error
        return self.op.last_error or self.op.error

    @property
    def error_at(self) -> datetime | None:
        return None if self.op.status in queue.TERMINAL else self.op.last_error_at

    def waiting_for_retry(self, now: datetime) -> bool:
        """Pending after a failed attempt, its next attempt not yet due."""
        return self.op.status == "pending" and self.op.attempt > 0 and self.op.run_after > now


def operation_views(operations: Sequence[Operation]) -> list[OperationView]:
    return [OperationView(op) for op in operations]


async def operation_view(pool: asyncpg.Pool, operation_id: uuid.UUID) -> OperationView:
    """One operation with its lease; raises NotFound."""
    op = await queue.get_operation(pool, operation_id)
    lease = await pool.fetchval(
        "SELECT lease_expires_at FROM operations WHERE id = $1 AND status = 'running'",
        operation_id,
    )
    return OperationView(op, lease_expires_at=lease)


# --- the fleet -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workers:
    """Workers as the database sees them: the processes connected under a worker id (leases
    and sessions carry the same id), those holding a live lease, and leases let expire."""

    connected: int
    leasing: int
    running: int
    expired: int


WORKERS = """
SELECT (SELECT count(DISTINCT application_name) FROM pg_stat_activity
        WHERE datname = current_database()
          AND (application_name LIKE 'worker:%' OR application_name LIKE 'replay:%'))
           AS connected,
       count(DISTINCT worker_id) FILTER (WHERE lease_expires_at >= now()) AS leasing,
       count(*) AS running,
       count(*) FILTER (WHERE lease_expires_at < now()) AS expired
FROM operations
WHERE status = 'running'
"""


async def workers(pool: asyncpg.Pool) -> Workers:
    row = await pool.fetchrow(WORKERS)
    return Workers(**dict(row))


@dataclass(frozen=True)
class LastError:
    operation_id: uuid.UUID
    bank_id: str
    status: str
    error: str
    at: datetime | None


# The newest error among live operations and the most recently created failed ones, through
# the partial index on live operations and the (status, created_at) index.
LAST_ERROR = """
WITH candidates AS (
    (SELECT id, bank_id, status, last_error, last_error_at, created_at FROM operations
     WHERE status IN ('pending', 'running') AND last_error IS NOT NULL)
    UNION ALL
    (SELECT id, bank_id, status, last_error, last_error_at, created_at FROM operations
     WHERE status = 'failed' ORDER BY created_at DESC, id DESC LIMIT 20)
)
SELECT id, bank_id, status, last_error AS error, last_error_at AS at
FROM candidates
WHERE last_error <> ''
ORDER BY last_error_at DESC NULLS LAST, created_at DESC
LIMIT 1
"""


async def last_error(pool: asyncpg.Pool) -> LastError | None:
    row = await pool.fetchrow(LAST_ERROR)
    if row is None:
        return None
    return LastError(row["id"], row["bank_id"], row["status"], row["error"], row["at"])


# --- memories over time --------------------------------------------------------------------------


@dataclass(frozen=True)
class Activity:
    """Per minute over a window ending at ``until`` (oldest first): memories ingested and
    memories that left the backlog (consolidated or failed), and the backlog now."""

    until: datetime
    minutes: int
    created: tuple[int, ...]
    consolidated: tuple[int, ...]
    failed: tuple[int, ...]
    pending_now: int

    def backlog(self) -> tuple[int, ...]:
        """Pending memories at the end of each minute, walked back from ``pending_now``.

        Memories deleted or recovered since are not seen, so earlier points are estimates."""
        points = [self.pending_now]
        for i in range(self.minutes - 1, 0, -1):
            before = points[-1] - self.created[i] + self.consolidated[i] + self.failed[i]
            points.append(max(0, before))
        return tuple(reversed(points))


# One pass over the memories touched in the window: each memory contributes its creation, its
# consolidation and its failure, counted in the minute each happened.
ACTIVITY = """
SELECT floor(extract(epoch FROM $2::timestamptz - e.at) / 60)::int AS minutes_ago,
       count(*) FILTER (WHERE e.kind = 'created') AS created,
       count(*) FILTER (WHERE e.kind = 'consolidated') AS consolidated,
       count(*) FILTER (WHERE e.kind = 'failed') AS failed
FROM memories m
CROSS JOIN LATERAL (VALUES ('created', m.created_at),
                           ('consolidated', m.consolidated_at),
                           ('failed', m.consolidation_failed_at)) AS e(kind, at)
WHERE ($1::text IS NULL OR m.bank_id = $1)
  AND m.forgotten_at IS NULL
  AND (m.created_at > $3 OR m.consolidated_at > $3 OR m.consolidation_failed_at > $3)
  AND e.at > $3 AND e.at <= $2
GROUP BY 1
"""

PENDING_NOW = """
SELECT count(*) FROM memories
WHERE ($1::text IS NULL OR bank_id = $1) AND forgotten_at IS NULL
  AND consolidated_at IS NULL AND consolidation_failed_at IS NULL
"""


async def activity(pool: asyncpg.Pool, bank_id: str | None, minutes: int) -> Activity:
    """Memory activity of one bank (or all) over the last ``minutes`` whole minutes."""
    async with pool.acquire() as conn, conn.transaction(isolation="repeatable_read"):
        until: datetime = await conn.fetchval("SELECT now()")
        since = until - timedelta(minutes=minutes)
        rows = await conn.fetch(ACTIVITY, bank_id, until, since)
        pending = await conn.fetchval(PENDING_NOW, bank_id)
    created, consolidated, failed = ([0] * minutes for _ in range(3))
    for r in rows:
        i = minutes - 1 - r["minutes_ago"]
        if 0 <= i < minutes:
            created[i] += r["created"]
            consolidated[i] += r["consolidated"]
            failed[i] += r["failed"]
    return Activity(until, minutes, tuple(created), tuple(consolidated), tuple(failed), pending)


# --- observations --------------------------------------------------------------------------------

# Full-text relevance finds other forms of a word ("switched" for "switch"), the substring match
# finds what full text does not split into words (names cut short, "Postgr"). Keyset on id.
SEARCH_OBSERVATIONS = r"""
SELECT o.id, o.scope, o.text, o.updated_at, o.version,
       ARRAY(SELECT s.memory_id FROM observation_sources s
             WHERE s.observation_id = o.id ORDER BY s.memory_id) AS source_memory_ids
FROM observations o
WHERE o.bank_id = $1
  AND ($2::text[] IS NULL OR o.scope = $2::text[])
  AND ($3::uuid IS NULL OR o.id > $3::uuid)
  AND (o.search @@ websearch_to_tsquery('english', $4)
       OR o.text ILIKE '%' || replace(replace(replace($4, '\', '\\'), '%', '\%'), '_', '\_') || '%')
ORDER BY o.id
LIMIT $5
"""


async def search_observations(
    pool: asyncpg.Pool,
    bank_id: str,
    text: str,
    *,
    scope: Scope | None,
    after: uuid.UUID | None,
    limit: int,
) -> list[ObservationRow]:
    """Observations of a bank (optionally one scope) that match ``text``, by id."""
    rows = await pool.fetch(SEARCH_OBSERVATIONS, bank_id, scope, after, text, limit)
    return [store.observation_row(r) for r in rows]
