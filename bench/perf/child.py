"""Run ONE consolidation operation in this (fresh) process and print its measurements as JSON.

``python -m bench.perf.child RESULT.json`` reads a :class:`RunSpec` as JSON on stdin and writes a
JSON result to RESULT.json; logs go to stderr (the driver sends them to a file). One process per
run keeps runs independent and makes peak RSS (``ru_maxrss``) the engine's own.

What it does: opens an asyncpg pool like ``db.create_pool`` (plus a query logger that counts
statements per wave), an :class:`HTTPConsolidator` pointed at the fake LLM, starts a foreground
operation (``queue.start_foreground``) and runs ``engine.run_operation`` on it while an
:class:`EventLoopLagMonitor` samples the loop. ``WavePipeline._next_wave`` is wrapped (in this
process only) so each wave is planned by :class:`bench.perf.plan.PlanTracker` and timed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import resource
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import orjson

from bench.perf.plan import PlanTracker
from consolidation import db, queue, runtime, store
from consolidation.engine import run_operation
from consolidation.engine.waves import WavePipeline
from consolidation.llm.embeddings import build_embedder, require_vector_storage
from consolidation.logs import configure_logging
from consolidation.metrics import EventLoopLagMonitor
from consolidation.settings import load_settings


@dataclass(frozen=True)
class RunSpec:
    database_url: str
    bank: str
    llm_url: str
    latency_ms: float
    # Settings fields (CONSOLIDATION_* without the prefix) that differ from the defaults.
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    count_statements: bool = True
    lag_interval_s: float = 0.02
    # "pyinstrument": <profile_out>.txt, -flat.txt, -all.txt; "py-spy" (started by the runner
    # around this process): <profile_out>.collapsed; "perf" (likewise, sampling only while
    # perf_control, "control-fifo,ack-fifo", is switched on around the operation):
    # <profile_out>.perf.data
    profile: str | None = None
    profile_out: str | None = None
    perf_control: str | None = None
    log_level: str = "INFO"
    loop: str = "auto"  # CONSOLIDATION_EVENT_LOOP: auto (as the service), uvloop or asyncio
    # Time every event-loop callback and report the slowest (diagnoses lag; costs ~1 µs each).
    trace_callbacks: bool = False
    # Write the run's database work to this file (bench/perf/dbonly.py), or replay such a file
    # instead of running the engine.
    record_to: str | None = None
    replay_from: str | None = None


def _statement_names() -> dict[str, str]:
    names: dict[str, str] = {"BEGIN;": "begin", "COMMIT;": "commit", "BEGIN": "begin"}
    for module in (store, queue):
        for attr, value in vars(module).items():
            if attr.isupper() and isinstance(value, str) and len(value) > 20:
                names[value] = attr.lower()
    return names


# The engine's recalls: one statement holds any number of them (store.recall_statement).
_RECALL_PREFIX = store.recall_statement(1, hybrid=False).split("FROM")[0]


def _statement_name(query: str) -> str:
    if query.lstrip().startswith("SELECT pg_advisory_unlock_all()"):
        return "pool_reset"  # asyncpg's Connection.reset() when a connection goes back
    if query.startswith(_RECALL_PREFIX):
        return "recall_hybrid" if "consolidation_recall_hybrid_v1" in query else "recall"
    return " ".join(query.split())[:40]


class LagMonitor(EventLoopLagMonitor):
    """The service's monitor with a window holding the whole run; no per-sample publishing
    (sorting a large window ten times a second would itself lag the loop)."""

    def _publish(self) -> None:
        pass


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _BackendCPU:
    """CPU of the Postgres backends serving this run's pool (their pids are taken as the pool
    opens connections), sampled every half second so a connection the pool closes during a
    long run still counts."""

    def __init__(self) -> None:
        self.pids: set[int] = set()
        self._baseline: dict[int, float] = {}
        self._last: dict[int, float] = {}
        self._task: asyncio.Task[None] | None = None

    def _sample(self) -> None:
        for pid in self.pids:
            cpu = proc_cpu_s(pid)
            if cpu > 0:
                self._last[pid] = cpu

    def start(self) -> None:
        self._sample()
        self._baseline = dict(self._last)

        async def every_half_second() -> None:
            while True:
                await asyncio.sleep(0.5)
                self._sample()

        self._task = asyncio.create_task(every_half_second())

    async def stop(self) -> float:
        """CPU seconds since :meth:`start`; a backend first seen later counts in full."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._sample()
        return sum(cpu - self._baseline.get(pid, 0.0) for pid, cpu in self._last.items())


