"""Whole-database checks shared by the reliability tests: journal, markers and observations agree.

``assert_consistent`` reads every table an operation writes and fails with the first
disagreement it finds. It holds after any sequence of crashes, cancels and retries, because the
journal (``consolidation_outcomes``) is the record of what was applied and every other table
must match it exactly.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from dataclasses import dataclass

import asyncpg

from consolidation.scopes import scopes_from_db

Scope = tuple[str, ...]


@dataclass(frozen=True)
class Census:
    """Counts of one database (or one bank), for the test to assert on."""

    memories: int
    consolidated: int
    failed: int
    pending: int
    outcomes: int
    observations: int
    sources: int
    observations_per_scope: dict[tuple[str, Scope], int]


async def census(pool: asyncpg.Pool, bank: str | None = None) -> Census:
    where = "" if bank is None else "WHERE bank_id = $1"
    args = [] if bank is None else [bank]
    row = await pool.fetchrow(
        f"""SELECT count(*) AS memories,
                   count(*) FILTER (WHERE consolidated_at IS NOT NULL) AS consolidated,
                   count(*) FILTER (WHERE consolidation_failed_at IS NOT NULL) AS failed,
                   count(*) FILTER (WHERE consolidated_at IS NULL
                                      AND consolidation_failed_at IS NULL) AS pending
            FROM memories {where}""",
        *args,
    )
    outcomes = await pool.fetchval(
        "SELECT count(*) FROM consolidation_outcomes o JOIN memories m ON m.id = o.memory_id"
        + ("" if bank is None else " WHERE m.bank_id = $1"),
        *args,
    )
    sources = await pool.fetchval(
        "SELECT count(*) FROM observation_sources s JOIN observations o ON o.id = s.observation_id"
        + ("" if bank is None else " WHERE o.bank_id = $1"),
        *args,
    )
    per_scope = {
        (r["bank_id"], tuple(r["scope"])): r["n"]
        for r in await pool.fetch(
            f"SELECT bank_id, scope, count(*) AS n FROM observations {where}"
            " GROUP BY bank_id, scope",
            *args,
        )
    }
    return Census(
        memories=row["memories"],
        consolidated=row["consolidated"],
        failed=row["failed"],
        pending=row["pending"],
        outcomes=outcomes,
        observations=sum(per_scope.values()),
        sources=sources,
        observations_per_scope=per_scope,
    )


async def assert_consistent(pool: asyncpg.Pool, *, allow_pending: bool = False) -> Census:
    """Fail unless the journal, the markers and the observations of every bank agree.

    - a memory is marked consolidated iff every write scope has a journal row, and never both
      consolidated and failed; with ``allow_pending`` False no memory is left pending;
    - every journal row is for one of the memory's write scopes;
    - every source row links an observation to a memory of the same bank, in one of the
      memory's write scopes, and that (memory, scope) has a journal row naming this observation
      (or one merged into it): nothing was applied twice or outside the journal;
    - every memory the journal says was acted on is still a source in that scope.
    """
    memories = {
        r["id"]: r
        for r in await pool.fetch(
            "SELECT m.id, m.bank_id, m.consolidated_at, m.consolidation_failed_at,"
            " (SELECT jsonb_agg(s.scope) FROM memory_scopes s WHERE s.memory_id = m.id) AS scopes"
            " FROM memories m"
        )
    }
    outcomes: dict[tuple[uuid.UUID, Scope], asyncpg.Record] = {}
    for r in await pool.fetch("SELECT * FROM consolidation_outcomes"):
        outcomes[(r["memory_id"], tuple(r["scope"]))] = r
    observations = {
        r["id"]: r for r in await pool.fetch("SELECT id, bank_id, scope FROM observations")
    }
    merged_into = {
        r["observation_id"]: r["merged_into"]
        for r in await pool.fetch(
            "SELECT observation_id, merged_into FROM observation_history"
            " WHERE action = 'merged_away'"
        )
    }
    sources: dict[tuple[uuid.UUID, Scope], set[uuid.UUID]] = defaultdict(set)
    for r in await pool.fetch("SELECT observation_id, memory_id FROM observation_sources"):
        obs = observations[r["observation_id"]]
        memory = memories[r["memory_id"]]
        assert obs["bank_id"] == memory["bank_id"], f"source crosses banks: {dict(r)}"
        sources[(r["memory_id"], tuple(obs["scope"]))].add(r["observation_id"])

    def resolve(observation_id: uuid.UUID) -> uuid.UUID:
        seen = set()
        while observation_id in merged_into and observation_id not in seen:
            seen.add(observation_id)
            observation_id = merged_into[observation_id]
        return observation_id

    for memory_id, m in memories.items():
        scopes = set(scopes_from_db(m["scopes"]))
        journaled = {s for (mid, s) in outcomes if mid == memory_id}
        consolidated = m["consolidated_at"] is not None
        failed = m["consolidation_failed_at"] is not None
        assert not (consolidated and failed), f"memory {memory_id} is consolidated and failed"
        assert journaled <= scopes, f"memory {memory_id} journaled outside its scopes: {journaled}"
        if consolidated:
            assert journaled == scopes, f"memory {memory_id} marked before its journal was complete"
        if not allow_pending:
            assert consolidated or failed, f"memory {memory_id} is still pending"
        for scope in scopes:
            cited = sources.get((memory_id, scope), set())
            outcome = outcomes.get((memory_id, scope))
            if outcome is None:
                assert not cited, f"memory {memory_id} is a source in {scope} without a journal row"
                continue
            named = {resolve(o) for o in outcome["observation_ids"]}
            assert cited <= named, (
                f"memory {memory_id} in scope {scope} is cited by {cited}, "
                f"but its journal row names {named}: applied twice?"
            )
            if outcome["action"] != "skipped":
                assert cited, (
                    f"memory {memory_id} was {outcome['action']} in {scope} but cites nothing"
                )
    for memory_id, scope in sources:
        assert scope in scopes_from_db(memories[memory_id]["scopes"]), (
            f"memory {memory_id} is a source in {scope}, not one of its write scopes"
        )
    return await census(pool)


async def tables_containing(pool: asyncpg.Pool, needle: str) -> dict[str, int]:
    """How many rows of each table of the schema hold ``needle`` in any column, as their text
    (a row cast to text shows every column, tsvectors and arrays included); only tables where
    it was found."""
    found: dict[str, int] = {}
    for table in await pool.fetch(
        "SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY tablename"
    ):
        name = table["tablename"]
        count = await pool.fetchval(
            f'SELECT count(*) FROM "{name}" AS t WHERE strpos(lower(t::text), lower($1)) > 0',
            needle,
        )
        if count:
            found[name] = count
    return found
