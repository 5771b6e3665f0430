"""The benchmark's outside world: bench databases on a Postgres server and the fake LLM process.

Databases are named ``bench_*``: one migrated template per bank shape (ingested once, then
``VACUUM ANALYZE``), cloned for every run (``CREATE DATABASE … TEMPLATE``) so every run starts
from the identical bank, and dropped at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import httpx
import orjson

from bench.perf.workload import BankShape, chunks
from consolidation import db, store
from consolidation.memories import parse_memories

BANK = "bench"
INGEST_CHUNK = 1000


def with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + name))


async def _admin(url: str, *statements: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()


class Databases:
    """Creates, clones and drops this benchmark's ``bench_*`` databases."""

    def __init__(self, admin_url: str) -> None:
        self.admin_url = admin_url
        self.tag = f"{os.getpid()}_{uuid.uuid4().hex[:6]}"
        self._templates: dict[str, str] = {}
        self._created: list[str] = []

    async def template(self, shape: BankShape, log: Any = print) -> tuple[str, float]:
        """A migrated database holding ``shape``'s bank (made once per shape); (name, seconds)."""
        key = shape.key()
        if key in self._templates:
            return self._templates[key], 0.0
        name = f"bench_tpl_{self.tag}_{len(self._templates)}"
        url = await self.migrated(name)
        extra_sql = os.environ.get("BENCH_TEMPLATE_SQL")
        if extra_sql:
            # Schema a proposed engine change needs (with BENCH_OVERLAY), e.g. a new function.
            await _admin(url, await asyncio.to_thread(Path(extra_sql).read_text))
        started = time.perf_counter()
        await ingest(url, shape, log)
        seconds = time.perf_counter() - started
        await _admin(url, "VACUUM ANALYZE")
        self._templates[key] = name
        return name, seconds

    async def migrated(self, name: str) -> str:
        """A new, empty database migrated to the current schema; returns its URL."""
        await _admin(self.admin_url, f'CREATE DATABASE "{name}"')
        self._created.append(name)
        url = with_database(self.admin_url, name)
        await asyncio.to_thread(db.migrate_sync, url)
        return url

    async def clone(self, template: str) -> str:
        """A fresh copy of a template; returns its URL."""
        name = f"bench_run_{self.tag}_{uuid.uuid4().hex[:8]}"
        await _admin(self.admin_url, f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
        self._created.append(name)
        return with_database(self.admin_url, name)

    async def drop(self, url_or_name: str) -> None:
        name = urlsplit(url_or_name).path.lstrip("/") if "://" in url_or_name else url_or_name
        await _admin(self.admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        if name in self._created:
            self._created.remove(name)

    async def drop_all(self) -> None:
        for name in list(self._created):
            await self.drop(name)
        self._templates.clear()


async def ingest(url: str, shape: BankShape, log: Any = print) -> None:
    """Validate and ingest the bank in chunks (``store.ingest_memories``, one transaction each)."""
    pool = await db.create_pool(url, min_size=1, max_size=2)
    try:
        done = 0
        last = time.monotonic()
        for chunk in chunks(shape, INGEST_CHUNK):
            await store.ingest_memories(pool, BANK, parse_memories(chunk))
            done += len(chunk)
            if time.monotonic() - last > 10:
                log(f"  ingested {done}/{shape.memories} memories")
                last = time.monotonic()
    finally:
        await pool.close()


def stop_process(process: subprocess.Popen[bytes] | None, grace_s: float) -> None:
    """SIGINT a child server (it shuts down cleanly), SIGKILL it after ``grace_s``."""
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class FakeLLM:
    """``consolidation fake-llm`` in its own process on a free loopback port."""

    def __init__(
        self,
        *,
        latency_ms: float,
        jitter_ms: float = 0.0,
        pad_bytes: int = 0,
        seed: int = 1,
        log_path: Path,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.extra_args = tuple(extra_args)
        self.latency_ms = latency_ms
        self.jitter_ms = jitter_ms
        self.pad_bytes = pad_bytes
        self.seed = seed
        self.log_path = log_path
        self.url = ""
        self._process: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "consolidation.cli",
            "fake-llm",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--latency-ms",
            f"{self.latency_ms:g}",
            "--jitter-ms",
            f"{self.jitter_ms:g}",
            "--pad-bytes",
            str(self.pad_bytes),
            "--seed",
            str(self.seed),
            *self.extra_args,
        ]

    def __enter__(self) -> FakeLLM:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "CONSOLIDATION_LOG_FORMAT": "json", "CONSOLIDATION_LOG_LEVEL": "INFO"}
        with self.log_path.open("wb") as log:
            self._process = subprocess.Popen(
                self.command(), stdout=log, stderr=log, env=env, stdin=subprocess.DEVNULL
            )
        deadline = time.monotonic() + 30
        while not self.url:
            if self._process.poll() is not None:
                raise RuntimeError(f"fake-llm exited; see {self.log_path}")
            if time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise RuntimeError(f"fake-llm did not start; see {self.log_path}")
            for line in self.log_path.read_bytes().splitlines():
                if b"fake_llm_listening" in line:
                    self.url = orjson.loads(line)["url"]
                    break
            else:
                time.sleep(0.05)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        process, self._process = self._process, None
        stop_process(process, grace_s=10)

    @property
    def pid(self) -> int:
        assert self._process is not None
        return self._process.pid

    def _admin_url(self, path: str) -> str:
        return self.url.removesuffix("/v1") + path

    def reset(self) -> None:
        httpx.post(self._admin_url("/_reset"), timeout=10).raise_for_status()

    def control(self, **changes: Any) -> None:
        """Change the fake's config fields (``FakeLLMConfig``) for the next requests."""
        httpx.post(self._admin_url("/_control"), json=changes, timeout=10).raise_for_status()

    def calls(self) -> list[dict[str, Any]]:
        """The calls the fake recorded since its last reset, in arrival order."""
        response = httpx.get(self._admin_url("/_stats"), timeout=60)
        response.raise_for_status()
        calls: list[dict[str, Any]] = response.json()["calls"]
        return calls

    def stats(self) -> dict[str, Any]:
        """The fake's counters (without the per-call list, which can be long)."""
        response = httpx.get(self._admin_url("/_stats"), timeout=30)
        response.raise_for_status()
        data: dict[str, Any] = response.json()
        calls = [c for c in data.pop("calls", []) if c["ended"] is not None]
        data["call_intervals"] = logical_calls(calls)
        # Time the fake spent on each call (its latency plus its own processing), as it saw it.
        served = sorted(c["ended"] - c["started"] for c in calls)
        data["in_flight_share"] = in_flight_share(calls)
        data["service_ms_mean"] = 1000 * sum(served) / len(served) if served else None
        data["service_ms_p50"] = 1000 * served[len(served) // 2] if served else None
        return data


def logical_calls(calls: list[dict[str, Any]]) -> list[tuple[float, float, list[str]]]:
    """(start, end, scope) of each call as the engine waited for it. A hedge's copy (the same
    request, sent while the first was in flight) makes one call with its first: from the first's
    start to the earliest answer (status 200) of the two, or the later end when neither was
    answered. Retries, sent after their failed request ended, stay calls of their own."""
    merged: list[tuple[float, float, list[str]]] = []
    by_request: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for call in sorted(calls, key=lambda c: c["started"]):
        by_request[(tuple(call["scope"]), tuple(call.get("fact_texts", ())))].append(call)
    for group in by_request.values():
        overlapping: list[dict[str, Any]] = []
        for next_call in [*group, None]:
            if overlapping and (
                next_call is None or next_call["started"] >= max(c["ended"] for c in overlapping)
            ):
                answered = [c["ended"] for c in overlapping if c.get("status") == 200]
                end = min(answered) if answered else max(c["ended"] for c in overlapping)
                merged.append((overlapping[0]["started"], end, overlapping[0]["scope"]))
                overlapping = []
            if next_call is not None:
                overlapping.append(next_call)
    return sorted(merged)


def in_flight_share(calls: list[dict[str, Any]]) -> dict[str, float]:
    """Share of the time from the first call's start to the last call's end during which
    ``k`` calls were in flight, for each ``k`` (how busy the engine kept its slots)."""
    events = sorted([(c["started"], 1) for c in calls] + [(c["ended"], -1) for c in calls])
    if not events:
        return {}
    spent: dict[int, float] = {}
    in_flight, last = 0, events[0][0]
    for at, change in events:
        spent[in_flight] = spent.get(in_flight, 0.0) + at - last
        in_flight, last = in_flight + change, at
    total = events[-1][0] - events[0][0]
    return {str(k): round(v / total, 4) for k, v in sorted(spent.items())} if total else {}


@contextlib.asynccontextmanager
async def pgvector_server(admin_url: str, log: Any = print) -> AsyncIterator[str]:
    """A Postgres server with pgvector where bench databases may be created: ``admin_url``'s
    when it has the extension, else the embedded one (PostgreSQL 16 with pgvector) in a
    temporary directory, stopped on exit."""
    conn = await asyncpg.connect(admin_url)
    try:
        available = await conn.fetchval(
            "SELECT EXISTS (SELECT 1 FROM pg_available_extensions WHERE name = 'vector')"
        )
    finally:
        await conn.close()
    if available:
        yield admin_url
        return
    from pgserver.postgres_server import get_server

    with tempfile.TemporaryDirectory(prefix="bench-pgvector-") as tmp:
        server = get_server(tmp, cleanup_mode="stop")
        log("  no pgvector on BENCH_DATABASE_URL's server: using the embedded Postgres")
        try:
            yield server.get_uri()
        finally:
            server.cleanup()


async def start_serve(
    args: Sequence[str],
    env: dict[str, str],
    log_path: Path,
    ready: Callable[[bytes], bool],
    *,
    deadline_s: float = 60,
) -> asyncio.subprocess.Process:
    """``consolidation serve ARGS`` in ``env``, its log in ``log_path``; returns once
    ``ready(log so far)`` holds, and kills it if it exits or the deadline passes first."""
    with log_path.open("wb") as out:
        process = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "consolidation.cli", "serve", *args),
            env=env,
            stdout=out,
            stderr=asyncio.subprocess.STDOUT,
            stdin=asyncio.subprocess.DEVNULL,
        )
    deadline = time.monotonic() + deadline_s
    while not ready(await asyncio.to_thread(log_path.read_bytes)):
        if process.returncode is not None or time.monotonic() > deadline:
            if process.returncode is None:
                process.kill()
                await process.wait()
            raise RuntimeError(f"consolidation serve did not start; see {log_path}")
        await asyncio.sleep(0.05)
    return process


async def start_worker(settings: dict[str, str], log_path: Path) -> asyncio.subprocess.Process:
    """``consolidation serve --no-api`` with ``settings`` (full CONSOLIDATION_* names) added to
    the environment, JSON log in ``log_path``; returns once it logged ``worker_started``."""
    env = {**os.environ, "CONSOLIDATION_LOG_FORMAT": "json", **settings}
    return await start_serve(["--no-api"], env, log_path, lambda log: b"worker_started" in log)
