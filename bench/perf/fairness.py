"""Fairness between banks: how long a small bank's memories wait behind a big bank's backlog.

    python -m bench fairness [--slices 60,5,1] [--repeats 1]

One ``consolidation serve --no-api`` process (the real worker; ``WORKER_CONCURRENCY=2``) against
``consolidation fake-llm`` (100 ms per call) on a scratch database. With the big bank: 10,000
memories (the benchmark's bank shape) are ingested and their consolidation starts; two seconds
later 50 small banks of 20 memories each are ingested and submitted at once. Without it: the
same 50 banks alone. For each small bank, ingest → consolidated is ``max(consolidated_at) −
min(created_at)`` of its memories, both stamped by Postgres. Reported: p50, p95 and max over the
50 banks, for each ``CONSOLIDATION_OPERATION_SLICE_S`` asked (0 = never yield), and the ratio
of p95 with the big bank to p95 without it (target ≤ 2).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import orjson

from bench.infra import FakeLLM, start_worker, with_database
from bench.perf.workload import BankShape, chunks, generate
from consolidation import db, queue, store
from consolidation.memories import parse_memories

RESULTS = Path(__file__).resolve().parents[1] / "results"
BIG = "big"
SMALL_BANKS = 50
SMALL_MEMORIES = 20
BIG_MEMORIES = 10_000
LATENCY_MS = 100
CONCURRENCY = 2
HEAD_START_S = 2.0
TARGET_RATIO = 2.0


@dataclass(frozen=True)
class Run:
    label: str
    big: bool
    slice_s: float
    p50_s: float
    p95_s: float
    max_s: float
    big_consolidated: int
    big_slices: int
    wall_s: float
    loadavg: float


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, int(len(ordered) * 0.95 + 0.5) - 1)]


async def _until(condition: Any, what: str, timeout_s: float = 1800) -> None:
    """Poll ``condition`` (async) until it is true."""
    deadline = time.monotonic() + timeout_s
    while True:
        if await condition():
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def one_run(admin_url: str, big: bool, slice_s: float, log_dir: Path) -> Run:
    name = f"bench_fair_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(admin_url)
    await admin.execute(f'CREATE DATABASE "{name}"')
    url = with_database(admin_url, name)
    label = f"{'with' if big else 'without'} the big bank, slice {slice_s:g} s"
    worker: asyncio.subprocess.Process | None = None
    log = log_dir / f"fairness-{name}.log"
    try:
        await db.migrate(url)
        pool = await db.create_pool(url, min_size=1, max_size=4)
        with FakeLLM(latency_ms=LATENCY_MS, log_path=log_dir / f"{name}-fake.log") as fake:
            if big:
                for chunk in chunks(BankShape(memories=BIG_MEMORIES), 1000):
                    await store.ingest_memories(pool, BIG, parse_memories(chunk))
                await pool.execute("VACUUM ANALYZE")
                await queue.submit(pool, BIG)
            worker = await start_worker(
                {
                    "CONSOLIDATION_DATABASE_URL": url,
                    "CONSOLIDATION_LLM_BASE_URL": fake.url,
                    "CONSOLIDATION_WORKER_CONCURRENCY": str(CONCURRENCY),
                    "CONSOLIDATION_OPERATION_SLICE_S": f"{slice_s:g}",
                    "CONSOLIDATION_SWEEP_INTERVAL_S": "0",
                    "CONSOLIDATION_AUTO_CONSOLIDATE": "false",
                },
                log,
            )
            started = time.monotonic()
            if big:
                await _until(
                    lambda: pool.fetchval(
                        "SELECT started_at IS NOT NULL FROM operations WHERE bank_id = $1", BIG
                    ),
                    "the big bank's operation to start",
                )
                await asyncio.sleep(HEAD_START_S)
            banks = [f"small-{i:02d}" for i in range(SMALL_BANKS)]
            for i, bank in enumerate(banks):
                shape = BankShape(memories=SMALL_MEMORIES, groups=4, seed=1000 + i)
                await store.ingest_memories(pool, bank, parse_memories(list(generate(shape))))
                await queue.submit(pool, bank)
            await _until(
                lambda: pool.fetchval(
                    "SELECT count(*) = 0 FROM memories WHERE bank_id <> $1"
                    " AND consolidated_at IS NULL AND consolidation_failed_at IS NULL",
                    BIG,
                ),
                "the small banks to be consolidated",
            )
            wall = time.monotonic() - started
            rows = await pool.fetch(
                """SELECT bank_id,
                          extract(epoch FROM max(COALESCE(consolidated_at,
                                                          consolidation_failed_at))
                                             - min(created_at))::float8 AS seconds
                   FROM memories WHERE bank_id <> $1 GROUP BY bank_id""",
                BIG,
            )
            latencies = [r["seconds"] for r in rows]
            big_consolidated = await pool.fetchval(
                "SELECT count(*) FROM memories WHERE bank_id = $1 AND consolidated_at IS NOT NULL",
                BIG,
            )
            slices = await pool.fetchval(
                "SELECT COALESCE(max((result->>'slices')::int), 0) FROM operations"
                " WHERE bank_id = $1",
                BIG,
            )
        await pool.close()
        return Run(
            label=label,
            big=big,
            slice_s=slice_s,
            p50_s=statistics.median(latencies),
            p95_s=_p95(latencies),
            max_s=max(latencies),
            big_consolidated=int(big_consolidated),
            big_slices=int(slices),
            wall_s=wall,
            loadavg=os.getloadavg()[0],
        )
    finally:
        if worker is not None and worker.returncode is None:
            worker.terminate()
            await asyncio.wait_for(worker.wait(), 60)
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


def render(runs: list[Run]) -> str:
    baseline = statistics.median([r.p95_s for r in runs if not r.big])
    lines = [
        "| run | p50 s | p95 s | max s | p95 / p95 without | big bank consolidated "
        "meanwhile | big bank's slices | load |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        ratio = r.p95_s / baseline
        verdict = "" if not r.big else (" (met)" if ratio <= TARGET_RATIO else " (not met)")
        big = f"{r.big_consolidated:,}" if r.big else "—"
        slices = str(r.big_slices) if r.big else "—"
        lines.append(
            f"| {r.label} | {r.p50_s:.2f} | {r.p95_s:.2f} | {r.max_s:.2f} | "
            f"{ratio:.2f}×{verdict} | {big} | {slices} | {r.loadavg:.2f} |"
        )
    return "\n".join(lines)


async def main(args: argparse.Namespace) -> None:
    log_dir = RESULTS / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    slices = [float(s) for s in args.slices.split(",")]
    runs: list[Run] = []
    for _ in range(args.repeats):
        runs.append(await one_run(args.database_url, False, 60.0, log_dir))
        print(f"done: {runs[-1]}", file=sys.stderr, flush=True)
        for slice_s in slices:
            runs.append(await one_run(args.database_url, True, slice_s, log_dir))
            print(f"done: {runs[-1]}", file=sys.stderr, flush=True)
    table = render(runs)
    print(table)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    path = RESULTS / f"fairness-{stamp}.json"
    path.write_bytes(
        orjson.dumps(
            {
                "command": "python -m bench " + " ".join(sys.argv[1:]),
                "runs": [asdict(r) for r in runs],
            },
            option=orjson.OPT_INDENT_2,
        )
    )
    print(f"\nJSON: {path}")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("fairness", help="small banks' wait behind a 10,000-memory bank")
    p.add_argument(
        "--slices",
        default="60,5,1,0",
        help="CONSOLIDATION_OPERATION_SLICE_S values to run with the big bank (0: never yield)",
    )
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument(
        "--database-url",
        default=os.environ.get(
            "BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
        ),
    )
    p.set_defaults(handler=lambda args: asyncio.run(main(args)) or 0)
