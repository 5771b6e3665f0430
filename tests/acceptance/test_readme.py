"""The README's "Try it" runs as written against a real `consolidation serve`.

The shell blocks are read from README.md itself, so the test and the README cannot drift apart.
They run in a directory laid out like a fresh clone (``.venv`` is the environment running the
tests, ``examples/`` the repository's); the only change made to them is the port, since the test
server takes a free one instead of 8080.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.services import Services

pytestmark = pytest.mark.acceptance

ROOT = Path(__file__).resolve().parents[2]


def try_it_blocks() -> list[str]:
    """The ```sh blocks of the README's "## Try it" section, in order."""
    return section_blocks("Try it", "sh")


def section_blocks(title: str, language: str) -> list[str]:
    """The code blocks of one ``language`` in the README's section ``## {title}``, in order."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"^```{language}\n(.*?)^```$", section, flags=re.MULTILINE | re.DOTALL)


def test_the_try_it_section_has_the_api_and_the_command_line_blocks() -> None:
    blocks = try_it_blocks()
    assert len(blocks) == 2
    assert "curl" in blocks[0] and ".venv/bin/consolidation ingest" in blocks[1]
    assert (ROOT / "examples" / "memories.jsonl").is_file()


def offline_env(database_url: str) -> dict[str, str]:
    """A service as the README starts it: the offline consolidator, automatic consolidation."""
    return {"CONSOLIDATION_DATABASE_URL": database_url, "CONSOLIDATION_LLM_BASE_URL": ""}


async def test_the_readme_try_it_commands_run_as_written(
    database_url: str, services: Services, tmp_path: Path
) -> None:
    # `serve` as the README's first command starts it: offline consolidator, auto-consolidation.
    service = services.start("svc", offline_env(database_url))
    port = (await service.api_url()).rsplit(":", 1)[1]
    clone = tmp_path / "clone"
    clone.mkdir()
    (clone / ".venv").symlink_to(sys.prefix, target_is_directory=True)
    (clone / "examples").symlink_to(ROOT / "examples", target_is_directory=True)
    env = {
        **os.environ,
        "CONSOLIDATION_DATABASE_URL": database_url,
        "CONSOLIDATION_LLM_BASE_URL": "",
        "CONSOLIDATION_LOG_LEVEL": "WARNING",
    }

    outputs = []
    for block in try_it_blocks():
        script = block.replace("localhost:8080", f"localhost:{port}")
        result = await asyncio.to_thread(
            subprocess.run,
            ["bash", "-euo", "pipefail", "-c", script],
            cwd=clone,
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert result.returncode == 0, f"{script}\n--- stdout\n{result.stdout}\n{result.stderr}"
        outputs.append(result.stdout)

    api, cli = outputs
    ingested, operations, stats, observations = (json.loads(line) for line in api.splitlines())
    assert len(ingested["ids"]) == 2 and ingested["operation_id"]
    assert [op["operation_id"] for op in operations["operations"]] == [ingested["operation_id"]]
    assert set(stats) == {
        "pending",
        "consolidated",
        "failed",
        "observations",
        "oldest_pending_age_s",
    }
    assert stats["pending"] + stats["consolidated"] == 2  # how far it got depends on timing
    assert set(observations) == {"observations", "next_cursor"}

    assert "ingested 12 memories into bank 'sam' (12 new, 0 already present)" in cli
    assert re.search(r"operation \S+ completed: 12 memories processed", cli), cli
    replayed = json.loads(cli[cli.index("{") :])
    assert replayed["status"] == "completed" and replayed["result"]["processed"] == 12


async def test_the_readme_python_client_agent_runs_as_written(
    database_url: str, services: Services, tmp_path: Path
) -> None:
    (agent,) = section_blocks("Python client", "python")
    (command,) = section_blocks("Python client", "sh")
    assert len(agent.strip().splitlines()) <= 10
    service = services.start("svc", offline_env(database_url))
    port = (await service.api_url()).rsplit(":", 1)[1]
    clone = tmp_path / "clone"
    clone.mkdir()
    (clone / ".venv").symlink_to(sys.prefix, target_is_directory=True)
    (clone / "agent.py").write_text(agent.replace("localhost:8080", f"localhost:{port}"))
    result = await asyncio.to_thread(
        subprocess.run,
        ["bash", "-euo", "pipefail", "-c", command],
        cwd=clone,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, f"{command}\n--- stdout\n{result.stdout}\n{result.stderr}"
    first, second = result.stdout.splitlines()
    assert first.startswith("completed: after 'Bob prefers window seats' the agent knows [")
    assert "window seats" in first and "Lisbon" not in first
    assert second.startswith("completed: after 'Bob moved to Lisbon in March'")
    assert "window seats" in second and "Lisbon" in second