@contextlib.contextmanager
def _backend_pids(
    backends: _BackendCPU, on_query: Callable[[Any], None] | None = None
) -> Iterator[None]:
    """Pools created within: each connection's backend is told to ``backends`` (and gets the
    query logger ``on_query``) by wrapping db.create_pool's connection initialiser, which a
    pool keeps for the connections it opens later."""
    init_connection = db._init_connection

    async def init(conn: asyncpg.Connection) -> None:
        await init_connection(conn)
        backends.pids.add(conn.get_server_pid())
        if on_query is not None:
            conn.add_query_logger(on_query)

    db._init_connection = init
    try:
        yield
    finally:
        db._init_connection = init_connection


async def _perf(control: str | None, command: str) -> None:
    """Switch the ``perf record`` around this process on or off (``perf --control``), so its
    samples are the operation's and not the interpreter's start-up; returns once perf acks."""
    if control is None:
        return
    fifo, ack = control.split(",")

    def send() -> None:
        with open(fifo, "w") as ctl, open(ack, "rb") as reply:
            ctl.write(command + "\n")
            ctl.flush()
            reply.read(4)

    await asyncio.to_thread(send)


def _where(handle: asyncio.events.Handle) -> str:
    """The innermost frame a task's coroutine chain is suspended at (or the callback)."""
    callback = getattr(handle, "_callback", None)
    task = getattr(callback, "__self__", None)
    if not isinstance(task, asyncio.Task):
        return getattr(callback, "__qualname__", repr(callback))
    coro: Any = task.get_coro()
    frame = None
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None) or frame
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    if frame is None:
        return "task (done)"
    name = frame.f_code.co_filename.rsplit("site-packages/", 1)[-1].replace("/work/main/", "")
    return f"{frame.f_code.co_qualname} {name}:{frame.f_lineno}"


class _CallbackTimer:
    """Wraps ``asyncio.Handle._run`` to keep the slowest callbacks (what blocks the loop)."""

    def __init__(self, keep: int = 15) -> None:
        self.keep = keep
        self.slowest: list[tuple[float, str]] = []
        self.over_5ms: Counter[str] = Counter()
        self._original = asyncio.events.Handle._run

    def __enter__(self) -> _CallbackTimer:
        timer, original = self, self._original

        # Named as in the method it stands in for, so its signature matches Handle._run's.
        def _run(self: asyncio.events.Handle) -> None:
            resumed = _where(self)
            started = time.perf_counter()
            try:
                original(self)
            finally:
                elapsed = time.perf_counter() - started
                if elapsed > 0.005:
                    timer._record(elapsed, f"{resumed} -> {_where(self)}")

        asyncio.events.Handle._run = _run  # type: ignore[method-assign]
        return self

    def _record(self, elapsed: float, where: str) -> None:
        self.over_5ms[where] += 1
        self.slowest.append((elapsed, where))
        self.slowest.sort(reverse=True)
        del self.slowest[self.keep :]

    def __exit__(self, *exc: object) -> None:
        asyncio.events.Handle._run = self._original  # type: ignore[method-assign]

    def to_json(self) -> dict[str, Any]:
        return {
            "slowest_ms": [(round(e * 1000, 2), w) for e, w in self.slowest],
            "over_5ms": dict(self.over_5ms.most_common(15)),
        }


