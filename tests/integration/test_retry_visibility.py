"""An operation waiting for its next attempt says why, through the API and the dashboard, and its
final failure says when no attempt is left (real Postgres, an LLM endpoint nobody listens on)."""

from __future__ import annotations

import socket
from datetime import datetime

import asyncpg

from consolidation import queue
from consolidation.engine import run_operation
from consolidation.settings import Settings
from tests.integration.conftest import ClientFactory
from tests.support.engine import http_llm, ingest, topics


def closed_port() -> int:
    """A loopback port nothing listens on: connections to it are refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


async def test_a_retrying_operation_shows_its_last_error_and_the_last_attempt_says_none_left(
    pool: asyncpg.Pool, make_client: ClientFactory
) -> None:
    await ingest(pool, "b", topics(1, 2))
    op = (await queue.submit(pool, "b", max_attempts=2)).operation
    llm = http_llm(f"http://127.0.0.1:{closed_port()}/v1")
    settings = Settings(retry_backoff_s=600)
    try:
        lease = await queue.claim(pool, "w", 30)
        assert lease is not None
        first = await run_operation(pool, lease, llm, settings)
        assert first.status == "pending"
        async with make_client(auto_consolidate=False) as client:
            waiting = (await client.get(f"/v1/operations/{op.id}")).json()
            assert waiting["status"] == "pending" and waiting["attempt"] == 1
            assert "LLMRetriesExhausted" in waiting["last_error"]
            assert "retried in 600 s (attempt 1 of 2)" in waiting["last_error"]
            assert "retried later" not in waiting["last_error"]
            last_error_at = datetime.fromisoformat(waiting["last_error_at"])
            run_after = datetime.fromisoformat(waiting["run_after"])
            assert run_after > last_error_at
            listed = (await client.get("/v1/operations", params={"bank_id": "b"})).json()
            assert listed["operations"][0]["last_error"] == waiting["last_error"]

            page = (await client.get("/ui/operations")).text
            assert "LLMRetriesExhausted" in page and 'class="last-error"' in page
            assert "next attempt in" in page and waiting["run_after"][:19] in page

            await pool.execute("UPDATE operations SET run_after = now() WHERE id = $1", op.id)
            lease = await queue.claim(pool, "w", 30)
            assert lease is not None and lease.attempt == 2
            # The next attempt runs: the previous one's error is still there to read.
            running = (await client.get(f"/v1/operations/{op.id}")).json()
            assert running["status"] == "running" and running["error"] is None
            assert running["last_error"] == waiting["last_error"]
            assert "LLMRetriesExhausted" in (await client.get("/ui/operations")).text

            last = await run_operation(pool, lease, llm, settings)
            final = (await client.get(f"/v1/operations/{op.id}")).json()
    finally:
        await llm.aclose()
    assert last.status == "failed" and final["status"] == "failed" and final["attempt"] == 2
    assert final["error"].endswith("no attempts left (attempt 2 of 2)")
    assert "retried" not in final["error"]
    assert final["last_error"] == final["error"]
    assert final["last_error_at"] is not None
