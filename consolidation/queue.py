"""Operation state: submit, claim, heartbeat, fence, finish, cancel. The only module that writes
``operations``.

Every write an operation makes after it is claimed is fenced on (id, worker_id, attempt,
status='running'), so a worker that lost its lease can never write again (River's rule).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from consolidation.errors import LeaseLost, NotCancellable, NotFound
from consolidation.scopes import Scope, scopes_from_db

NOTIFY_SUBMIT = "consolidation_submit"
NOTIFY_CANCEL = "consolidation_cancel"

TERMINAL = frozenset({"completed", "failed", "cancelled"})

# What an operation does: consolidate pending memories, or forget memories asked to be forgotten.
CONSOLIDATE = "consolidate"
FORGET = "forget"
# A takeover after an expired lease cannot tell a worker that died of the operation's own work
# (killed for its memory, a crash) from one that lost its database past the lease (an outage, a
# read-only spell, a partition) or was restarted: the first MAX_FREE_RECLAIMS of an operation are
# taken to be the latter and spend no attempt; later ones do, so an operation that keeps killing
# its worker still ends (docs/reliability.md).
MAX_FREE_RECLAIMS = 3
# An attempt that saw the database unavailable is handed back without spending an attempt at most
# this many times (reclaims that spent none included); past that it spends attempts like any error.
MAX_INTERRUPTIONS = 20

# Forgetting goes before any consolidation (users' priorities are within ±1000): a claim takes it
# first, and a running consolidation of its bank yields to it at the end of its slice.
FORGET_PRIORITY = 10_000


@dataclass(frozen=True)
class Lease:
    """The fence of one claimed attempt of an operation."""

    operation_id: uuid.UUID
    bank_id: str
    worker_id: str
    attempt: int
    scope_filter: tuple[Scope, ...] | None
    max_attempts: int
    # Earlier attempts handed back without spending an attempt because the database was
    # unavailable, or taken over after their lease expired (see MAX_FREE_RECLAIMS).
    interruptions: int = 0
    kind: str = CONSOLIDATE
    # The result stored when an earlier slice of this operation yielded its slot (fairness): this
    # attempt continues it, so the operation reports one result until its bank is done.
    resumed: Mapping[str, Any] | None = None
    # This attempt took the operation over from a worker whose lease had expired.
    reclaimed: bool = False


@dataclass(frozen=True)
class Operation:
    """An operation row as the API and CLI report it."""

    id: uuid.UUID
    bank_id: str
    kind: str
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
    run_after: datetime
    # The latest attempt's error (or why it was handed back); kept while the next one waits.
    last_error: str | None
    last_error_at: datetime | None

    def to_json(self) -> dict[str, Any]:
        return {
            "operation_id": str(self.id),
            "bank_id": self.bank_id,
            "kind": self.kind,
            "status": self.status,
            "attempt": self.attempt,
            "progress": self.progress,
            "result": self.result,
            "error": self.error,
            "last_error": self.last_error,
            "last_error_at": _iso(self.last_error_at),
            "run_after": _iso(self.run_after),
            "created_at": _iso(self.created_at),
            "started_at": _iso(self.started_at),
            "finished_at": _iso(self.finished_at),
        }


def _iso(value: datetime | None) -> str | None:
    return value.isoformat().replace("+00:00", "Z") if value else None


def _scope_filter_json(scopes: Sequence[Scope] | None) -> list[list[str]] | None:
    return None if scopes is None else [list(s) for s in scopes]


def _resumed(result: object) -> dict[str, Any] | None:
    """The result an attempt continues: one an earlier attempt handed back with its progress
    (a slice's end, a token budget's pause)."""
    if isinstance(result, dict) and (result.get("slices") or result.get("pauses")):
        return result
    return None


def _lease_from_row(row: asyncpg.Record) -> Lease:
    raw = row["scope_filter"]
    result = row["result"]
    return Lease(
        operation_id=row["id"],
        bank_id=row["bank_id"],
        worker_id=row["worker_id"],
        attempt=row["attempt"],
        scope_filter=None if raw is None else scopes_from_db(raw),
        max_attempts=row["max_attempts"],
        interruptions=row["interruptions"],
        kind=row["kind"],
        resumed=_resumed(result),
        reclaimed=row.get("reclaimed", False),
    )


OPERATION_COLUMNS = """
id, bank_id, kind, status, scope_filter, priority, attempt, max_attempts, worker_id, progress, result,
error, cancel_requested_at, created_at, started_at, finished_at, run_after, last_error,
last_error_at
"""

# --- submit ---------------------------------------------------------------------------------

SUBMIT = f"""
WITH bank AS (
    INSERT INTO banks (id) VALUES ($2) ON CONFLICT (id) DO NOTHING
)
INSERT INTO operations (id, bank_id, status, scope_filter, priority, max_attempts)
VALUES ($1, $2, 'pending', $3, $4, $5)
ON CONFLICT (bank_id) WHERE status = 'pending' AND scope_filter IS NULL AND kind = 'consolidate'
DO NOTHING
RETURNING {OPERATION_COLUMNS}
"""

PENDING_UNSCOPED = f"""
SELECT {OPERATION_COLUMNS} FROM operations
WHERE bank_id = $1 AND status = 'pending' AND scope_filter IS NULL AND kind = 'consolidate'
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


