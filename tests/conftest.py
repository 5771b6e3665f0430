"""Test databases: a real Postgres, one fresh database per test cloned from a migrated template.

The server comes from TEST_DATABASE_URL when set, else a testcontainers Postgres when a Docker
engine answers, else the embedded Postgres (pgserver). Tests never skip for want of a database.

Tests that need pgvector (embeddings) use ``vector_database_url``: the TEST_DATABASE_URL server
when it has pgvector, else the embedded Postgres (PostgreSQL 16 with pgvector, a dependency of
the package), started once per session only when such a test runs, with its own template.
"""

from __future__ import annotations

import asyncio
import functools
import os
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from consolidation import db
from consolidation.testing.fake_llm import FakeLLMConfig, FakeLLMServer

pytest_plugins = ["tests.support.fixtures"]

CONTAINER_IMAGE = "postgres:16-alpine"


def _with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + name))


def _docker_answers() -> bool:
    try:
        import docker

        docker.from_env(timeout=3).ping()
        return True
    except Exception:
        return False


@functools.cache
def _database_server() -> str:
    """Which server the run uses: "url" (TEST_DATABASE_URL), "docker" or "embedded"."""
    if os.environ.get("TEST_DATABASE_URL"):
        return "url"
    return "docker" if _docker_answers() else "embedded"


def pytest_report_header(config: pytest.Config) -> str:
    kind = _database_server()
    if kind == "docker":
        return f"database server: testcontainers {CONTAINER_IMAGE} (a Docker engine answers)"
    if kind == "embedded":
        return "database server: embedded Postgres (pgserver; no TEST_DATABASE_URL, no Docker)"
    url = os.environ["TEST_DATABASE_URL"]
    parts = urlsplit(url)
    where = f"{parts.hostname}:{parts.port or 5432}"
    return f"database server: TEST_DATABASE_URL {where}, {_server_version(url)}"


def _server_version(url: str) -> str:
    async def version() -> str:
        conn = await asyncio.wait_for(asyncpg.connect(url), 5)
        try:
            return str(await conn.fetchval("SHOW server_version"))
        finally:
            await conn.close()

    try:
        return f"PostgreSQL {asyncio.run(version())}"
    except Exception as exc:
        return f"not answering ({type(exc).__name__}: {exc})"


@pytest.fixture(scope="session")
def pg_admin_url() -> Iterator[str]:
    """A URL to a Postgres server where tests may create and drop databases."""
    kind = _database_server()
    if kind == "url":
        yield os.environ["TEST_DATABASE_URL"]
        return
    if kind == "docker":
        from testcontainers.postgres import PostgresContainer

        with PostgresContainer(CONTAINER_IMAGE, driver=None) as container:
            yield container.get_connection_url()
        return
    from pgserver.postgres_server import get_server

    with tempfile.TemporaryDirectory(prefix="consolidation-tests-") as tmp:
        server = get_server(tmp, cleanup_mode="stop")
        yield server.get_uri()
        server.cleanup()


