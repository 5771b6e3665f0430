"""The sweeper: a memory must not stay pending because nobody triggered an operation.

Every ``CONSOLIDATION_SWEEP_INTERVAL_S`` each worker process tries to sweep; a Postgres advisory
try-lock lets one of the fleet do it at a time (``queue.sweep``): every bank with pending memories
and no pending or running operation gets an unscoped consolidation, every bank with memories
asked to be forgotten and no forget under way gets a forget operation, and a bank whose latest
operations failed waits ``RETRY_BACKOFF_S`` doubled per failure in a row (at most 10 minutes)
after the last one. A provider outage that ends an operation ``failed`` therefore drains by
itself once the provider is back.
"""

from __future__ import annotations

import asyncio

import asyncpg
import structlog

from consolidation import metrics, queue
from consolidation.settings import Settings

log = structlog.get_logger(__name__)


async def sweep_once(pool: asyncpg.Pool, settings: Settings) -> list[queue.Swept]:
    """One sweep (nothing when another worker holds the sweep lock); logs what it enqueued."""
    swept = await queue.sweep(
        pool, retry_backoff_s=settings.retry_backoff_s, max_attempts=settings.max_attempts
    )
    for item in swept:
        metrics.SWEPT.labels(kind=item.kind).inc()
        log.info(
            "sweeper_enqueued",
            operation_id=str(item.operation_id),
            bank_id=item.bank_id,
            kind=item.kind,
        )
    return swept


async def run_sweeper(pool: asyncpg.Pool, settings: Settings) -> None:
    """Sweep every ``sweep_interval_s`` until cancelled (the worker does, when it stops); a
    failed sweep is logged and the next one comes an interval later."""
    interval = settings.sweep_interval_s
    if interval <= 0:
        return
    while True:
        await asyncio.sleep(interval)
        try:
            await sweep_once(pool, settings)
        except Exception as exc:
            log.warning("sweep_failed", error=repr(exc))
