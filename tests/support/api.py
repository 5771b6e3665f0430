"""The HTTP calls acceptance tests make to a real service, each asserting its success status."""

from __future__ import annotations

from typing import Any

import httpx

from tests.support.waiting import wait_for


async def post_memories(
    client: httpx.AsyncClient, bank: str, memories: list[dict[str, Any]]
) -> list[str]:
    """Ingest ``memories`` into ``bank`` (201); their ids."""
    response = await client.post(f"/v1/banks/{bank}/memories", json={"memories": memories})
    assert response.status_code == 201, response.text
    ids: list[str] = response.json()["ids"]
    return ids


async def submit(client: httpx.AsyncClient, bank: str, **body: Any) -> str:
    """Ask for a consolidation of ``bank`` (202); the operation's id."""
    response = await client.post(f"/v1/banks/{bank}/consolidations", json=body)
    assert response.status_code == 202, response.text
    operation_id: str = response.json()["operation_id"]
    return operation_id


async def operation(client: httpx.AsyncClient, operation_id: str) -> dict[str, Any]:
    body: dict[str, Any] = (await client.get(f"/v1/operations/{operation_id}")).json()
    return body


async def wait_status(
    client: httpx.AsyncClient, operation_id: str, status: str, timeout_s: float, what: str
) -> None:
    """Wait until the API reports the operation in ``status``."""

    async def reached() -> bool:
        return bool((await operation(client, operation_id))["status"] == status)

    await wait_for(reached, timeout_s, what=what)
