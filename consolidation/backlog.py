"""The backlog on ``/metrics``: read from the database when Prometheus scrapes, never hanging.

Fleet-wide figures (every replica reports the same: aggregate them with ``max``, not ``sum``):
pending and failed memories, the age of the oldest pending memory, the ``TOP_BANKS`` banks whose
oldest pending memory is oldest, live operations by kind and status, and running operations
whose lease expired. One read serves the scrapes of ``MAX_AGE_S``; a read that fails or takes
longer than ``TIMEOUT_S`` (the database is down or saturated) leaves only
``consolidation_backlog_up 0``, so a scrape never waits longer than that and never reports
stale figures as current. The queries go through partial indexes (pending and failed memories,
pending and running operations): their cost follows the backlog, not the history.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass

import asyncpg
import structlog
from prometheus_client.core import REGISTRY, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from consolidation import queue, store

log = structlog.get_logger(__name__)

TOP_BANKS = 10
MAX_AGE_S = 5.0
TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Snapshot:
    backlog: store.Backlog
    queue: list[queue.QueueCounts]
    read_s: float


class BacklogCollector(Collector):
    """Serves the last snapshot read by :meth:`refresh` (nothing but ``up 0`` without one)."""

    def __init__(self) -> None:
        self.snapshot: Snapshot | None = None
        self._read_at = -1e9
        self._pool: asyncpg.Pool | None = None
        self._reading: asyncio.Task[Snapshot] | None = None

    async def refresh(self, pool: asyncpg.Pool) -> None:
        """Read the figures again unless the last read (from this pool) is under ``MAX_AGE_S``
        old; give up waiting after ``TIMEOUT_S``. A read given up on goes on in the background
        (cancelling a query on a connection that does not answer can itself hang) and a later
        scrape uses it; none is started beside it."""
        if pool is self._pool and time.monotonic() - self._read_at < MAX_AGE_S:
            return
        reading = self._reading
        if (
            reading is None
            or reading.done()
            or reading.get_loop() is not asyncio.get_running_loop()
        ):
            reading = self._reading = asyncio.create_task(_read(pool), name="backlog-read")
        done, _ = await asyncio.wait({reading}, timeout=TIMEOUT_S)
        self._pool = pool
        self._read_at = time.monotonic()
        if not done:
            log.warning("backlog_unavailable", error=f"no answer within {TIMEOUT_S}s")
            self.snapshot = None
        elif reading.exception() is not None:
            log.warning("backlog_unavailable", error=repr(reading.exception()))
            self.snapshot = None
        else:
            self.snapshot = reading.result()

    def collect(self) -> Iterator[Metric]:
        snapshot = self.snapshot
        yield GaugeMetricFamily(
            "consolidation_backlog_up",
            "1 when the backlog figures below were read from the database for this scrape, 0 "
            "when it could not be read (they are then absent).",
            value=0 if snapshot is None else 1,
        )
        if snapshot is None:
            return
        b = snapshot.backlog
        yield GaugeMetricFamily(
            "consolidation_backlog_read_seconds",
            "How long reading the backlog figures took.",
            value=snapshot.read_s,
        )
        yield GaugeMetricFamily(
            "consolidation_memories_pending",
            "Memories waiting to be consolidated, every bank (asked-to-be-forgotten ones aside).",
            value=b.pending,
        )
        yield GaugeMetricFamily(
            "consolidation_memories_failed",
            "Memories marked failed (unusable LLM answers), every bank; POST "
            "/v1/banks/{bank}/memories/recover retries them.",
            value=b.failed,
        )
        yield GaugeMetricFamily(
            "consolidation_oldest_pending_age_seconds",
            "Age of the oldest pending memory of any bank (since ingestion); 0 with none.",
            value=b.oldest_pending_age_s or 0.0,
        )
        age = GaugeMetricFamily(
            "consolidation_bank_oldest_pending_age_seconds",
            f"Age of a bank's oldest pending memory, for the {TOP_BANKS} banks where it is oldest.",
            labels=["bank_id"],
        )
        pending = GaugeMetricFamily(
            "consolidation_bank_memories_pending",
            f"Pending memories of the same {TOP_BANKS} banks.",
            labels=["bank_id"],
        )
        for bank_id, count, seconds in b.oldest_banks:
            age.add_metric([bank_id], seconds)
            pending.add_metric([bank_id], count)
        yield age
        yield pending
        operations = GaugeMetricFamily(
            "consolidation_queue_operations",
            "Live operations of every bank by kind and status (pending, running); finished ones "
            "are counted by consolidation_operations_total.",
            labels=["kind", "status"],
        )
        due = GaugeMetricFamily(
            "consolidation_queue_operations_due",
            "Pending operations that could start now (their retry delay is over), by kind.",
            labels=["kind"],
        )
        expired = GaugeMetricFamily(
            "consolidation_queue_leases_expired",
            "Running operations whose lease expired (their worker died or stalled); a worker "
            "reclaims them, so a lasting non-zero value means no worker is claiming.",
            labels=["kind"],
        )
        for counts in snapshot.queue:
            operations.add_metric([counts.kind, "pending"], counts.pending)
            operations.add_metric([counts.kind, "running"], counts.running)
            due.add_metric([counts.kind], counts.due)
            expired.add_metric([counts.kind], counts.expired)
        yield operations
        yield due
        yield expired


async def _read(pool: asyncpg.Pool) -> Snapshot:
    started = time.monotonic()
    backlog = await store.backlog(pool, TOP_BANKS)
    counts = await queue.queue_counts(pool)
    return Snapshot(backlog, counts, time.monotonic() - started)


BACKLOG = BacklogCollector()
REGISTRY.register(BACKLOG)