async def _result_digest(pool: asyncpg.Pool, bank: str) -> dict[str, Any]:
    """What the run produced, independent of ids and timestamps: two runs of one bank that
    made the same decisions have the same digest (whatever the parallelism or the code path)."""
    row = await pool.fetchrow(
        """
        SELECT
          (SELECT md5(string_agg(array_to_string(o.scope, ',') || '|' || o.text || '|' ||
                                 (SELECT count(*) FROM observation_sources s
                                   WHERE s.observation_id = o.id), E'\n'
                                 ORDER BY o.scope, o.text))
             FROM observations o WHERE o.bank_id = $1) AS observations_md5,
          (SELECT count(*) FROM observations WHERE bank_id = $1) AS observations,
          (SELECT count(*) FROM observation_history WHERE bank_id = $1) AS history,
          (SELECT count(*) FROM consolidation_outcomes c JOIN memories m ON m.id = c.memory_id
            WHERE m.bank_id = $1) AS outcomes,
          (SELECT count(*) FROM memories WHERE bank_id = $1 AND consolidated_at IS NULL)
            AS unmarked
        """,
        bank,
    )
    return dict(row)


def _write_profile(profiler: Any, out: str) -> None:
    from pyinstrument.renderers import ConsoleRenderer

    session = profiler.last_session
    assert session is not None
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    for suffix, renderer in (
        (".txt", ConsoleRenderer(unicode=True, color=False)),
        ("-flat.txt", ConsoleRenderer(unicode=True, color=False, flat=True)),
        ("-all.txt", ConsoleRenderer(unicode=True, color=False, show_all=True)),
    ):
        Path(out + suffix).write_text(renderer.render(session))


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


