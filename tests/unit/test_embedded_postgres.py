"""The embedded Postgres as root: what pgserver will change on the machine is known (and logged)
before it happens, and the default data directory keeps it away from the home directory."""

from __future__ import annotations

import pwd
import shutil
from pathlib import Path

import pytest

from consolidation.db import (
    EMBEDDED_OS_USER,
    check_embedded_data_version,
    database_url,
    embedded_major_version,
    embedded_root_side_effects,
)
from consolidation.errors import ConfigError
from consolidation.settings import default_data_dir, load_settings


def test_as_root_the_default_data_directory_is_outside_the_home(tmp_path: Path) -> None:
    in_home = tmp_path / ".local" / "share" / "consolidation"
    assert default_data_dir(euid=1000, home=tmp_path) == in_home
    assert default_data_dir(euid=0, home=tmp_path) == Path("/var/lib/consolidation")
    # A database already there stays in use (upgrading must not lose it).
    (in_home / "pgdata").mkdir(parents=True)
    (in_home / "pgdata" / "PG_VERSION").write_text("18\n")
    assert default_data_dir(euid=0, home=tmp_path) == in_home


def test_the_side_effects_name_every_directory_pgserver_will_open(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    (locked / "open" / "data").mkdir(parents=True)
    (locked / "open").chmod(0o755)
    locked.chmod(0o700)
    binaries = tmp_path / "venv" / "pginstall" / "bin"
    binaries.mkdir(parents=True)
    (tmp_path / "venv").chmod(0o750)
    pgdata = locked / "open" / "data" / "pgdata"

    effects = embedded_root_side_effects(pgdata, euid=0, binaries=binaries)

    assert effects is not None
    assert locked in effects.opened and tmp_path / "venv" in effects.opened
    assert locked / "open" not in effects.opened
    try:
        pwd.getpwnam(EMBEDDED_OS_USER)
        assert not effects.creates_user
    except KeyError:
        assert effects.creates_user
    line = effects.describe()
    assert "\n" not in line and str(locked) in line and str(pgdata) in line
    assert "CONSOLIDATION_DATABASE_URL" in line
    assert (locked.stat().st_mode & 0o777) == 0o700, "reading the effects changes nothing"


def test_not_as_root_the_embedded_postgres_has_no_side_effects(tmp_path: Path) -> None:
    assert embedded_root_side_effects(tmp_path / "pgdata", euid=1000) is None


def test_a_data_directory_of_another_postgres_major_is_refused_before_starting(
    tmp_path: Path,
) -> None:
    embedded = embedded_major_version()
    assert embedded.isdigit()
    pgdata = tmp_path / "pgdata"
    pgdata.mkdir()
    (pgdata / "PG_VERSION").write_text("18\n" if embedded != "18" else "17\n")
    settings = load_settings(data_dir=tmp_path)

    with pytest.raises(ConfigError) as caught:
        database_url(settings)

    message = str(caught.value)
    assert f"embedded Postgres is PostgreSQL {embedded}" in message
    assert "CONSOLIDATION_DATABASE_URL" in message and "\n" not in message
    assert sorted(p.name for p in pgdata.iterdir()) == ["PG_VERSION"]  # nothing started there
    # Its own version, or a new directory, passes.
    (pgdata / "PG_VERSION").write_text(f"{embedded}\n")
    check_embedded_data_version(pgdata)
    check_embedded_data_version(tmp_path / "new")


def test_programs_behind_a_closed_directory_are_copied_under_the_data_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A virtualenv under /root (0700): the programs are run from a copy under the data
    directory, with their shared libraries, and the closed directory keeps its mode."""
    import subprocess

    from pgserver import _commands, postgres_server

    from consolidation.db import relocate_embedded_binaries

    installed = Path(_commands.POSTGRES_BIN_PATH).parent.parent  # site-packages/pgserver
    closed = tmp_path / "home"
    site = closed / "venv" / "site-packages"
    site.mkdir(parents=True)
    shutil.copytree(installed / "pginstall", site / "pgserver" / "pginstall", symlinks=True)
    if (installed.parent / "pgserver.libs").is_dir():
        shutil.copytree(installed.parent / "pgserver.libs", site / "pgserver.libs", symlinks=True)
    closed.chmod(0o700)
    monkeypatch.setattr(_commands, "POSTGRES_BIN_PATH", site / "pgserver" / "pginstall" / "bin")
    monkeypatch.setattr(postgres_server, "POSTGRES_BIN_PATH", _commands.POSTGRES_BIN_PATH)
    data_dir = tmp_path / "data"
    data_dir.mkdir()

    binaries = relocate_embedded_binaries(data_dir)

    assert binaries.is_relative_to(data_dir)
    # pgserver's postgres_server imports the path without re-exporting it: only its name is read.
    pinned = postgres_server.POSTGRES_BIN_PATH  # type: ignore[attr-defined]
    assert _commands.POSTGRES_BIN_PATH == binaries == pinned
    version = subprocess.run(
        [str(binaries / "postgres"), "-V"], capture_output=True, text=True, check=True
    )
    assert "PostgreSQL" in version.stdout
    assert closed.stat().st_mode & 0o777 == 0o700
    # Made once: a second start uses the copy as it is.
    assert relocate_embedded_binaries(data_dir) == binaries


def test_programs_others_can_reach_are_run_where_they_are(tmp_path: Path) -> None:
    from pgserver import _commands

    from consolidation.db import relocate_embedded_binaries

    installed = Path(_commands.POSTGRES_BIN_PATH)
    if any(p.stat().st_mode & 0o055 != 0o055 for p in installed.parents):
        pytest.skip("this test environment's pgserver itself sits behind a closed directory")
    assert relocate_embedded_binaries(tmp_path) == installed
    assert not any(tmp_path.iterdir())
