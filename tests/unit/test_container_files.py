"""docker-compose.yml and the Dockerfile keep the properties operators rely on (no Docker engine
is needed: the files are read as data)."""

from __future__ import annotations

import re
import tomllib
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
    assert fake["ports"] == [f"127.0.0.1:{port}:{port}"]


def test_long_running_services_restart() -> None:
    for name, service in compose()["services"].items():
        assert service.get("restart") == "unless-stopped", name


def test_the_service_waits_for_a_healthy_postgres() -> None:
    service = compose()["services"]["consolidation"]
    assert service["depends_on"]["postgres"]["condition"] == "service_healthy"


def test_the_embedded_database_lives_in_data() -> None:
    assert "CONSOLIDATION_DATA_DIR=/data" in dockerfile()


def test_the_image_health_check_follows_the_configured_port() -> None:
    check = next(line for line in dockerfile().splitlines() if "/readyz" in line)
    assert "CONSOLIDATION_HTTP_PORT" in check


def test_no_secret_is_written_in_the_compose_file() -> None:
    services = compose()["services"]
    postgres = services["postgres"]["environment"]["POSTGRES_PASSWORD"]
    assert postgres.startswith("${POSTGRES_PASSWORD:?"), postgres
    service = services["consolidation"]["environment"]
    assert service["CONSOLIDATION_API_KEY"].startswith("${CONSOLIDATION_API_KEY:?")
    assert "${POSTGRES_PASSWORD:?" in service["CONSOLIDATION_DATABASE_URL"]
    example = (ROOT / ".env.example").read_text()
    assert re.search(r"^POSTGRES_PASSWORD=$", example, re.MULTILINE)
    assert re.search(r"^CONSOLIDATION_API_KEY=$", example, re.MULTILINE)
    assert ".env" in (ROOT / ".gitignore").read_text().splitlines()


def test_every_published_port_is_on_loopback_by_default() -> None:
    for name, service in compose()["services"].items():
        for port in service.get("ports", []):
            host = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", port)
            assert host.startswith("127.0.0.1:"), (name, port)


def test_the_service_is_health_checked_on_healthz() -> None:
    probe = " ".join(compose()["services"]["consolidation"]["healthcheck"]["test"])
    assert "/healthz" in probe


def test_no_anonymous_volume_when_postgres_is_external() -> None:
    assert not re.search(r"^VOLUME", dockerfile(), re.MULTILINE)
    assert "volumes" not in compose()["services"]["consolidation"]


def test_every_service_has_resource_and_log_limits() -> None:
    for name, service in compose()["services"].items():
        limits = service["deploy"]["resources"]["limits"]
        assert limits["cpus"] and limits["memory"], name
        assert service["logging"]["options"]["max-size"], name


def test_images_are_pinned_to_exact_tags_and_dependencies_to_a_lock() -> None:
    bases = re.findall(r"^FROM (\S+)", dockerfile(), re.MULTILINE)
    assert bases and all(re.fullmatch(r"python:\d+\.\d+\.\d+-[a-z-]+", b) for b in bases), bases
    assert re.fullmatch(r"[\w/]+:\d+\.\d+\.\d+-pg\d+", compose()["services"]["postgres"]["image"])
    assert "--constraint requirements.lock" in dockerfile()
    pinned = {
        re.split(r"==", line)[0].lower().replace("_", "-")
        for line in (ROOT / "requirements.lock").read_text().splitlines()
        if line and not line.startswith("#")
    }
    assert all(
        "==" in line
        for line in (ROOT / "requirements.lock").read_text().splitlines()
        if line and not line.startswith("#")
    )
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for requirement in project["dependencies"]:
        name = re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower().replace("_", "-")
        assert name in pinned, f"{name} is not pinned in requirements.lock"
