"""Per-bank token budgets: an operation over its bank's budget pauses at a batch boundary and is
handed back until the rolling 24 h window frees enough, without failing or losing anything."""

from __future__ import annotations

import datetime as dt
from typing import Any

import asyncpg
import httpx
import pytest
from prometheus_client import REGISTRY

from consolidation import budgets, queue
from consolidation.api.routes import create_app
from consolidation.client import AsyncClient, InvalidRequest
from consolidation.settings import Settings, load_settings
from consolidation.testing.fake_llm import FakeLLMServer
from tests.integration.conftest import ClientFactory
from tests.support.engine import http_llm, ingest, markers, run_next, topics
from tests.support.invariants import assert_consistent

# Three waves of four memories of one scope, two passes a wave (as in test_fairness.py).
CONFIG = Settings(wave_size=4, llm_batch_size=2, retry_backoff_s=0)
WINDOW = dt.timedelta(hours=24)


async def operation(pool: asyncpg.Pool, operation_id: Any) -> asyncpg.Record:
    row = await pool.fetchrow("SELECT * FROM operations WHERE id = $1", operation_id)
    assert row is not None
    return row


async def usage_rows(pool: asyncpg.Pool, bank: str) -> list[asyncpg.Record]:
    rows: list[asyncpg.Record] = await pool.fetch(
        "SELECT tokens, used_at FROM bank_token_usage WHERE bank_id = $1 ORDER BY used_at", bank
    )
    return rows


async def back_date(pool: asyncpg.Pool, bank: str, *rows: tuple[int, dt.timedelta]) -> None:
    """Usage of ``bank`` that happened the given time ago (instead of waiting for it)."""
    for tokens, ago in rows:
        await pool.execute(
            "INSERT INTO bank_token_usage (bank_id, tokens, used_at) VALUES ($1, $2, now() - $3::interval)",
            bank,
            tokens,
            ago,
        )


def tokens_metric(bank: str) -> float:
    value = REGISTRY.get_sample_value("consolidation_bank_tokens_total", {"bank_id": bank})
    return value or 0.0


def perf_tokens(result: dict[str, Any]) -> int:
    return int(result["perf"]["prompt_tokens"] + result["perf"]["completion_tokens"])


async def test_a_bank_over_its_budget_pauses_after_its_running_passes_and_resumes_when_the_window_frees(
    pool: asyncpg.Pool, fake: FakeLLMServer, make_client: ClientFactory
) -> None:
    bank = "budgeted"
    await ingest(pool, bank, topics(1, 12))
    op = (await queue.submit(pool, bank)).operation
    before = tokens_metric(bank)
    llm = http_llm(fake.url)
    config = CONFIG.model_copy(update={"bank_token_budget": 1})  # one pass's tokens use it up
    try:
        paused = await run_next(pool, llm, config)
        assert paused.status == "pending"
        row = await operation(pool, op.id)
        # Handed back, no attempt spent, nothing failed; the passes that ran are committed.
        assert row["status"] == "pending" and row["attempt"] == 0
        result = row["result"]
        assert 0 < result["processed"] < 12 and result["failed"] == 0
        assert (await markers(pool, bank)) == {
            "consolidated": result["processed"],
            "failed": 0,
            "pending": 12 - result["processed"],
        }
        # Every token the passes used is recorded, in the database and on /metrics.
        rows = await usage_rows(pool, bank)
        used = sum(r["tokens"] for r in rows)
        assert used == perf_tokens(result) > 0
        assert tokens_metric(bank) - before == used
        async with make_client() as client:
            scraped = (await client.get("/metrics")).text
        assert f'consolidation_bank_tokens_total{{bank_id="{bank}"}} {before + used}' in scraped
        # Due again when its oldest usage leaves the window; its status says why it waits.
        assert dt.timedelta(0) <= row["run_after"] - (rows[0]["used_at"] + WINDOW)
        assert row["run_after"] - (rows[0]["used_at"] + WINDOW) < dt.timedelta(minutes=1)
        assert row["error"].startswith(budgets.PAUSE_PREFIX) and f"{used}/1 tokens" in row["error"]
        assert row["last_error"] == row["error"]
        assert await queue.claim(pool, "w", 30) is None  # not due while the window is full

        # A day later (the usage back-dated out of the window): it continues under its id.
        await pool.execute(
            "UPDATE bank_token_usage SET used_at = used_at - interval '25 hours' WHERE bank_id = $1",
            bank,
        )
        await pool.execute("UPDATE operations SET run_after = now() WHERE id = $1", op.id)
        config = CONFIG.model_copy(update={"bank_token_budget": 10**9})
        done = await run_next(pool, llm, config)
    finally:
        await llm.aclose()
    assert done.status == "completed"
    row = await operation(pool, op.id)
    assert row["status"] == "completed" and row["attempt"] == 1
    assert row["result"]["processed"] == 12 and row["result"]["consolidated"] == 12
    assert row["result"]["failed"] == 0
    assert (await markers(pool, bank))["consolidated"] == 12
    # The first attempt's rows, out of the window, were pruned when the second recorded its own.
    second = sum(r["tokens"] for r in await usage_rows(pool, bank))
    assert used + second == perf_tokens(row["result"])
    await assert_consistent(pool)


