"""Operation state: submit, claim, heartbeat, fence, finish, cancel. The only module that writes
``operations``.

Every write an operation makes after it is claimed is fenced on (id, worker_id, attempt,
status='running'), so a worker that lost its lease can never write again (River's rule).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from consolidation.errors import LeaseLost, NotFound
from consolidation.scopes import Scope, scopes_from_db

NOTIFY_SUBMIT = "consolidation_submit"
NOTIFY_CANCEL = "consolidation_cancel"

TERMINAL = frozenset({"completed", "failed", "cancelled"})


@dataclass(frozen=True)
class Lease:
    """The fence of one claimed attempt of an operation."""

    operation_id: uuid.UUID
    bank_id: str
    worker_id: str
    attempt: int
    scope_filter: tuple[Scope, ...] | None
    max_attempts: int
    interruptions: int = 0  # earlier attempts handed back because the database was unreachable


@dataclass(frozen=True)
class Operation:
    """An operation row as the API and CLI report it."""

    id: uuid.UUID
    bank_id: str
    status: str
    scope_filter: list[list[str]] | None
    priority: int
    attempt: int
    max_attempts: int
    worker_id: str | None
    progress: dict[str, Any]
    result: dict[str, Any] | None
    error: str | None
    cancel_requested_at: datetime | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None

    def to_json(self) -> dict[str, Any]:
        return {
            "operation_id": str(self.id),
            "bank_id": self.bank_id,
            "status": self.status,
            "attempt": self.attempt,
            "progress": self.progress,
            "result": self.result,
            "error": self.error,
            "created_at": _iso(self.created_at),
            "started_at": _iso(self.started_at),
            "finished_at": _iso(self.finished_at),
        }


def _iso(value: datetime | None) -> str | None:
    return value.isoformat().replace("+00:00", "Z") if value else None


def _scope_filter_json(scopes: Sequence[Scope] | None) -> list[list[str]] | None:
    return None if scopes is None else [list(s) for s in scopes]


def _lease_from_row(row: asyncpg.Record) -> Lease:
    raw = row["scope_filter"]
    return Lease(
        operation_id=row["id"],
        bank_id=row["bank_id"],
        worker_id=row["worker_id"],
        attempt=row["attempt"],
        scope_filter=None if raw is None else scopes_from_db(raw),
        max_attempts=row["max_attempts"],
        interruptions=row["interruptions"],
    )


OPERATION_COLUMNS = """
id, bank_id, status, scope_filter, priority, attempt, max_attempts, worker_id, progress, result,
error, cancel_requested_at, created_at, started_at, finished_at
"""

# --- submit ---------------------------------------------------------------------------------

SUBMIT = f"""
WITH bank AS (
    INSERT INTO banks (id) VALUES ($2) ON CONFLICT (id) DO NOTHING
)
INSERT INTO operations (id, bank_id, status, scope_filter, priority, max_attempts)
VALUES ($1, $2, 'pending', $3, $4, $5)
ON CONFLICT (bank_id) WHERE status = 'pending' AND scope_filter IS NULL DO NOTHING
RETURNING {OPERATION_COLUMNS}
"""

PENDING_UNSCOPED = f"""
SELECT {OPERATION_COLUMNS} FROM operations
WHERE bank_id = $1 AND status = 'pending' AND scope_filter IS NULL
"""


@dataclass(frozen=True)
class Submitted:
    operation: Operation
    deduplicated: bool


async def submit(
    pool: asyncpg.Pool | asyncpg.Connection,
    bank_id: str,
    *,
    scopes: Sequence[Scope] | None = None,
    priority: int = 0,
    max_attempts: int = 5,
) -> Submitted:
    """Enqueue a consolidation of a bank; an unscoped one joins an already pending one."""
    filter_json = _scope_filter_json(scopes)
    for _ in range(3):
        row = await pool.fetchrow(
            SUBMIT, uuid.uuid4(), bank_id, filter_json, priority, max_attempts
        )
        if row is not None:
            await pool.execute("SELECT pg_notify($1, $2)", NOTIFY_SUBMIT, bank_id)
            return Submitted(_operation(row), deduplicated=False)
        existing = await pool.fetchrow(PENDING_UNSCOPED, bank_id)
        if existing is not None:  # else it was claimed in between: try again
            return Submitted(_operation(existing), deduplicated=True)
    raise RuntimeError("could not submit an operation: the pending one kept changing")


CREATE_RUNNING = f"""
WITH bank AS (
    INSERT INTO banks (id) VALUES ($2) ON CONFLICT (id) DO NOTHING
)
INSERT INTO operations (id, bank_id, status, scope_filter, attempt, max_attempts, worker_id,
                        lease_expires_at, started_at)
