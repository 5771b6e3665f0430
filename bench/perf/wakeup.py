"""How fast an idle worker picks up a submitted operation (LISTEN/NOTIFY, not polling).

    python -m bench.perf.wakeup [--samples 30]

Starts `consolidation serve --no-api` with an hour-long poll interval against a scratch
database, submits operations one at a time, and reports started_at - created_at of each (both
stamped by Postgres, so no clock skew between processes).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import uuid
from pathlib import Path

import asyncpg

from bench.infra import start_worker
from consolidation import db, queue, store
from consolidation.memories import parse_memories

ADMIN_URL = os.environ.get("BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")


async def main(samples: int) -> None:
    name = f"bench_wakeup_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(ADMIN_URL)
    await admin.execute(f'CREATE DATABASE "{name}"')
    url = ADMIN_URL.rsplit("/", 1)[0] + "/" + name
    log = Path(tempfile.mkdtemp()) / "worker.log"
    worker = None
    try:
        await db.migrate(url)
        pool = await db.create_pool(url)
        worker = await start_worker(
            {
                "CONSOLIDATION_DATABASE_URL": url,
                "CONSOLIDATION_POLL_INTERVAL_S": "3600",
                "CONSOLIDATION_AUTO_CONSOLIDATE": "false",
                "CONSOLIDATION_LOG_LEVEL": "INFO",
            },
            log,
        )
        latencies = []
        for i in range(samples):
            bank = f"wake-{i}"
            await store.ingest_memories(pool, bank, parse_memories([{"text": f"fact {i}"}]))
            op = (await queue.submit(pool, bank)).operation
            while True:
                row = await pool.fetchrow(
                    "SELECT status, extract(epoch FROM started_at - created_at) AS s"
                    " FROM operations WHERE id = $1",
                    op.id,
                )
                if row["status"] == "completed":
                    latencies.append(float(row["s"]) * 1000)
                    break
                await asyncio.sleep(0.01)
        latencies.sort()
        p95 = latencies[max(0, int(len(latencies) * 0.95) - 1)]
        print(
            f"submit -> claim on an idle worker over {samples} operations: "
            f"median {statistics.median(latencies):.1f} ms, p95 {p95:.1f} ms, "
            f"max {latencies[-1]:.1f} ms (poll interval 3600 s: every pickup was a NOTIFY)"
        )
        await pool.close()
    finally:
        if worker is not None:
            worker.terminate()
            await asyncio.wait_for(worker.wait(), 30)
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=30)
    asyncio.run(main(parser.parse_args().samples))
