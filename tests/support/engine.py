"""Shared helpers for engine tests: ingest, run one foreground operation, read results."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any
from urllib.parse import urlsplit

import asyncpg

from consolidation import db, queue, store
from consolidation.engine import OperationEnd, StopReason, StopSignal, run_operation
from consolidation.llm.client import Consolidator, HTTPConsolidator
from consolidation.memories import parse_memories
from consolidation.settings import Settings
from consolidation.testing.fake_llm import FakeLLMServer
from tests.support.waiting import wait_for


async def ingest(pool: asyncpg.Pool, bank: str, memories: Sequence[dict[str, Any]]) -> list[Any]:
    result = await store.ingest_memories(pool, bank, parse_memories(list(memories)))
    return result.ids


async def submit_after_ingest(
    pool: asyncpg.Pool, bank: str, memories: Sequence[dict[str, Any]], **options: Any
) -> queue.Operation:
    """Ingest ``memories`` into ``bank``, then enqueue its consolidation (``options`` as
    ``queue.submit`` takes them): the operation a worker under test is to run."""
    await ingest(pool, bank, memories)
    return (await queue.submit(pool, bank, **options)).operation


async def run_next(
    pool: asyncpg.Pool, llm: Consolidator, config: Settings | None = None, **options: Any
) -> OperationEnd:
    """Claim the operation a worker would claim next and run that attempt to its end."""
    lease = await queue.claim(pool, "test-worker", 30)
    assert lease is not None, "no operation was due"
    return await run_operation(pool, lease, llm, config or Settings(), **options)


async def consolidate(
    pool: asyncpg.Pool,
    bank: str,
    llm: Consolidator,
    config: Settings | None = None,
    stop: StopSignal | None = None,
) -> OperationEnd:
    lease = await queue.start_foreground(pool, bank, "test-worker", 30)
    return await run_operation(pool, lease, llm, config or Settings(), stop=stop)


def http_llm(url: str, **overrides: Any) -> HTTPConsolidator:
    options: dict[str, Any] = {
        "base_url": url,
        "model": "fake",
        "max_retries": 2,
        "backoff_base_s": 0.01,
        "backoff_max_s": 0.05,
        "timeout_s": 10,
    }
    options.update(overrides)
    return HTTPConsolidator(**options)


async def grew(pool: asyncpg.Pool, query: str, than: int) -> bool:
    """Whether the count ``query`` returns is now above ``than``."""
    return bool(await pool.fetchval(query) > than)


async def observations_by_scope(pool: asyncpg.Pool, bank: str) -> dict[tuple[str, ...], list[str]]:
    rows = await pool.fetch(
        "SELECT scope, text FROM observations WHERE bank_id = $1 ORDER BY created_at", bank
    )
    out: dict[tuple[str, ...], list[str]] = {}
    for r in rows:
        out.setdefault(tuple(r["scope"]), []).append(r["text"])
    return out


async def markers(pool: asyncpg.Pool, bank: str) -> dict[str, int]:
    row = await pool.fetchrow(
        """SELECT count(*) FILTER (WHERE consolidated_at IS NOT NULL) AS consolidated,
                  count(*) FILTER (WHERE consolidation_failed_at IS NOT NULL) AS failed,
                  count(*) FILTER (WHERE consolidated_at IS NULL AND consolidation_failed_at IS NULL)
                      AS pending
           FROM memories WHERE bank_id = $1""",
        bank,
    )
    return dict(row)


def topics(count: int, per_topic: int) -> list[dict[str, Any]]:
    """``count`` topics (one tag each) of ``per_topic`` near-identical facts."""
    return [
        {"text": f"Person{t} drinks green tea every morning, note {i}", "tags": [f"topic-{t}"]}
        for t in range(count)
        for i in range(per_topic)
    ]


async def set_read_only(pool: asyncpg.Pool, database_url: str, on: bool) -> None:
    """Make the test database refuse writes in every new session (what a failover to a replica
    looks like), or take it back; from a session that can still write."""
    name = urlsplit(database_url).path.lstrip("/")
    async with pool.acquire() as conn:
        await conn.execute("SET default_transaction_read_only = off")
        value = "on" if on else "off"
        await conn.execute(f'ALTER DATABASE "{name}" SET default_transaction_read_only = {value}')


def topic(person: str, n: int, tags: list[str], **extra: Any) -> list[dict[str, Any]]:
    return [
        {"text": f"{person} drinks green tea every morning, cup {i}", "tags": tags, **extra}
        for i in range(n)
    ]


@contextlib.asynccontextmanager
async def logged_pool(
    database_url: str, keep: Callable[[asyncpg.connection.LoggedQuery], Any] = lambda r: r.query
) -> AsyncIterator[tuple[asyncpg.Pool, list[Any]]]:
    """A pool whose connections append every statement they run (``keep`` of it: its text
    unless told otherwise) to the list it yields."""
    statements: list[Any] = []

    async def init(conn: asyncpg.Connection) -> None:
        await db._init_connection(conn)
        conn.add_query_logger(lambda record: statements.append(keep(record)))

    pool = await asyncpg.create_pool(database_url, init=init, min_size=1, max_size=10)
    try:
        yield pool, statements
    finally:
        await pool.close()


async def consolidate_notes(
    pool: asyncpg.Pool,
    fake: FakeLLMServer,
    order: list[str],
    settings: Settings,
    base_url: str | None = None,
    **llm: Any,
) -> Any:
    """One memory per tag of ``order``, in that consolidation order, consolidated over HTTP
    (``base_url``: the fake's unless given; ``llm``: options of the HTTP client)."""
    memories = [
        {
            "text": f"Note {i} about topic {tag}",
            "tags": [tag],
            "occurred_at": f"2026-01-01T00:00:{i:02d}Z",
        }
        for i, tag in enumerate(order)
    ]
    await ingest(pool, "b", memories)
    client = http_llm(base_url or fake.url, **llm)
    try:
        return await consolidate(pool, "b", client, settings)
    finally:
        await client.aclose()


# Each apply's outcomes, logged when they are written and after: an apply waits at the gate (an
# advisory lock the test holds) between the two.
APPLY_GATE = """
CREATE TABLE apply_log (at timestamptz NOT NULL, step text NOT NULL, tx bigint NOT NULL);
CREATE FUNCTION apply_gate() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO apply_log VALUES (clock_timestamp(), TG_WHEN, txid_current());
    IF TG_WHEN = 'BEFORE' THEN
        PERFORM pg_advisory_xact_lock_shared(4242);
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER apply_gate_before BEFORE INSERT ON consolidation_outcomes
    FOR EACH STATEMENT EXECUTE FUNCTION apply_gate();
CREATE TRIGGER apply_gate_after AFTER INSERT ON consolidation_outcomes
    FOR EACH STATEMENT EXECUTE FUNCTION apply_gate();
"""


async def two_calls_while_the_first_apply_is_held(
    pool: asyncpg.Pool,
    database_url: str,
    fake: FakeLLMServer,
    settings: Settings,
    stop: StopSignal | None = None,
) -> tuple[Any, list[dict[str, Any]]]:
    """Consolidate bank "b" with every apply held at the gate until the fake has seen two
    calls (which fails unless the second starts while the first apply waits) — and ``stop``
    set to a shutdown then, if given; returns the operation's end and the fake's first calls."""
    await pool.execute(APPLY_GATE)
    gate = await asyncpg.connect(database_url)
    llm = http_llm(fake.url)
    try:
        await gate.execute("SELECT pg_advisory_lock(4242)")
        run = asyncio.create_task(consolidate(pool, "b", llm, settings, stop=stop))
        calls = await wait_for(
            lambda: len(fake.stats()["calls"]) >= 2 and fake.stats()["calls"],
            what="a second call while the first apply is held",
        )
        assert await pool.fetchval("SELECT count(*) FROM consolidation_outcomes") == 0
        if stop is not None:
            stop.set(StopReason.SHUTDOWN)
        await gate.execute("SELECT pg_advisory_unlock(4242)")
        return await asyncio.wait_for(run, 30), calls
    finally:
        await gate.close()
        await llm.aclose()


@contextlib.contextmanager
def unretrieved_task_errors() -> Iterator[list[str]]:
    """The messages of the event loop's exception handler while the block runs ("Task
    exception was never retrieved" among them), after a garbage collection at its end: a task
    that failed unobserved is reported when it is collected."""
    loop = asyncio.get_running_loop()
    seen: list[str] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: seen.append(str(context.get("message"))))
    try:
        yield seen
        gc.collect()
    finally:
        loop.set_exception_handler(previous)