VALUES ($1, $2, 'running', $3, 1, 1, $4, now() + make_interval(secs => $5), now())
RETURNING {OPERATION_COLUMNS}, lease_expires_at, interruptions
"""


ABANDON_EXPIRED = """
UPDATE operations
SET status = 'failed', finished_at = now(), lease_expires_at = NULL,
    error = 'its worker stopped renewing the lease; superseded by a foreground replay'
WHERE bank_id = $1 AND status = 'running' AND lease_expires_at < now()
"""


class BankBusy(Exception):
    """The bank already has a running operation."""


async def start_foreground(
    pool: asyncpg.Pool,
    bank_id: str,
    worker_id: str,
    lease_s: float,
    scopes: Sequence[Scope] | None = None,
) -> Lease:
    """Create an operation that is running at once, owned by ``worker_id`` (``replay``).

    A running operation of the bank whose lease expired (its process died) is ended first: the
    new operation redoes whatever it left, and the journal keeps that from being done twice.
    """
    try:
        async with pool.acquire() as conn, conn.transaction():
            await conn.execute(ABANDON_EXPIRED, bank_id)
            row = await conn.fetchrow(
                CREATE_RUNNING,
                uuid.uuid4(),
                bank_id,
                _scope_filter_json(scopes),
                worker_id,
                lease_s,
            )
    except asyncpg.UniqueViolationError:
        running = await pool.fetchval(
            "SELECT id FROM operations WHERE bank_id = $1 AND status = 'running'", bank_id
        )
        raise BankBusy(
            f"bank {bank_id!r} already has a running operation ({running}); "
            "wait for it or cancel it first"
        ) from None
    assert row is not None
    return _lease_from_row(row)


# --- claim ----------------------------------------------------------------------------------

# Pending operations that are due, and running ones whose lease expired (their worker died).
# SKIP LOCKED lets replicas claim side by side; the unique index on running operations makes
# a second running operation for a bank impossible even if two claims raced.
CLAIM = """
WITH candidate AS (
    SELECT o.id
    FROM operations o
    WHERE ((o.status = 'pending' AND o.run_after <= now())
           OR (o.status = 'running' AND o.lease_expires_at < now()))
      -- Not one the claiming worker is still running: its lease lapsed (the database was
      -- unreachable past it) but its next heartbeat renews it; reclaiming it would run two
      -- attempts side by side in one worker.
      AND o.id <> ALL($3::uuid[])
      -- A bank with a running operation (live or expired) gets no second one; an expired one
      -- is itself a candidate, so it is reclaimed before its bank's pending work is started.
      AND NOT EXISTS (
          SELECT 1 FROM operations r
          WHERE r.bank_id = o.bank_id AND r.status = 'running' AND r.id <> o.id)
    ORDER BY o.priority DESC, o.run_after, o.created_at
    LIMIT 1
    FOR UPDATE SKIP LOCKED
)
UPDATE operations o
SET status = 'running',
    worker_id = $1,
    attempt = o.attempt + 1,
    lease_expires_at = now() + make_interval(secs => $2),
    started_at = COALESCE(o.started_at, now()),
    error = NULL
FROM candidate
WHERE o.id = candidate.id
RETURNING o.id, o.bank_id, o.worker_id, o.attempt, o.scope_filter, o.max_attempts, o.status,
          o.interruptions
"""


async def claim(
    pool: asyncpg.Pool,
    worker_id: str,
    lease_s: float,
    running: Sequence[uuid.UUID] = (),
) -> Lease | None:
    """Claim one due operation (or one whose lease expired, except those in ``running``, which
    the caller is still running); None when there is none."""
    for _ in range(3):
        try:
            row = await pool.fetchrow(CLAIM, worker_id, lease_s, list(running))
        except asyncpg.UniqueViolationError:
            # Another worker started a running operation on the same bank between our
            # candidate scan and the update; the index kept the promise, try another.
            continue
        return None if row is None else _lease_from_row(row)
    return None


# A worker that stopped renewing its lease may be frozen in the middle of a transaction (between
# Execute and Sync no server timeout applies), holding its share lock on the operation row, so
# the claim's SKIP LOCKED would never see the row. Its sessions carry its worker id as
# application_name; ending them rolls back whatever it had not committed and frees the row.
TERMINATE_STALLED = """
SELECT a.pid, a.application_name, pg_terminate_backend(a.pid) AS terminated
FROM pg_stat_activity a
WHERE a.datname = current_database()
  AND a.pid <> pg_backend_pid()
  AND a.application_name <> $2
  AND a.application_name IN (
      SELECT o.worker_id FROM operations o
      WHERE o.status = 'running'
        AND o.lease_expires_at < now() - make_interval(secs => $1))