SUBMIT_FORGET = f"""
INSERT INTO operations (id, bank_id, kind, status, priority, max_attempts)
VALUES ($1, $2, 'forget', 'pending', {FORGET_PRIORITY}, $3)
ON CONFLICT (bank_id) WHERE status = 'pending' AND kind = 'forget' DO NOTHING
RETURNING {OPERATION_COLUMNS}
"""

PENDING_FORGET = f"""
SELECT {OPERATION_COLUMNS} FROM operations
WHERE bank_id = $1 AND status = 'pending' AND kind = 'forget'
"""


async def submit_forget(
    conn: asyncpg.Pool | asyncpg.Connection, bank_id: str, *, max_attempts: int = 5
) -> Operation:
    """Enqueue the forget operation of an existing bank, or join the one already pending.

    In the caller's transaction when ``conn`` is a connection inside one: the wake-up is sent when
    it commits.
    """
    for _ in range(3):
        row = await conn.fetchrow(SUBMIT_FORGET, uuid.uuid4(), bank_id, max_attempts)
        if row is not None:
            await conn.execute("SELECT pg_notify($1, $2)", NOTIFY_SUBMIT, bank_id)
            return _operation(row)
        existing = await conn.fetchrow(PENDING_FORGET, bank_id)
        if existing is not None:  # else it was claimed in between: try again
            return _operation(existing)
    raise RuntimeError("could not submit a forget operation: the pending one kept changing")


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

# A running operation whose lease expired and whose takeover would have to spend an attempt it
# does not have (see MAX_FREE_RECLAIMS).
# ``{free_reclaims}`` and ``{free_interruptions}`` name the parameters holding the bounds.
_RECLAIM_EXHAUSTED = """
o.status = 'running' AND o.lease_expires_at < now()
AND (o.reclaims >= {free_reclaims} OR o.interruptions >= {free_interruptions})
AND o.attempt >= o.max_attempts
"""

