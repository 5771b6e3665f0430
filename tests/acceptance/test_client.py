"""consolidation.client (``Client`` and ``AsyncClient``) against a real `consolidation serve`."""

from __future__ import annotations

import asyncio
import signal
import uuid

import pytest

from consolidation.client import (
    AsyncClient,
    Client,
    Conflict,
    InvalidRequest,
    MemoryIn,
    NotFound,
    Retries,
    Unauthorized,
    Unavailable,
    WaitTimeout,
)
from consolidation.testing.fake_llm import FakeLLMServer
from tests.support.proxy import TcpProxy
from tests.support.services import Serve
from tests.support.waiting import wait_for

pytestmark = pytest.mark.acceptance

KEY = "s3cret"


def _memories(bank: str) -> list[MemoryIn | dict[str, object]]:
    """Three memories in three scopes (so three observations), one as a model with its own id."""
    return [
        MemoryIn(id=uuid.uuid4(), text=f"{bank} drinks green tea every morning", tags=["tea"]),
        {"text": f"{bank} commutes to the office by bike", "tags": ["commute"]},
        {"text": f"{bank} learns Portuguese on Tuesdays", "tags": ["languages"]},
    ]


def _sync_scenario(base: str, fake: FakeLLMServer) -> None:
    with Client(base, api_key=KEY) as client:
        memories = _memories("alice")
        ingested = client.ingest("alice", memories)
        first = memories[0]
        assert isinstance(first, MemoryIn)
        assert len(ingested.ids) == 3 and ingested.ids[0] == first.id
        assert ingested.operation_id is None  # CONSOLIDATION_AUTO_CONSOLIDATE=false
        client.ingest("zed", [{"text": "Zed keeps bees", "tags": ["bees"]}])

        submitted = client.submit("alice")
        assert submitted.deduplicated is False
        done = client.wait(submitted.operation_id, timeout_s=60)
        assert done.status == "completed" and done.result and done.result["processed"] == 3
        assert client.get_operation(submitted.operation_id) == done
        stats = client.stats("alice")
        assert (stats.pending, stats.consolidated, stats.failed) == (0, 3, 0)

        # Paging: one observation a page gives the same observations as one page of all.
        one_by_one = list(client.list_observations("alice", page_size=1))
        assert len(one_by_one) == 3
        assert [o.id for o in one_by_one] == [o.id for o in client.list_observations("alice")]
        (tea,) = client.list_observations("alice", scope=["tea"])
        assert tea.scope == ["tea"] and tea.source_memory_ids == [first.id]
        assert list(client.list_observations("alice", scope=[])) == []

        assert [b.bank_id for b in client.list_banks(page_size=1)] == ["alice", "zed"]
        listed = list(client.list_operations(bank_id="alice", status="completed", page_size=1))
        assert [op.operation_id for op in listed] == [submitted.operation_id]

        assert first.id is not None
        forgotten = client.forget("alice", first.id)
        assert client.wait(forgotten.operation_id, timeout_s=60).status == "completed"
        assert client.stats("alice").consolidated == 2
        assert client.recover("alice").recovered == 0

        # A running operation whose LLM call hangs: wait gives up, a cancel ends it.
        fake.control(script=[{"hang": True}])
        hanging = client.submit("zed").operation_id
        with pytest.raises(WaitTimeout) as timed_out:
            client.wait(hanging, timeout_s=0.2)
        assert timed_out.value.operation.status in ("pending", "running")
        client.cancel_operation(hanging)
        assert client.wait(hanging, timeout_s=60).status == "cancelled"

        # The API's errors as typed exceptions with its code and message.
        with pytest.raises(NotFound) as not_found:
            client.get_operation(uuid.uuid4())
        assert not_found.value.status == 404 and not_found.value.code == "operation_not_found"
        with pytest.raises(InvalidRequest) as invalid:
            client.ingest("alice", [{"text": "fine"}, {"text": ""}])
        assert invalid.value.status == 422 and invalid.value.code == "invalid_memories"
        assert any("memories[1]" in d for d in invalid.value.details), invalid.value.details
        with pytest.raises(Conflict) as conflict:
            client.ingest("zed", [{"id": str(ingested.ids[1]), "text": "another text"}])
        assert conflict.value.code == "id_conflict"
        with pytest.raises(ValueError, match="comma"):
            client.list_observations("alice", scope=["a,b"])

        # Deleting a bank: the dry run counts, deletes nothing; the real one deletes.
        counts = client.delete_bank_dry_run("alice")
        assert counts.memories == 2 and counts.observations == 2
        assert client.stats("alice").consolidated == 2
        deleted = client.delete_bank("alice")
        assert deleted.bank_id == "alice" and deleted.deleted == counts
        with pytest.raises(NotFound) as gone:
            client.stats("alice")
        assert gone.value.code == "bank_not_found"

    with Client(base, api_key="wrong") as intruder, pytest.raises(Unauthorized) as denied:
        intruder.stats("zed")
    assert denied.value.status == 401 and "API key" in denied.value.message