"""


async def terminate_stalled_workers(
    pool: asyncpg.Pool, own_worker_id: str, grace_s: float
) -> list[str]:
    """End the database sessions of workers whose lease expired over ``grace_s`` ago.

    Returns the worker ids fenced. Best effort: without the right to signal those sessions,
    the operation is reclaimed once the stalled worker resumes (and then stops) or dies.
    """
    try:
        rows = await pool.fetch(TERMINATE_STALLED, grace_s, own_worker_id)
    except asyncpg.InsufficientPrivilegeError:
        return []
    return sorted({r["application_name"] for r in rows if r["terminated"]})


# --- fenced writes --------------------------------------------------------------------------

# Every fenced write of an operation row: consolidation/sql/consolidation_holds_lease_v1.sql is the
# one definition of the fence, shared with the apply of a pass and the wave's markers (store.py).
FENCE = "id = $1 AND consolidation_holds_lease_v1($1, $2, $3)"

HEARTBEAT = f"""
UPDATE operations SET lease_expires_at = now() + make_interval(secs => $4)
WHERE {FENCE}
RETURNING cancel_requested_at IS NOT NULL AS cancel_requested
"""


def _fence_args(lease: Lease) -> tuple[uuid.UUID, str, int]:
    return lease.operation_id, lease.worker_id, lease.attempt


async def heartbeat(pool: asyncpg.Pool | asyncpg.Connection, lease: Lease, lease_s: float) -> bool:
    """Extend the lease; returns whether a cancel was requested. Raises LeaseLost."""
    row = await pool.fetchrow(HEARTBEAT, *_fence_args(lease), lease_s)
    if row is None:
        raise LeaseLost(f"operation {lease.operation_id} attempt {lease.attempt} is no longer ours")
    return bool(row["cancel_requested"])


PROGRESS = f"""
UPDATE operations SET progress = $4 WHERE {FENCE}
RETURNING cancel_requested_at IS NOT NULL AS cancel_requested
"""


async def record_progress(
    pool: asyncpg.Pool | asyncpg.Connection, lease: Lease, progress: dict[str, Any]
) -> bool:
    """Store progress; returns whether a cancel was requested. Raises LeaseLost."""
    row = await pool.fetchrow(PROGRESS, *_fence_args(lease), progress)
    if row is None:
        raise LeaseLost(f"operation {lease.operation_id} attempt {lease.attempt} is no longer ours")
    return bool(row["cancel_requested"])


FINISH = f"""
UPDATE operations
SET status = $4, result = $5, error = $6, finished_at = now(), lease_expires_at = NULL
WHERE {FENCE}
RETURNING id
"""


async def finish(
    pool: asyncpg.Pool,
    lease: Lease,
    status: str,
    *,
    result: dict[str, Any] | None = None,
    error: str | None = None,
) -> None:
    """Record the final status of an attempt. Raises LeaseLost when it is no longer ours."""
    if status not in TERMINAL:
        raise ValueError(f"not a final status: {status}")
    if await pool.fetchval(FINISH, *_fence_args(lease), status, result, error) is None:
        raise LeaseLost(f"operation {lease.operation_id} attempt {lease.attempt} is no longer ours")


# Back to pending for a later attempt. If a newer unscoped operation is already pending for the
# bank, that one will cover the same memories, so this one ends instead of violating the index.
RETRY = f"""
WITH me AS (SELECT id, bank_id, scope_filter FROM operations WHERE {FENCE} FOR UPDATE),
     newer AS (
         SELECT o.id FROM operations o, me
         WHERE o.bank_id = me.bank_id AND o.status = 'pending' AND o.scope_filter IS NULL
           AND me.scope_filter IS NULL)
