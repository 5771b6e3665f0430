"""`consolidation ingest` and `consolidation migrate` as real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import asyncpg


def run_cli(
    *args: str, env: dict[str, str], stdin: bytes | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "consolidation.cli", *args],
        env={**os.environ, "CONSOLIDATION_LOG_FORMAT": "json", **env},
        input=stdin.decode() if stdin else None,
        capture_output=True,
        text=True,
        timeout=120,
    )


def write_jsonl(path: Path, lines: list[object]) -> Path:
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


async def test_ingest_reads_a_jsonl_file_and_is_idempotent(
    database_url: str, tmp_path: Path
) -> None:
    fixed = str(uuid.uuid4())
    file = write_jsonl(
        tmp_path / "m.jsonl",
        [{"id": fixed, "text": "Alice likes tea", "tags": ["alice"]}, "", {"text": "Bob cycles"}],
    )
    env = {"CONSOLIDATION_DATABASE_URL": database_url}
    first = run_cli("ingest", "bank-a", str(file), env=env)
    assert first.returncode == 0, first.stderr
    assert "ingested 2 memories" in first.stdout and "2 new" in first.stdout
    second = run_cli("ingest", "bank-a", str(file), env=env)
    assert second.returncode == 0 and "0 new" in second.stdout
    conn = await asyncpg.connect(database_url)
    try:
        assert await conn.fetchval("SELECT count(*) FROM memories WHERE bank_id='bank-a'") == 2
    finally:
        await conn.close()


async def test_a_file_with_bad_lines_is_rejected_whole_with_every_line_named(
    database_url: str, tmp_path: Path
) -> None:
    file = write_jsonl(
        tmp_path / "bad.jsonl",
        [
            {"text": "fine"},
            "{not json",
            {"text": "", "tags": ["a"]},
            {"text": "fine too", "observation_scopes": "sometimes"},
        ],
    )
    result = run_cli(
        "ingest", "bank-b", str(file), env={"CONSOLIDATION_DATABASE_URL": database_url}
    )
    assert result.returncode == 2
    assert "nothing was ingested" in result.stderr
    for line in ("line 2:", "line 3:", "line 4:"):
        assert line in result.stderr
    assert "line 1:" not in result.stderr
    conn = await asyncpg.connect(database_url)
    try:
        assert await conn.fetchval("SELECT count(*) FROM memories") == 0
    finally:
        await conn.close()


def test_a_missing_file_is_a_one_line_error(database_url: str) -> None:
    result = run_cli(
        "ingest", "b", "/nonexistent.jsonl", env={"CONSOLIDATION_DATABASE_URL": database_url}
    )
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "cannot read" in result.stderr


def test_a_bad_setting_is_a_one_line_error_naming_it() -> None:
    result = run_cli("migrate", env={"CONSOLIDATION_WAVE_SIZE": "lots"})
    assert result.returncode == 2
    assert "CONSOLIDATION_WAVE_SIZE" in result.stderr and result.stderr.strip().count("\n") == 0


def test_without_a_database_url_an_embedded_postgres_is_started_and_announced(
    open_data_dir: Path,
) -> None:
    env = {"CONSOLIDATION_DATA_DIR": str(open_data_dir), "CONSOLIDATION_DATABASE_URL": ""}
    first = run_cli("migrate", env=env)
    assert first.returncode == 0, first.stderr
    assert "embedded_postgres" in first.stderr
    assert "schema migrated from empty" in first.stdout
    # The next command uses the same data.
    second = run_cli("migrate", env=env)
    assert second.returncode == 0 and "schema already at" in second.stdout


async def test_a_tag_with_a_control_character_is_refused_as_the_api_refuses_it(
    database_url: str, tmp_path: Path
) -> None:
    file = write_jsonl(tmp_path / "del.jsonl", [{"text": "fine", "tags": ["a\x7fb"]}])
    result = run_cli(
        "ingest", "bank-a", str(file), env={"CONSOLIDATION_DATABASE_URL": database_url}
    )
    assert result.returncode != 0
    assert "control characters" in result.stderr


async def test_a_file_repeating_an_id_is_rejected_whole_naming_both_lines(
    database_url: str, tmp_path: Path
) -> None:
    repeated = str(uuid.uuid4())
    same_line = {"text": "Bob cycles"}
    file = write_jsonl(
        tmp_path / "dup.jsonl",
        [
            {"id": repeated, "text": "first"},
            same_line,
            {"id": repeated, "text": "second"},
            same_line,
        ],
    )
    result = run_cli(
        "ingest", "bank-d", str(file), env={"CONSOLIDATION_DATABASE_URL": database_url}
    )
    assert result.returncode == 2
    assert "nothing was ingested" in result.stderr
    assert f"line 3: id {repeated} is already used by line 1" in result.stderr
    # Identical lines without an id derive the same id: the same memory twice.
    assert "is already used by line 2" in result.stderr
    assert "Traceback" not in result.stderr
    conn = await asyncpg.connect(database_url)
    try:
        assert await conn.fetchval("SELECT count(*) FROM memories") == 0
    finally:
        await conn.close()