async def _admin(url: str, *statements: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()


def _migrated_template(admin_url: str, prefix: str) -> Iterator[str]:
    import asyncio

    name = f"{prefix}_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    asyncio.run(_admin(admin_url, f'CREATE DATABASE "{name}"'))
    db.migrate_sync(_with_database(admin_url, name))
    yield name
    asyncio.run(_admin(admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


async def _clone(admin_url: str, template: str, prefix: str) -> AsyncIterator[str]:
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    await _admin(admin_url, f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    yield _with_database(admin_url, name)
    await _admin(admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def template_name(pg_admin_url: str) -> Iterator[str]:
    """A database migrated to head, cloned by every test (much faster than migrating each)."""
    yield from _migrated_template(pg_admin_url, "consolidation_tpl")


@pytest.fixture
async def database_url(pg_admin_url: str, template_name: str) -> AsyncIterator[str]:
    """A fresh, migrated database for this test alone."""
    async for url in _clone(pg_admin_url, template_name, "consolidation_t"):
        yield url


@pytest.fixture
async def empty_database_url(pg_admin_url: str) -> AsyncIterator[str]:
    """A fresh database with no schema at all (for migration tests)."""
    name = f"consolidation_e_{uuid.uuid4().hex[:12]}"
    await _admin(pg_admin_url, f'CREATE DATABASE "{name}"')
    yield _with_database(pg_admin_url, name)
    await _admin(pg_admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
async def pool(database_url: str) -> AsyncIterator[asyncpg.Pool]:
    p = await db.create_pool(database_url, min_size=1, max_size=10)
    yield p
    await p.close()


async def _has_pgvector(url: str) -> bool:
    conn = await asyncpg.connect(url)
    try:
        return bool(
            await conn.fetchval(
                "SELECT EXISTS (SELECT 1 FROM pg_available_extensions WHERE name = 'vector')"
            )
        )
    finally:
        await conn.close()


@pytest.fixture(scope="session")
def vector_admin_url(pg_admin_url: str) -> Iterator[str]:
    """A Postgres server with pgvector where tests may create databases: the main test server
    when it has the extension, else the embedded one (never a skip)."""
    import asyncio

    if asyncio.run(_has_pgvector(pg_admin_url)):
        yield pg_admin_url
        return
    from pgserver.postgres_server import get_server

    with tempfile.TemporaryDirectory(prefix="consolidation-vector-tests-") as tmp:
        server = get_server(tmp, cleanup_mode="stop")
        print(f"\n[tests] pgvector server: embedded Postgres in {tmp}")
        try:
            yield server.get_uri()
        finally:
            server.cleanup()


@pytest.fixture(scope="session")
def vector_template_name(vector_admin_url: str) -> Iterator[str]:
    """A database migrated to head on the pgvector server (so it has the embedding columns)."""
    yield from _migrated_template(vector_admin_url, "consolidation_vtpl")


@pytest.fixture
async def vector_database_url(
    vector_admin_url: str, vector_template_name: str
) -> AsyncIterator[str]:
    """A fresh, migrated database with pgvector for this test alone."""
    async for url in _clone(vector_admin_url, vector_template_name, "consolidation_v"):
        yield url


@pytest.fixture
async def vector_pool(vector_database_url: str) -> AsyncIterator[asyncpg.Pool]:
    p = await db.create_pool(vector_database_url, min_size=1, max_size=10)
    yield p
    await p.close()


@pytest.fixture
def fake() -> Iterator[FakeLLMServer]:
    """The project's fake OpenAI-compatible LLM over real HTTP on loopback, fresh per test."""
    with FakeLLMServer(FakeLLMConfig()) as server:
        yield server


def embedded_postmaster_pid(data_dir: Path) -> int | None:
    """The pid of the embedded Postgres running on ``data_dir``'s pgdata, None when none is."""
    try:
        pid = int((data_dir / "pgdata" / "postmaster.pid").read_text().split()[0])
        os.kill(pid, 0)
    except (FileNotFoundError, IndexError, ValueError, ProcessLookupError):
        return None
    return pid


@pytest.fixture
def open_data_dir() -> Iterator[Path]:
    """A ``CONSOLIDATION_DATA_DIR`` (not yet created) whose parents everyone may enter, so that
    the embedded Postgres may start there as root; its server is stopped and all removed after.

    pytest's own tmp_path lies under a 0700 directory, where, as root, starting is refused.
    """
    parent = Path(tempfile.mkdtemp(prefix="consolidation-data-"))
    parent.chmod(0o755)
    data_dir = parent / "data"
    yield data_dir
    pid = embedded_postmaster_pid(data_dir)
    if pid is not None:
        os.kill(pid, signal.SIGINT)  # Postgres' fast shutdown
        deadline = time.monotonic() + 60
        while embedded_postmaster_pid(data_dir) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
    shutil.rmtree(parent, ignore_errors=True)
