"""API fuzzing: schemathesis generates requests from ``/openapi.json`` of a real `consolidation
serve` process on loopback (API and worker, offline consolidator, fresh database) and checks
every response: no 5xx, status codes, content types, headers and bodies as the schema says, and
requests that break the schema rejected with a 4xx.

Runs the schemathesis CLI (its pytest plugin does not support this pytest yet), bounded by
FUZZ_MAX_EXAMPLES cases per operation and phase (default 30) and a fixed seed (FUZZ_SEED), so a
CI run is reproducible and takes well under two minutes.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.support.services import ServiceProcess

pytestmark = pytest.mark.acceptance

MAX_EXAMPLES = os.environ.get("FUZZ_MAX_EXAMPLES", "30")
SEED = os.environ.get("FUZZ_SEED", "20260101")
# What the API promises about its answers: never a 5xx, and every answer as the schema says.
RESPONSE_CHECKS = [
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_headers_conformance",
    "response_schema_conformance",
]


@pytest.fixture
async def api_url(database_url: str, tmp_path: Path) -> AsyncIterator[str]:
    service = ServiceProcess(
        "api",
        tmp_path,
        {
            "CONSOLIDATION_DATABASE_URL": database_url,
            "CONSOLIDATION_LLM_BASE_URL": "",  # the offline consolidator
            "CONSOLIDATION_POLL_INTERVAL_S": "0.5",
        },
    )
    try:
        yield await service.api_url()
        assert service.proc.poll() is None, "the service died while being fuzzed"
    finally:
        service.stop()


def schemathesis_command() -> list[str]:
    found = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    assert found, "schemathesis is not installed: pip install -e '.[dev]'"
    return [found]


async def run_schemathesis(api_url: str, report_dir: Path, *options: str) -> None:
    command = [
        *schemathesis_command(),
        "--no-color",
        "run",
        f"{api_url}/openapi.json",
        "--seed",
        SEED,
        # One worker: with two threads, hypothesis describing a strategy's lambda (ast.parse)
        # in both trips CPython 3.11's AST recursion counter now and then (python/cpython#106905:
        # "SystemError: AST constructor recursion depth mismatch", seen here on 3.11.7), and
        # schemathesis ends the run with a runtime error that says nothing about the API.
        "--workers",
        "1",
        "--request-timeout",
        "30",
        "--wait-for-schema",
        "30",
        "--generation-database",
        "none",
        "--report",
        "junit",
        "--report-dir",
        str(report_dir),
        *options,
    ]
    result = await asyncio.to_thread(
        subprocess.run,
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
        env={**os.environ, "NO_COLOR": "1"},
        check=False,
    )
    assert result.returncode == 0, result.stdout[-20_000:]


async def test_no_generated_request_makes_the_api_answer_5xx_or_break_its_schema(
    api_url: str, tmp_path: Path
) -> None:
    await run_schemathesis(
        api_url,
        tmp_path,
        "--checks",
        ",".join(RESPONSE_CHECKS),
        "--phases",
        "examples,coverage,fuzzing",
        "--mode",
        "all",
        "--max-examples",
        MAX_EXAMPLES,
    )


async def test_every_generated_request_that_breaks_the_schema_is_rejected_with_a_4xx(
    api_url: str, tmp_path: Path
) -> None:
    await run_schemathesis(
        api_url,
        tmp_path,
        "--checks",
        "not_a_server_error,negative_data_rejection",
        "--phases",
        "coverage",
        "--mode",
        "all",
        "--max-examples",
        MAX_EXAMPLES,
    )
