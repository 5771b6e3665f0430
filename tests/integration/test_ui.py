"""The dashboard's pages and its sign-in, in-process (httpx ASGI transport), over real Postgres.

The browser flows (auto-refresh, confirmations, buttons) are in tests/acceptance/test_dashboard.py.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlencode

import asyncpg
import httpx
import pytest

from consolidation import queue
from consolidation.perf import PerfLog
from tests.integration.conftest import ClientFactory

SAME_ORIGIN = {"Origin": "http://test"}
HOSTILE = '<script>alert("x")</script>'


@pytest.fixture
async def client(make_client: ClientFactory) -> AsyncIterator[httpx.AsyncClient]:
    async with make_client(auto_consolidate=False) as c:
        yield c


async def _seed(client: httpx.AsyncClient, pool: asyncpg.Pool) -> dict[str, Any]:
    """A bank whose text, tags, failure reason and observation are all hostile HTML."""
    memories = [
        {"text": f"ok {HOSTILE}", "tags": ["<b>tag</b>"]},
        {"text": f"bad {HOSTILE}", "tags": ["<b>tag</b>"]},
    ]
    response = await client.post("/v1/banks/<i>bank/memories", json={"memories": memories})
    assert response.status_code == 201, response.text
    ok, bad = (uuid.UUID(i) for i in response.json()["ids"])
    await pool.execute(
        "UPDATE memories SET consolidation_failed_at = now(),"
        " consolidation_failed_reason = $2 WHERE id = $1",
        bad,
        f"the model cited an unknown fact {HOSTILE}",
    )
    await pool.execute("UPDATE memories SET consolidated_at = now() WHERE id = $1", ok)
    observation = uuid.uuid4()
    await pool.execute(
        "INSERT INTO observations (id, bank_id, scope, text) VALUES ($1, '<i>bank', $2, $3)",
        observation,
        ["<b>tag</b>"],
        f"observed {HOSTILE}",
    )
    await pool.execute(
        "INSERT INTO observation_sources (observation_id, memory_id) VALUES ($1, $2)",
        observation,
        ok,
    )
    return {"ok": ok, "bad": bad, "observation": observation}


def _assert_page(response: httpx.Response, status: int = 200) -> str:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("text/html")
    csp = response.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert response.headers["x-frame-options"] == "DENY"
    assert "<script>alert" not in response.text
    return response.text


async def test_every_view_renders_database_text_escaped(
    client: httpx.AsyncClient, pool: asyncpg.Pool
) -> None:
    ids = await _seed(client, pool)
    escaped = "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;"  # markupsafe's entities

    banks = _assert_page(await client.get("/ui"))
    assert "&lt;i&gt;bank" in banks and 'href="/ui/banks/%3Ci%3Ebank"' in banks

    bank = _assert_page(await client.get("/ui/banks/%3Ci%3Ebank"))
    assert f"bad {escaped}" in bank and f"the model cited an unknown fact {escaped}" in bank
    assert f'data-memory="{ids["bad"]}"' in bank
    assert 'data-action="POST /v1/banks/%3Ci%3Ebank/memories/recover"' in bank
    assert "&lt;b&gt;tag&lt;/b&gt;" in bank

    observations = _assert_page(
        await client.get("/ui/banks/%3Ci%3Ebank/observations", params={"scope": "<b>tag</b>"})
    )
    assert f"observed {escaped}" in observations and f"ok {escaped}" in observations

    await client.post("/v1/banks/%3Ci%3Ebank/consolidations")
    operations = _assert_page(await client.get("/ui/operations"))
    assert 'data-status="pending"' in operations and 'data-kind="cancel"' in operations


@pytest.mark.parametrize(
    ("path", "status"),
    [
        ("/ui/banks/nobody", 404),
        ("/ui/banks/nobody/observations", 404),
        ("/ui/banks/%01/observations", 422),
        ("/ui/operations?status=done", 422),
        ("/ui/operations?bank_id=%00", 422),
        ("/ui/operations?cursor=nope", 400),
        ("/ui?cursor=%2F", 400),
        ("/ui/banks/b?failed_cursor=x", 400),
        ("/ui/banks/b/observations?scope=a,,b", 422),
        ("/ui/banks/b/observations?cursor=x", 400),
        ("/ui/operations/nope", 422),
        (f"/ui/operations/{uuid.uuid4()}", 404),
    ],
)
async def test_a_page_that_cannot_be_shown_says_why_in_a_page(
    client: httpx.AsyncClient, path: str, status: int
) -> None:
    await client.post("/v1/banks/b/memories", json={"memories": [{"text": "x"}]})
    _assert_page(await client.get(path), status)


async def test_only_the_dashboard_entry_is_in_the_openapi_document(
    client: httpx.AsyncClient,
) -> None:
    paths = (await client.get("/openapi.json")).json()["paths"]
    assert "/ui" in paths and "/v1/banks" in paths and "/v1/operations" in paths
    assert [p for p in paths if p.startswith("/ui/")] == []
    assert (await client.get("/ui/")).headers["location"] == "/ui"


async def test_the_static_files_are_served_from_the_package(client: httpx.AsyncClient) -> None:
    page = (await client.get("/ui")).text
    for name, kind in (("ui.css", "text/css"), ("ui.js", "text/javascript")):
        assert f'"/ui/static/{name}?v=' in page
        response = await client.get(f"/ui/static/{name}")
        assert response.status_code == 200 and response.headers["content-type"].startswith(kind)
        assert "immutable" in response.headers["cache-control"]
    assert (await client.get("/ui/static/../api.py")).status_code == 404


# --- with an API key ------------------------------------------------------------------------


async def _sign_in(client: httpx.AsyncClient, key: str, **form: str) -> httpx.Response:
    return await client.post(
        "/ui/login",
        content=urlencode({"key": key, **form}).encode(),
        headers={"Content-Type": "application/x-www-form-urlencoded", **SAME_ORIGIN},
    )


async def test_with_an_api_key_the_pages_ask_for_it_and_a_strict_cookie_stands_for_it(
    make_client: ClientFactory,
) -> None:
    async with make_client(api_key="s3cret", auto_consolidate=False) as client:
        await client.post(
            "/v1/banks/b/memories",
            json={"memories": [{"text": "x"}]},
            headers={"Authorization": "Bearer s3cret"},
        )
        to_login = await client.get("/ui/banks/b?x=1")
        assert to_login.status_code == 303
        assert to_login.headers["location"] == "/ui/login?next=%2Fui%2Fbanks%2Fb%3Fx%3D1"
        assert "autocomplete" in _assert_page(await client.get("/ui/login"))

        refused = await _sign_in(client, "wrong", next="/ui/banks/b")
        assert "That is not the API key." in _assert_page(refused, 401)
        assert "set-cookie" not in refused.headers

        signed_in = await _sign_in(client, "s3cret", next="/ui/banks/b?x=1")
        assert signed_in.status_code == 303 and signed_in.headers["location"] == "/ui/banks/b?x=1"
        cookie = signed_in.headers["set-cookie"]
        assert cookie.startswith("consolidation_session=") and "s3cret" not in cookie
        assert {"HttpOnly", "SameSite=strict", "Path=/"} <= {
            part.strip() for part in cookie.split(";")
        }
        session = {"Cookie": cookie.split(";")[0]}
        client.cookies.clear()

        _assert_page(await client.get("/ui/banks/b", headers=session))
        assert (await client.get("/v1/banks", headers=session)).status_code == 200
        # A change by cookie must come from the dashboard's own origin (CSRF).
        for origin in ({}, {"Origin": "http://evil.example"}, {"Origin": "null"}):
            response = await client.post(
                "/v1/banks/b/consolidations", headers={**session, **origin}
            )
            assert response.status_code == 403, origin
            assert response.json()["error"]["code"] == "cross_origin"
        allowed = await client.post(
            "/v1/banks/b/consolidations", headers={**session, **SAME_ORIGIN}
        )
        assert allowed.status_code == 202

        # Explicit credentials win: a wrong bearer with a good cookie is still a 401.
        wrong = {**session, "Authorization": "Bearer nope"}
        assert (await client.get("/v1/banks", headers=wrong)).status_code == 401
        forged = {"Cookie": "consolidation_session=" + "0" * 64}
        assert (await client.get("/v1/banks", headers=forged)).status_code == 401
        assert (await client.get("/ui", headers=forged)).status_code == 303
        assert (await client.get("/v1/banks")).status_code == 401
        bearer = {"Authorization": "Bearer s3cret"}
        assert (await client.get("/v1/banks", headers=bearer)).status_code == 200

        out = await client.post("/ui/logout", headers={**session, **SAME_ORIGIN})
        assert out.status_code == 303 and out.headers["location"] == "/ui/login"
        assert 'consolidation_session=""' in out.headers["set-cookie"]
        assert "Max-Age=0" in out.headers["set-cookie"]


@pytest.mark.parametrize(
    "target", ["//evil.example/ui", "https://evil.example", "/v1/banks", "/ui\\@evil"]
)
async def test_signing_in_never_redirects_off_the_dashboard(
    make_client: ClientFactory, target: str
) -> None:
    async with make_client(api_key="s3cret", auto_consolidate=False) as client:
        response = await _sign_in(client, "s3cret", next=target)
        assert response.status_code == 303 and response.headers["location"] == "/ui"


async def test_a_sign_in_from_another_site_is_refused(make_client: ClientFactory) -> None:
    async with make_client(api_key="s3cret", auto_consolidate=False) as client:
        response = await client.post(
            "/ui/login",
            content=b"key=s3cret",
            headers={
                "Content-Type": "application/x-www-form-urlencoded",
                "Origin": "http://evil.example",
            },
        )
        assert response.status_code == 403 and "set-cookie" not in response.headers


async def test_without_an_api_key_the_dashboard_is_open(client: httpx.AsyncClient) -> None:
    _assert_page(await client.get("/ui"))
    assert (await client.get("/ui/login")).headers["location"] == "/ui"
    assert "Sign out" not in (await client.get("/ui")).text


# --- operations: scopes, retries, the operation page ------------------------------------------


async def _claimed(pool: asyncpg.Pool, bank: str, worker: str = "worker:test:1") -> queue.Lease:
    lease = await queue.claim(pool, worker, 30)
    assert lease is not None and lease.bank_id == bank
    return lease


async def test_a_scoped_operation_shows_its_scopes_as_tags(client: httpx.AsyncClient) -> None:
    await client.post("/v1/banks/b/memories", json={"memories": [{"text": "x", "tags": ["p"]}]})
    response = await client.post(
        "/v1/banks/b/consolidations", json={"scopes": [["proj", "<b>x</b>"], []]}
    )
    operation_id = response.json()["operation_id"]
    for path in ("/ui/operations", "/ui/banks/b", f"/ui/operations/{operation_id}"):
        page = _assert_page(await client.get(path))
        assert '<span class="tag">proj</span>' in page, path
        assert '<span class="tag">&lt;b&gt;x&lt;/b&gt;</span>' in page, path
        assert '<span class="tag shared">shared</span>' in page, path
        assert "&lt;span" not in page, path


async def test_an_operation_waiting_to_retry_shows_the_last_error_and_when_it_is_due(
    client: httpx.AsyncClient, pool: asyncpg.Pool
) -> None:
    await client.post("/v1/banks/b/memories", json={"memories": [{"text": "x"}]})
    submitted = await client.post("/v1/banks/b/consolidations")
    operation_id = submitted.json()["operation_id"]
    lease = await _claimed(pool, "b")
    error = "LLM unreachable: Cannot connect to host 127.0.0.1:9 <refused>"
    await queue.release(pool, lease, delay_s=600, error=error, refund_attempt=False)

    page = _assert_page(await client.get("/ui/operations"))
    row = _row(page, operation_id)
    assert 'data-status="pending"' in row
    note = re.sub(r"<[^>]+>", "", row)
    assert re.search(r"next attempt in (9|10) min \(attempt 2/5\)", note), note
    assert "LLM unreachable: Cannot connect to host 127.0.0.1:9 &lt;refused&gt;" in row

    detail = _assert_page(await client.get(f"/ui/operations/{operation_id}"))
    assert "Where it stands" in detail and "&lt;refused&gt;" in detail
    assert 'data-field="run_after"><time datetime="' in detail

    health = _assert_page(await client.get("/ui"))
    assert 'data-health="last-error"' in health and "&lt;refused&gt;" in health


async def test_the_last_attempts_error_shows_while_the_next_attempt_runs(
    client: httpx.AsyncClient, pool: asyncpg.Pool
) -> None:
    await client.post("/v1/banks/b/memories", json={"memories": [{"text": "x"}]})
    operation_id = (await client.post("/v1/banks/b/consolidations")).json()["operation_id"]
    lease = await _claimed(pool, "b")
    await queue.release(pool, lease, delay_s=0, error="HTTP 503 from the LLM", refund_attempt=False)
    await pool.execute(
        "UPDATE operations SET last_error_at = now() - interval '2 minutes' WHERE id = $1",
        uuid.UUID(operation_id),
    )
    await _claimed(pool, "b")  # the second attempt: the claim clears `error`, not `last_error`

    row = _row(_assert_page(await client.get("/ui/operations")), operation_id)
    assert 'data-status="running"' in row
    assert "attempt 2/5 running; the previous one failed:" in row
    assert "HTTP 503 from the LLM" in row and "2 min ago" in row
    detail = _assert_page(await client.get(f"/ui/operations/{operation_id}"))
    assert "HTTP 503 from the LLM" in detail and "expires in" in detail


async def test_the_operation_page_shows_the_perflog_and_offers_a_retry_when_failed(
    client: httpx.AsyncClient, pool: asyncpg.Pool
) -> None:
    await client.post("/v1/banks/b/memories", json={"memories": [{"text": "x", "tags": ["t"]}]})
    submitted = await client.post("/v1/banks/b/consolidations", json={"scopes": [["t"]]})
    operation_id = submitted.json()["operation_id"]
    lease = await _claimed(pool, "b")
    perf = PerfLog(memories=40, llm_calls=7, llm_repairs=2, splits=1, prompt_tokens=900)
    perf.completion_tokens, perf.llm_s, perf.recall_s, perf.apply_s = 100, 12.5, 0.25, 75.0
    await queue.finish(
        pool,
        lease,
        "failed",
        result={"perf": perf.to_dict(), "waves": 3, "processed": 40},
        error="LLMConfigError: HTTP 401 from the LLM: check CONSOLIDATION_LLM_API_KEY",
    )

    page = _assert_page(await client.get(f"/ui/operations/{operation_id}"))
    for key, shown in (
        ("memories", "40"),
        ("llm_calls", "7"),
        ("llm_repairs", "2"),
        ("splits", "1"),
        ("tokens", "1000"),
        ("llm_s", "12 s"),
        ("recall_s", "0.2 s"),
        ("apply_s", "1 min"),
    ):
        assert f'data-perf="{key}">{shown}</td>' in page, key
    assert "waves 3 · processed 40" in page
    assert "Why it failed" in page and "HTTP 401 from the LLM" in page
    assert "data-refresh" not in page  # a finished operation does not change
    retry = 'data-kind="retry" data-action="POST /v1/banks/b/consolidations"'
    assert retry in page and 'data-body="{&#34;scopes&#34;: [[&#34;t&#34;]]}"' in page

    # The button's request, as ui.js sends it, enqueues the same scoped consolidation.
    again = await client.post("/v1/banks/b/consolidations", json={"scopes": [["t"]]})
    assert again.status_code == 202 and again.json()["operation_id"] != operation_id
    listed = _assert_page(await client.get("/ui/operations?status=failed"))
    assert retry in _row(listed, operation_id)


async def test_every_operation_id_links_to_its_page(client: httpx.AsyncClient) -> None:
    await client.post("/v1/banks/b/memories", json={"memories": [{"text": "x"}]})
    operation_id = (await client.post("/v1/banks/b/consolidations")).json()["operation_id"]
    link = f'<a href="/ui/operations/{operation_id}">'
    assert link in _assert_page(await client.get("/ui/operations"))
    assert link in _assert_page(await client.get("/ui/banks/b"))
    page = _assert_page(await client.get(link.split('"')[1]))
    assert "No PerfLog yet" in page and 'data-refresh="2000"' in page


def _row(page: str, operation_id: str) -> str:
    start = page.index(f'<tr data-operation="{operation_id}"')
    return page[start : page.index("</tr>", start)]


# --- health and charts --------------------------------------------------------------------------


async def test_the_health_strip_counts_workers_by_their_leases_and_says_whose_requests(
    make_client: ClientFactory, pool: asyncpg.Pool
) -> None:
    async with make_client(
        auto_consolidate=False, embeddings_base_url="http://user:pw@embed.internal:8000/v1"
    ) as client:
        for bank in ("a", "b"):
            await client.post(f"/v1/banks/{bank}/memories", json={"memories": [{"text": "x"}]})
            await client.post(f"/v1/banks/{bank}/consolidations")
        await _claimed(pool, "a", "worker:host-1:10")
        lease = await _claimed(pool, "b", "worker:host-2:20")
        await pool.execute(
            "UPDATE operations SET lease_expires_at = now() - interval '1 minute' WHERE id = $1",
            lease.operation_id,
        )
        page = _assert_page(await client.get("/ui"))
    strip = page[page.index('<section class="health"') : page.index("</section>")]
    assert "1 operation running under the live leases of 1 worker" in strip
    assert "1 lease expired" in strip
    assert "this process's requests only" in strip
    assert 'data-configured="yes"' in strip and "embed.internal:8000" in strip
    assert "pw" not in strip
    async with make_client(auto_consolidate=False) as client:
        page = _assert_page(await client.get("/ui/operations"))
    assert 'data-configured="no"' in page and "recall is full-text only" in page


async def test_the_charts_show_memories_consolidated_per_minute_and_the_backlog(
    client: httpx.AsyncClient, pool: asyncpg.Pool
) -> None:
    memories = [{"text": f"fact {i}"} for i in range(7)]
    ids = (await client.post("/v1/banks/c/memories", json={"memories": memories})).json()["ids"]
    await pool.execute(
        "UPDATE memories SET consolidated_at = now() - interval '90 seconds'"
        " WHERE id = ANY($1::uuid[])",
        [uuid.UUID(i) for i in ids[:4]],
    )
    await pool.execute(
        "UPDATE memories SET consolidation_failed_at = now() WHERE id = $1", uuid.UUID(ids[4])
    )
    page = _assert_page(await client.get("/ui/banks/c"))
    assert 'data-chart="throughput" data-latest="1" data-total="5"' in page
    assert 'data-chart="backlog" data-latest="2"' in page
    assert "<svg" in page and "<polyline" in page and "<rect" in page
    # The fleet's charts on the banks page count every bank.
    assert 'data-chart="throughput"' in _assert_page(await client.get("/ui"))


# --- observations: scope filter and text search -----------------------------------------------


async def _observations(pool: asyncpg.Pool, bank: str, items: list[tuple[list[str], str]]) -> None:
    for scope, text in items:
        await pool.execute(
            "INSERT INTO observations (id, bank_id, scope, text) VALUES ($1, $2, $3, $4)",
            uuid.uuid4(),
            bank,
            scope,
            text,
        )


async def test_observations_are_filtered_by_scope_and_searched_by_text(
    client: httpx.AsyncClient, pool: asyncpg.Pool
) -> None:
    await client.post("/v1/banks/s/memories", json={"memories": [{"text": "x"}]})
    await _observations(
        pool,
        "s",
        [
            (["work"], "Sam switched the team from Go to Postgres functions."),
            (["work"], "Sam reviews pull requests on Fridays."),
            (["home"], "Sam grows tomatoes on the balcony."),
            ([], "Sam prefers 100% rye bread."),
        ],
    )

    async def texts(**params: str) -> list[str]:
        page = _assert_page(await client.get("/ui/banks/s/observations", params=params))
        return re.findall(r'<p class="text">(.*?)</p>', page)

    assert len(await texts()) == 4
    assert len(await texts(scope="*")) == 4
    assert len(await texts(scope="work")) == 2
    assert await texts(scope="", q="rye") == ["Sam prefers 100% <mark>rye</mark> bread."]
    # Full text finds another form of the word; the substring match a part of one.
    assert await texts(q="switching") == ["Sam switched the team from Go to Postgres functions."]
    assert await texts(q="Postgr") == [
        "Sam switched the team from Go to <mark>Postgr</mark>es functions."
    ]
    assert await texts(q="tomatoes", scope="work") == []
    # LIKE's wildcards are plain characters in a search.
    assert await texts(q="100%") == ["Sam prefers <mark>100%</mark> rye bread."]
    assert await texts(q="_") == []

    page = _assert_page(
        await client.get("/ui/banks/s/observations", params={"q": "Sam", "scope": "work"})
    )
    assert '<option value="work" selected>' in page and 'value="Sam"' in page
    assert "No observation matches" in _assert_page(
        await client.get("/ui/banks/s/observations", params={"q": "<b>nothing</b>"})
    )
    too_long = await client.get("/ui/banks/s/observations", params={"q": "x" * 201})
    assert "at most 200 characters" in _assert_page(too_long, 422)
