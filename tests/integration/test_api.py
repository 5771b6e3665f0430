"""The HTTP API in-process (httpx ASGI transport) over a real Postgres database."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest

from consolidation import db
from consolidation.api.routes import MAX_BODY_BYTES, create_app
from consolidation.settings import load_settings
from tests.integration.conftest import ClientFactory
from tests.support.engine import set_read_only


@pytest.fixture
async def client(make_client: ClientFactory) -> AsyncIterator[httpx.AsyncClient]:
    async with make_client(auto_consolidate=True) as c:
        yield c


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    error: dict[str, Any] = body["error"]
    assert isinstance(error["code"], str) and isinstance(error["message"], str)
    assert set(error) <= {"code", "message", "details"}
    if "details" in error:
        assert error["details"] and all(isinstance(d, str) for d in error["details"])
    if code is not None:
        assert error["code"] == code, error
    return error


async def ingest(client: httpx.AsyncClient, bank: str, *memories: dict[str, Any]) -> list[str]:
    response = await client.post(f"/v1/banks/{bank}/memories", json={"memories": list(memories)})
    assert response.status_code == 201, response.text
    ids: list[str] = response.json()["ids"]
    return ids


# --- ingestion ---------------------------------------------------------------------------------


async def test_ingest_returns_201_with_ids_in_input_order(
    client: httpx.AsyncClient, pool: asyncpg.Pool
) -> None:
    given = str(uuid.uuid4())
    ids = await ingest(
        client,
        "bank-1",
        {"text": "Alice likes tea", "tags": ["alice"]},
        {"id": given, "text": "Bob likes coffee", "occurred_at": "2026-01-02T03:04:05Z"},
        {"text": "Shared", "observation_scopes": "shared", "metadata": {"k": [1, 2]}},
    )
    assert len(ids) == 3 and ids[1] == given
    assert all(uuid.UUID(i) for i in ids)
    rows = await pool.fetch("SELECT id::text, text FROM memories WHERE bank_id = 'bank-1'")
    assert {r["id"]: r["text"] for r in rows}[given] == "Bob likes coffee"
    assert len(rows) == 3


async def test_resending_the_same_ids_is_idempotent(
    client: httpx.AsyncClient, pool: asyncpg.Pool
) -> None:
    batch = [{"id": str(uuid.uuid4()), "text": f"fact {i}"} for i in range(3)]
    first = await ingest(client, "b", *batch)
    second = await ingest(client, "b", *batch)
    assert first == second == [m["id"] for m in batch]
    assert await pool.fetchval("SELECT count(*) FROM memories") == 3


async def test_ingest_enqueues_one_consolidation_and_later_ingests_join_it(
    client: httpx.AsyncClient, pool: asyncpg.Pool
) -> None:
    await ingest(client, "b", {"text": "one"})
    await ingest(client, "b", {"text": "two"})
    ops = await pool.fetch("SELECT id, status, scope_filter FROM operations WHERE bank_id = 'b'")
    assert len(ops) == 1
    assert ops[0]["status"] == "pending" and ops[0]["scope_filter"] is None

    response = await client.post("/v1/banks/b/consolidations")
    assert response.status_code == 202, response.text
    assert response.json() == {
        "operation_id": str(ops[0]["id"]),
        "status": "pending",
        "deduplicated": True,
    }


async def test_the_ingest_answer_names_the_operation_it_enqueued_or_joined(
    client: httpx.AsyncClient, manual_client: httpx.AsyncClient, pool: asyncpg.Pool
) -> None:
    first = await client.post("/v1/banks/b/memories", json={"memories": [{"text": "one"}]})
    second = await client.post("/v1/banks/b/memories", json={"memories": [{"text": "two"}]})
    pending = await pool.fetchval("SELECT id::text FROM operations WHERE bank_id = 'b'")
    assert first.json()["operation_id"] == second.json()["operation_id"] == pending
    # Once it runs, the next ingestion enqueues (and names) a new one.
    await pool.execute("UPDATE operations SET status = 'running', worker_id = 'w', attempt = 1")
    third = await client.post("/v1/banks/b/memories", json={"memories": [{"text": "three"}]})
    assert third.json()["operation_id"] not in (None, pending)
    assert await pool.fetchval("SELECT count(*) FROM operations") == 2
    unqueued = await manual_client.post("/v1/banks/c/memories", json={"memories": [{"text": "x"}]})
    assert unqueued.status_code == 201 and unqueued.json()["operation_id"] is None


async def test_ingest_without_auto_consolidate_enqueues_nothing(
    manual_client: httpx.AsyncClient, pool: asyncpg.Pool
) -> None:
    await ingest(manual_client, "b", {"text": "one"})
    assert await pool.fetchval("SELECT count(*) FROM operations") == 0


async def test_a_bad_item_rejects_the_whole_batch_listing_every_problem(
    client: httpx.AsyncClient, pool: asyncpg.Pool
) -> None:
    response = await client.post(
        "/v1/banks/b/memories",
        json={
            "memories": [
                {"text": "fine"},
                {"text": ""},
                {"text": "x", "tags": ["t" * 129]},
                "not an object",
                {"text": "x", "id": "nope", "colour": "red"},
            ]
        },
    )
    error = assert_error(response, 422, "invalid_memories")
    details = error["details"]
    assert any(d.startswith("memories[1]: text") for d in details)
    assert any(d.startswith("memories[2]: tag") for d in details)
    assert any(d.startswith("memories[3]:") for d in details)
    assert any(d.startswith("memories[4]: unknown field") for d in details)
    assert any(d.startswith("memories[4]: id must be a UUID") for d in details)
    assert not any(d.startswith("memories[0]") for d in details)
    assert await pool.fetchval("SELECT count(*) FROM memories") == 0
    assert await pool.fetchval("SELECT count(*) FROM operations") == 0


@pytest.mark.parametrize("count", [0, 1001])
async def test_batches_of_zero_or_over_1000_memories_are_rejected(
    client: httpx.AsyncClient, count: int
) -> None:
    response = await client.post("/v1/banks/b/memories", json={"memories": [{"text": "x"}] * count})
    assert_error(response, 422, "invalid_request")


async def test_an_id_of_another_bank_is_a_409_and_nothing_is_written(
    client: httpx.AsyncClient, pool: asyncpg.Pool
) -> None:
    taken = str(uuid.uuid4())
    await ingest(client, "a", {"id": taken, "text": "mine"})
    response = await client.post(
        "/v1/banks/b/memories", json={"memories": [{"text": "new"}, {"id": taken, "text": "x"}]}
    )
    error = assert_error(response, 409, "id_conflict")
    assert taken in error["message"]
    assert await pool.fetchval("SELECT count(*) FROM memories") == 1


async def test_an_id_given_twice_in_one_request_is_a_422_naming_it_and_nothing_is_written(
    client: httpx.AsyncClient, pool: asyncpg.Pool
) -> None:
    repeated = str(uuid.uuid4())
    response = await client.post(
        "/v1/banks/b/memories",
        json={
            "memories": [
                {"id": repeated, "text": "first"},
                {"text": "other"},
                {"id": repeated, "text": "second"},
            ]
        },
    )
    error = assert_error(response, 422, "invalid_memories")
    assert error["details"] == [f"memories[2]: id {repeated} is already used by memories[0]"]
    assert await pool.fetchval("SELECT count(*) FROM memories") == 0
    assert await pool.fetchval("SELECT count(*) FROM operations") == 0


def _nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth):
        value = {"a": value}
    return value


@pytest.mark.parametrize(
    "memory",
    [
        {"text": "x", "metadata": {"k": "a\u0000b"}},
        {"text": "x", "observation_scopes": [["a\u0000"]]},
        {"text": "x", "metadata": _nested(300)},
    ],
)
async def test_a_value_postgres_cannot_store_is_a_422_not_a_500(
    client: httpx.AsyncClient, pool: asyncpg.Pool, memory: dict[str, Any]
) -> None:
    response = await client.post("/v1/banks/b/memories", json={"memories": [memory]})
    error = assert_error(response, 422, "invalid_memories")
    assert "UUID(" not in error["message"]
    assert await pool.fetchval("SELECT count(*) FROM memories") == 0


async def test_a_bad_bank_id_is_rejected(client: httpx.AsyncClient) -> None:
    for bank in ("%20%20", "a%01b", "x" * 257):
        response = await client.post(
            f"/v1/banks/{bank}/memories", json={"memories": [{"text": "x"}]}
        )
        assert_error(response, 422)


# --- consolidations and operations --------------------------------------------------------------


async def test_consolidation_with_scopes_and_priority_is_not_deduplicated(
    manual_client: httpx.AsyncClient, pool: asyncpg.Pool
) -> None:
    await ingest(manual_client, "b", {"text": "x", "tags": ["p", "q"]})
    body = {"scopes": [["q", "p", "q"], []], "priority": 7}
    first = await manual_client.post("/v1/banks/b/consolidations", json=body)
    second = await manual_client.post("/v1/banks/b/consolidations", json=body)
    assert first.status_code == second.status_code == 202
    assert first.json()["deduplicated"] is False and second.json()["deduplicated"] is False
    assert first.json()["operation_id"] != second.json()["operation_id"]
    row = await pool.fetchrow(
        "SELECT scope_filter, priority, max_attempts FROM operations WHERE id = $1",
        uuid.UUID(first.json()["operation_id"]),
    )
    assert row["scope_filter"] == [[], ["p", "q"]]
    assert row["priority"] == 7 and row["max_attempts"] == 5


async def test_an_empty_body_or_empty_object_requests_a_whole_bank_consolidation(
    manual_client: httpx.AsyncClient,
) -> None:
    await ingest(manual_client, "b", {"text": "x"})
    first = await manual_client.post("/v1/banks/b/consolidations")
    second = await manual_client.post("/v1/banks/b/consolidations", json={})
    assert first.status_code == 202 and first.json()["deduplicated"] is False
    assert first.json()["status"] == "pending"
    assert second.json() == {**first.json(), "deduplicated": True}


@pytest.mark.parametrize(
    "body",
    [
        {"scopes": []},
        {"scopes": [["a"]] * 101},
        {"scopes": [[""]]},
        {"scopes": [["   "]]},
        {"scopes": [["t" * 129]]},
        {"scopes": [[f"t{i}" for i in range(33)]]},
        {"scopes": [["a\u0000"]]},
        {"scopes": "a"},
        {"scopes": [[1]]},
        {"priority": 1001},
        {"priority": -1001},
        {"priority": "5"},
        {"priority": 1.5},
        {"priority": True},
        {"unknown": 1},
        [],
    ],
)
async def test_invalid_consolidation_requests_are_422(
    manual_client: httpx.AsyncClient, body: Any
) -> None:
    await ingest(manual_client, "b", {"text": "x"})
    response = await manual_client.post("/v1/banks/b/consolidations", json=body)
    error = assert_error(response, 422, "invalid_request")
    assert error["details"]


# Each of these is refused by scopes.tag_problem, the one rule for tags everywhere.
BAD_TAGS = ["a\x7fb", "a\x1fb", "\x00", " ", "t" * 129]


@pytest.mark.parametrize("tag", BAD_TAGS, ids=repr)
async def test_every_route_that_takes_tags_refuses_what_the_scope_rules_refuse(
    manual_client: httpx.AsyncClient, pool: asyncpg.Pool, tag: str
) -> None:
    await ingest(manual_client, "b", {"text": "x", "tags": ["ok"]})
    for memory in ({"text": "y", "tags": [tag]}, {"text": "y", "observation_scopes": [[tag]]}):
        response = await manual_client.post("/v1/banks/b/memories", json={"memories": [memory]})
        assert_error(response, 422, "invalid_memories")
    response = await manual_client.post("/v1/banks/b/consolidations", json={"scopes": [[tag]]})
    assert_error(response, 422, "invalid_request")
    response = await manual_client.get("/v1/banks/b/observations", params={"scope": tag})
    assert_error(response, 422, "invalid_request")
    assert await pool.fetchval("SELECT count(*) FROM memories") == 1
    assert await pool.fetchval("SELECT count(*) FROM operations") == 0


async def test_consolidating_an_unknown_bank_is_404(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/banks/nobody/consolidations")
    assert_error(response, 404, "bank_not_found")


async def test_get_operation_reports_every_contract_key(client: httpx.AsyncClient) -> None:
    await ingest(client, "b", {"text": "x"})
    submitted = (await client.post("/v1/banks/b/consolidations")).json()
    response = await client.get(f"/v1/operations/{submitted['operation_id']}")
    assert response.status_code == 200
    op = response.json()
    assert set(op) == {
        "operation_id",
        "bank_id",
        "kind",  # consolidate or forget
        "status",
        "attempt",
        "progress",
        "result",
        "error",
        "last_error",  # the latest attempt's error, kept while the next one waits
        "last_error_at",
        "run_after",
        "created_at",
        "started_at",
        "finished_at",
    }
    assert op["operation_id"] == submitted["operation_id"]
    assert (op["bank_id"], op["status"], op["attempt"]) == ("b", "pending", 0)
    assert op["created_at"].endswith("Z") and op["started_at"] is None


async def test_an_unknown_operation_is_404_and_a_non_uuid_is_422(
    client: httpx.AsyncClient,
) -> None:
    assert_error(await client.get(f"/v1/operations/{uuid.uuid4()}"), 404, "operation_not_found")
    assert_error(await client.get("/v1/operations/not-a-uuid"), 422, "invalid_request")
    assert_error(
        await client.post(f"/v1/operations/{uuid.uuid4()}/cancel"), 404, "operation_not_found"
    )


async def _insert_operations(
    pool: asyncpg.Pool, rows: list[tuple[str, str, str]]
) -> list[uuid.UUID]:
    """(bank, status, created_at offset like '-5 minutes') → ids; finished ones get no lease."""
    ids = []
    for bank, status, offset in rows:
        await pool.execute("INSERT INTO banks (id) VALUES ($1) ON CONFLICT DO NOTHING", bank)
        op_id = uuid.uuid4()
        await pool.execute(
            "INSERT INTO operations (id, bank_id, status, scope_filter, created_at)"
            " VALUES ($1, $2, $3, '[[\"x\"]]', '2026-01-01T00:00:00Z'::timestamptz + $4::text::interval)",
            op_id,
            bank,
            status,
            offset,
        )
        ids.append(op_id)
    return ids


async def test_operations_are_listed_newest_first_page_by_page_as_get_shows_them(
    client: httpx.AsyncClient, pool: asyncpg.Pool
) -> None:
    # Three share one created_at: the id breaks the tie, so no page repeats or skips one.
    ids = await _insert_operations(
        pool,
        [
            ("a", "completed", "1 minute"),
            ("b", "failed", "2 minutes"),
            ("a", "pending", "3 minutes"),
            ("b", "completed", "3 minutes"),
            ("a", "cancelled", "3 minutes"),
            ("c", "running", "4 minutes"),
        ],
    )
    expected = [
        str(r["id"])
        for r in await pool.fetch("SELECT id FROM operations ORDER BY created_at DESC, id DESC")
    ]
    seen: list[dict[str, Any]] = []
    cursor = None
    for _ in range(10):
        params: dict[str, Any] = {"limit": 2, **({"cursor": cursor} if cursor else {})}
        response = await client.get("/v1/operations", params=params)
        assert response.status_code == 200, response.text
        body = response.json()
        assert set(body) == {"operations", "next_cursor"} and len(body["operations"]) <= 2
        seen += body["operations"]
        cursor = body["next_cursor"]
        if cursor is None:
            break
    assert [op["operation_id"] for op in seen] == expected
    assert len(seen) == len(ids)
    for op in seen:
        assert op == (await client.get(f"/v1/operations/{op['operation_id']}")).json()

    only_a = (await client.get("/v1/operations", params={"bank_id": "a"})).json()
    assert [op["bank_id"] for op in only_a["operations"]] == ["a", "a", "a"]
    completed = (await client.get("/v1/operations", params={"status": "completed"})).json()
    assert {op["operation_id"] for op in completed["operations"]} == {str(ids[0]), str(ids[3])}
    both = await client.get("/v1/operations", params={"bank_id": "b", "status": "failed"})
    assert [op["operation_id"] for op in both.json()["operations"]] == [str(ids[1])]
    nobody = (await client.get("/v1/operations", params={"bank_id": "nobody"})).json()
    assert nobody == {"operations": [], "next_cursor": None}


@pytest.mark.parametrize(
    ("query", "status", "code"),
    [
        ("status=done", 422, "invalid_request"),
        ("status=", 422, "invalid_request"),
        ("bank_id=", 422, "invalid_request"),
        ("bank_id=%00", 422, "invalid_request"),
        (f"bank_id={'x' * 257}", 422, "invalid_request"),
        ("limit=0", 422, "invalid_request"),
        ("limit=1001", 422, "invalid_request"),
        ("cursor=garbage", 400, "invalid_cursor"),
        (f"cursor={'A' * 22}", 400, "invalid_cursor"),
        (f"cursor={'/' * 32}", 400, "invalid_cursor"),
        (f"cursor={'_' * 31}", 400, "invalid_cursor"),
    ],
)
async def test_invalid_operation_list_filters_are_4xx(
    client: httpx.AsyncClient, query: str, status: int, code: str
) -> None:
    assert_error(await client.get(f"/v1/operations?{query}"), status, code)


async def test_cancelling_a_pending_operation_cancels_it_at_once(
    client: httpx.AsyncClient,
) -> None:
    await ingest(client, "b", {"text": "x"})
    op_id = (await client.post("/v1/banks/b/consolidations")).json()["operation_id"]
    response = await client.post(f"/v1/operations/{op_id}/cancel")
    assert response.status_code == 202
    assert response.json() == {"operation_id": op_id, "status": "cancelled"}
    assert (await client.get(f"/v1/operations/{op_id}")).json()["status"] == "cancelled"
    again = await client.post(f"/v1/operations/{op_id}/cancel")
    assert again.status_code == 202 and again.json()["status"] == "cancelled"


async def test_cancelling_a_running_operation_asks_its_worker_to_stop(
    client: httpx.AsyncClient, pool: asyncpg.Pool
) -> None:
    op_id = uuid.uuid4()
    await pool.execute("INSERT INTO banks (id) VALUES ('b')")
    await pool.execute(
        "INSERT INTO operations (id, bank_id, status, attempt, worker_id, lease_expires_at,"
        " started_at) VALUES ($1, 'b', 'running', 1, 'w1', now() + interval '30 s', now())",
        op_id,
    )
    response = await client.post(f"/v1/operations/{op_id}/cancel")
    assert response.status_code == 202
    assert response.json() == {"operation_id": str(op_id), "status": "running"}
    row = await pool.fetchrow(
        "SELECT status, cancel_requested_at FROM operations WHERE id = $1", op_id
    )
    assert row["status"] == "running" and row["cancel_requested_at"] is not None


# --- observations, stats, recover -------------------------------------------------------------


async def _insert_observations(
    pool: asyncpg.Pool, bank: str, scopes: list[list[str]]
) -> list[uuid.UUID]:
    """One memory and one observation (citing it) per scope, written directly."""
    await pool.execute("INSERT INTO banks (id) VALUES ($1) ON CONFLICT DO NOTHING", bank)
    ids = []
    for i, scope in enumerate(scopes):
        memory_id, observation_id = uuid.uuid4(), uuid.uuid4()
        await pool.execute(
            "INSERT INTO memories (id, bank_id, text, tags) VALUES ($1, $2, $3, $4)",
            memory_id,
            bank,
            f"fact {i}",
            scope,
        )
        await pool.execute(
            "INSERT INTO memory_scopes (memory_id, scope) VALUES ($1, $2)", memory_id, scope
        )
        await pool.execute(
            "INSERT INTO observations (id, bank_id, scope, text) VALUES ($1, $2, $3, $4)",
            observation_id,
            bank,
            scope,
            f"observation {i}",
        )
        await pool.execute(
            "INSERT INTO observation_sources (observation_id, memory_id) VALUES ($1, $2)",
            observation_id,
            memory_id,
        )
        ids.append(observation_id)
    return ids


async def test_observations_are_listed_with_their_sources(
    client: httpx.AsyncClient, pool: asyncpg.Pool
) -> None:
    [observation_id] = await _insert_observations(pool, "b", [["a", "b"]])
    response = await client.get("/v1/banks/b/observations")
    assert response.status_code == 200
    page = response.json()
    assert page["next_cursor"] is None
    [obs] = page["observations"]
    assert set(obs) == {"id", "scope", "text", "source_memory_ids", "updated_at"}
    assert obs["id"] == str(observation_id) and obs["scope"] == ["a", "b"]
    source = await pool.fetchval("SELECT id::text FROM memories WHERE bank_id = 'b'")
    assert obs["source_memory_ids"] == [source]


async def test_the_scope_parameter_filters_and_an_empty_one_means_shared(
    client: httpx.AsyncClient, pool: asyncpg.Pool
) -> None:
    ab, a, shared = await _insert_observations(pool, "b", [["a", "b"], ["a"], []])

    async def listed(query: str) -> set[str]:
        response = await client.get(f"/v1/banks/b/observations{query}")
        assert response.status_code == 200, response.text
        return {o["id"] for o in response.json()["observations"]}

    assert await listed("") == {str(ab), str(a), str(shared)}
    assert await listed("?scope=b,a") == {str(ab)}
    assert await listed("?scope=a,a") == {str(a)}
    assert await listed("?scope=") == {str(shared)}
    assert await listed("?scope=zzz") == set()


async def test_pagination_visits_every_observation_exactly_once(
    client: httpx.AsyncClient, pool: asyncpg.Pool
) -> None:
    expected = await _insert_observations(pool, "b", [["t"]] * 7 + [["u"]] * 3)
    seen: list[str] = []
    cursor: str | None = None
    pages = 0
    while True:
        params = {"limit": "3", "scope": "t"} | ({"cursor": cursor} if cursor else {})
        response = await client.get("/v1/banks/b/observations", params=params)
        assert response.status_code == 200, response.text
        page = response.json()
        pages += 1
        seen += [o["id"] for o in page["observations"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert pages == 3
    assert sorted(seen) == sorted(str(i) for i in expected[:7])
    assert len(seen) == len(set(seen))


async def test_an_exact_last_page_has_no_next_cursor(
    client: httpx.AsyncClient, pool: asyncpg.Pool
) -> None:
    await _insert_observations(pool, "b", [["t"]] * 4)
    first = (await client.get("/v1/banks/b/observations?limit=2")).json()
    assert first["next_cursor"] is not None
    second = (
        await client.get(f"/v1/banks/b/observations?limit=2&cursor={first['next_cursor']}")
    ).json()
    assert len(second["observations"]) == 2 and second["next_cursor"] is None


@pytest.mark.parametrize(
    "cursor", ["garbage", "!!!!!!!!!!!!!!!!!!!!!!", "AAAAAAAAAAAAAAAAAAAAAB", "a" * 300, "é" * 22]
)
async def test_a_bad_cursor_is_400(
    client: httpx.AsyncClient, pool: asyncpg.Pool, cursor: str
) -> None:
    await _insert_observations(pool, "b", [["t"]])
    response = await client.get("/v1/banks/b/observations", params={"cursor": cursor})
    assert_error(response, 400, "invalid_cursor")


@pytest.mark.parametrize("query", ["limit=0", "limit=1001", "limit=-1", "limit=x", "scope=a,,b"])
async def test_bad_observation_queries_are_422(
    client: httpx.AsyncClient, pool: asyncpg.Pool, query: str
) -> None:
    await _insert_observations(pool, "b", [["t"]])
    assert_error(await client.get(f"/v1/banks/b/observations?{query}"), 422, "invalid_request")


async def test_stats_count_memories_by_state(
    manual_client: httpx.AsyncClient, pool: asyncpg.Pool
) -> None:
    ids = await ingest(manual_client, "b", {"text": "one"}, {"text": "two"}, {"text": "three"})
    await pool.execute("UPDATE memories SET consolidated_at = now() WHERE id = $1::uuid", ids[0])
    await pool.execute(
        "UPDATE memories SET consolidation_failed_at = now() WHERE id = $1::uuid", ids[1]
    )
    response = await manual_client.get("/v1/banks/b/stats")
    assert response.status_code == 200
    stats = response.json()
    assert set(stats) == {
        "pending",
        "consolidated",
        "failed",
        "observations",
        "oldest_pending_age_s",
    }
    assert (stats["pending"], stats["consolidated"], stats["failed"]) == (1, 1, 1)
    assert stats["observations"] == 0 and stats["oldest_pending_age_s"] >= 0


async def test_banks_are_listed_with_their_stats_page_by_page(
    manual_client: httpx.AsyncClient, pool: asyncpg.Pool
) -> None:
    names = ["b-é", "a", "c d", "b"]
    for name in names:
        await ingest(manual_client, name, {"text": "one"}, {"text": "two"})
    await pool.execute(
        "UPDATE memories SET consolidated_at = now() WHERE bank_id = 'a' AND text = 'one'"
    )
    await pool.execute("UPDATE memories SET consolidation_failed_at = now() WHERE bank_id = 'b'")
    await _insert_observations(pool, "a", [["t"], ["u"]])
    listed: list[dict[str, Any]] = []
    cursor = None
    for _ in range(10):
        params: dict[str, Any] = {"limit": 3, **({"cursor": cursor} if cursor else {})}
        body = (await manual_client.get("/v1/banks", params=params)).json()
        listed += body["banks"]
        cursor = body["next_cursor"]
        if cursor is None:
            break
    assert [b["bank_id"] for b in listed] == sorted(names)
    for bank in listed:
        stats = (await manual_client.get(f"/v1/banks/{bank['bank_id']}/stats")).json()
        age = bank.pop("oldest_pending_age_s"), stats.pop("oldest_pending_age_s")
        assert bank.pop("bank_id") and bank.pop("created_at").endswith("Z")
        assert bank == stats
        assert (age[0] is None) == (age[1] is None)
    by_id = {b["bank_id"]: b for b in (await manual_client.get("/v1/banks")).json()["banks"]}
    assert (by_id["a"]["consolidated"], by_id["a"]["observations"]) == (1, 2)
    assert (by_id["b"]["failed"], by_id["b"]["pending"]) == (2, 0)
    assert by_id["b"]["oldest_pending_age_s"] is None


@pytest.mark.parametrize(
    "query", ["limit=0", "cursor=", "cursor=%2F%2F", "cursor=QQ%3D%3D", "cursor=_w"]
)
async def test_bad_bank_list_queries_are_4xx(client: httpx.AsyncClient, query: str) -> None:
    response = await client.get(f"/v1/banks?{query}")
    assert 400 <= response.status_code < 500
    assert_error(response, response.status_code)


async def test_stats_of_an_empty_bank_have_no_pending_age(
    client: httpx.AsyncClient, pool: asyncpg.Pool
) -> None:
    await pool.execute("INSERT INTO banks (id) VALUES ('empty')")
    stats = (await client.get("/v1/banks/empty/stats")).json()
    assert stats == {
        "pending": 0,
        "consolidated": 0,
        "failed": 0,
        "observations": 0,
        "oldest_pending_age_s": None,
    }


async def test_recover_clears_failed_markers_and_enqueues_a_consolidation(
    client: httpx.AsyncClient, pool: asyncpg.Pool
) -> None:
    await ingest(client, "b", {"text": "one"}, {"text": "two"})
    await pool.execute("UPDATE operations SET status = 'completed', finished_at = now()")
    await pool.execute("UPDATE memories SET consolidation_failed_at = now()")
    response = await client.post("/v1/banks/b/memories/recover")
    assert response.status_code == 200 and response.json() == {"recovered": 2}
    assert await pool.fetchval("SELECT count(*) FROM operations WHERE status = 'pending'") == 1
    again = await client.post("/v1/banks/b/memories/recover")
    assert again.json() == {"recovered": 0}
    assert (
        await pool.fetchval("SELECT count(*) FROM memories WHERE consolidation_failed_at IS NULL")
        == 2
    )


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/banks/nobody/stats"),
        ("GET", "/v1/banks/nobody/observations"),
        ("POST", "/v1/banks/nobody/memories/recover"),
    ],
)
async def test_unknown_banks_are_404(client: httpx.AsyncClient, method: str, path: str) -> None:
    assert_error(await client.request(method, path), 404, "bank_not_found")


# --- probes -------------------------------------------------------------------------------------


async def test_health_readiness_and_metrics(client: httpx.AsyncClient) -> None:
    health = await client.get("/healthz")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    ready = await client.get("/readyz")
    assert ready.status_code == 200 and ready.json() == {"status": "ready"}
    metrics = await client.get("/metrics")
    assert metrics.status_code == 200
    assert metrics.headers["content-type"].startswith("text/plain")
    assert "consolidation_operations" in metrics.text


async def test_an_unreachable_database_is_503_not_500(make_client: ClientFactory) -> None:
    # Port 1 refuses connections; with min_size=0 the pool only tries when used.
    dead = await db.create_pool("postgresql://postgres@127.0.0.1:1/nothing", min_size=0)
    try:
        async with make_client(on=dead) as client:
            assert_error(await client.get("/readyz"), 503, "database_unavailable")
            assert_error(await client.get("/v1/banks/b/stats"), 503, "database_unavailable")
            response = await client.post("/v1/banks/b/memories", json={"memories": [{"text": "x"}]})
            assert_error(response, 503, "database_unavailable")
            assert (await client.get("/healthz")).status_code == 200
    finally:
        await dead.close()


async def test_a_database_that_cannot_take_writes_is_503_with_retry_after_until_it_can(
    make_client: ClientFactory, pool: asyncpg.Pool, database_url: str
) -> None:
    """What a failover to a replica looks like (every new session read-only): ingestion and
    submits answer 503 with the error shape and Retry-After (it used to be a 500), /readyz is 503;
    once writes are back, 201 / 202 / 200 again."""
    app_pool = await db.create_pool(database_url)
    try:
        async with make_client(on=app_pool, auto_consolidate=True) as client:
            await ingest(client, "b", {"text": "before"})
            await set_read_only(pool, database_url, True)
            await app_pool.expire_connections()
            memories = {"memories": [{"text": "during"}]}
            for response in (
                await client.post("/v1/banks/b/memories", json=memories),
                await client.post("/v1/banks/b/consolidations", json={}),
                await client.get("/readyz"),
            ):
                error = assert_error(response, 503, "database_unavailable")
                assert response.headers["retry-after"] == "1"
                if response.url.path != "/readyz":
                    assert "read-only" in error["message"]
            assert (await client.get("/healthz")).status_code == 200
            assert (await client.get("/v1/banks/b/stats")).status_code == 200  # reads still work

            await set_read_only(pool, database_url, False)
            await app_pool.expire_connections()
            await ingest(client, "b", {"text": "after"})
            submitted = await client.post("/v1/banks/b/consolidations", json={})
            assert submitted.status_code == 202, submitted.text
            assert (await client.get("/readyz")).status_code == 200
    finally:
        await set_read_only(pool, database_url, False)
        await app_pool.close()


@pytest.mark.parametrize(
    "sqlstate",
    ["25006", "53300", "57P01", "57P02", "57P03", "25P03", "08006"],
)
async def test_every_way_a_database_refuses_for_now_is_classed_as_unavailable(
    sqlstate: str,
) -> None:
    error = asyncpg.PostgresError.get_message_class_for_sqlstate(sqlstate)("refused")
    assert isinstance(error, db.DATABASE_DOWN)
    assert db.unavailable_reason(error).endswith("retry later")


async def test_the_openapi_document_is_served(client: httpx.AsyncClient) -> None:
    response = await client.get("/openapi.json")
    assert response.status_code == 200
    spec = response.json()
    assert spec["info"]["title"] == "consolidation"
    assert "/v1/banks/{bank_id}/memories" in spec["paths"]
    assert (await client.get("/docs")).status_code == 200


async def test_the_docs_pages_load_their_scripts_from_the_service_itself(
    client: httpx.AsyncClient,
) -> None:
    for page, asset in (
        ("/docs", "/static/swagger-ui-bundle.js"),
        ("/docs", "/static/swagger-ui.css"),
        ("/redoc", "/static/redoc.standalone.js"),
    ):
        html = (await client.get(page)).text
        assert f'"{asset}"' in html and "https://" not in html, html
        served = await client.get(asset)
        assert served.status_code == 200 and len(served.content) > 10_000, asset
    assert (await client.get("/docs/oauth2-redirect")).status_code == 200


@pytest.mark.parametrize(
    ("path", "headers"),
    [
        ("/v1/banks/b/memories", {"Content-Type": "application/x-www-form-urlencoded"}),
        ("/v1/banks/b/memories", {"Content-Type": "text/plain"}),
        ("/v1/banks/b/memories", {}),
        ("/v1/banks/b/consolidations", {"Content-Type": "multipart/form-data; boundary=x"}),
    ],
)
async def test_a_body_not_sent_as_json_is_415_saying_so(
    client: httpx.AsyncClient, path: str, headers: dict[str, str]
) -> None:
    await ingest(client, "b", {"text": "x"})
    body = b'{"memories": [{"text": "Alice likes tea"}]}'
    response = await client.post(path, content=body, headers=headers)
    error = assert_error(response, 415, "unsupported_media_type")
    assert "Content-Type: application/json" in error["message"]
    assert (headers.get("Content-Type", "no Content-Type")) in error["message"]


@pytest.mark.parametrize(
    "content_type", ["application/json", "application/json; charset=utf-8", "application/x+json"]
)
async def test_any_json_content_type_is_accepted(
    client: httpx.AsyncClient, content_type: str
) -> None:
    body = b'{"memories": [{"text": "Alice likes tea"}]}'
    response = await client.post(
        "/v1/banks/b/memories", content=body, headers={"Content-Type": content_type}
    )
    assert response.status_code == 201, response.text


async def test_an_unexpected_exception_is_a_generic_json_500(
    pool: asyncpg.Pool, database_url: str
) -> None:
    app = create_app(load_settings(database_url=database_url), pool)

    async def boom() -> None:
        raise RuntimeError("secret detail")

    app.add_api_route("/boom", boom)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        error = assert_error(await client.get("/boom"), 500, "internal_error")
    assert "secret" not in error["message"]


# --- API key --------------------------------------------------------------------------------


async def test_an_api_key_guards_every_v1_route_but_not_the_probes(
    make_client: ClientFactory,
) -> None:
    async with make_client(api_key="s3cret") as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
            response = await client.get("/v1/banks/b/stats", headers=headers)
            assert_error(response, 401, "unauthorized")
            assert response.headers["www-authenticate"] == "Bearer"
        # Rejected before the body is even parsed, and unknown /v1 paths too.
        response = await client.post("/v1/banks/b/memories", content=b"{nope")
        assert_error(response, 401, "unauthorized")
        assert_error(await client.get("/v1/nowhere"), 401, "unauthorized")

        ok = {"Authorization": "Bearer s3cret"}
        response = await client.post(
            "/v1/banks/b/memories", json={"memories": [{"text": "x"}]}, headers=ok
        )
        assert response.status_code == 201
        assert (await client.get("/v1/banks/b/stats", headers=ok)).status_code == 200
        for open_path in (
            "/healthz",
            "/readyz",
            "/metrics",
            "/openapi.json",
            "/docs",
            "/redoc",
            "/static/swagger-ui.css",
        ):
            assert (await client.get(open_path)).status_code == 200, open_path


# --- request size -----------------------------------------------------------------------------


async def test_a_body_over_16_mib_is_413(client: httpx.AsyncClient) -> None:
    big = b'{"memories": [{"text": "' + b"x" * MAX_BODY_BYTES + b'"}]}'
    response = await client.post(
        "/v1/banks/b/memories", content=big, headers={"Content-Type": "application/json"}
    )
    assert_error(response, 413, "payload_too_large")


async def test_a_streamed_body_over_16_mib_is_413(client: httpx.AsyncClient) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"memories": [{"text": "'
        for _ in range(17):
            yield b"x" * (1024 * 1024)
        yield b'"}]}'

    response = await client.post(
        "/v1/banks/b/memories", content=chunks(), headers={"Content-Type": "application/json"}
    )
    assert "content-length" not in response.request.headers
    assert_error(response, 413, "payload_too_large")


# --- every route, malformed input -----------------------------------------------------------

OP = "00000000-0000-4000-8000-000000000000"
JSON = {"Content-Type": "application/json"}

MALFORMED: list[tuple[str, str, dict[str, Any], int]] = [
    # ingest
    ("POST", "/v1/banks/b/memories", {"content": b"{bad json", "headers": JSON}, 400),
    ("POST", "/v1/banks/b/memories", {"content": b'"\\ud800"', "headers": JSON}, 400),
    ("POST", "/v1/banks/b/memories", {"content": b'{"memories": [NaN]}', "headers": JSON}, 400),
    ("POST", "/v1/banks/b/memories", {"content": b"[" * 5000, "headers": JSON}, 400),
    ("POST", "/v1/banks/b/memories", {"content": b'{"memories": []}'}, 415),  # no content type
    ("POST", "/v1/banks/b/memories", {"json": None}, 422),
    ("POST", "/v1/banks/b/memories", {}, 422),
    ("POST", "/v1/banks/b/memories", {"json": {"memories": "x"}}, 422),
    ("POST", "/v1/banks/b/memories", {"json": {"memories": {"text": "x"}}}, 422),
    ("POST", "/v1/banks/b/memories", {"json": {"memories": [{"text": 5}]}}, 422),
    ("POST", "/v1/banks/b/memories", {"json": {"memories": [None]}}, 422),
    ("POST", "/v1/banks/b/memories", {"json": {"memories": [{"text": "x", "tags": "a"}]}}, 422),
    ("POST", "/v1/banks/b/memories", {"json": {"memories": [{"text": "x", "metadata": 1}]}}, 422),
    (
        "POST",
        "/v1/banks/b/memories",
        {"json": {"memories": [{"text": "x", "observation_scopes": [["a\u0000"]]}]}},
        422,
    ),
    (
        "POST",
        "/v1/banks/b/memories",
        {"json": {"memories": [{"text": "x", "occurred_at": 12}]}},
        422,
    ),
    ("POST", "/v1/banks/b/memories", {"json": {"memories": [{"text": "x"}], "extra": 1}}, 422),
    ("PUT", "/v1/banks/b/memories", {"json": {"memories": [{"text": "x"}]}}, 405),
    ("GET", "/v1/banks/b/memories", {}, 405),
    # consolidations
    ("POST", "/v1/banks/b/consolidations", {"content": b"{", "headers": JSON}, 400),
    ("POST", "/v1/banks/b/consolidations", {"json": {"priority": "high"}}, 422),
    ("POST", "/v1/banks/b/consolidations", {"json": {"scopes": [[None]]}}, 422),
    ("POST", "/v1/banks/nobody/consolidations", {"json": {}}, 404),
    ("DELETE", "/v1/banks/b/consolidations", {}, 405),
    # operations
    ("GET", "/v1/operations/not-a-uuid", {}, 422),
    ("GET", f"/v1/operations/{OP}", {}, 404),
    ("POST", "/v1/operations/12345/cancel", {}, 422),
    ("POST", f"/v1/operations/{OP}/cancel", {}, 404),
    ("GET", f"/v1/operations/{OP}/cancel", {}, 405),
    ("DELETE", f"/v1/operations/{OP}", {}, 405),
    ("GET", "/v1/operations?status=x", {}, 422),
    ("GET", "/v1/operations?cursor=x", {}, 400),
    ("POST", "/v1/operations", {"json": {}}, 405),
    # banks
    ("GET", "/v1/banks?limit=x", {}, 422),
    ("GET", "/v1/banks?cursor=%00", {}, 400),
    ("POST", "/v1/banks", {"json": {}}, 405),
    # observations
    ("GET", "/v1/banks/b/observations?limit=100000000000000000000000", {}, 422),
    ("GET", "/v1/banks/b/observations?limit=-5", {}, 422),
    ("GET", "/v1/banks/b/observations?limit=1.5", {}, 422),
    ("GET", "/v1/banks/b/observations?cursor=%00%01", {}, 400),
    ("GET", "/v1/banks/b/observations?scope=%00", {}, 422),
    ("GET", "/v1/banks/b/observations?scope=a%0A", {}, 422),
    ("GET", "/v1/banks/b/observations?scope=%20", {}, 422),
    ("GET", f"/v1/banks/b/observations?scope={'t' * 129}", {}, 422),
    ("GET", "/v1/banks/nobody/observations", {}, 404),
    ("POST", "/v1/banks/b/observations", {}, 405),
    # stats and recover
    ("GET", "/v1/banks/nobody/stats", {}, 404),
    ("GET", f"/v1/banks/{'x' * 300}/stats", {}, 422),
    ("GET", "/v1/banks/%00/stats", {}, 422),
    ("POST", "/v1/banks/b/stats", {}, 405),
    ("POST", "/v1/banks/nobody/memories/recover", {}, 404),
    ("GET", "/v1/banks/b/memories/recover", {}, 405),
    # probes and unknown routes
    ("POST", "/healthz", {}, 405),
    ("POST", "/readyz", {}, 405),
    ("DELETE", "/metrics", {}, 405),
    ("GET", "/v1/nowhere", {}, 404),
    ("GET", "/v1/banks/b/stats/", {}, 404),
    ("GET", "/nowhere", {}, 404),
    ("GET", "/v2/banks/b/stats", {}, 404),
]


@pytest.mark.parametrize(
    ("method", "path", "kwargs", "status"),
    MALFORMED,
    ids=[f"{m} {p[:50]} {i}" for i, (m, p, _, _) in enumerate(MALFORMED)],
)
async def test_malformed_input_gets_a_4xx_json_error(
    manual_client: httpx.AsyncClient,
    method: str,
    path: str,
    kwargs: dict[str, Any],
    status: int,
) -> None:
    await ingest(manual_client, "b", {"text": "x"})
    response = await manual_client.request(method, path, **kwargs)
    assert_error(response, status)
