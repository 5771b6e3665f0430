"""The lifecycle routes in-process (httpx ASGI transport) over a real Postgres: forget a memory,
delete a bank, a forget refuses to be cancelled, the backlog on /metrics."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import asyncpg
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from consolidation import backlog, db, queue, store
from consolidation.engine import StopReason, StopSignal
from consolidation.errors import NotFound
from consolidation.testing.fake_llm import FakeLLMServer
from tests.integration.conftest import ClientFactory
from tests.integration.test_api import assert_error, ingest
from tests.support.engine import http_llm, run_next
from tests.support.engine import ingest as ingest_direct
from tests.support.invariants import tables_containing
from tests.support.proxy import TcpProxy
from tests.support.waiting import wait_for


async def test_delete_a_memory_answers_202_with_its_forget_operation_idempotently(
    manual_client: httpx.AsyncClient, pool: asyncpg.Pool, fake: FakeLLMServer
) -> None:
    first, other = await ingest(manual_client, "b", {"text": "one"}, {"text": "two"})
    response = await manual_client.delete(f"/v1/banks/b/memories/{first}")
    assert response.status_code == 202, response.text
    body = response.json()
    assert set(body) == {"memory_id", "operation_id"} and body["memory_id"] == first
    again = await manual_client.delete(f"/v1/banks/b/memories/{first}")
    assert again.status_code == 202 and again.json() == body

    op = (await manual_client.get(f"/v1/operations/{body['operation_id']}")).json()
    assert op["kind"] == "forget" and op["status"] == "pending" and op["bank_id"] == "b"
    refused = await manual_client.post(f"/v1/operations/{body['operation_id']}/cancel")
    assert_error(refused, 409, "not_cancellable")

    llm = http_llm(fake.url)
    try:
        assert (await run_next(pool, llm)).status == "completed"
    finally:
        await llm.aclose()
    done = (await manual_client.get(f"/v1/operations/{body['operation_id']}")).json()
    assert done["status"] == "completed" and done["result"]["forgotten"] == 1
    # Asked again once it is gone: the same operation, not a 404.
    after = await manual_client.delete(f"/v1/banks/b/memories/{first}")
    assert after.status_code == 202 and after.json() == body
    stats = (await manual_client.get("/v1/banks/b/stats")).json()
    assert stats["pending"] == 1 and stats["consolidated"] == 0
    assert other != first


async def test_delete_an_unknown_memory_or_bank_is_a_404_and_a_bad_id_a_422(
    manual_client: httpx.AsyncClient,
) -> None:
    (memory,) = await ingest(manual_client, "b", {"text": "one"})
    await ingest(manual_client, "c", {"text": "two"})
    assert_error(
        await manual_client.delete(f"/v1/banks/b/memories/{uuid.uuid4()}"),
        404,
        "memory_not_found",
    )
    # A memory of another bank is unknown to this one.
    assert_error(
        await manual_client.delete(f"/v1/banks/c/memories/{memory}"), 404, "memory_not_found"
    )
    assert_error(
        await manual_client.delete(f"/v1/banks/nope/memories/{memory}"), 404, "bank_not_found"
    )
    assert_error(await manual_client.delete("/v1/banks/b/memories/not-a-uuid"), 422)


async def test_delete_a_bank_without_confirm_is_a_dry_run_with_the_counts(
    manual_client: httpx.AsyncClient, pool: asyncpg.Pool, fake: FakeLLMServer
) -> None:
    await ingest(manual_client, "kept", {"text": "kept fact", "tags": ["t"]})
    llm = http_llm(fake.url)
    try:
        for i in range(2):  # the second consolidation updates the first one's observation
            await ingest(manual_client, "doomed", {"text": f"doomed fact {i}", "tags": ["t"]})
            await queue.submit(pool, "doomed")
            assert (await run_next(pool, llm)).status == "completed"
    finally:
        await llm.aclose()
    await queue.submit(pool, "doomed", scopes=[("t",)])
    expected = {
        "memories": 2,
        "observations": 1,
        "observation_sources": 2,
        "observation_history": 1,
        "consolidation_outcomes": 2,
        "operations": 3,
        "operations_cancelled": 1,
    }
    for query in ("", "?confirm=", "?confirm=kept", "?confirm=DOOMED"):
        response = await manual_client.delete(f"/v1/banks/doomed{query}")
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "confirmation_required" and "confirm" in error["message"]
        assert error["counts"] == expected
    # Nothing was deleted (its token usage included).
    assert len(await tables_containing(pool, "doomed")) == 6

    response = await manual_client.delete("/v1/banks/doomed?confirm=doomed")
    assert response.status_code == 200, response.text
    assert response.json() == {"bank_id": "doomed", "deleted": expected}
    assert await tables_containing(pool, "doomed") == {}
    assert set(await tables_containing(pool, "kept")) == {"banks", "memories"}
    assert_error(await manual_client.delete("/v1/banks/doomed?confirm=doomed"), 404)
    assert_error(await manual_client.get("/v1/banks/doomed/stats"), 404, "bank_not_found")


async def test_deleting_a_bank_stops_its_running_operation_which_writes_nothing_after(
    manual_client: httpx.AsyncClient, pool: asyncpg.Pool, database_url: str, fake: FakeLLMServer
) -> None:
    memories = [{"text": f"doomed fact {i}", "tags": [f"t{i}"]} for i in range(4)]
    await ingest(manual_client, "doomed", *memories)
    await queue.submit(pool, "doomed")
    fake.control(script=[{"pass": True}, {"hang": True}])
    llm = http_llm(fake.url)
    stop = StopSignal()
    listener = await db.connect(database_url)

    def on_cancel(_c: object, _p: int, _ch: str, _payload: str) -> None:
        stop.set(StopReason.CANCEL)  # what a worker does with the notification

    await listener.add_listener(queue.NOTIFY_CANCEL, on_cancel)
    try:
        running = asyncio.create_task(run_next(pool, llm, stop=stop))
        await wait_for(lambda: fake.stats()["in_flight"] >= 1, what="a pass in flight")
        response = await manual_client.delete("/v1/banks/doomed?confirm=doomed")
        assert response.status_code == 200
        assert response.json()["deleted"]["operations_cancelled"] == 1
        end = await running
    finally:
        await listener.close()
        await llm.aclose()
    assert end.status == "lost"
    assert stop.reason is StopReason.CANCEL  # told at once, not only fenced
    assert await tables_containing(pool, "doomed") == {}
    assert await pool.fetchval("SELECT count(*) FROM observations") == 0


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


async def scrape(client: httpx.AsyncClient) -> dict[tuple[str, tuple[Any, ...]], float]:
    backlog.BACKLOG._read_at = -1e9  # read again for this scrape
    response = await client.get("/metrics")
    assert response.status_code == 200
    return _samples(response.text)


async def test_metrics_show_the_backlog_of_every_bank(
    manual_client: httpx.AsyncClient, pool: asyncpg.Pool
) -> None:
    await ingest(manual_client, "old", {"text": "a"}, {"text": "b"})
    await pool.execute("UPDATE memories SET created_at = now() - interval '1 hour'")
    await ingest(manual_client, "new", {"text": "c"}, {"text": "d"}, {"text": "e"})
    await pool.execute(
        "UPDATE memories SET consolidation_failed_at = now() WHERE text IN ('d', 'e')"
    )
    await queue.submit(pool, "old")
    await queue.start_foreground(pool, "new", "dead-worker", 30)
    await pool.execute(
        "UPDATE operations SET lease_expires_at = now() - interval '1 s' WHERE status = 'running'"
    )

    samples = await scrape(manual_client)
    assert samples[("consolidation_backlog_up", ())] == 1
    assert samples[("consolidation_memories_pending", ())] == 3
    assert samples[("consolidation_memories_failed", ())] == 2
    assert 3600 <= samples[("consolidation_oldest_pending_age_seconds", ())] < 3600 * 2
    bank = (("bank_id", "old"),)
    assert samples[("consolidation_bank_memories_pending", bank)] == 2
    assert samples[("consolidation_bank_oldest_pending_age_seconds", bank)] >= 3600
    assert samples[("consolidation_bank_memories_pending", (("bank_id", "new"),))] == 1
    consolidate = ("kind", "consolidate")
    assert samples[("consolidation_queue_operations", (consolidate, ("status", "pending")))] == 1
    assert samples[("consolidation_queue_operations", (consolidate, ("status", "running")))] == 1
    assert samples[("consolidation_queue_operations_due", (consolidate,))] == 1
    assert samples[("consolidation_queue_leases_expired", (consolidate,))] == 1
    assert samples[("consolidation_queue_leases_expired", (("kind", "forget"),))] == 0


async def test_a_scrape_answers_without_the_backlog_when_the_database_does_not(
    database_url: str, make_client: ClientFactory
) -> None:
    async with TcpProxy.in_front_of(database_url) as proxy:
        stalled = await db.create_pool(proxy.url(database_url), min_size=1, max_size=2)
        try:
            async with make_client(on=stalled, auto_consolidate=False) as client:
                proxy.hold()  # the database stops answering; nothing is reset
                samples = await asyncio.wait_for(scrape(client), 30)
                proxy.release()
        finally:
            stalled.terminate()
    assert samples[("consolidation_backlog_up", ())] == 0
    assert ("consolidation_memories_pending", ()) not in samples
    # The process's own metrics are still there.
    assert any(name == "consolidation_llm_in_flight" for name, _ in samples)


async def test_a_bank_deleted_while_a_pass_is_being_applied_waits_for_it_without_deadlock(
    pool: asyncpg.Pool,
) -> None:
    await ingest_direct(pool, "doomed", [{"text": "fact", "tags": []}])
    await queue.submit(pool, "doomed")
    lease = await queue.claim(pool, "w", 30)
    assert lease is not None
    async with pool.acquire() as applying:
        transaction = applying.transaction()
        await transaction.start()
        # What a pass's apply does first: the fence (its operation row), then rows whose foreign
        # key points at the bank.
        assert await applying.fetchval(
            "SELECT consolidation_holds_lease_v1($1, $2, $3)",
            lease.operation_id,
            lease.worker_id,
            lease.attempt,
        )
        deleting = asyncio.create_task(store.delete_bank(pool, "doomed", dry_run=False))
        await wait_for(
            lambda: pool.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            ),
            what="the deletion to wait for the pass",
        )
        await applying.execute(
            "INSERT INTO observations (id, bank_id, scope, text)"
            " VALUES (gen_random_uuid(), 'doomed', '{}', 'x')"
        )
        await transaction.commit()
    counts = await deleting
    assert counts.observations == 1 and counts.operations_cancelled == 1
    assert await tables_containing(pool, "doomed") == {}


async def test_an_ingestion_that_waited_for_its_bank_being_deleted_starts_the_bank_anew(
    pool: asyncpg.Pool,
) -> None:
    await ingest_direct(pool, "b", [{"text": "old", "tags": []}])
    async with pool.acquire() as deleting:
        transaction = deleting.transaction()
        await transaction.start()
        await deleting.execute("SELECT 1 FROM banks WHERE id = 'b' FOR UPDATE")
        adding = asyncio.create_task(ingest_direct(pool, "b", [{"text": "new", "tags": []}]))
        await wait_for(
            lambda: pool.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            ),
            what="the ingestion to wait for the bank",
        )
        await deleting.execute("DELETE FROM banks WHERE id = 'b'")
        await transaction.commit()
    await adding
    texts = await pool.fetch("SELECT text FROM memories WHERE bank_id = 'b'")
    assert [r["text"] for r in texts] == ["new"]


async def test_a_forget_asked_while_its_bank_is_being_deleted_finds_no_bank(
    pool: asyncpg.Pool,
) -> None:
    (memory_id,) = await ingest_direct(pool, "b", [{"text": "old", "tags": []}])
    async with pool.acquire() as deleting:
        transaction = deleting.transaction()
        await transaction.start()
        await deleting.execute("SELECT 1 FROM banks WHERE id = 'b' FOR UPDATE")
        asking = asyncio.create_task(store.request_forget(pool, "b", [memory_id]))
        await wait_for(
            lambda: pool.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            ),
            what="the request to wait for the bank",
        )
        await deleting.execute("DELETE FROM banks WHERE id = 'b'")
        await transaction.commit()
    with pytest.raises(NotFound, match="bank 'b' does not exist"):
        await asking
    assert await pool.fetchval("SELECT count(*) FROM operations") == 0