# Pending operations that are due, and running ones whose lease expired (their worker died or
# lost its database). SKIP LOCKED lets replicas claim side by side; the unique index on running
# operations makes a second running operation for a bank impossible even if two claims raced.
#
# A pending operation starts its next attempt. A takeover keeps the attempt number while it is
# free (see MAX_FREE_RECLAIMS): the fence (id, worker_id, attempt) still changes, because the
# expired owner is another worker, or this worker once it has stopped running it (``$3``).
CLAIM = f"""
WITH candidate AS (
    SELECT o.id, o.status AS was,
           o.status = 'running' AND o.reclaims < $4 AND o.interruptions < $5 AS free
    FROM operations o
    WHERE ((o.status = 'pending' AND o.run_after <= now())
           OR (o.status = 'running' AND o.lease_expires_at < now()))
      -- Not one the claiming worker is still running: its lease lapsed (the database was
      -- unreachable past it) but its next heartbeat renews it; reclaiming it would run two
      -- attempts side by side in one worker.
      AND o.id <> ALL($3::uuid[])
      -- Not one with no attempt left to take over with: end_exhausted_reclaims ends it.
      AND NOT ({_RECLAIM_EXHAUSTED.format(free_reclaims="$4", free_interruptions="$5")})
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
    attempt = o.attempt + CASE WHEN candidate.free THEN 0 ELSE 1 END,
    reclaims = o.reclaims + CASE WHEN candidate.was = 'running' THEN 1 ELSE 0 END,
    interruptions = o.interruptions + CASE WHEN candidate.free THEN 1 ELSE 0 END,
    last_error = CASE WHEN candidate.was = 'running'
                      THEN 'its worker ' || o.worker_id || ' stopped renewing the lease (it '
                           || 'died, or lost the database past the lease); taken over by '
                           || $1 || CASE WHEN candidate.free
                                         THEN ' without spending an attempt'
                                         ELSE ', spending an attempt' END
                      ELSE o.last_error END,
    last_error_at = CASE WHEN candidate.was = 'running' THEN now() ELSE o.last_error_at END,
    lease_expires_at = now() + make_interval(secs => $2),
    started_at = COALESCE(o.started_at, now()),
    error = NULL
FROM candidate
WHERE o.id = candidate.id
RETURNING o.id, o.bank_id, o.worker_id, o.attempt, o.scope_filter, o.max_attempts, o.status,
          o.interruptions, o.kind, o.result, candidate.was = 'running' AS reclaimed
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
            row = await pool.fetchrow(
                CLAIM, worker_id, lease_s, list(running), MAX_FREE_RECLAIMS, MAX_INTERRUPTIONS
            )
        except asyncpg.UniqueViolationError:
            # Another worker started a running operation on the same bank between our
            # candidate scan and the update; the index kept the promise, try another.
            continue
        return None if row is None else _lease_from_row(row)
    return None


END_EXHAUSTED = f"""
WITH exhausted AS (
    SELECT o.id,
           'its worker ' || o.worker_id || ' stopped renewing the lease (it died, or lost the '
           || 'database past the lease) once more after ' || o.reclaims::text
           || ' takeovers and ' || o.interruptions::text || ' interruptions; no attempts left ('
           || o.attempt::text || ' of ' || o.max_attempts::text || ')' AS message
    FROM operations o
    WHERE {_RECLAIM_EXHAUSTED.format(free_reclaims="$2", free_interruptions="$3")}
      AND o.id <> ALL($1::uuid[])
    FOR UPDATE SKIP LOCKED
)
UPDATE operations o
SET status = 'failed', finished_at = now(), lease_expires_at = NULL,
    reclaims = o.reclaims + 1,
    error = exhausted.message, last_error = exhausted.message, last_error_at = now()
