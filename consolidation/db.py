"""Database plumbing: which Postgres to use, asyncpg pools, and migrations at start-up."""

from __future__ import annotations

import asyncio
import importlib.util
import uuid
import warnings
from pathlib import Path
from typing import Any

import asyncpg
import orjson
import structlog

from consolidation.errors import ConfigError
from consolidation.settings import Settings

log = structlog.get_logger(__name__)

# Errors that mean "the database cannot be reached right now", not "this request or operation is
# wrong": the API answers 503, and an operation is handed back without spending an attempt.
DATABASE_DOWN: tuple[type[Exception], ...] = (
    OSError,  # refused, unreachable, DNS, TimeoutError (a client-side statement timeout)
    asyncpg.PostgresConnectionError,  # includes a session that was terminated
    asyncpg.InterfaceError,  # includes "pool is closing"
    asyncpg.exceptions.InternalClientError,  # a pooled connection the server closed
    asyncpg.exceptions.OperatorInterventionError,  # shutdown, cannot connect now, timeouts
    asyncpg.exceptions.InsufficientResourcesError,  # too many connections
)

# Arbitrary constant: replicas starting together serialise their migrations on it.
MIGRATION_LOCK_KEY = 0x636F6E73  # "cons"


def embedded_database_url(data_dir: Path) -> str:
    """Start (or reuse) the embedded Postgres under ``data_dir`` and return its URL.

    Processes sharing one data directory share the server; the last one to exit stops it.
    The data stays for the next command.
    """
    # Imported lazily: it is only needed when no URL is configured. Its platformdirs lookup
    # warns when XDG_RUNTIME_DIR is unset (containers, CI), which says nothing to our users.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from pgserver.postgres_server import get_server

    data_dir.mkdir(parents=True, exist_ok=True)
    server = get_server(data_dir / "pgdata", cleanup_mode="stop")
    url: str = server.get_uri()
    log.info("embedded_postgres", data_dir=str(data_dir / "pgdata"), url=url)
    return url


def database_url(settings: Settings) -> str:
    """The configured database URL, or the embedded server's when none is configured."""
    if settings.database_url:
        return settings.database_url
    try:
        return embedded_database_url(settings.data_dir)
    except Exception as exc:  # pgserver raises assorted errors; say which setting fixes it
        raise ConfigError(
            f"could not start the embedded Postgres under {settings.data_dir} ({exc}); "
            "set CONSOLIDATION_DATABASE_URL to use an existing server"
        ) from exc


def dumps_default(value: object) -> str:
    """orjson's ``default`` for what the database returns: asyncpg's own UUID subclass, which
    orjson does not recognise."""
    if isinstance(value, uuid.UUID):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def dumps(value: object) -> str:
    """JSON text for a json/jsonb parameter."""
    return orjson.dumps(value, default=dumps_default).decode()


async def _init_connection(conn: asyncpg.Connection) -> None:
    for name in ("json", "jsonb"):
        await conn.set_type_codec(
            name,
            encoder=dumps,
            decoder=orjson.loads,
            schema="pg_catalog",
        )


async def _keep_session(conn: asyncpg.Connection) -> None:
    """Pool connections keep no session state (LISTEN uses dedicated connections; no session
    locks, cursors or SETs), so the default reset query — one more round trip on every release —
    is skipped. asyncpg still rolls back a transaction left open before calling this."""


async def connect(url: str) -> asyncpg.Connection:
    """One connection with the project's JSON codecs (for LISTEN and one-off commands)."""
    conn: asyncpg.Connection = await asyncpg.connect(url)
    await _init_connection(conn)
    return conn


async def create_pool(
    url: str,
    *,
    min_size: int = 1,
    max_size: int = 10,
    application_name: str | None = None,
    idle_in_transaction_timeout_s: float | None = None,
) -> asyncpg.Pool:
    """An asyncpg pool with orjson codecs for json/jsonb.

    ``application_name`` names the sessions after the worker, so a worker that stalls past its
    lease can be fenced by ending its sessions (queue.terminate_stalled_workers).
    ``idle_in_transaction_timeout_s`` makes the server end a session left inside a transaction
    by a stalled client, releasing its locks.
    """
    server_settings = {}
    if application_name:
        server_settings["application_name"] = application_name[:63]
    if idle_in_transaction_timeout_s is not None:
        ms = str(max(1, int(idle_in_transaction_timeout_s * 1000)))
        server_settings["idle_in_transaction_session_timeout"] = ms
    pool: asyncpg.Pool = await asyncpg.create_pool(
        url,
        min_size=min_size,
        max_size=max_size,
        server_settings=server_settings,
        init=_init_connection,
        reset=_keep_session,
        # Statements are few and named; the cache avoids re-planning on the hot path.
        statement_cache_size=256,
    )
    return pool


def migrations_dir() -> Path:
    """The Alembic directory (``migrations/`` in the repository, installed as
    ``consolidation.migrations``)."""
    spec = importlib.util.find_spec("consolidation.migrations")
    if spec is None or spec.origin is None:
        raise ConfigError("the consolidation.migrations package is missing: reinstall the package")
    return Path(spec.origin).parent


def _alembic_config(url: str) -> Any:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.set_main_option("sqlalchemy.url", sqlalchemy_url(url).replace("%", "%%"))
    return cfg


def sqlalchemy_url(url: str) -> str:
    """The same database for SQLAlchemy's synchronous psycopg2 driver (migrations only)."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg2://" + url[len(prefix) :]
    return url


def migrate_sync(url: str, revision: str = "head") -> None:
    """Apply migrations up to ``revision`` under a Postgres advisory lock (safe for replicas)."""
    from alembic import command
    from sqlalchemy import create_engine, text
    from sqlalchemy.pool import NullPool

    cfg = _alembic_config(url)
    engine = create_engine(sqlalchemy_url(url), poolclass=NullPool)
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": MIGRATION_LOCK_KEY})
            try:
                cfg.attributes["connection"] = conn
                command.upgrade(cfg, revision)
                conn.commit()
            finally:
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": MIGRATION_LOCK_KEY})
                conn.commit()
    finally:
        engine.dispose()


def current_revision(url: str) -> str | None:
    """The revision the database is at, or None before the first migration."""
    from alembic.runtime.migration import MigrationContext
    from sqlalchemy import create_engine
    from sqlalchemy.pool import NullPool

    engine = create_engine(sqlalchemy_url(url), poolclass=NullPool)
    try:
        with engine.connect() as conn:
            rev: str | None = MigrationContext.configure(conn).get_current_revision()
            return rev
    finally:
        engine.dispose()


async def migrate(url: str) -> None:
    """Async wrapper: migrations use a synchronous driver, so keep them off the event loop."""
    await asyncio.to_thread(migrate_sync, url)


async def prepare_database(settings: Settings) -> str:
    """Resolve the database (embedded when unset) and bring its schema to head; returns the URL."""
    url = await asyncio.to_thread(database_url, settings)
    await migrate(url)
    return url
