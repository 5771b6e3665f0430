"""The dashboard's pages and its sign-in, in-process (httpx ASGI transport), over real Postgres.

The browser flows (auto-refresh, confirmations, buttons) are in tests/acceptance/test_dashboard.py.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlencode

import asyncpg
import httpx
import pytest

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
