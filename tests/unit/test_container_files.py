"""docker-compose.yml and the Dockerfile keep the properties operators rely on (no Docker engine
is needed: the files are read as data)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]


def compose() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return document


def dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def test_the_image_is_built_once_and_every_service_of_it_uses_that_image() -> None:
    services = compose()["services"]
    built = [name for name, s in services.items() if "build" in s]
    assert built == ["consolidation"]
    image = services["consolidation"]["image"]
    assert services["fake-llm"]["image"] == image
    assert services["fake-llm"]["pull_policy"] == "never"


def test_the_postgres_health_check_probes_tcp_not_the_init_time_socket() -> None:
    test = compose()["services"]["postgres"]["healthcheck"]["test"]
    assert test[0] == "CMD" and test[1] == "pg_isready"
    assert test[test.index("-h") + 1] == "127.0.0.1"


def test_the_fake_llm_probes_its_own_port_not_the_services() -> None:
    fake = compose()["services"]["fake-llm"]
    port = fake["command"][fake["command"].index("--port") + 1]
    probe = " ".join(fake["healthcheck"]["test"])
    assert f"'127.0.0.1', {port}" in probe and "8080" not in probe
    assert fake["ports"] == [f"{port}:{port}"]


def test_long_running_services_restart() -> None:
    for name, service in compose()["services"].items():
        assert service.get("restart") == "unless-stopped", name


def test_the_service_waits_for_a_healthy_postgres() -> None:
    service = compose()["services"]["consolidation"]
    assert service["depends_on"]["postgres"]["condition"] == "service_healthy"


def test_the_embedded_database_lives_on_a_volume() -> None:
    assert re.search(r'^VOLUME \["/data"\]$', dockerfile(), re.MULTILINE)
    assert "CONSOLIDATION_DATA_DIR=/data" in dockerfile()


def test_the_image_health_check_follows_the_configured_port() -> None:
    check = next(line for line in dockerfile().splitlines() if "/readyz" in line)
    assert "CONSOLIDATION_HTTP_PORT" in check
