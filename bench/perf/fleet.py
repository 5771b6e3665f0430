"""``python -m bench fleet``: 1, 2 and 4 ``consolidation serve`` replicas on one Postgres.

    python -m bench fleet [--quick] [--replicas 1,2,4] [--rate 5] [--banks 200]

Each replica count gets a fresh copy of one migrated ``bench_fleet_*`` database (all dropped at
the end), its replicas (real processes, API and worker, each on its own loopback port) and one
``consolidation fake-llm`` with a real server's latency (lognormal median 1 s, p99 8 s, plus
10 ms per completion token). A bounded load loop posts memories one at a time to
``POST /v1/banks/{bank}/memories`` of the replicas in turn, spread over 200 banks at a steady
rate, for a fixed time; ``AUTO_CONSOLIDATE`` enqueues their consolidation. Then the replicas get
a bounded time to drain.

Measured per replica count, over the steady part of the load (its first fifth is warm-up):
throughput (memories whose ``consolidated_at`` falls in the window, per second); freshness
(``consolidated_at − created_at`` of the memories created in the window, both stamped by
Postgres; one still pending at the end ranks above every consolidated one, so a percentile
that reaches it is a lower bound, shown ``≥``); connections to the database (``pg_stat_activity``, sampled
twice a second: open and active); CPU of each replica (``/proc/<pid>/stat``) and of the
Postgres backends serving the database (the same, for every backend ``pg_stat_activity`` shows
for it, sampled likewise); calls in flight at the fake against ``LLM_MAX_CONCURRENT`` × replicas
and running operations against ``WORKER_CONCURRENCY`` × replicas. The verdict names what
stopped scaling (:func:`verdict`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import math
import os
import random
import shlex
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import httpx
import orjson

from bench.infra import FakeLLM, start_serve, with_database
from bench.perf.child import proc_cpu_s
from bench.perf.workload import BankShape, generate
from consolidation import db

RESULTS = Path(__file__).resolve().parents[1] / "results"
APPLICATION = "bench-fleet"
SAMPLE_S = 0.5
WARMUP_SHARE = 0.2
# Thresholds of the verdict: a resource counts as the limit once the run keeps it this busy.
KEPT_UP = 0.9  # throughput / offered rate
SATURATED = 0.75  # mean use / capacity
CONNECTIONS_NEAR = 0.8  # peak open / what the server has left for this database


@dataclass(frozen=True)
class Sizes:
    name: str
    replicas: tuple[int, ...]
    banks: int
    rate: float  # memories/s offered, all banks together
    load_s: float
    drain_s: float  # at most, after the load stops


FULL = Sizes("full", (1, 2, 4), banks=200, rate=5.0, load_s=120.0, drain_s=45.0)
QUICK = Sizes("quick", (1, 2, 4), banks=200, rate=5.0, load_s=20.0, drain_s=10.0)


@dataclass(frozen=True)
class Service:
    """What each replica is started with (the CONSOLIDATION_* settings the verdict weighs)."""

    llm_max_concurrent: int = 4
    worker_concurrency: int = 4
    group_parallelism: int = 2

    def pool_max(self) -> int:
        """A replica's pool ceiling, as runtime.open_runtime sizes it, plus its LISTEN
        connection."""
        return max(10, self.group_parallelism * self.worker_concurrency + 4) + 1


@dataclass(frozen=True)
class Latency:
    median_ms: float = 1000.0
    p99_ms: float = 8000.0
    ttft_ms: float = 0.0
    per_token_ms: float = 10.0

    def args(self) -> list[str]:
        return [
            "--latency-median-ms",
            f"{self.median_ms:g}",
            "--latency-p99-ms",
            f"{self.p99_ms:g}",
            "--ttft-ms",
            f"{self.ttft_ms:g}",
            "--per-token-ms",
            f"{self.per_token_ms:g}",
        ]


# ---------------------------------------------------------------------------- pure parts


def _rank(n: int, q: float) -> int:
    """The 1-based nearest rank of the ``q`` quantile among ``n`` values."""
    return max(1, math.ceil(q * n))


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0–1) by nearest rank: a value that was observed."""
    if not values:
        return math.nan
    return sorted(values)[_rank(len(values), q) - 1]


