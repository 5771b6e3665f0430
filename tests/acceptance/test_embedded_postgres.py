"""The embedded Postgres under real processes: a server left by a `serve` killed with SIGKILL is
adopted by the next start and stopped by its clean exit, and as root nothing outside the data
directory changes mode (starting is refused, in one line, when pgserver would change any)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from tests.conftest import embedded_postmaster_pid
from tests.support.services import Services
from tests.support.waiting import wait_for

pytestmark = pytest.mark.acceptance


def embedded_env(data_dir: Path) -> dict[str, str]:
    return {
        "CONSOLIDATION_DATA_DIR": str(data_dir),
        "CONSOLIDATION_DATABASE_URL": "",
        "CONSOLIDATION_AUTO_CONSOLIDATE": "false",
    }


def migrate(data_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "consolidation.cli", "migrate"],
        env={**os.environ, "CONSOLIDATION_LOG_FORMAT": "json", **embedded_env(data_dir)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def mode(path: Path) -> int:
    return path.stat().st_mode & 0o7777


async def test_a_server_left_by_a_killed_serve_is_adopted_and_stopped_by_the_next_clean_exit(
    open_data_dir: Path, services: Services
) -> None:
    killed = services.start("killed", embedded_env(open_data_dir))
    await killed.wait_event("service_started")
    postmaster = embedded_postmaster_pid(open_data_dir)
    assert postmaster is not None
    killed.signal(signal.SIGKILL)
    killed.wait_exit()
    assert embedded_postmaster_pid(open_data_dir) == postmaster, "SIGKILL cannot stop it"

    adopting = services.start("adopting", embedded_env(open_data_dir))
    adopted = await adopting.wait_event("embedded_postgres_adopted")
    assert adopted["dead_pids"] == [killed.proc.pid]
    await adopting.wait_event("service_started")
    assert embedded_postmaster_pid(open_data_dir) == postmaster, "the running server is reused"
    adopting.signal(signal.SIGTERM)
    assert adopting.wait_exit() == 0

    await wait_for(
        lambda: embedded_postmaster_pid(open_data_dir) is None,
        60,
        what="the clean exit to stop the adopted server",
    )


def test_starting_changes_the_mode_of_nothing_outside_the_data_directory(
    open_data_dir: Path,
) -> None:
    parent, home = open_data_dir.parent, Path.home()
    before = {parent: mode(parent), home: mode(home)}
    result = migrate(open_data_dir)
    assert result.returncode == 0, result.stderr
    assert {parent: mode(parent), home: mode(home)} == before


def test_as_root_a_data_directory_under_a_closed_one_is_refused_in_one_line(
    tmp_path: Path,
) -> None:
    locked = tmp_path / "locked"
    (locked / "data").mkdir(parents=True)
    locked.chmod(0o700)
    result = migrate(locked / "data")
    assert mode(locked) == 0o700
    if os.geteuid() != 0:
        assert result.returncode == 0, result.stderr  # pgserver changes nothing for other users
        return
    assert result.returncode == 1
    plain = []
    for line in result.stderr.splitlines():
        try:
            orjson.loads(line)
        except orjson.JSONDecodeError:
            plain.append(line)
    assert len(plain) == 1, result.stderr
    assert str(locked) in plain[0] and "CONSOLIDATION_DATABASE_URL" in plain[0]
    assert f"CONSOLIDATION_DATA_DIR={locked / 'data'}" in plain[0]
    assert not (locked / "data" / "pgdata" / "PG_VERSION").exists(), "nothing was started"
