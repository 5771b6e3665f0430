"""Waiting on a condition with a deadline: the one way tests synchronise with the code."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import asyncpg


async def wait_for(condition: Callable[[], Any], timeout_s: float = 30.0, what: str = "") -> Any:
    """Poll ``condition`` (sync or async) until truthy; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or condition}")
        await asyncio.sleep(0.02)


async def completed(pool: asyncpg.Pool, operation_id: Any) -> bool:
    """Whether the operation has completed (by whichever worker)."""
    return bool(
        await pool.fetchval(
            "SELECT status = 'completed' FROM operations WHERE id = $1", operation_id
        )
    )


async def wait_completed(
    pool: asyncpg.Pool, operation_id: Any, timeout_s: float = 60.0, what: str = ""
) -> None:
    """Wait until the operation has completed (by whichever worker)."""
    await wait_for(
        lambda: completed(pool, operation_id),
        timeout_s,
        what=what or f"operation {operation_id} to complete",
    )


async def wait_drained(
    pool: asyncpg.Pool, *, idle: bool = False, timeout_s: float = 30.0, what: str = ""
) -> None:
    """Wait until no memory of any bank is left unconsolidated (failed ones count as left unless
    ``idle``); with ``idle``, until no memory is pending and no operation is queued or running."""
    unfinished = "SELECT count(*) FROM memories WHERE consolidated_at IS NULL" + (
        " AND consolidation_failed_at IS NULL" if idle else ""
    )

    async def drained() -> bool:
        if idle and await pool.fetchval(
            "SELECT count(*) FROM operations WHERE status IN ('pending', 'running')"
        ):
            return False
        return bool(await pool.fetchval(unfinished) == 0)

    await wait_for(drained, timeout_s, what=what or "every memory to be consolidated")