@dataclass(frozen=True)
class Freshness:
    """Percentiles of created → consolidated; ``lower_bound`` marks those that land on a
    memory still pending when measured (its true freshness is longer)."""

    p50_s: float
    p95_s: float
    p99_s: float
    lower_bound: tuple[bool, bool, bool]
    memories: int
    pending: int


def freshness(done_s: Sequence[float], pending_age_s: Sequence[float]) -> Freshness:
    """Percentiles over consolidated memories (``done_s``) and pending ones counted at their
    age (``pending_age_s``); a percentile is a lower bound when its rank reaches into the
    pending ones, which are treated as longer than any consolidated one."""
    values = sorted(done_s)
    pending = sorted(pending_age_s)
    everything = values + [max(values[-1] if values else 0.0, p) for p in pending]
    quantiles = (0.5, 0.95, 0.99)
    p50, p95, p99 = (percentile(everything, q) for q in quantiles)
    bounds = tuple(bool(everything) and _rank(len(everything), q) > len(values) for q in quantiles)
    return Freshness(
        p50, p95, p99, (bounds[0], bounds[1], bounds[2]), len(everything), len(pending)
    )


@dataclass(frozen=True)
class Load:
    """How busy one run kept each resource that can stop scaling."""

    offered_per_s: float
    throughput_per_s: float
    llm_in_flight_mean: float
    llm_in_flight_max: int
    llm_cap: int  # LLM_MAX_CONCURRENT × replicas
    operations_mean: float
    operation_slots: int  # WORKER_CONCURRENCY × replicas
    connections_max: int
    connections_left: int  # max_connections less those of other databases at the start
    postgres_cores: float
    cores: int


def limits(load: Load) -> list[str]:
    """The resources this run kept saturated, most binding first."""
    found: list[tuple[float, str]] = []
    if load.llm_cap and load.llm_in_flight_max >= load.llm_cap:
        share = load.llm_in_flight_mean / load.llm_cap
        if share >= SATURATED:
            found.append((share, "LLM cap"))
    if load.operation_slots:
        share = load.operations_mean / load.operation_slots
        if share >= SATURATED:
            found.append((share, "operation slots"))
    if load.connections_left:
        share = load.connections_max / load.connections_left
        if share >= CONNECTIONS_NEAR:
            found.append((share, "connections"))
    if load.cores:
        share = load.postgres_cores / load.cores
        if share >= 0.5:
            found.append((share, "Postgres CPU"))
    return [name for _, name in sorted(found, key=lambda f: -f[0])]


def verdict(load: Load) -> str:
    """One phrase: whether the fleet kept up with the offered rate, and what stopped it."""
    kept_up = load.throughput_per_s >= KEPT_UP * load.offered_per_s
    binding = limits(load)
    if kept_up:
        return "keeps up" + (f" ({', '.join(binding)} busy)" if binding else "")
    if binding:
        return "stops at " + ", ".join(binding)
    return "stops: no resource saturated (latency-bound)"


def in_flight_mean(intervals: Sequence[tuple[float, float]], start: float, end: float) -> float:
    """Mean number of calls in flight over [start, end] for calls given as (start, end)."""
    if end <= start:
        return 0.0
    busy = sum(max(0.0, min(e, end) - max(s, start)) for s, e in intervals)
    return busy / (end - start)


# ---------------------------------------------------------------------------- the run


