"""One claimed attempt from start to recorded end: the lease kept alive beside the run of the
operation's kind, then the end :func:`consolidation.engine.outcome.decide_end` chose, written
fenced and shielded."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import TracebackType

import asyncpg
import structlog

from consolidation import budgets, db, metrics, queue
from consolidation.engine.consolidate import ConsolidateRun
from consolidation.engine.context import Run, RunContext
from consolidation.engine.forget import ForgetRun
from consolidation.engine.outcome import EndKind, decide_end, describe
from consolidation.engine.stop import StopReason, StopSignal
from consolidation.engine.summary import ProgressCallback, RunSummary
from consolidation.errors import LeaseLost
from consolidation.llm.client import Consolidator
from consolidation.llm.embeddings import Embedder
from consolidation.queue import Lease
from consolidation.settings import Settings

log = structlog.get_logger("consolidation.engine")

# The run of each kind of operation (``operations.kind``).
RUN_KINDS: Mapping[str, Callable[[RunContext], Run]] = {
    queue.CONSOLIDATE: ConsolidateRun,
    queue.FORGET: ForgetRun,
}

# The final status write is retried while the database is unreachable, for at most one lease:
# after that the lease has run out and another worker reclaims the operation anyway.
END_WRITE_RETRY_S = (0.1, 2.0)


@dataclass(frozen=True)
class OperationEnd:
    """How an attempt ended: the status now stored (or ``lost`` when it was not ours to write)."""

    status: str
    summary: RunSummary
    error: str | None = None


class LeaseKeeper:
    """Extends the lease every lease/3 while the ``async with`` block runs; a cancel request
    seen in the heartbeat, or a lost lease, is set on ``stop``."""

    def __init__(self, pool: asyncpg.Pool, lease: Lease, lease_s: float, stop: StopSignal):
        self.pool = pool
        self.lease = lease
        self.lease_s = lease_s
        self.stop = stop
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> LeaseKeeper:
        self._task = asyncio.create_task(self._keep())
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    async def _keep(self) -> None:
        lease = self.lease
        while True:
            await asyncio.sleep(self.lease_s / 3)
            try:
                if await queue.heartbeat(self.pool, lease, self.lease_s):
                    self.stop.set(StopReason.CANCEL)
            except LeaseLost:
                log.warning(
                    "lease_lost", operation_id=str(lease.operation_id), attempt=lease.attempt
                )
                self.stop.set(StopReason.LEASE_LOST)
                return
            except Exception as exc:
                # Any other failure (a dropped connection surfaces as OSError, PostgresError,
                # InterfaceError or InternalClientError) is the database's, not the lease's: it
                # may be back before the lease runs out, so keep trying rather than let it lapse.
                log.warning(
                    "heartbeat_failed", operation_id=str(lease.operation_id), error=repr(exc)
                )


async def run_operation(
    pool: asyncpg.Pool,
    lease: Lease,
    llm: Consolidator,
    settings: Settings,
    *,
    stop: StopSignal | None = None,
    on_progress: ProgressCallback | None = None,
    embedder: Embedder | None = None,
    slice_s: float | None = None,
) -> OperationEnd:
    """Run one claimed attempt to its end and record the final status (shielded, fenced).

    completed → ``completed``; cancel → ``cancelled``; shutdown → back to ``pending`` without
    spending an attempt; after ``slice_s`` with other operations waiting → back to ``pending``
    behind them, no attempt spent, progress kept; its bank's token budget used → back to
    ``pending`` until the window frees enough, no attempt spent, progress kept; LLM
    configuration error → ``failed`` at once; other errors → back to ``pending`` with backoff
    until ``max_attempts``, then ``failed``; lost lease → no write. With an ``embedder``, recall is hybrid and observations are stored with
    their vectors (the database must have them: embeddings.require_vector_storage); its faults
    are the LLM's. The lease's kind picks the run (:data:`RUN_KINDS`).
    """
    stop = stop or StopSignal()
    context = RunContext(pool, lease, llm, settings, stop, on_progress, embedder, slice_s)
    run = RUN_KINDS.get(lease.kind, ConsolidateRun)(context)
    bound = log.bind(operation_id=str(lease.operation_id), bank_id=lease.bank_id)
    bound.info("operation_started", attempt=lease.attempt, scope_filter=lease.scope_filter)
    inner = asyncio.create_task(run.run(), name=f"operation-{lease.operation_id}")
    stop.attach(inner)
    outer_cancelled = False
    async with LeaseKeeper(pool, lease, settings.lease_s, stop):
        try:
            await asyncio.wait({inner})
        except asyncio.CancelledError:
            # The caller gave up on us (hard shutdown): stop the engine, then still record the end.
            outer_cancelled = True
            stop.set(StopReason.SHUTDOWN)
            stop.force()
            await asyncio.wait({inner})

    end = await asyncio.shield(_finish(pool, lease, settings, inner, stop, run.summary))
    bound.info(
        "operation_finished",
        status=end.status,
        error=end.error,
        attempt=lease.attempt,
        **run.summary.progress(),
    )
    if outer_cancelled:
        raise asyncio.CancelledError()
    return end


async def _finish(
    pool: asyncpg.Pool,
    lease: Lease,
    settings: Settings,
    inner: asyncio.Task[RunSummary],
    stop: StopSignal,
    summary: RunSummary,
) -> OperationEnd:
    """Record how the attempt ended, retrying the write through a database outage."""
    error: BaseException | None
    error = asyncio.CancelledError() if inner.cancelled() else inner.exception()
    deadline = time.monotonic() + settings.lease_s
    delay, max_delay = END_WRITE_RETRY_S
    while True:
        try:
            return await _record_end(pool, lease, settings, error, stop, summary)
        except LeaseLost as exc:
            return OperationEnd("lost", summary, str(exc))
        except db.DATABASE_DOWN as exc:
            if time.monotonic() + delay > deadline:
                log.warning(
                    "operation_end_unrecorded",
                    operation_id=str(lease.operation_id),
                    attempt=lease.attempt,
                    error=repr(exc),
                    hint="the database stayed unavailable until the lease ran out; a worker "
                    "takes the operation over once it is back, without spending an attempt "
                    f"for the first {queue.MAX_FREE_RECLAIMS} takeovers",
                )
                return OperationEnd("unrecorded", summary, describe(exc))
            if delay == END_WRITE_RETRY_S[0]:
                log.warning(
                    "operation_end_retrying",
                    operation_id=str(lease.operation_id),
                    attempt=lease.attempt,
                    error=repr(exc),
                    until_s=settings.lease_s,
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_delay)


async def _record_end(
    pool: asyncpg.Pool,
    lease: Lease,
    settings: Settings,
    error: BaseException | None,
    stop: StopSignal,
    summary: RunSummary,
) -> OperationEnd:
    """Write the end :func:`decide_end` chose (fenced: LeaseLost when it is not ours)."""
    decision = decide_end(error, stop.reason, lease, settings.retry_backoff_s)
    message = decision.message
    result = summary.to_json()
    kind = decision.kind
    if kind is EndKind.COMPLETED:
        await queue.finish(pool, lease, "completed", result=result)
        return OperationEnd("completed", summary)
    if kind is EndKind.LOST:
        return OperationEnd("lost", summary, message)
    if kind is EndKind.CANCELLED:
        await queue.finish(pool, lease, "cancelled", result=result, error=message)
        return OperationEnd("cancelled", summary, message)
    if kind is EndKind.YIELDED:
        slices = summary.slices + 1
        status = await queue.yield_operation(pool, lease, {**result, "slices": slices})
        metrics.OPERATION_SLICES.inc()
        log.info(
            "operation_yielded",
            operation_id=str(lease.operation_id),
            bank_id=lease.bank_id,
            status=status,
            slices=slices,
        )
        return OperationEnd(status, summary, None if status == "pending" else "cancelled")
    if kind is EndKind.PAUSED:
        return await _pause(pool, lease, settings, summary, result)
    if kind is EndKind.SHUT_DOWN:
        status = await queue.release(
            pool, lease, delay_s=0, error=message, refund_attempt=True, result=result
        )
        return OperationEnd(status, summary, message)
    if kind is EndKind.INTERRUPTED:
        status = await queue.release(
            pool,
            lease,
            delay_s=decision.delay_s,
            error=message,
            refund_attempt=True,
            interrupted=True,
            result=result,
        )
        # Logged once the hand-back is stored: when it never gets through, _finish says so.
        log.warning(
            "operation_interrupted",
            operation_id=str(lease.operation_id),
            bank_id=lease.bank_id,
            attempt=lease.attempt,
            interruptions=lease.interruptions + 1,
            status=status,
            error=message,
        )
        return OperationEnd(status, summary, message)
    if kind is EndKind.FAILED:
        await queue.finish(pool, lease, "failed", result=result, error=message)
        return OperationEnd("failed", summary, message)
    status = await queue.release(
        pool, lease, delay_s=decision.delay_s, error=message, refund_attempt=False, result=result
    )
    return OperationEnd(status, summary, message)


async def _pause(
    pool: asyncpg.Pool,
    lease: Lease,
    settings: Settings,
    summary: RunSummary,
    result: dict[str, object],
) -> OperationEnd:
    """Hand the operation back until its bank's rolling window frees enough for a pass, saying so
    in its ``error`` (and ``last_error``); no attempt spent, the progress kept."""
    window = await budgets.window(pool, lease.bank_id, settings.bank_token_budget)
    limit = window.limit if window is not None else None
    used = window.used if window is not None else 0
    resumes = None if limit is None else await budgets.frees_at(pool, lease.bank_id, limit)
    now = await pool.fetchval("SELECT now()")
    if limit is None:  # the budget was lifted meanwhile
        delay_s, message = 0.0, f"{budgets.PAUSE_PREFIX} lifted; resumes at once"
    elif resumes is None:  # a budget of 0: looked at again once a window has passed
        delay_s = budgets.WINDOW_S
        message = f"{budgets.PAUSE_PREFIX} of 0 tokens per 24 h; waits for a budget change"
    else:
        delay_s = max((resumes - now).total_seconds(), 0.0)
        message = (
            f"{budgets.PAUSE_PREFIX} {used}/{limit} tokens per 24 h used; "
            f"resumes at {resumes.isoformat(timespec='seconds')}"
        )
    summary.pauses += 1
    result = {**result, "pauses": summary.pauses}
    status = await queue.yield_operation(pool, lease, result, delay_s=delay_s, note=message)
    metrics.BUDGET_PAUSES.inc()
    log.info(
        "operation_paused",
        operation_id=str(lease.operation_id),
        bank_id=lease.bank_id,
        status=status,
        used=used,
        limit=limit,
        delay_s=round(delay_s, 3),
        **summary.progress(),
    )
    return OperationEnd(status, summary, message if status == "pending" else "cancelled")
