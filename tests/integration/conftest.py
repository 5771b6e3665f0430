"""Fixtures of the in-process API tests (test_api.py, test_ui.py, test_lifecycle_api.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import asyncpg
import httpx
import pytest

from consolidation.api.routes import create_app
from consolidation.settings import load_settings

ClientFactory = Callable[..., AbstractAsyncContextManager[httpx.AsyncClient]]


@pytest.fixture
def make_client(pool: asyncpg.Pool, database_url: str) -> ClientFactory:
    """Open a client on a fresh app (httpx ASGI transport); keyword arguments override settings,
    ``on`` another pool."""

    @asynccontextmanager
    async def factory(
        *, on: asyncpg.Pool | None = None, **overrides: Any
    ) -> AsyncIterator[httpx.AsyncClient]:
        settings = load_settings(database_url=database_url, **overrides)
        app = create_app(settings, on or pool)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client

    return factory


@pytest.fixture
async def manual_client(make_client: ClientFactory) -> AsyncIterator[httpx.AsyncClient]:
    """A client of an app that does not enqueue consolidations on ingestion."""
    async with make_client(auto_consolidate=False) as c:
        yield c
