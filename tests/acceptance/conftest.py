"""Fixtures for tests that start real `consolidation serve` processes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.services import ServiceProcess


@pytest.fixture
def services() -> Iterator[list[ServiceProcess]]:
    """Processes a test starts; whatever is still running at the end is killed."""
    started: list[ServiceProcess] = []
    yield started
    for service in started:
        service.stop()