FROM exhausted
WHERE o.id = exhausted.id
RETURNING o.id, o.bank_id, o.error
"""


@dataclass(frozen=True)
class Exhausted:
    """An operation ended ``failed`` because taking it over would have spent an attempt it did
    not have."""

    operation_id: uuid.UUID
    bank_id: str
    error: str


async def end_exhausted_reclaims(
    pool: asyncpg.Pool, running: Sequence[uuid.UUID] = ()
) -> list[Exhausted]:
    """End ``failed`` every expired operation (except those in ``running``, which the caller is
    still running) that has used its free takeovers (or interruptions) and all its attempts;
    :func:`claim` never takes those."""
    rows = await pool.fetch(END_EXHAUSTED, list(running), MAX_FREE_RECLAIMS, MAX_INTERRUPTIONS)
    return [Exhausted(r["id"], r["bank_id"], r["error"]) for r in rows]


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

# The fence (DESIGN §4) of a write to the operation row itself, checked on the row the write
# locks: under READ COMMITTED an UPDATE (or SELECT ... FOR UPDATE) that waited behind a concurrent
# writer checks these conditions again on the newest version, so a write that waited behind a
# reclaim writes nothing, and a reclaim waits until the write has committed. The same conditions
# as consolidation_holds_lease_v1 (the fence of the writes to other tables: the apply of a pass,
# the wave's markers), but not that function: its FOR SHARE lock, taken first, would then have to
# become the UPDATE's, and two such writes at once (a worker's heartbeat and its progress report)
# each waited for the other's share lock: a deadlock that failed the operation.
FENCE = "id = $1 AND worker_id = $2 AND attempt = $3 AND status = 'running'"

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
SET status = $4, result = $5, error = $6, finished_at = now(), lease_expires_at = NULL,
    last_error = CASE WHEN $4 = 'failed' THEN $6 ELSE last_error END,
    last_error_at = CASE WHEN $4 = 'failed' THEN now() ELSE last_error_at END
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
WITH me AS (SELECT id, bank_id, scope_filter, kind FROM operations WHERE {FENCE} FOR UPDATE),
     newer AS (
         SELECT o.id FROM operations o, me
         WHERE o.bank_id = me.bank_id AND o.status = 'pending' AND o.scope_filter IS NULL
           AND me.scope_filter IS NULL AND o.kind = me.kind),
     -- A superseded forget's memories are the newer forget's to delete: a repeated DELETE of
     -- one of them answers that operation.
     handed_over AS (
         UPDATE forgotten_memories t SET operation_id = newer.id
         FROM me, newer
         WHERE t.operation_id = me.id AND t.completed_at IS NULL)
UPDATE operations o
SET status = CASE WHEN EXISTS (SELECT 1 FROM newer) THEN $7 ELSE 'pending' END,
    attempt = o.attempt - CASE WHEN $4 THEN 1 ELSE 0 END,
    interruptions = o.interruptions + CASE WHEN $9 THEN 1 ELSE 0 END,
    run_after = now() + make_interval(secs => $5),
    error = CASE WHEN EXISTS (SELECT 1 FROM newer)
                 THEN $6 || ' (superseded by pending operation '
                      || (SELECT id FROM newer)::text || ')'
                 ELSE $6 END,
    -- A shutdown's hand-back is no error: the one before it stays visible.
    last_error = CASE WHEN $6 = '' OR ($4 AND NOT $9) THEN o.last_error ELSE $6 END,
    last_error_at = CASE WHEN $6 = '' OR ($4 AND NOT $9) THEN o.last_error_at ELSE now() END,
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


# --- fairness: yielding a slot ----------------------------------------------------------------

# Operations a worker slot would go to if this one gave its slot up: due pending operations of
# banks with nothing running, and its own bank's that come first (a forget, a higher priority).
OTHERS_WAITING = """
SELECT EXISTS (
    SELECT 1 FROM operations o
    WHERE o.status = 'pending' AND o.run_after <= now() AND o.id <> $1
      AND CASE WHEN o.bank_id = $2
               THEN o.priority > (SELECT m.priority FROM operations m WHERE m.id = $1)
               ELSE NOT EXISTS (SELECT 1 FROM operations r
                                WHERE r.bank_id = o.bank_id AND r.status = 'running')
          END)
"""


async def others_waiting(pool: asyncpg.Pool, lease: Lease) -> bool:
    """Whether an operation other than ``lease``'s waits for a slot that this one could give."""
    return bool(await pool.fetchval(OTHERS_WAITING, lease.operation_id, lease.bank_id))


YIELDING = f"""
SELECT scope_filter IS NULL AND kind = 'consolidate' AS unscoped,
       cancel_requested_at IS NOT NULL AS cancel_requested
FROM operations WHERE {FENCE} FOR UPDATE
"""

# A newer unscoped operation submitted while this one ran covers the same memories: this one,
# which carries the progress so far, continues and absorbs it (its priority, if higher).
ABSORB_NEWER = """
UPDATE operations
SET status = 'cancelled', finished_at = now(),
    error = 'superseded by operation ' || $2::text || ', which continues its bank''s consolidation'
WHERE bank_id = $1 AND status = 'pending' AND scope_filter IS NULL AND kind = 'consolidate'
  AND id <> $2
RETURNING priority
"""

YIELD = f"""
UPDATE operations
SET status = CASE WHEN cancel_requested_at IS NULL THEN 'pending' ELSE 'cancelled' END,
    finished_at = CASE WHEN cancel_requested_at IS NULL THEN NULL ELSE now() END,
    error = CASE WHEN cancel_requested_at IS NULL THEN $7::text ELSE 'cancelled on request' END,
    last_error = CASE WHEN $7::text IS NULL THEN last_error ELSE $7::text END,
    last_error_at = CASE WHEN $7::text IS NULL THEN last_error_at ELSE now() END,
    attempt = attempt - 1,
    priority = GREATEST(priority, $4),
    run_after = now() + make_interval(secs => $6),
    result = $5,
    worker_id = NULL, lease_expires_at = NULL
WHERE {FENCE}
RETURNING status
"""


