"""A real `consolidation serve` on 0.0.0.0 without a key exits at once with one line, before it
touches the database or opens the port."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.acceptance


def test_serve_on_every_interface_without_a_key_exits_with_one_line() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "consolidation.cli", "serve"],
        env={
            **{k: v for k, v in os.environ.items() if k != "CONSOLIDATION_ALLOW_UNAUTHENTICATED"},
            # A database nobody could reach: the refusal comes first, so it is never tried.
            "CONSOLIDATION_DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none",
            "CONSOLIDATION_HTTP_HOST": "0.0.0.0",
            "CONSOLIDATION_HTTP_PORT": "0",
            "CONSOLIDATION_LOG_FORMAT": "json",
            "CONSOLIDATION_API_KEY": "",
        },
        capture_output=True,
        text=True,
        timeout=60,  # a deadline, not a measure
    )
    assert result.returncode == 1, result.stderr
    lines = [line for line in result.stderr.splitlines() if not line.startswith("{")]
    assert len(lines) == 1, result.stderr
    assert "refusing to serve the API on 0.0.0.0 without a key" in lines[0]
