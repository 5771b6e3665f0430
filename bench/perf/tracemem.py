"""Python memory over one long operation: does the engine keep anything per wave?

``python -m bench.perf.tracemem [MEMORIES]`` (default 20,000) ingests the benchmark's bank into a
scratch database on ``BENCH_DATABASE_URL``'s server, runs one operation with the offline
consolidator (no HTTP: only the engine's own objects), and prints the memory ``tracemalloc``
traces every ten waves, then the allocations that grew most between wave 10 and the end. A
level series means nothing is retained per wave; peak RSS (``python -m bench rss``) also counts
the allocator's heap, which this does not.
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import tracemalloc
import uuid
from typing import Any

import asyncpg

from bench.perf.scenarios import DEFAULT_BANK
from bench.perf.workload import generate
from consolidation import db, queue, store
from consolidation.engine import RunSummary, run_operation
from consolidation.llm.client import OfflineConsolidator
from consolidation.memories import parse_memories
from consolidation.settings import Settings

ADMIN_URL = os.environ.get("BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")


async def measure(memories: int) -> None:
    name = f"bench_tracemem_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(ADMIN_URL)
    await admin.execute(f'CREATE DATABASE "{name}"')
    await admin.close()
    url = ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    try:
        await db.migrate(url)
        pool = await db.create_pool(url, min_size=1, max_size=12)
        bank = list(generate(DEFAULT_BANK.shape(memories)))
        for start in range(0, memories, 2000):
            await store.ingest_memories(pool, "b", parse_memories(bank[start : start + 2000]))
        del bank
        gc.collect()
        tracemalloc.start(5)
        series: list[tuple[int, float]] = []
        snapshots: dict[int, Any] = {}

        def progress(summary: RunSummary) -> None:
            if summary.waves % 10 == 0:
                gc.collect()
                series.append((summary.waves, tracemalloc.get_traced_memory()[0] / 1e6))
                if summary.waves == 10:
                    snapshots[10] = tracemalloc.take_snapshot()

        lease = await queue.start_foreground(pool, "b", "tracemem", 120)
        end = await run_operation(
            pool, lease, OfflineConsolidator(), Settings(), on_progress=progress
        )
        gc.collect()
        last = tracemalloc.take_snapshot()
        print(
            f"{end.status} ({end.error}): {end.summary.waves} waves, {end.summary.processed} memories"
        )
        print("traced MB every ten waves:", ", ".join(f"{w}: {mb:.1f}" for w, mb in series))
        if snapshots.get(10) is not None:
            print("grew most between wave 10 and the end:")
            for stat in last.compare_to(snapshots[10], "lineno")[:8]:
                print("  ", stat)
        await pool.close()
    finally:
        admin = await asyncpg.connect(ADMIN_URL)
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


if __name__ == "__main__":
    asyncio.run(measure(int(sys.argv[1]) if len(sys.argv) > 1 else 20_000))
