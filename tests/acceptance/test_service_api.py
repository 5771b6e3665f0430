"""The HTTP API of a real `consolidation serve` process."""

from __future__ import annotations

import signal

import asyncpg
import httpx
import pytest

from consolidation.testing.fake_llm import FakeLLMServer
from tests.support.api import post_memories, wait_status
from tests.support.engine import grew, markers
from tests.support.services import Services
from tests.support.waiting import wait_for

pytestmark = pytest.mark.acceptance


def env(database_url: str, llm_url: str, **extra: str) -> dict[str, str]:
    """A service with its own defaults (automatic consolidation on ingest), unlike worker_env."""
    return {
        "CONSOLIDATION_DATABASE_URL": database_url,
        "CONSOLIDATION_LLM_BASE_URL": llm_url,
        "CONSOLIDATION_LLM_BATCH_SIZE": "2",
        "CONSOLIDATION_LLM_MAX_RETRIES": "0",
        **extra,
    }


async def test_ingest_consolidate_and_cancel_a_running_operation_over_http(
    pool: asyncpg.Pool,
    database_url: str,
    fake: FakeLLMServer,
    services: Services,
) -> None:
    fake.control(script=[{"pass": True}, {"hang": True}])
    service = services.start(
        "svc", env(database_url, fake.url, CONSOLIDATION_AUTO_CONSOLIDATE="false")
    )
    base = await service.api_url()
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        memories = [
            {"text": f"Alice drinks green tea, note {i}", "tags": ["alice"]} for i in range(6)
        ]
        await post_memories(client, "b", memories)
        submitted = await client.post("/v1/banks/b/consolidations", json={})
        assert submitted.status_code == 202 and submitted.json()["deduplicated"] is False
        operation_id = submitted.json()["operation_id"]
        await wait_for(lambda: fake.stats()["requests"] >= 2, what="the hanging LLM call")
        # The second call starts once the first answer is in, while the first pass applies.
        await wait_for(
            lambda: grew(pool, "SELECT count(*) FROM consolidation_outcomes", 1),
            what="the first pass's apply",
        )
        assert (await client.get(f"/v1/operations/{operation_id}")).json()["status"] == "running"

        cancel = await client.post(f"/v1/operations/{operation_id}/cancel")
        assert cancel.status_code == 202 and cancel.json()["status"] == "running"
        await wait_status(client, operation_id, "cancelled", 10, "the operation to end cancelled")
        await wait_for(lambda: fake.stats()["aborted"] == 1, what="the in-flight call to abort")
        stats = (await client.get("/v1/banks/b/stats")).json()
        assert stats["consolidated"] == 2 and stats["pending"] == 4
        assert await markers(pool, "b") == {"consolidated": 2, "failed": 0, "pending": 4}

        metrics = (await client.get("/metrics")).text
        for name in (
            "consolidation_operations_total",
            "consolidation_memories_total",
            "consolidation_llm_requests_total",
            "consolidation_llm_latency_seconds",
            "consolidation_llm_in_flight",
            "consolidation_llm_tokens_total",
            "consolidation_event_loop_lag_seconds",
        ):
            assert name in metrics, name
    service.signal(signal.SIGTERM)
    assert service.wait_exit() == 0


async def test_with_an_api_key_requests_without_it_get_401(
    database_url: str, fake: FakeLLMServer, services: Services
) -> None:
    service = services.start(
        "svc", env(database_url, fake.url, CONSOLIDATION_API_KEY="s3cret"), "--no-worker"
    )
    base = await service.api_url()
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            response = await client.get("/v1/banks/b/stats", headers=headers)
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "unauthorized"
        ok = await client.post(
            "/v1/banks/b/memories",
            json={"memories": [{"text": "hello"}]},
            headers={"Authorization": "Bearer s3cret"},
        )
        assert ok.status_code == 201
        # Auto-consolidation enqueued one operation; a second submit joins it.
        again = await client.post(
            "/v1/banks/b/consolidations", json={}, headers={"Authorization": "Bearer s3cret"}
        )
        assert again.status_code == 202 and again.json()["deduplicated"] is True
        assert (await client.get("/healthz")).status_code == 200
        assert (await client.get("/readyz")).status_code == 200


# tests/integration/test_api.py checks every route's malformed input in-process; these check
# that a real process (uvicorn, its HTTP parser, the guard) answers them the same way.
MALFORMED: list[tuple[str, str, bytes | None]] = [
    ("POST", "/v1/banks/b/memories", b"{not json"),
    ("POST", "/v1/banks/b/memories", b'{"memories": "nope"}'),
    ("POST", "/v1/banks/b/memories", b'{"memories": [{"text": ""}]}'),
    ("POST", "/v1/banks/b/consolidations", b'{"priority": "high"}'),
    ("GET", "/v1/operations/not-a-uuid", None),
    ("POST", "/v1/operations/00000000-0000-0000-0000-000000000000/cancel", None),
    ("GET", "/v1/banks/nobank/observations?limit=-1", None),
    ("GET", "/v1/banks/nobank/stats", None),
    ("DELETE", "/v1/banks/b/memories", None),
    ("GET", "/v1/nothing-here", None),
]


async def test_malformed_requests_get_a_4xx_json_error_from_a_real_process(
    database_url: str, fake: FakeLLMServer, services: Services
) -> None:
    service = services.start("svc", env(database_url, fake.url), "--no-worker")
    base = await service.api_url()
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        for method, path, body in MALFORMED:
            response = await client.request(
                method, path, content=body, headers={"Content-Type": "application/json"}
            )
            case = (method, path, response.status_code, response.text)
            assert 400 <= response.status_code < 500, case
            error = response.json()["error"]
            assert error["code"] and error["message"], case
