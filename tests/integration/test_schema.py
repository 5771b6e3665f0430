"""The committed schema files are what migrating an empty database gives (both variants), and
the released SQL files that migrations read at run time never change."""

from __future__ import annotations

import hashlib
import uuid
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from consolidation import db, schema

SQL_DIR = Path(schema.__file__).resolve().parent / "sql"
REGENERATE = "regenerate with `python -m consolidation.schema`"


async def _migrated_from_empty(admin_url: str) -> tuple[str, str]:
    name = f"consolidation_s_{uuid.uuid4().hex[:12]}"
    conn = await asyncpg.connect(admin_url)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    return name, urlunsplit(urlsplit(admin_url)._replace(path="/" + name))


async def _drop(admin_url: str, name: str) -> None:
    conn = await asyncpg.connect(admin_url)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


async def _assert_schema_matches(admin_url: str, expect_pgvector: bool | None) -> None:
    name, url = await _migrated_from_empty(admin_url)
    try:
        await db.migrate(url)
        vector = await schema.has_pgvector(url)
        if expect_pgvector is not None:
            assert vector is expect_pgvector
        assert schema.dump_schema(url) == schema.committed(vector), (
            f"{schema.variant_path(vector).name} is not the migrated schema: {REGENERATE}"
        )
    finally:
        await _drop(admin_url, name)


async def test_the_committed_schema_is_what_migrating_an_empty_database_gives(
    pg_admin_url: str,
) -> None:
    # The variant this server makes: without pgvector on most servers, with it where installed.
    await _assert_schema_matches(pg_admin_url, None)


async def test_the_committed_pgvector_schema_is_what_migrating_an_empty_database_gives(
    vector_admin_url: str,
) -> None:
    await _assert_schema_matches(vector_admin_url, True)


def test_the_two_variants_differ_only_by_pgvector_and_the_vector_columns() -> None:
    def without_pgvector(text: str) -> list[str]:
        lines = [line.rstrip(",") for line in text.splitlines()]
        noise = ("vector", "embedding")
        return [
            ln for ln in lines if ln and not any(w in ln.replace("tsvector", "") for w in noise)
        ]

    vector = schema.committed(True)
    assert without_pgvector(vector) == without_pgvector(schema.committed(False))
    assert "CREATE EXTENSION IF NOT EXISTS vector" in vector
    assert "embedding public.vector" in vector


def test_released_sql_files_never_change() -> None:
    # Migrations read these files when they run: editing a released one changes what an old
    # migration creates, so a database migrated before and one migrated after differ.
    listed = {}
    for line in (SQL_DIR / "SHA256SUMS").read_text().splitlines():
        digest, file = line.split()
        listed[file] = digest
    present = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in SQL_DIR.glob("*.sql")}
    changed = sorted(f for f in listed if f in present and present[f] != listed[f])
    assert not changed, f"released SQL edited: {changed}; add a new version file instead"
    assert not sorted(set(listed) - set(present)), "a released SQL file was removed"
    new = sorted(set(present) - set(listed))
    assert not new, f"add {new} to consolidation/sql/SHA256SUMS (`sha256sum {new[0]}`)"