async def yield_operation(
    pool: asyncpg.Pool,
    lease: Lease,
    result: dict[str, Any],
    *,
    delay_s: float = 0.0,
    note: str | None = None,
) -> str:
    """Hand a running operation back to ``pending`` behind the operations that are due now (or
    due after ``delay_s``), same id, no attempt spent, ``result`` kept for its next attempt to
    continue; ``note`` (why it waits) is its ``error`` and ``last_error`` meanwhile; ``cancelled``
    if a cancel was asked meanwhile. Returns the new status. Raises LeaseLost."""
    async with pool.acquire() as conn, conn.transaction():
        me = await conn.fetchrow(YIELDING, *_fence_args(lease))
        if me is None:
            raise LeaseLost(
                f"operation {lease.operation_id} attempt {lease.attempt} is no longer ours"
            )
        absorbed: list[int] = []
        if me["unscoped"] and not me["cancel_requested"]:
            rows = await conn.fetch(ABSORB_NEWER, lease.bank_id, lease.operation_id)
            absorbed = [r["priority"] for r in rows]
        status = await conn.fetchval(
            YIELD,
            *_fence_args(lease),
            max(absorbed, default=-(2**31)),
            result,
            delay_s,
            note,
        )
    return str(status)


# --- the sweeper -------------------------------------------------------------------------------

# Arbitrary constant: one sweeper of the fleet at a time (a transaction-level try-lock).
SWEEP_LOCK_KEY = 0x73776570  # "swep"
MAX_SWEEP_BACKOFF_S = 600.0

# Every bank with pending memories and no pending or running operation gets an unscoped
# consolidation; every bank with memories asked to be forgotten and no pending or running forget
# gets a forget. A bank whose latest operations of that kind failed waits
# backoff × 2^(failures in a row − 1) after the last failure (at most MAX_SWEEP_BACKOFF_S).
SWEEP = f"""
WITH candidates AS (
    SELECT b.id AS bank_id, k.kind
    FROM banks b
    CROSS JOIN (VALUES ('consolidate'), ('forget')) AS k(kind)
    LEFT JOIN LATERAL (
        SELECT count(*) AS failures, max(r.finished_at) AS last_failed_at
        FROM (SELECT o.finished_at,
                     bool_and(o.status = 'failed')
                         OVER (ORDER BY o.created_at DESC ROWS UNBOUNDED PRECEDING) AS streak
              FROM operations o
              WHERE o.bank_id = b.id AND o.kind = k.kind
              ORDER BY o.created_at DESC
              LIMIT 16) AS r
        WHERE r.streak
    ) AS f ON true
    WHERE CASE k.kind
            WHEN 'consolidate' THEN
                EXISTS (SELECT 1 FROM memories m
                        WHERE m.bank_id = b.id AND m.consolidated_at IS NULL
                          AND m.consolidation_failed_at IS NULL AND m.forgotten_at IS NULL)
                AND NOT EXISTS (SELECT 1 FROM operations o
                                WHERE o.bank_id = b.id AND o.status IN ('pending', 'running'))
            ELSE
                EXISTS (SELECT 1 FROM memories m
                        WHERE m.bank_id = b.id AND m.forgotten_at IS NOT NULL)
                AND NOT EXISTS (SELECT 1 FROM operations o
                                WHERE o.bank_id = b.id AND o.kind = 'forget'
                                  AND o.status IN ('pending', 'running'))
          END
      AND (f.failures = 0
           OR f.last_failed_at + make_interval(
                  secs => least($1::float8 * power(2::float8, f.failures - 1),
                                {MAX_SWEEP_BACKOFF_S}))
              <= now())
), inserted AS (
    INSERT INTO operations (id, bank_id, kind, status, priority, max_attempts)
    SELECT gen_random_uuid(), c.bank_id, c.kind, 'pending',
           CASE WHEN c.kind = 'forget' THEN {FORGET_PRIORITY} ELSE 0 END, $2
    FROM candidates c
    ON CONFLICT DO NOTHING
    RETURNING id, bank_id, kind
), tombstones AS (
    -- A repeated DELETE of a memory still waiting answers the operation that will forget it.
    UPDATE forgotten_memories t SET operation_id = i.id
    FROM inserted i
    WHERE i.kind = 'forget' AND t.bank_id = i.bank_id AND t.completed_at IS NULL
)
SELECT id, bank_id, kind FROM inserted ORDER BY bank_id, kind
"""


@dataclass(frozen=True)
class Swept:
    operation_id: uuid.UUID
    bank_id: str
    kind: str


