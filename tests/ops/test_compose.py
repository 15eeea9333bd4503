"""docker-compose.yml describes the same cluster as `modelpool up` (checked without a Docker engine)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.cli import COMMANDS
from services.cluster.up import SERVICES

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def _command(service: dict[str, Any]) -> list[str]:
    command = service["command"]
    return command.split() if isinstance(command, str) else list(command)


def test_every_service_has_its_own_container_running_its_own_command(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name in SERVICES:
        assert name in services, f"no container for {name}"
        argv = _command(services[name])
        assert argv[0] == "modelpool" and argv[1] == name
        assert argv[1] in COMMANDS, f"`modelpool {argv[1]}` is not a command"
        assert services[name]["image"] == services["migrate"]["image"]
    assert _command(services["migrate"])[:2] == ["modelpool", "migrate"] and "migrate" in COMMANDS


def test_services_start_after_healthy_servers_and_finished_migrations(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name in SERVICES:
        depends = services[name]["depends_on"]
        assert depends["nats"]["condition"] == "service_healthy"
        assert depends["postgres"]["condition"] == "service_healthy"
        assert depends["migrate"]["condition"] == "service_completed_successfully"
    migrate = services["migrate"]
    assert migrate["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert migrate.get("restart", "no") == "no"  # a one-shot, or it would never "complete"


def test_servers_have_health_checks_and_jetstream(compose: dict[str, Any]) -> None:
    services = compose["services"]
    nats_args = _command(services["nats"])
    assert "-js" in nats_args or "--jetstream" in nats_args
    assert any("healthz" in part for part in services["nats"]["healthcheck"]["test"])
    assert services["postgres"]["image"].split(":")[1].startswith("16")
    assert "pg_isready" in " ".join(services["postgres"]["healthcheck"]["test"])


def test_every_service_is_restarted_and_judged_by_whether_it_reaches_its_servers(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name in SERVICES:
        service = services[name]
        assert service["restart"] == "unless-stopped"
        assert service["healthcheck"]["test"][1:3] == ["modelpool", "health"] and "health" in COMMANDS
        assert service["environment"]["MODELPOOL_HEALTH_FILE"]  # where the service writes what `health` reads


def test_servers_are_reached_by_url_and_the_gateway_port_is_published(compose: dict[str, Any]) -> None:
    services = compose["services"]
    postgres_env = services["postgres"]["environment"]
    for name in [*SERVICES, "migrate"]:
        env = services[name]["environment"]
        assert env["NATS_URL"] == "nats://nats:4222"
        url = re.fullmatch(r"postgresql://(\w+):(\w+)@postgres:5432/(\w+)", env["DATABASE_URL"])
        assert url is not None, env["DATABASE_URL"]
        assert url.groups() == (postgres_env["POSTGRES_USER"], postgres_env["POSTGRES_PASSWORD"], postgres_env["POSTGRES_DB"])
    gateway = services["gateway"]
    port = str(gateway["environment"]["MODELPOOL_GATEWAY_PORT"])
    assert gateway["environment"]["MODELPOOL_GATEWAY_HOST"] == "0.0.0.0"  # reachable from outside its container
    assert f"{port}:{port}" in [str(p) for p in gateway["ports"]]


def test_the_dockerfile_builds_one_image_with_the_modelpool_command() -> None:
    dockerfile = (REPO / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11", dockerfile, re.MULTILINE)
    assert "pip install -e ." in dockerfile
    assert re.search(r"^USER (?!root)\w+", dockerfile, re.MULTILINE)  # services do not run as root
    for path in ("shared", "services", "migrations", "alembic.ini", "pyproject.toml"):
        assert re.search(rf"^COPY .*\b{re.escape(path)}\b", dockerfile, re.MULTILINE), f"{path} not copied into the image"
        assert (REPO / path).exists()


def test_only_the_gateway_is_published_and_engines_listen_on_the_worker_address(compose: dict[str, Any]) -> None:
    services = compose["services"]
    published = sorted(name for name, service in services.items() if service.get("ports"))
    assert published == ["gateway"]
    worker = services["worker"]["environment"]
    assert worker["MODELPOOL_WORKER_HOST"] not in ("0.0.0.0", "::", "")
