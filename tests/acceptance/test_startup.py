"""Start-up against a database that cannot be used: the real CLI retries a server that refuses
for CONSOLIDATION_DATABASE_WAIT_S, gives up at once when waiting cannot help, and either way
exits non-zero with one line naming CONSOLIDATION_DATABASE_URL and the cause, never the
password."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from urllib.parse import urlsplit, urlunsplit

import orjson
import pytest

from tests.support.proxy import TcpProxy
from tests.support.services import Services, worker_env

pytestmark = pytest.mark.acceptance

PASSWORD = "s3cret-not-for-logs"
VERBS = {
    "serve": ["serve"],
    "migrate": ["migrate"],
    "ingest": ["ingest", "b", "-"],
    "replay": ["replay", "b"],
}


def run_cli(args: list[str], database_url: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "consolidation.cli", *args],
        env={
            **os.environ,
            "CONSOLIDATION_DATABASE_URL": database_url,
            "CONSOLIDATION_LOG_FORMAT": "json",
            "CONSOLIDATION_HTTP_PORT": "0",
            **env,
        },
        input='{"text": "a memory"}\n',
        capture_output=True,
        text=True,
        # A deadline, not a measure: a process that retries for an hour never meets it.
        timeout=120,
    )


def the_one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The process's only line that is not a JSON log record."""
    assert result.returncode == 1, result.stderr
    assert PASSWORD not in result.stdout + result.stderr
    plain = []
    for line in result.stderr.splitlines():
        try:
            orjson.loads(line)
        except orjson.JSONDecodeError:
            plain.append(line)
    assert len(plain) == 1, result.stderr
    assert plain[0].startswith("consolidation: error: ")
    assert "CONSOLIDATION_DATABASE_URL=" in plain[0]
    return plain[0]


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


@pytest.mark.parametrize("verb", VERBS)
def test_a_server_that_refuses_is_retried_then_every_verb_exits_with_one_line(verb: str) -> None:
    url = f"postgresql://app:{PASSWORD}@127.0.0.1:{closed_port()}/app"
    result = run_cli(VERBS[verb], url, CONSOLIDATION_DATABASE_WAIT_S="1.5")
    line = the_one_error_line(result)
    assert "connection refused" in line and "CONSOLIDATION_DATABASE_WAIT_S" in line
    assert "app:***@127.0.0.1" in line
    assert '"database_unreachable_retrying"' in result.stderr


def _with(url: str, *, user: str | None = None, database: str | None = None) -> str:
    parts = urlsplit(url)
    if user is not None:
        netloc = f"{user}:{PASSWORD}@{parts.netloc.rpartition('@')[2]}"
        parts = parts._replace(netloc=netloc)
    if database is not None:
        parts = parts._replace(path="/" + database)
    return urlunsplit(parts)


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("unknown database", 'database "no_such_database" does not exist'),
        ("unknown role", 'role "no_such_role" does not exist'),
        ("unknown host", "host name '-no-such-host-' not found"),
    ],
)
@pytest.mark.parametrize("verb", ["serve", "migrate"])
def test_a_cause_that_waiting_cannot_fix_fails_at_once_with_one_line(
    database_url: str, verb: str, case: str, expected: str
) -> None:
    url = {
        "unknown database": _with(database_url, database="no_such_database"),
        "unknown role": _with(database_url, user="no_such_role"),
        # Not a valid host name, so the resolver library answers "not found" without asking a
        # name server: the case holds with loopback only, where a DNS query would only say
        # "try again" (rightly retried) or time out.
        "unknown host": f"postgresql://app:{PASSWORD}@-no-such-host-:5432/app",
    }[case]
    # An hour of retrying would outlast run_cli's deadline: these must not retry at all.
    result = run_cli(VERBS[verb], url, CONSOLIDATION_DATABASE_WAIT_S="3600")
    assert expected in the_one_error_line(result)
    assert "database_unreachable_retrying" not in result.stderr


async def test_a_server_that_comes_up_within_the_wait_is_used(
    database_url: str, services: Services
) -> None:
    async with TcpProxy.in_front_of(database_url) as proxy:
        proxy.sever()
        env = worker_env(proxy.url(database_url), "http://127.0.0.1:9/v1")
        service = services.start("service", {**env, "CONSOLIDATION_DATABASE_WAIT_S": "600"})
        await service.wait_event("database_unreachable_retrying")
        proxy.restore()
        await service.wait_event("service_started")