async def sweep(pool: asyncpg.Pool, *, retry_backoff_s: float, max_attempts: int) -> list[Swept]:
    """Enqueue what nobody triggered (see SWEEP), unless another worker is sweeping right now;
    returns the operations enqueued."""
    async with pool.acquire() as conn, conn.transaction():
        if not await conn.fetchval("SELECT pg_try_advisory_xact_lock($1)", SWEEP_LOCK_KEY):
            return []
        rows = await conn.fetch(SWEEP, retry_backoff_s, max_attempts)
        for row in rows:
            await conn.execute("SELECT pg_notify($1, $2)", NOTIFY_SUBMIT, row["bank_id"])
    return [Swept(r["id"], r["bank_id"], r["kind"]) for r in rows]


# --- the queue, fleet-wide (/metrics) ----------------------------------------------------------


@dataclass(frozen=True)
class QueueCounts:
    """Live operations of every bank, by kind: pending (``due`` of them may start now), running
    (``expired`` of them: their worker stopped renewing the lease)."""

    kind: str
    pending: int
    due: int
    running: int
    expired: int


# Live operations only, through the partial indexes on pending and running operations; finished
# ones are counted by each process as they end (consolidation_operations_total).
QUEUE_COUNTS = """
SELECT kind,
       count(*) FILTER (WHERE status = 'pending') AS pending,
       count(*) FILTER (WHERE status = 'pending' AND run_after <= now()) AS due,
       count(*) FILTER (WHERE status = 'running') AS running,
       count(*) FILTER (WHERE status = 'running' AND lease_expires_at < now()) AS expired
FROM operations
WHERE status IN ('pending', 'running')
GROUP BY kind
"""


async def queue_counts(pool: asyncpg.Pool | asyncpg.Connection) -> list[QueueCounts]:
    rows = await pool.fetch(QUEUE_COUNTS)
    counts = {r["kind"]: QueueCounts(**dict(r)) for r in rows}
    return [counts.get(kind, QueueCounts(kind, 0, 0, 0, 0)) for kind in (CONSOLIDATE, FORGET)]


# --- deleting a bank ---------------------------------------------------------------------------

CANCEL_BANK = """
WITH live AS (
    SELECT id, status FROM operations
    WHERE bank_id = $1 AND status IN ('pending', 'running')
    FOR UPDATE
)
UPDATE operations o
SET status = 'cancelled', finished_at = now(), lease_expires_at = NULL,
    cancel_requested_at = COALESCE(o.cancel_requested_at, now()),
    error = 'cancelled: its bank was deleted'
FROM live
WHERE o.id = live.id
RETURNING o.id, live.status AS was
"""


async def cancel_bank_operations(conn: asyncpg.Connection, bank_id: str) -> int:
    """Cancel every pending and running operation of a bank, in the caller's transaction; the
    workers running them are told when it commits (and are fenced out either way)."""
    rows = await conn.fetch(CANCEL_BANK, bank_id)
    for row in rows:
        if row["was"] == "running":
            await conn.execute("SELECT pg_notify($1, $2)", NOTIFY_CANCEL, str(row["id"]))
    return len(rows)


# --- cancel and read ------------------------------------------------------------------------

CANCEL = f"""
UPDATE operations
SET status = CASE WHEN status = 'pending' THEN 'cancelled' ELSE status END,
    finished_at = CASE WHEN status = 'pending' THEN now() ELSE finished_at END,
    cancel_requested_at = COALESCE(cancel_requested_at, now())
WHERE id = $1 AND status IN ('pending', 'running') AND kind = 'consolidate'
RETURNING {OPERATION_COLUMNS}
"""


async def request_cancel(pool: asyncpg.Pool, operation_id: uuid.UUID) -> Operation:
    """Cancel a pending operation at once, or ask the running one's worker to stop.

    A finished operation is returned unchanged. Raises NotFound, and NotCancellable for a
    forget operation that has not finished.
    """
    row = await pool.fetchrow(CANCEL, operation_id)
    if row is None:
        op = await get_operation(pool, operation_id)
        if op.kind == FORGET and op.status not in TERMINAL:
            raise NotCancellable(
                f"operation {operation_id} forgets memories and cannot be cancelled; "
                "deleting the bank is the only way to stop it"
            )
        return op
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
