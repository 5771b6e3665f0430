"""The long-running poller: claims operations, runs them in slots, shuts down gracefully.

Wake-ups come from LISTEN/NOTIFY (submit and cancel) with a polling fallback, so a lost
notification costs at most one poll interval; the LISTEN connection is reopened when it drops,
and pinged every lease/3 because a silent connection may be one whose peer is gone. The pings
also say when the database last answered (:attr:`Worker.contact`, read by ``/healthz``).
The pool and the LLM client belong to the caller (service.py holds them in one exit stack).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import uuid
from dataclasses import dataclass

import asyncpg
import structlog

from consolidation import db, metrics, queue
from consolidation.engine import OperationEnd, StopReason, StopSignal, run_operation
from consolidation.llm.client import Consolidator
from consolidation.llm.embeddings import Embedder
from consolidation.settings import Settings
from consolidation.sweeper import run_sweeper

log = structlog.get_logger(__name__)

# After a failed claim (database unreachable), wait this long before trying again.
CLAIM_ERROR_BACKOFF_S = 1.0
# After a failed attempt to (re)open the LISTEN connection, poll this long before trying again.
LISTEN_RETRY_S = 1.0


@dataclass
class _Slot:
    lease: queue.Lease
    stop: StopSignal
    task: asyncio.Task[OperationEnd]


class Worker:
    """Runs up to ``worker_concurrency`` operations at once until :meth:`run`'s shutdown event."""

    def __init__(
        self,
        settings: Settings,
        pool: asyncpg.Pool,
        database_url: str,
        llm: Consolidator,
        *,
        worker_id: str,
        embedder: Embedder | None = None,
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.database_url = database_url
        self.llm = llm
        self.embedder = embedder
        self.worker_id = worker_id
        self.slots: dict[uuid.UUID, _Slot] = {}
        self._wake = asyncio.Event()
        self._listener: asyncpg.Connection | None = None
        self._listen_retry_at = 0.0
        self.timeouts = db.Timeouts.for_lease(settings.lease_s)
        self.contact = db.LastContact()
        self.log = log.bind(worker_id=self.worker_id)

    # --- notifications ------------------------------------------------------------------------

    def _on_submit(self, *_: object) -> None:
        self._wake.set()

    def _on_cancel(self, _conn: object, _pid: int, _channel: str, payload: str) -> None:
        try:
            operation_id = uuid.UUID(payload)
        except ValueError:
            return
        slot = self.slots.get(operation_id)
        if slot is not None:
            self.log.info("cancel_requested", operation_id=payload)
            slot.stop.set(StopReason.CANCEL)

    async def _ensure_listener(self) -> None:
        """(Re)open the LISTEN connection when it is missing or was closed (a database restart,
        a terminated session). Until it is back, polling alone finds work."""
        if self._listener is not None and not self._listener.is_closed():
            return
        if time.monotonic() < self._listen_retry_at:
            return
        # Listened before (this connection, or one that dropped before a failed reopen).
        reconnect = self._listener is not None or self._listen_retry_at > 0
        if self._listener is not None:
            await _close_quietly(self._listener)
            self._listener = None
        conn = None
        try:
            conn = await db.connect(self.database_url, timeouts=self.timeouts)
            await conn.add_listener(queue.NOTIFY_SUBMIT, self._on_submit)
            await conn.add_listener(queue.NOTIFY_CANCEL, self._on_cancel)
            # A dropped LISTEN session wakes the loop, which reopens it at once.
            conn.add_termination_listener(self._on_submit)
        except Exception as exc:
            if conn is not None:
                conn.terminate()
            self._listen_retry_at = time.monotonic() + LISTEN_RETRY_S
            self.log.warning("listen_unavailable", error=repr(exc))
            return
        self._listener = conn
        self.contact.heard()
        if reconnect:
            self.log.info("listen_restored")
            # Notifications sent while we were not listening are lost: look for work now, and
            # for cancels of running operations (their heartbeat also notices within lease/3).
            self._wake.set()

    async def _ping_listener(self) -> None:
        """Every lease/3, ask the LISTEN connection for an answer. A partition can leave the
        socket open and silent (no error ever comes), so no answer within lease/3 closes it and
        wakes the loop, which reopens it."""
        interval = self.settings.lease_s / 3
        while True:
            await asyncio.sleep(interval)
            conn = self._listener
            if conn is None or conn.is_closed():
                self._wake.set()  # the loop reopens it, however long its poll interval
                continue
            try:
                await conn.fetchval("SELECT 1", timeout=interval)
            except Exception as exc:
                self.log.warning("listen_connection_lost", error=repr(exc))
                conn.terminate()  # its termination listener wakes the loop
                continue
            self.contact.heard()

    # --- the loop -----------------------------------------------------------------------------

    async def run(self, shutdown: asyncio.Event) -> None:
        """Claim and run operations until ``shutdown`` is set, then shut down gracefully. The
        sweeper (sweeper.py) runs beside the loop until then."""
        pinger = asyncio.create_task(self._ping_listener(), name="listen-ping")
        sweeper = asyncio.create_task(run_sweeper(self.pool, self.settings), name="sweeper")
        try:
            await self._ensure_listener()
            self.log.info(
                "worker_started",
                concurrency=self.settings.worker_concurrency,
                lease_s=self.settings.lease_s,
            )
            while not shutdown.is_set():
                await self._ensure_listener()
                await self._fill_slots()
                await self._wait_for_work(shutdown)
            await self._drain()
        finally:
            pinger.cancel()
            sweeper.cancel()
            await asyncio.gather(pinger, sweeper, return_exceptions=True)
            if self._listener is not None:
                await _close_quietly(self._listener)
        self.log.info("worker_stopped")

    async def _fill_slots(self) -> None:
        if len(self.slots) < self.settings.worker_concurrency:
            await self._fence_stalled_workers()
            await self._end_exhausted()
        while len(self.slots) < self.settings.worker_concurrency:
            try:
                lease = await queue.claim(
                    self.pool, self.worker_id, self.settings.lease_s, running=list(self.slots)
                )
            except Exception as exc:
                # Whatever the database or driver throws, the poll loop must outlive it.
                self.log.warning("claim_failed", error=repr(exc))
                await asyncio.sleep(CLAIM_ERROR_BACKOFF_S)
                return
            if lease is None:
                return
            self._start(lease)

    async def _fence_stalled_workers(self) -> None:
        try:
            fenced = await queue.terminate_stalled_workers(
                self.pool, self.worker_id, grace_s=self.settings.lease_s
            )
        except Exception as exc:
            self.log.warning("fence_check_failed", error=repr(exc))
            return
        for worker_id in fenced:
            self.log.warning("stalled_worker_fenced", stalled_worker_id=worker_id)

    async def _end_exhausted(self) -> None:
        try:
            ended = await queue.end_exhausted_reclaims(self.pool, list(self.slots))
        except Exception as exc:
            self.log.warning("exhausted_check_failed", error=repr(exc))
            return
        for op in ended:
            metrics.OPERATIONS.labels(status="failed").inc()
            self.log.warning(
                "operation_failed_unrenewed",
                operation_id=str(op.operation_id),
                bank_id=op.bank_id,
                error=op.error,
            )

    def _start(self, lease: queue.Lease) -> None:
        stop = StopSignal()
        task = asyncio.create_task(
            run_operation(
                self.pool,
                lease,
                self.llm,
                self.settings,
                stop=stop,
                embedder=self.embedder,
                slice_s=self.settings.operation_slice_s or None,
            ),
            name=f"slot-{lease.operation_id}",
        )
        self.slots[lease.operation_id] = _Slot(lease, stop, task)
        metrics.OPERATIONS_RUNNING.inc()
        self.log.info(
            "operation_claimed",
            operation_id=str(lease.operation_id),
            bank_id=lease.bank_id,
            attempt=lease.attempt,
            max_attempts=lease.max_attempts,
            reclaimed=lease.reclaimed,
            interruptions=lease.interruptions,
        )
        task.add_done_callback(functools.partial(self._finished, lease.operation_id))

    def _finished(self, operation_id: uuid.UUID, task: asyncio.Task[OperationEnd]) -> None:
        slot = self.slots.get(operation_id)
        if slot is not None and slot.task is task:
            del self.slots[operation_id]
        metrics.OPERATIONS_RUNNING.dec()
        if task.cancelled():
            status = "interrupted"
        elif task.exception() is not None:
            status = "error"
            self.log.error(
                "operation_crashed", operation_id=str(operation_id), error=repr(task.exception())
            )
        else:
            status = task.result().status
        metrics.OPERATIONS.labels(status=status).inc()
        if status == "pending" and task.result().error is not None:  # not a slice's yield
            self.log.info("operation_retried", operation_id=str(operation_id))
        self._wake.set()  # a slot is free

    async def _wait_for_work(self, shutdown: asyncio.Event) -> None:
        """Until a wake-up, shutdown or the poll interval. A wake-up that came while the loop
        was busy (claiming, backing off) is consumed here, not lost."""
        waiters = [asyncio.ensure_future(self._wake.wait()), asyncio.ensure_future(shutdown.wait())]
        try:
            await asyncio.wait(
                waiters,
                timeout=self.settings.poll_interval_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            for waiter in waiters:
                waiter.cancel()
        self._wake.clear()

    async def _drain(self) -> None:
        """Stop claiming; let running passes finish within the grace period, then cancel.

        Each operation commits its markers and goes back to ``pending`` without spending an
        attempt (the engine does both, shielded).
        """
        slots = list(self.slots.values())
        if not slots:
            return
        self.log.info(
            "worker_draining", operations=len(slots), grace_s=self.settings.shutdown_grace_s
        )
        for slot in slots:
            slot.stop.set(StopReason.SHUTDOWN)
        tasks = [slot.task for slot in slots]
        _, still_running = await asyncio.wait(tasks, timeout=self.settings.shutdown_grace_s)
        for slot in slots:
            if slot.task in still_running:
                slot.stop.force()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _close_quietly(conn: asyncpg.Connection) -> None:
    with contextlib.suppress(Exception):
        await conn.close()
