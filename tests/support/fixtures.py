"""Fixtures of the tests that start real `consolidation serve` processes (loaded as a plugin by
tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from consolidation.testing.fake_llm import FakeLLMServer
from tests.support.services import Serve, Services


@pytest.fixture
def services(tmp_path: Path) -> Iterator[Services]:
    """Processes a test starts, with any environment; whatever is still running at the end is
    killed."""
    started = Services(tmp_path)
    yield started
    started.stop_all()


@pytest.fixture
def serve(database_url: str, fake: FakeLLMServer, services: Services) -> Serve:
    """Start workers and services on this test's database and fake LLM. ``services`` comes last
    so that its processes are killed before the database and the fake LLM go away."""
    return Serve(services, database_url, fake.url)