class _Sampler:
    """Samples the database twice a second: its connections (open, active), running
    operations and the CPU of every backend serving it. Only samples taken between
    :meth:`open_window` and :meth:`close_window` count."""

    def __init__(self, conn: asyncpg.Connection, name: str) -> None:
        self.conn = conn
        self.name = name
        self.connections: list[int] = []
        self.active: list[int] = []
        self.operations: list[int] = []
        self._first: dict[int, float] = {}
        self._last: dict[int, float] = {}
        self._counting = False
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    async def _sample(self) -> None:
        async with self._lock:
            await self._sample_once()

    async def _sample_once(self) -> None:
        rows = await self.conn.fetch(
            "SELECT pid, state FROM pg_stat_activity WHERE datname = $1 AND application_name <> $2",
            self.name,
            APPLICATION,
        )
        for row in rows:
            cpu = proc_cpu_s(row["pid"])
            if cpu > 0:
                # A backend born during the window counts from zero.
                self._first.setdefault(row["pid"], 0.0 if self._counting else cpu)
                self._last[row["pid"]] = cpu
        if not self._counting:
            return
        self.connections.append(len(rows))
        self.active.append(sum(1 for r in rows if r["state"] not in ("idle", None)))
        running = await self.conn.fetchval(
            "SELECT count(*) FROM operations WHERE status = 'running'"
        )
        self.operations.append(int(running))

    async def _loop(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(asyncpg.PostgresError, OSError):
                await self._sample()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), SAMPLE_S)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def open_window(self) -> None:
        await self._sample()
        self._first = dict(self._last)
        self._counting = True

    async def close_window(self) -> float:
        """Stop counting; the backends' CPU seconds within the window."""
        await self._sample()
        self._counting = False
        return sum(cpu - self._first.get(pid, 0.0) for pid, cpu in self._last.items())

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task


@dataclass
class Replica:
    process: asyncio.subprocess.Process
    url: str
    log: Path