async def test_the_client_drives_every_route_of_a_real_service_and_raises_its_errors(
    fake: FakeLLMServer, serve: Serve
) -> None:
    service = serve("svc", API_KEY=KEY)
    base = await service.api_url()
    # The blocking client in a thread: the fake LLM and the service keep running meanwhile.
    await asyncio.to_thread(_sync_scenario, base, fake)
    service.signal(signal.SIGTERM)
    assert service.wait_exit() == 0


async def test_the_async_client_drives_every_route_of_a_real_service_and_raises_its_errors(
    fake: FakeLLMServer, serve: Serve
) -> None:
    service = serve("svc", API_KEY=KEY)
    base = await service.api_url()
    async with AsyncClient(base, api_key=KEY) as client:
        memories = _memories("bob")
        ingested = await client.ingest("bob", memories)
        submitted = await client.submit("bob", scopes=[["tea"], ["commute"]], priority=5)
        done = await client.wait(submitted.operation_id, timeout_s=60)
        assert done.status == "completed" and done.result and done.result["processed"] == 2
        assert (await client.get_operation(submitted.operation_id)).status == "completed"
        assert (await client.stats("bob")).pending == 1  # the languages scope was not asked for

        observations = [o async for o in client.list_observations("bob", page_size=1)]
        assert sorted(o.scope[0] for o in observations) == ["commute", "tea"]
        assert [b.bank_id async for b in client.list_banks()] == ["bob"]
        operations = [op async for op in client.list_operations(bank_id="bob", page_size=1)]
        assert [op.operation_id for op in operations] == [submitted.operation_id]

        forgotten = await client.forget("bob", ingested.ids[0])
        assert (await client.wait(forgotten.operation_id, timeout_s=60)).status == "completed"
        assert (await client.recover("bob")).recovered == 0

        fake.control(script=[{"hang": True}])
        hanging = (await client.submit("bob")).operation_id
        with pytest.raises(WaitTimeout):
            await client.wait(hanging, timeout_s=0.2)
        await client.cancel_operation(hanging)
        assert (await client.wait(hanging, timeout_s=60)).status == "cancelled"

        with pytest.raises(NotFound) as not_found:
            await client.forget("bob", uuid.uuid4())
        assert not_found.value.code == "memory_not_found"
        counts = await client.delete_bank_dry_run("bob")
        assert counts.memories == 2  # the forgotten one is gone
        assert (await client.delete_bank("bob")).deleted == counts
        with pytest.raises(NotFound):
            await client.delete_bank_dry_run("bob")
    service.signal(signal.SIGTERM)
    assert service.wait_exit() == 0


async def test_a_503_from_a_database_outage_is_retried_after_retry_after_until_it_heals(
    database_url: str, serve: Serve
) -> None:
    async with TcpProxy.in_front_of(database_url) as proxy:
        service = serve("svc", "--no-worker", database_url=proxy.url(database_url))
        base = await service.api_url()
        async with AsyncClient(base, retries=Retries(max_retries=30)) as client:
            await client.ingest("b", [{"text": "Bea plays the cello"}])
            proxy.sever()
            stats = asyncio.create_task(client.stats("b"))
            # The service answered the client's request with a 503 (it logs each one) ...
            await service.wait_event("database_unavailable", path="/v1/banks/b/stats")
            assert not stats.done()
            proxy.restore()
            # ... and the client, retrying after Retry-After, gets the stats once it heals.
            assert (await stats).pending == 1

            async with AsyncClient(base, retries=Retries(max_retries=1)) as impatient:
                proxy.sever()
                with pytest.raises(Unavailable) as unavailable:
                    await impatient.stats("b")
                proxy.restore()
            assert unavailable.value.status == 503
            assert unavailable.value.code == "database_unavailable"
            assert "retry later" in unavailable.value.message
        service.signal(signal.SIGTERM)
        # Not service.wait_exit(): the proxy lives in this event loop, which must keep running.
        await wait_for(lambda: service.proc.poll() is not None, what="the service to exit")
    assert service.proc.returncode == 0