async def test_usage_of_the_window_pauses_before_any_pass_until_the_oldest_rows_leave_it(
    pool: asyncpg.Pool, fake: FakeLLMServer
) -> None:
    bank = "spent"
    await ingest(pool, bank, topics(1, 4))
    op = (await queue.submit(pool, bank)).operation
    # 1,200 used of 1,000: once the 23-hour-old row leaves the window (in an hour), 600 remain.
    await back_date(pool, bank, (600, dt.timedelta(hours=23)), (600, dt.timedelta(hours=1)))
    llm = http_llm(fake.url)
    config = CONFIG.model_copy(update={"bank_token_budget": 1000})
    try:
        paused = await run_next(pool, llm, config)
    finally:
        await llm.aclose()
    assert paused.status == "pending"
    row = await operation(pool, op.id)
    assert row["attempt"] == 0 and row["result"]["processed"] == 0
    assert row["result"]["perf"]["llm_calls"] == 0
    oldest = (await usage_rows(pool, bank))[0]["used_at"]
    assert dt.timedelta(0) <= row["run_after"] - (oldest + WINDOW) < dt.timedelta(minutes=1)
    assert "1200/1000 tokens" in row["error"]


async def test_a_banks_own_budget_beats_the_setting(
    pool: asyncpg.Pool, fake: FakeLLMServer
) -> None:
    await ingest(pool, "generous", topics(1, 4))
    await ingest(pool, "strict", topics(1, 4))
    await budgets.set_bank_budget(pool, "generous", 10**9)
    await budgets.set_bank_budget(pool, "strict", 0)
    llm = http_llm(fake.url)
    config = CONFIG.model_copy(update={"bank_token_budget": 1})
    try:
        generous = (await queue.submit(pool, "generous")).operation
        assert (await run_next(pool, llm, config)).status == "completed"
        strict = (await queue.submit(pool, "strict")).operation
        assert (await run_next(pool, llm, CONFIG)).status == "pending"  # no setting: still 0
    finally:
        await llm.aclose()
    assert (await operation(pool, generous.id))["status"] == "completed"
    row = await operation(pool, strict.id)
    assert row["status"] == "pending" and row["result"]["processed"] == 0
    assert row["error"].startswith(budgets.PAUSE_PREFIX)
    # Lifting it makes the paused operation due at once.
    await budgets.set_bank_budget(pool, "strict", None)
    assert (await operation(pool, strict.id))["run_after"] <= await pool.fetchval("SELECT now()")


