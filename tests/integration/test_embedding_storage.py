"""Embedding storage and hybrid recall on a real Postgres: with pgvector (the embedded server
when the test server lacks it — never skipped) and without it (the machine's server)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from consolidation import db, store
from consolidation.errors import ConfigError
from consolidation.llm.embeddings import PGVECTOR_AVAILABLE, require_vector_storage, vector_literal
from consolidation.testing.fake_embeddings import embed_text
from consolidation.testing.fake_llm import FakeLLMServer
from tests.integration.test_replay_process import start_replay
from tests.support.engine import ingest

COLUMNS = """
SELECT array_agg(column_name::text ORDER BY column_name) FROM information_schema.columns
WHERE table_name = 'observations' AND column_name LIKE 'embedding%'
"""


async def _columns(url: str) -> list[str]:
    conn = await db.connect(url)
    try:
        return list(await conn.fetchval(COLUMNS) or [])
    finally:
        await conn.close()


async def test_with_pgvector_observations_get_vector_columns(vector_database_url: str) -> None:
    assert await _columns(vector_database_url) == ["embedding", "embedding_version"]


async def test_the_migration_works_without_pgvector_and_adds_no_column(database_url: str) -> None:
    conn = await db.connect(database_url)
    try:
        available = await conn.fetchval(PGVECTOR_AVAILABLE)
        hybrid = await conn.fetchval(
            "SELECT count(*) FROM pg_proc WHERE proname = 'consolidation_recall_hybrid_v1'"
        )
    finally:
        await conn.close()
    # The machine's server (and the testcontainers image) has no pgvector; the embedded one
    # does, and there the migration creates the extension and the columns.
    expected = ["embedding", "embedding_version"] if available else []
    assert await _columns(database_url) == expected
    assert hybrid == 1


async def test_start_up_stops_in_one_line_when_the_server_has_no_pgvector(
    database_url: str,
) -> None:
    conn = await db.connect(database_url)
    try:
        if await conn.fetchval(PGVECTOR_AVAILABLE):
            await require_vector_storage(conn)
            return
        with pytest.raises(ConfigError) as caught:
            await require_vector_storage(conn)
    finally:
        await conn.close()
    message = str(caught.value)
    assert "\n" not in message
    assert "no pgvector extension" in message
    assert "CONSOLIDATION_EMBEDDINGS_BASE_URL" in message


async def test_a_server_that_gains_pgvector_later_gets_the_columns_at_start_up(
    vector_database_url: str,
) -> None:
    conn = await db.connect(vector_database_url)
    try:
        # As if migrated on a server without pgvector, which was installed afterwards.
        await conn.execute(
            "ALTER TABLE observations DROP COLUMN embedding, DROP COLUMN embedding_version;"
            " DROP EXTENSION vector"
        )
        assert await _columns(vector_database_url) == []
        await require_vector_storage(conn)
        assert await _columns(vector_database_url) == ["embedding", "embedding_version"]
        await require_vector_storage(conn)  # idempotent
    finally:
        await conn.close()


OTHER_FACTS = [
    "Alice visited Porto in May",
    "Alice's uncle works as a plumber",
    "Alice bought a blue lamp at the market",
    "Alice read a thriller on holiday",
    "Alice watched a western with Samir",
    "Alice cooked paella for Ines on Friday",
    "Alice has a vet appointment on Monday",
    "Alice met Pavel at the library",
    "Alice wants to learn pottery",
    "Alice fixed the boiler in the cellar",
    "Alice lent Greta a drill",
    "Alice painted the attic navy",
]


async def _observations(pool: asyncpg.Pool, texts: list[str], *, embed: bool) -> list[uuid.UUID]:
    """Observations of scope ['alice'], the first the oldest; with fake vectors if ``embed``."""
    await pool.execute("INSERT INTO banks (id) VALUES ('b') ON CONFLICT DO NOTHING")
    now = datetime.now(UTC)
    ids = [uuid.uuid4() for _ in texts]
    await pool.executemany(
        "INSERT INTO observations (id, bank_id, scope, text, updated_at, embedding,"
        " embedding_version) VALUES ($1, 'b', '{alice}', $2, $3, $4::vector, $5)",
        [
            (
                oid,
                text,
                now - timedelta(days=len(texts) - i),
                vector_literal(embed_text(text)) if embed else None,
                1 if embed else None,
            )
            for i, (oid, text) in enumerate(zip(ids, texts, strict=True))
        ],
    )
    return ids


async def test_hybrid_recall_finds_a_paraphrase_that_full_text_ranks_out(
    vector_pool: asyncpg.Pool,
) -> None:
    # The twin is the oldest observation and shares only the name with the new fact.
    await _observations(vector_pool, ["Alice loves green tea", *OTHER_FACTS], embed=True)
    fact = "Alice adores matcha"
    vector = vector_literal(embed_text(fact))
    full_text = await store.recall(vector_pool, "b", ("alice",), [fact], 5)
    hybrid = await store.recall(vector_pool, "b", ("alice",), [fact], 5, [vector])
    assert "Alice loves green tea" not in [o.text for o in full_text]
    assert hybrid[0].text == "Alice loves green tea"
    assert len(hybrid) == 5  # topped up with the most recent


async def test_hybrid_recall_interleaves_the_facts_of_a_pass(vector_pool: asyncpg.Pool) -> None:
    twins = ["Alice loves green tea", "Alice cycles to work", "Alice is afraid of flying"]
    await _observations(vector_pool, [*twins, *OTHER_FACTS], embed=True)
    facts = [
        "Alice adores matcha",
        "Alice rides a bike to the office",
        "Alice gets anxious on planes",
    ]
    vectors = [vector_literal(embed_text(f)) for f in facts]
    recalled = await store.recall(vector_pool, "b", ("alice",), facts, 3, vectors)
    assert sorted(o.text for o in recalled) == sorted(twins)


async def test_hybrid_recall_ignores_stale_vectors_and_facts_without_one(
    vector_pool: asyncpg.Pool,
) -> None:
    ids = await _observations(vector_pool, ["Alice loves green tea", *OTHER_FACTS], embed=True)
    fact = "Alice adores matcha"
    # Updated by a worker without embeddings: the text changed, the vector did not.
    await vector_pool.execute("UPDATE observations SET version = version + 1 WHERE id = $1", ids[0])
    stale = await store.recall(
        vector_pool, "b", ("alice",), [fact], 5, [vector_literal(embed_text(fact))]
    )
    assert "Alice loves green tea" not in [o.text for o in stale]
    # A fact the endpoint refused (no vector) is ranked by full text alone.
    lexical = await store.recall(vector_pool, "b", ("alice",), ["Alice loves tea"], 1, [None])
    assert [o.text for o in lexical] == ["Alice loves green tea"]


async def test_hybrid_recall_stays_within_the_scope_and_ignores_other_dimensions(
    vector_pool: asyncpg.Pool,
) -> None:
    await _observations(vector_pool, OTHER_FACTS, embed=True)
    await vector_pool.execute(
        "INSERT INTO observations (id, bank_id, scope, text, embedding, embedding_version)"
        " VALUES ($1, 'b', '{bob}', 'Alice loves green tea', $2::vector, 1),"
        "        ($3, 'b', '{alice}', 'Alice enjoys matcha lattes', $4::vector, 1)",
        uuid.uuid4(),
        vector_literal(embed_text("Alice loves green tea")),
        uuid.uuid4(),
        vector_literal(embed_text("Alice enjoys matcha lattes", 16)),
    )
    fact = "Alice adores matcha"
    recalled = await store.recall(
        vector_pool, "b", ("alice",), [fact], 20, [vector_literal(embed_text(fact))]
    )
    texts = [o.text for o in recalled]
    assert "Alice loves green tea" not in texts  # another scope
    assert len(texts) == len(OTHER_FACTS) + 1  # the 16-dimensional one only by recency/text


async def test_replay_with_embeddings_and_no_pgvector_stops_with_one_line(
    pool: asyncpg.Pool, database_url: str, fake: FakeLLMServer
) -> None:
    available = await pool.fetchval(PGVECTOR_AVAILABLE)
    await ingest(pool, "b", [{"text": "Alice loves green tea", "tags": ["alice"]}])
    proc = start_replay(
        database_url,
        fake.url,
        CONSOLIDATION_EMBEDDINGS_BASE_URL=fake.url,
        CONSOLIDATION_LOG_LEVEL="ERROR",
    )
    _, stderr = proc.communicate(timeout=120)
    if available:  # the embedded server: the replay runs and succeeds
        assert proc.returncode == 0, stderr
        return
    assert proc.returncode != 0
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert "no pgvector extension" in lines[0]
    assert fake.stats()["embeddings"]["requests"] == 0