UPDATE operations o
SET status = CASE WHEN EXISTS (SELECT 1 FROM newer) THEN $7 ELSE 'pending' END,
    attempt = o.attempt - CASE WHEN $4 THEN 1 ELSE 0 END,
    interruptions = o.interruptions + CASE WHEN $9 THEN 1 ELSE 0 END,
    run_after = now() + make_interval(secs => $5),
    error = CASE WHEN EXISTS (SELECT 1 FROM newer)
                 THEN $6 || ' (superseded by pending operation '
                      || (SELECT id FROM newer)::text || ')'
                 ELSE $6 END,
    result = $8,
    worker_id = NULL, lease_expires_at = NULL,
    finished_at = CASE WHEN EXISTS (SELECT 1 FROM newer) THEN now() END
FROM me
WHERE o.id = me.id
RETURNING o.status
"""


async def release(
    pool: asyncpg.Pool,
    lease: Lease,
    *,
    delay_s: float,
    error: str | None,
    refund_attempt: bool,
    result: dict[str, Any] | None = None,
    interrupted: bool = False,
) -> str:
    """Hand an attempt back to ``pending`` (after ``delay_s``); returns the new status.

    ``refund_attempt`` (graceful shutdown, database outage) does not spend an attempt;
    ``interrupted`` counts a database outage in ``interruptions``. Raises LeaseLost.
    """
    superseded_status = "cancelled" if refund_attempt else "failed"
    status = await pool.fetchval(
        RETRY,
        *_fence_args(lease),
        refund_attempt,
        delay_s,
        error or "",
        superseded_status,
        result,
        interrupted,
    )
    if status is None:
        raise LeaseLost(f"operation {lease.operation_id} attempt {lease.attempt} is no longer ours")
    return str(status)


# --- cancel and read ------------------------------------------------------------------------

CANCEL = f"""
UPDATE operations
SET status = CASE WHEN status = 'pending' THEN 'cancelled' ELSE status END,
    finished_at = CASE WHEN status = 'pending' THEN now() ELSE finished_at END,
    cancel_requested_at = COALESCE(cancel_requested_at, now())
WHERE id = $1 AND status IN ('pending', 'running')
RETURNING {OPERATION_COLUMNS}
"""


async def request_cancel(pool: asyncpg.Pool, operation_id: uuid.UUID) -> Operation:
    """Cancel a pending operation at once, or ask the running one's worker to stop.

    A finished operation is returned unchanged. Raises NotFound.
    """
    row = await pool.fetchrow(CANCEL, operation_id)
    if row is None:
        return await get_operation(pool, operation_id)
    op = _operation(row)
    if op.status == "running":
        await pool.execute("SELECT pg_notify($1, $2)", NOTIFY_CANCEL, str(operation_id))
    return op


async def get_operation(
    pool: asyncpg.Pool | asyncpg.Connection, operation_id: uuid.UUID
) -> Operation:
    row = await pool.fetchrow(
        f"SELECT {OPERATION_COLUMNS} FROM operations WHERE id = $1", operation_id
    )
    if row is None:
        raise NotFound(f"operation {operation_id} does not exist")
    return _operation(row)


# Newest first, keyset-paginated on (created_at, id); migration 0007's indexes serve every filter.
LIST_OPERATIONS = f"""
SELECT {OPERATION_COLUMNS} FROM operations
WHERE ($1::text IS NULL OR bank_id = $1)
  AND ($2::text IS NULL OR status = $2)
  AND ($3::timestamptz IS NULL OR (created_at, id) < ($3::timestamptz, $4::uuid))
ORDER BY created_at DESC, id DESC
LIMIT $5
"""


async def list_operations(
    pool: asyncpg.Pool | asyncpg.Connection,
    *,
    bank_id: str | None = None,
    status: str | None = None,
    before: tuple[datetime, uuid.UUID] | None = None,
    limit: int = 100,
) -> list[Operation]:
    """Operations, newest first, optionally of one bank and/or in one status; ``before`` is the
    (created_at, id) of the previous page's last operation."""
    created_at, last_id = before if before is not None else (None, None)
    rows = await pool.fetch(LIST_OPERATIONS, bank_id, status, created_at, last_id, limit)
    return [_operation(r) for r in rows]


def _operation(row: asyncpg.Record) -> Operation:
    return Operation(**{k: row[k] for k in Operation.__dataclass_fields__})