async def run(spec: RunSpec) -> dict[str, Any]:
    settings = load_settings(
        **{"llm_base_url": spec.llm_url, "llm_model": "fake", "llm_timeout_s": 120, "lease_s": 60}
        | spec.settings
    )
    tracker = PlanTracker(settings.llm_batch_size)
    statements: Counter[str] = Counter()
    statement_seconds: Counter[str] = Counter()
    names = _statement_names()

    counting = False

    def on_query(record: Any) -> None:
        if not counting:
            return
        query = record.query
        name = names.get(query) or names.get(query.strip()) or _statement_name(query)
        wave = tracker.current
        if wave is not None:
            wave.statements[name] = wave.statements.get(name, 0) + 1
        else:
            statements[name] += 1
        statement_seconds[name] += record.elapsed

    # The pool comes from db.create_pool itself (so any change there is measured); its
    # connection initialiser is wrapped to add the query logger.
    backends = _BackendCPU()
    with _backend_pids(backends, on_query if spec.count_statements else None):
        # The replay's pool, session options and warm connections (cli._replay /
        # runtime.open_runtime and foreground_pool).
        size, warm = runtime.foreground_pool(settings.group_parallelism)
        pool = await db.create_pool(
            spec.database_url,
            min_size=warm,
            max_size=size,
            application_name="bench-worker",
            timeouts=db.Timeouts.for_lease(60.0),
        )
    llm = runtime.build_consolidator(settings)
    # With embeddings (the fake's /v1/embeddings): the service's client and start-up check.
    embedder = build_embedder(settings)
    if embedder is not None:
        async with pool.acquire() as conn:
            await require_vector_storage(conn)
    await store.warm(pool, warm, hybrid=embedder is not None)
    next_wave = WavePipeline._next_wave

    async def planned_next_wave(pipeline: WavePipeline) -> list[store.WaveMemory]:
        started = time.monotonic()
        wave = await next_wave(pipeline)
        if wave:
            tracker.add_wave(wave, started)
        else:
            tracker.close(started)
        return wave

    WavePipeline._next_wave = planned_next_wave  # type: ignore[method-assign,assignment]
    recorder = None
    if spec.record_to:
        from bench.perf.dbonly import Recorder

        recorder = Recorder()
        recorder.install()
    profiler = None
    try:
        lease = await queue.start_foreground(pool, spec.bank, "bench-worker", 60.0)
        rss_before = _rss_mb()
        monitor = LagMonitor(interval_s=spec.lag_interval_s, window=10_000_000)
        if spec.profile == "pyinstrument":
            from pyinstrument import Profiler

            profiler = Profiler(interval=0.0005, async_mode="disabled")
            profiler.start()
        backends.start()
        counting = True
        timer = _CallbackTimer() if spec.trace_callbacks else None
        with timer or contextlib.nullcontext():
            async with monitor:
                await _perf(spec.perf_control, "enable")
                cpu_before = _cpu_s()
                started = time.perf_counter()
                end = await run_operation(pool, lease, llm, settings, embedder=embedder)
                wall = time.perf_counter() - started
                engine_cpu = _cpu_s() - cpu_before
                await _perf(spec.perf_control, "disable")
        counting = False
        if profiler is not None:
            profiler.stop()
        lag = monitor.snapshot()
        backend_cpu = await backends.stop()
        digest = await _result_digest(pool, spec.bank)
    finally:
        if recorder is not None:
            recorder.uninstall()
            await asyncio.to_thread(Path(str(spec.record_to)).write_bytes, recorder.dump())
        WavePipeline._next_wave = next_wave  # type: ignore[method-assign]
        await llm.aclose()
        if embedder is not None:
            await embedder.aclose()
        await pool.close()
    if profiler is not None and spec.profile_out:
        _write_profile(profiler, spec.profile_out)
    latency_s = spec.latency_ms / 1000.0
    concurrency = min(settings.group_parallelism, settings.llm_max_concurrent)
    waves = [w.to_json(latency_s, concurrency) for w in tracker.waves]
    markers = [w["statements"].get("commit_marker", 0) for w in waves]
    per_wave_statements = [sum(w["statements"].values()) for w in waves]
    return {
        "spec": dataclasses.asdict(spec),
        "status": end.status,
        "error": end.error,
        "wall_s": wall,
        "engine_cpu_s": engine_cpu,
        "postgres_cpu_s": backend_cpu,
        "summary": end.summary.to_json(),
        "digest": digest,
        "plan": tracker.summary(latency_s, concurrency),
        "scope_chains": tracker.scope_chains(),
        "waves": waves,
        "marker_statements_per_wave": {
            "min": min(markers, default=0),
            "max": max(markers, default=0),
        },
        "statements_per_wave_mean": (
            sum(per_wave_statements) / len(per_wave_statements) if per_wave_statements else 0
        ),
        "statements_outside_waves": dict(statements),
        "statement_seconds": {k: round(v, 6) for k, v in statement_seconds.most_common()},
        "lag": lag,
        "slow_callbacks": timer.to_json() if timer is not None else None,
        "rss_before_mb": rss_before,
        "peak_rss_mb": _peak_rss_mb(),
        "python": sys.version.split()[0],
        "event_loop": runtime.event_loop_name(spec.loop),
    }


async def replay(spec: RunSpec) -> dict[str, Any]:
    from bench.perf.dbonly import replay as replay_recording

    settings = load_settings(**spec.settings)
    assert spec.replay_from is not None
    recording = await asyncio.to_thread(Path(spec.replay_from).read_bytes)
    backends = _BackendCPU()
    with _backend_pids(backends):
        return await replay_recording(
            spec.database_url, recording, settings.group_parallelism, backends
        )


def main() -> None:
    spec = RunSpec(**orjson.loads(sys.stdin.buffer.read()))
    configure_logging("json", spec.log_level)
    runtime.tune_gc()  # as the consolidation command does
    result = runtime.run(replay(spec) if spec.replay_from else run(spec), spec.loop)
    # A file rather than stdout: a profiler wrapping this process may print on stdout.
    Path(sys.argv[1]).write_bytes(orjson.dumps(result))


if __name__ == "__main__":
    main()