async def test_the_token_budget_routes_answer_the_budget_its_source_usage_and_resume_time(
    make_client: ClientFactory, pool: asyncpg.Pool
) -> None:
    async with make_client(bank_token_budget=1000) as client:
        missing = await client.get("/v1/banks/nobody/token-budget")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "bank_not_found"

        await ingest(pool, "b", topics(1, 1))
        await back_date(pool, "b", (700, dt.timedelta(hours=2)), (30, dt.timedelta(days=2)))
        body = (await client.get("/v1/banks/b/token-budget")).json()
        assert body == {
            "bank_id": "b",
            "tokens_per_24h": 1000,
            "source": "setting",
            "used_24h": 700,
            "resumes_at": None,
        }
        put = await client.put("/v1/banks/b/token-budget", json={"tokens_per_24h": 500})
        assert put.status_code == 200, put.text
        body = put.json()
        assert body["source"] == "bank" and body["tokens_per_24h"] == 500
        oldest = (await usage_rows(pool, "b"))[-1]["used_at"]  # the 2-day-old row is outside
        assert dt.datetime.fromisoformat(body["resumes_at"]) == oldest + WINDOW

        back = await client.put("/v1/banks/b/token-budget", json={"tokens_per_24h": None})
        assert back.json()["source"] == "setting" and back.json()["tokens_per_24h"] == 1000

        # A bank created by its budget, before any memory.
        fresh = await client.put("/v1/banks/new/token-budget", json={"tokens_per_24h": 0})
        assert fresh.status_code == 200 and fresh.json()["used_24h"] == 0
        assert fresh.json()["resumes_at"] is None

    async with make_client() as client:
        body = (await client.get("/v1/banks/b/token-budget")).json()
        assert body["source"] == "none" and body["tokens_per_24h"] is None


async def test_the_token_budget_route_refuses_bad_bodies_with_json_4xx(
    make_client: ClientFactory,
) -> None:
    bad_bodies: tuple[dict[str, object] | list[object], ...] = (
        {"tokens_per_24h": -1},
        {"tokens_per_24h": "100"},
        {"tokens_per_24h": 1.5},
        {"tokens_per_24h": True},
        {"tokens_per_24h": 10**16},
        {},
        {"tokens_per_24h": 5, "other": 1},
        [],
    )
    async with make_client() as client:
        for body in bad_bodies:
            response = await client.put("/v1/banks/b/token-budget", json=body)
            assert response.status_code == 422, (body, response.text)
            assert set(response.json()["error"]) >= {"code", "message"}
        text = await client.put(
            "/v1/banks/b/token-budget", content=b"5", headers={"content-type": "text/plain"}
        )
        assert 400 <= text.status_code < 500 and "error" in text.json()
        assert (await client.get("/v1/banks/%20/token-budget")).status_code == 422


async def test_clients_read_and_set_a_banks_token_budget(
    pool: asyncpg.Pool, database_url: str
) -> None:
    app = create_app(load_settings(database_url=database_url), pool)
    transport = httpx.ASGITransport(app=app)
    async with AsyncClient("http://test", transport=transport) as client:
        answer = await client.set_token_budget("c", 42)
        assert answer.tokens_per_24h == 42 and answer.source == "bank"
        assert (await client.token_budget("c")).used_24h == 0
        assert (await client.set_token_budget("c", None)).source == "none"
        with pytest.raises(InvalidRequest) as refused:
            await client.set_token_budget("c", -1)
        assert refused.value.status == 422


async def test_the_dashboards_bank_page_shows_the_budget_the_usage_and_when_it_resumes(
    make_client: ClientFactory, pool: asyncpg.Pool
) -> None:
    await ingest(pool, "d", topics(1, 1))
    await back_date(pool, "d", (400, dt.timedelta(hours=3)), (200, dt.timedelta(hours=1)))
    async with make_client() as client:
        page = (await client.get("/ui/banks/d")).text
        assert 'data-stat="used_24h">600<' in page and "data-budget-paused" not in page
        await client.put("/v1/banks/d/token-budget", json={"tokens_per_24h": 500})
        page = (await client.get("/ui/banks/d")).text
    assert 'data-stat="used_24h">600 / 500<' in page and "data-budget-paused" in page
    oldest = (await usage_rows(pool, "d"))[0]["used_at"]
    resumes = (oldest + WINDOW).astimezone(dt.UTC).isoformat(timespec="seconds")
    assert f'datetime="{resumes.replace("+00:00", "Z")}"' in page