async def start_replica(settings: dict[str, str], log_path: Path) -> Replica:
    """``consolidation serve`` (API and worker) on a free loopback port; returns once it both
    listens and has its worker started."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONSOLIDATION_")}
    env.update({"CONSOLIDATION_LOG_FORMAT": "json", **settings})
    process = await start_serve(
        [],
        env,
        log_path,
        lambda log: b'"api_listening"' in log and b"worker_started" in log,
        deadline_s=90,
    )
    text = await asyncio.to_thread(log_path.read_bytes)
    url = next(
        orjson.loads(line)["url"] for line in text.splitlines() if b'"api_listening"' in line
    )
    if urlsplit(url).hostname != "127.0.0.1":
        raise RuntimeError(f"replica listens on {url}, not on loopback")
    return Replica(process, url, log_path)


async def stop_replica(replica: Replica) -> None:
    if replica.process.returncode is None:
        replica.process.terminate()
        try:
            await asyncio.wait_for(replica.process.wait(), 60)
        except TimeoutError:
            replica.process.kill()
            await replica.process.wait()


def _bank_memories(banks: int, per_bank: int) -> dict[str, list[dict[str, Any]]]:
    """Each bank's memories in arrival order: a small agent's stream (4 tag groups)."""
    return {
        f"fleet-{b:03d}": list(generate(BankShape(memories=per_bank, groups=4, seed=5000 + b)))
        for b in range(banks)
    }


async def _post_load(
    replicas: Sequence[Replica], sizes: Sizes, seed: int, log: Any
) -> tuple[int, int, float]:
    """Post memories one at a time at ``sizes.rate`` for ``sizes.load_s`` to the replicas in
    turn; returns (posted, refused, seconds). Bounded: it stops at the deadline whatever is in
    flight, and never has more than 64 requests open."""
    per_bank = math.ceil(sizes.rate * sizes.load_s / sizes.banks) * 3 + 4
    streams = _bank_memories(sizes.banks, per_bank)
    cursor = dict.fromkeys(streams, 0)
    rng = random.Random(seed)
    names = list(streams)
    total = int(sizes.rate * sizes.load_s)
    gate = asyncio.Semaphore(64)
    refused = 0
    targets = itertools.cycle(replicas)

    async def post(client: httpx.AsyncClient, url: str, bank: str, memory: dict[str, Any]) -> None:
        nonlocal refused
        try:
            response = await client.post(
                f"{url}/v1/banks/{bank}/memories", json={"memories": [memory]}
            )
            if response.status_code != 201:
                refused += 1
        except httpx.HTTPError:
            refused += 1
        finally:
            gate.release()

    tasks: set[asyncio.Task[None]] = set()
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
        for i in range(total):
            due = started + i / sizes.rate
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            bank = rng.choice(names)
            memory = streams[bank][cursor[bank] % per_bank]
            cursor[bank] += 1
            await gate.acquire()
            task = asyncio.create_task(post(client, next(targets).url, bank, memory))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(tasks, timeout=30)
    elapsed = time.monotonic() - started
    log(f"  posted {total} memories in {elapsed:.1f} s ({refused} refused)")
    return total, refused, elapsed


@dataclass(frozen=True)
class Run:
    replicas: int
    offered_per_s: float
    posted: int
    refused: int
    throughput_per_s: float
    freshness: Freshness
    memories_per_call: float
    llm_calls: int
    llm_in_flight_mean: float
    llm_in_flight_max: int
    llm_cap: int
    llm_service_s_mean: float
    operations_mean: float
    operation_slots: int
    operations_by_replica: tuple[int, ...]
    connections_mean: float
    connections_max: int
    active_mean: float
    active_max: int
    connections_left: int
    replica_cpu_cores: tuple[float, ...]
    replica_cpu_ms_per_memory: float
    postgres_cpu_cores: float
    postgres_cpu_ms_per_memory: float
    window_s: float
    drained: bool
    loadavg: float
    verdict: str


async def _pending(pool: asyncpg.Pool) -> int:
    return int(
        await pool.fetchval(
            "SELECT count(*) FROM memories"
            " WHERE consolidated_at IS NULL AND consolidation_failed_at IS NULL"
        )
    )


async def _drain(pool: asyncpg.Pool, within_s: float) -> bool:
    """Wait until no memory is pending, for at most ``within_s``; whether none is."""
    deadline = time.monotonic() + within_s
    while True:
        if await _pending(pool) == 0:
            return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.5)


async def one_run(
    admin_url: str,
    template: str,
    n: int,
    sizes: Sizes,
    service: Service,
    fake: FakeLLM,
    log_dir: Path,
    log: Any,
) -> Run:
    """One replica count on a fresh copy of ``template``, dropped at the end."""
    name = f"bench_fleet_{uuid.uuid4().hex[:8]}_r{n}"
    url = with_database(admin_url, name)
    admin = await asyncpg.connect(admin_url, server_settings={"application_name": APPLICATION})
    replicas: list[Replica] = []
    try:
        await admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
        max_connections = int(await admin.fetchval("SHOW max_connections"))
        others = int(await admin.fetchval("SELECT count(*) FROM pg_stat_activity"))
        left = max_connections - others
        if left < n * service.pool_max():
            log(f"  note: {left} connections left on the server, {n} pools of {service.pool_max()}")
        await asyncio.to_thread(fake.reset)
        settings = {
            "CONSOLIDATION_DATABASE_URL": url,
            "CONSOLIDATION_LLM_BASE_URL": fake.url,
            "CONSOLIDATION_HTTP_HOST": "127.0.0.1",
            "CONSOLIDATION_HTTP_PORT": "0",
            "CONSOLIDATION_LLM_MAX_CONCURRENT": str(service.llm_max_concurrent),
            "CONSOLIDATION_WORKER_CONCURRENCY": str(service.worker_concurrency),
            "CONSOLIDATION_GROUP_PARALLELISM": str(service.group_parallelism),
            "CONSOLIDATION_AUTO_CONSOLIDATE": "true",
            "CONSOLIDATION_LOG_LEVEL": "INFO",
        }
        for i in range(n):
            replicas.append(await start_replica(settings, log_dir / f"{name}-replica{i}.log"))
        log(f"  {n} replica(s) up: {', '.join(r.url for r in replicas)}")
        pool = await db.create_pool(url, min_size=1, max_size=2, application_name=APPLICATION)
        sampler = _Sampler(
            await asyncpg.connect(url, server_settings={"application_name": APPLICATION}), name
        )
        sampler.start()
        try:
            load = asyncio.create_task(_post_load(replicas, sizes, seed=n, log=log))
            # The window opens once the warm-up is over: every replica busy, banks queued.
            await asyncio.sleep(WARMUP_SHARE * sizes.load_s)
            await sampler.open_window()
            opened = await pool.fetchval("SELECT clock_timestamp()")
            # time.monotonic() is the system's monotonic clock: the fake stamps its calls with
            # the same one.
            fake_t0 = time.monotonic()
            replica_cpu0 = [proc_cpu_s(r.process.pid) for r in replicas]
            posted, refused, _ = await load
            closed = await pool.fetchval("SELECT clock_timestamp()")
            fake_t1 = time.monotonic()
            replica_cpu = [
                proc_cpu_s(r.process.pid) - c for r, c in zip(replicas, replica_cpu0, strict=True)
            ]
            backend_cpu = await sampler.close_window()
            drained = await _drain(pool, sizes.drain_s)
            window_s = (closed - opened).total_seconds()
            consolidated = int(
                await pool.fetchval(
                    "SELECT count(*) FROM memories"
                    " WHERE consolidated_at >= $1 AND consolidated_at < $2",
                    opened,
                    closed,
                )
            )
            rows = await pool.fetch(
                """SELECT extract(epoch FROM consolidated_at - created_at)::float8 AS done,
                          extract(epoch FROM clock_timestamp() - created_at)::float8 AS age
                   FROM memories WHERE created_at >= $1 AND created_at < $2
                     AND consolidation_failed_at IS NULL""",
                opened,
                closed,
            )
            fresh = freshness(
                [r["done"] for r in rows if r["done"] is not None],
                [r["age"] for r in rows if r["done"] is None],
            )
            by_worker = await pool.fetch(
                "SELECT worker_id, count(*) AS n FROM operations"
                " WHERE worker_id IS NOT NULL GROUP BY worker_id ORDER BY n DESC"
            )
        finally:
            await sampler.stop()
            await sampler.conn.close()
            await pool.close()
        stats = await asyncio.to_thread(fake.stats)
        calls = [(s, e) for s, e, _ in stats["call_intervals"]]
        window_calls = [(s, e) for s, e in calls if fake_t0 <= s < fake_t1]
        throughput = consolidated / window_s
        measured = Load(
            offered_per_s=sizes.rate,
            throughput_per_s=throughput,
            llm_in_flight_mean=in_flight_mean(calls, fake_t0, fake_t1),
            llm_in_flight_max=int(stats["max_in_flight"]),
            llm_cap=service.llm_max_concurrent * n,
            operations_mean=statistics.fmean(sampler.operations or [0]),
            operation_slots=service.worker_concurrency * n,
            connections_max=max(sampler.connections or [0]),
            connections_left=left,
            postgres_cores=backend_cpu / window_s,
            cores=os.cpu_count() or 1,
        )
        return Run(
            replicas=n,
            offered_per_s=sizes.rate,
            posted=posted,
            refused=refused,
            throughput_per_s=throughput,
            freshness=fresh,
            memories_per_call=consolidated / len(window_calls) if window_calls else math.nan,
            llm_calls=len(window_calls),
            llm_in_flight_mean=measured.llm_in_flight_mean,
            llm_in_flight_max=measured.llm_in_flight_max,
            llm_cap=measured.llm_cap,
            llm_service_s_mean=(
                statistics.fmean(e - s for s, e in window_calls) if window_calls else math.nan
            ),
            operations_mean=measured.operations_mean,
            operation_slots=measured.operation_slots,
            operations_by_replica=tuple(int(r["n"]) for r in by_worker),
            connections_mean=statistics.fmean(sampler.connections or [0]),
            connections_max=measured.connections_max,
            active_mean=statistics.fmean(sampler.active or [0]),
            active_max=max(sampler.active or [0]),
            connections_left=left,
            replica_cpu_cores=tuple(c / window_s for c in replica_cpu),
            replica_cpu_ms_per_memory=1000 * sum(replica_cpu) / max(1, consolidated),
            postgres_cpu_cores=measured.postgres_cores,
            postgres_cpu_ms_per_memory=1000 * backend_cpu / max(1, consolidated),
            window_s=window_s,
            drained=drained,
            loadavg=os.getloadavg()[0],
            verdict=verdict(measured),
        )
    finally:
        await asyncio.gather(*(stop_replica(r) for r in replicas))
        with contextlib.suppress(asyncpg.PostgresError):
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


# ---------------------------------------------------------------------------- report


def _f(value: float, digits: int = 2) -> str:
    return "—" if math.isnan(value) else f"{value:.{digits}f}"


def _fresh(f: Freshness, i: int, value: float) -> str:
    return ("≥" if f.lower_bound[i] else "") + _f(value, 1)


def render(runs: Sequence[Run]) -> str:
    """The fleet table: one column per replica count, side by side."""
    rows: list[tuple[str, list[str]]] = [
        ("offered, memories/s", [_f(r.offered_per_s, 1) for r in runs]),
        ("throughput, memories consolidated/s", [_f(r.throughput_per_s) for r in runs]),
        ("freshness p50, s", [_fresh(r.freshness, 0, r.freshness.p50_s) for r in runs]),
        ("freshness p95, s", [_fresh(r.freshness, 1, r.freshness.p95_s) for r in runs]),
        ("freshness p99, s", [_fresh(r.freshness, 2, r.freshness.p99_s) for r in runs]),
        (
            "still pending at the end / created in the window",
            [f"{r.freshness.pending} / {r.freshness.memories}" for r in runs],
        ),
        ("memories per LLM call", [_f(r.memories_per_call) for r in runs]),
        (
            "LLM calls in flight: mean / max / cap",
            [f"{_f(r.llm_in_flight_mean, 1)} / {r.llm_in_flight_max} / {r.llm_cap}" for r in runs],
        ),
        ("LLM call, mean s", [_f(r.llm_service_s_mean) for r in runs]),
        (
            "operations running: mean / slots",
            [f"{_f(r.operations_mean, 1)} / {r.operation_slots}" for r in runs],
        ),
        (
            "operations claimed per replica",
            [", ".join(str(x) for x in r.operations_by_replica) for r in runs],
        ),
        (
            "connections open: mean / max (left on the server)",
            [
                f"{_f(r.connections_mean, 1)} / {r.connections_max} ({r.connections_left})"
                for r in runs
            ],
        ),
        (
            "connections active: mean / max",
            [f"{_f(r.active_mean, 1)} / {r.active_max}" for r in runs],
        ),
        (
            "CPU per replica, cores",
            [", ".join(_f(c, 3) for c in r.replica_cpu_cores) for r in runs],
        ),
        ("replicas' CPU per memory, ms", [_f(r.replica_cpu_ms_per_memory, 1) for r in runs]),
        ("Postgres CPU, cores", [_f(r.postgres_cpu_cores, 3) for r in runs]),
        ("Postgres CPU per memory, ms", [_f(r.postgres_cpu_ms_per_memory, 1) for r in runs]),
        ("1-min load average at the end", [_f(r.loadavg) for r in runs]),
        ("where scaling stops", [r.verdict for r in runs]),
    ]
    head = "| | " + " | ".join(f"{r.replicas} replica{'s' if r.replicas > 1 else ''}" for r in runs)
    lines = [head + " |", "|---|" + "---:|" * len(runs)]
    lines += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows]
    return "\n".join(lines)


async def main(args: argparse.Namespace, log: Any) -> dict[str, Any]:
    base = QUICK if args.quick else FULL
    sizes = Sizes(
        base.name,
        tuple(int(x) for x in args.replicas.split(",")) if args.replicas else base.replicas,
        banks=args.banks or base.banks,
        rate=args.rate or base.rate,
        load_s=args.load_s or base.load_s,
        drain_s=base.drain_s,
    )
    service = Service(args.llm_max_concurrent, args.worker_concurrency, args.group_parallelism)
    latency = Latency(args.median_ms, args.p99_ms, args.ttft_ms, args.per_token_ms)
    log_dir = args.results_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    admin = await asyncpg.connect(args.database_url)
    template = f"bench_fleet_tpl_{uuid.uuid4().hex[:8]}"
    runs: list[Run] = []
    try:
        await admin.execute(f'CREATE DATABASE "{template}"')
        await asyncio.to_thread(db.migrate_sync, with_database(args.database_url, template))
        with FakeLLM(
            latency_ms=0,
            seed=7,
            log_path=log_dir / f"{template}-fake.log",
            extra_args=latency.args(),
        ) as fake:
            for n in sizes.replicas:
                log(f"fleet: {n} replica(s), {sizes.rate:g} memories/s over {sizes.banks} banks")
                runs.append(
                    await one_run(
                        args.database_url, template, n, sizes, service, fake, log_dir, log
                    )
                )
                log(f"  {runs[-1].verdict}; throughput {runs[-1].throughput_per_s:.2f}/s")
    finally:
        with contextlib.suppress(asyncpg.PostgresError):
            await admin.execute(f'DROP DATABASE IF EXISTS "{template}" WITH (FORCE)')
        await admin.close()
    return {
        "command": "python -m bench " + shlex.join(sys.argv[1:]),
        "mode": sizes.name,
        "sizes": asdict(sizes),
        "service": asdict(service),
        "latency": asdict(latency),
        "cores": os.cpu_count(),
        "runs": [asdict(r) for r in runs],
    }


def cmd_fleet(args: argparse.Namespace) -> int:
    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    results = asyncio.run(main(args, log))
    runs = [_run_from_json(r) for r in results["runs"]]
    print(render(runs))
    args.results_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    path = args.results_dir / f"fleet-{stamp}.json"
    path.write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))
    print(f"\nJSON: {path}")
    return 0


def _run_from_json(data: dict[str, Any]) -> Run:
    fresh = dict(data["freshness"])
    fresh["lower_bound"] = tuple(fresh["lower_bound"])
    values = {**data, "freshness": Freshness(**fresh)}
    for key in ("operations_by_replica", "replica_cpu_cores"):
        values[key] = tuple(values[key])
    return Run(**values)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("fleet", help="1, 2 and 4 serve replicas on one Postgres, 200 banks")
    p.add_argument(
        "--quick",
        action="store_true",
        help="20 s of load per replica count (about 2 minutes in all)",
    )
    p.add_argument("--replicas", default="", help="replica counts, comma-separated (1,2,4)")
    p.add_argument("--banks", type=int, default=0, help="banks receiving memories (200)")
    p.add_argument("--rate", type=float, default=0.0, help="memories/s offered (5)")
    p.add_argument("--load-s", type=float, default=0.0, help="seconds of load (120; quick 20)")
    default = Service()
    p.add_argument("--llm-max-concurrent", type=int, default=default.llm_max_concurrent)
    p.add_argument("--worker-concurrency", type=int, default=default.worker_concurrency)
    p.add_argument("--group-parallelism", type=int, default=default.group_parallelism)
    latency = Latency()
    p.add_argument("--median-ms", type=float, default=latency.median_ms)
    p.add_argument("--p99-ms", type=float, default=latency.p99_ms)
    p.add_argument("--ttft-ms", type=float, default=latency.ttft_ms)
    p.add_argument("--per-token-ms", type=float, default=latency.per_token_ms)
    p.add_argument(
        "--database-url",
        default=os.environ.get(
            "BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
        ),
    )
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    p.set_defaults(handler=cmd_fleet)
