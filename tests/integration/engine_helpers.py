"""Shared helpers for engine tests: ingest, run one foreground operation, read results."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

import asyncpg

from consolidation import queue, store
from consolidation.engine import OperationEnd, StopSignal, run_operation
from consolidation.llm import Consolidator, HTTPConsolidator
from consolidation.memories import parse_memories
from consolidation.settings import Settings


async def ingest(pool: asyncpg.Pool, bank: str, memories: Sequence[dict[str, Any]]) -> list[Any]:
    result = await store.ingest_memories(pool, bank, parse_memories(list(memories)))
    return result.ids


async def run_next(
    pool: asyncpg.Pool, llm: Consolidator, config: Settings | None = None, **options: Any
) -> OperationEnd:
    """Claim the operation a worker would claim next and run that attempt to its end."""
    lease = await queue.claim(pool, "test-worker", 30)
    assert lease is not None, "no operation was due"
    return await run_operation(pool, lease, llm, config or Settings(), **options)


async def consolidate(
    pool: asyncpg.Pool,
    bank: str,
    llm: Consolidator,
    config: Settings | None = None,
    stop: StopSignal | None = None,
) -> OperationEnd:
    lease = await queue.start_foreground(pool, bank, "test-worker", 30)
    return await run_operation(pool, lease, llm, config or Settings(), stop=stop)


def http_llm(url: str, **overrides: Any) -> HTTPConsolidator:
    options: dict[str, Any] = {
        "base_url": url,
        "model": "fake",
        "max_retries": 2,
        "backoff_base_s": 0.01,
        "backoff_max_s": 0.05,
        "timeout_s": 10,
    }
    options.update(overrides)
    return HTTPConsolidator(**options)


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


async def grew(pool: asyncpg.Pool, query: str, than: int) -> bool:
    """Whether the count ``query`` returns is now above ``than``."""
    return bool(await pool.fetchval(query) > than)


async def observations_by_scope(pool: asyncpg.Pool, bank: str) -> dict[tuple[str, ...], list[str]]:
    rows = await pool.fetch(
        "SELECT scope, text FROM observations WHERE bank_id = $1 ORDER BY created_at", bank
    )
    out: dict[tuple[str, ...], list[str]] = {}
    for r in rows:
        out.setdefault(tuple(r["scope"]), []).append(r["text"])
    return out


async def markers(pool: asyncpg.Pool, bank: str) -> dict[str, int]:
    row = await pool.fetchrow(
        """SELECT count(*) FILTER (WHERE consolidated_at IS NOT NULL) AS consolidated,
                  count(*) FILTER (WHERE consolidation_failed_at IS NOT NULL) AS failed,
                  count(*) FILTER (WHERE consolidated_at IS NULL AND consolidation_failed_at IS NULL)
                      AS pending
           FROM memories WHERE bank_id = $1""",
        bank,
    )
    return dict(row)


async def wait_completed(pool: asyncpg.Pool, operation_id: Any, timeout_s: float = 60.0) -> None:
    """Wait until the operation has completed (by whichever worker)."""
    await wait_for(
        lambda: pool.fetchval(
            "SELECT status = 'completed' FROM operations WHERE id = $1", operation_id
        ),
        timeout_s,
        what=f"operation {operation_id} to complete",
    )


def topics(count: int, per_topic: int) -> list[dict[str, Any]]:
    """``count`` topics (one tag each) of ``per_topic`` near-identical facts."""
    return [
        {"text": f"Person{t} drinks green tea every morning, note {i}", "tags": [f"topic-{t}"]}
        for t in range(count)
        for i in range(per_topic)
    ]


async def set_read_only(pool: asyncpg.Pool, database_url: str, on: bool) -> None:
    """Make the test database refuse writes in every new session (what a failover to a replica
    looks like), or take it back; from a session that can still write."""
    name = urlsplit(database_url).path.lstrip("/")
    async with pool.acquire() as conn:
        await conn.execute("SET default_transaction_read_only = off")
        value = "on" if on else "off"
        await conn.execute(f'ALTER DATABASE "{name}" SET default_transaction_read_only = {value}')
