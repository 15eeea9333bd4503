"""`docker compose up` as a user runs it: built, started, serving from COLD, surviving restarts, leaving nothing.

The compose file names the official base images; where no image registry is reachable (as here) the test
builds stand-ins from Debian's packages (`deploy/standins/build.sh`) and passes them through the file's
variables, exactly as an operator without a registry would. A Docker engine is found running, or installed
and started (`docker_support.py`); where none can run, the test fails saying how to get one.
"""

from __future__ import annotations

import concurrent.futures
import json
import secrets
import threading
import time
import urllib.request

import openai
import pytest
import yaml

from docker_support import (REPO, Compose, build_standins, ensure_docker_engine, healthy, offer_llama_wheel,
                            prune_replaced_images, say)
from services.cluster.up import SERVICES
from shared.net import free_port

pytestmark = [pytest.mark.processes, pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(3600)]

ALIAS = "smollm2-135m"  # config/pool.yaml's default alias: the real llama.cpp engine in the worker container
API_KEY = "sk-compose-test-" + secrets.token_hex(8)


def test_the_compose_file_names_the_official_images_behind_variables() -> None:
    """What a user on a normal machine gets without setting anything."""
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    services = compose["services"]
    assert services["nats"]["image"] == "${NATS_IMAGE:-nats:2.10-alpine}"
    assert services["postgres"]["image"] == "${POSTGRES_IMAGE:-postgres:16}"
    assert services["migrate"]["build"]["args"]["PYTHON_IMAGE"] == "${PYTHON_IMAGE:-python:3.11-slim}"
    assert "ARG PYTHON_IMAGE=python:3.11-slim" in (REPO / "Dockerfile").read_text()
    assert services["prometheus"]["image"] == "${PROMETHEUS_IMAGE:-prom/prometheus:v2.53.0}"
    assert services["prometheus"]["profiles"] == ["observability"]  # only when asked for
    ours = [name for name in services
            if name not in ("nats", "postgres", "migrate", "prometheus", "credentials", "database-roles")]
    assert sorted(ours) == sorted(SERVICES)
    # The cluster secret: made once in its volume, which only the gateway and the worker mount.
    assert services["credentials"]["command"][:3] == ["modelpool", "credentials", "/credentials"]
    holders = {name for name, s in services.items() if any(v.startswith("credentials:") for v in s.get("volumes", []))}
    assert holders == {"credentials", "gateway", "worker"}
    for name in ("gateway", "worker"):
        assert services[name]["environment"]["MODELPOOL_CLUSTER_SECRET_FILE"] == "/credentials/cluster-secret"
    # Postgres' passwords: the superuser's and the owner's only where the database is set up and migrated, the
    # service role's (no URL carries one) in every service.
    admins = {name for name, s in services.items()
              if any(v.startswith("db-admin-credentials:") for v in s.get("volumes", []))}
    assert admins == {"credentials", "postgres", "database-roles", "migrate"}
    assert services["migrate"]["environment"]["DATABASE_URL"] == "postgresql://modelpool_owner@postgres:5432/modelpool"
    for name in ours:
        env = services[name]["environment"]
        assert env["DATABASE_URL"] == "postgresql://modelpool_service@postgres:5432/modelpool", name
        assert env["MODELPOOL_DATABASE_PASSWORD_FILE"] == "/db-credentials/service-password", name
    # The bus's users: NATS runs with their list; each service mounts its own user's volume, and no other.
    assert "/etc/nats/users/nats-server.conf" in services["nats"]["command"]
    users = {"migrate": "operator", "worker": "worker-worker-1", **{name: name for name in ours if name != "worker"}}
    for name, user in users.items():
        mounted = [v for v in services[name]["volumes"] if v.startswith("nats-")]
        assert mounted == [f"nats-{user.removeprefix('worker-')}:/nats-credentials:ro"], name
        assert services[name]["environment"]["MODELPOOL_NATS_CREDENTIALS_FILE"] == "/nats-credentials/nats.json"
        assert f"nats-{user.removeprefix('worker-')}:/credentials/nats/{user}" in services["credentials"]["volumes"]
    # Every service serves its own /metrics on the compose network, where Prometheus scrapes each of them.
    scraped = yaml.safe_load((REPO / "deploy" / "prometheus" / "compose.yml").read_text())["scrape_configs"]
    targets = {t for job in scraped for group in job["static_configs"] for t in group["targets"]}
    assert targets == {"gateway:8000", *(f"{name}:9100" for name in ours)}
    for name in ours:
        assert services[name]["environment"]["MODELPOOL_METRICS_PORT"] == "9100", name


def test_compose_up_serves_from_cold_through_restarts_then_down_leaves_nothing() -> None:
    began = time.monotonic()
    ensure_docker_engine()
    images = build_standins()
    offer_llama_wheel()
    port, prometheus_port = free_port(), free_port()
    # With the `observability` profile: Prometheus scraping every service, as an operator would run it.
    compose = Compose(f"mptest{secrets.token_hex(4)}", {
        **images, "MODELPOOL_GATEWAY_BIND": f"127.0.0.1:{port}", "MODELPOOL_API_KEYS": API_KEY,
        "MODELPOOL_PROMETHEUS_BIND": f"127.0.0.1:{prometheus_port}", "COMPOSE_PROFILES": "observability"})
    url = f"http://127.0.0.1:{port}"
    try:
        say("building the modelpool image")
        # Every modelpool service runs the one image: build it once (compose v1 would build it per service).
        compose("build", "migrate", timeout_s=2400)
        say(f"image built after {time.monotonic() - began:.0f} s; compose up")
        compose("up", "-d", "--no-build", timeout_s=600)
        deadline = time.monotonic() + 180
        while not healthy(url):
            assert time.monotonic() < deadline, f"the gateway never answered /health:\n{compose('logs', check=False).stdout[-6000:]}"
            time.sleep(1)
        listed = compose("ps", timeout_s=60).stdout
        assert "Exit" not in listed.replace("Exit 0", ""), listed

        client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
        assert ALIAS in [model.id for model in client.models.list()]
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="sk-wrong", max_retries=0).models.list()

        say("first request, from COLD")
        sent = time.monotonic()
        raw = client.chat.completions.with_raw_response.create(
            model=ALIAS, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8)
        answer = raw.parse()
        assert answer.choices[0].message.content, answer
        assert raw.headers["x-modelpool-engine"] == "llama.cpp"  # the real engine, not the simulator
        say(f"answered from COLD in {time.monotonic() - sent:.1f} s by {raw.headers['x-modelpool-instance']}")

        scraped = every_service_scraped(f"http://127.0.0.1:{prometheus_port}")
        say(f"Prometheus scrapes every service: {sorted(scraped)}")

        results = load_through_restarts(client, compose)
        failed = [r for r in results if r is not None]
        assert len(results) >= 20 and not failed, f"{len(failed)} of {len(results)} failed: {failed[:5]}"

        for argv in (["modelpool", "replay"], ["modelpool", "replay", "--verify-decisions"]):
            replayed = compose("exec", "-T", "gateway", *argv, timeout_s=300, check=False)
            assert replayed.returncode == 0, f"{' '.join(argv)}:\n{replayed.stdout[-3000:]}\n{replayed.stderr[-3000:]}"
    except BaseException:
        say("services' last logs:\n" + compose("logs", "--tail", "40", check=False).stdout[-12000:])
        raise
    finally:
        compose("down", "-v", "--remove-orphans", timeout_s=300, check=False)
        prune_replaced_images()
    assert compose.leftovers() == {}
    say(f"whole test {time.monotonic() - began:.0f} s")


def every_service_scraped(prometheus: str, timeout_s: float = 120) -> set[str]:
    """Once Prometheus has every target up: the services whose own /metrics say they reach both servers."""
    deadline, last = time.monotonic() + timeout_s, None
    while True:
        try:
            with urllib.request.urlopen(f"{prometheus}/api/v1/targets", timeout=5) as answer:
                targets = json.loads(answer.read())["data"]["activeTargets"]
            with urllib.request.urlopen(f"{prometheus}/api/v1/query?query=modelpool_service_server_up",
                                        timeout=5) as answer:
                series = json.loads(answer.read())["data"]["result"]
            last = (targets, series)
            reaching = {s["metric"]["service"] for s in series if s["value"][1] == "1"}
            every = {t["labels"].get("service", t["labels"]["job"]) for t in targets}
            if targets and all(t["health"] == "up" for t in targets) and reaching == every - {"modelpool-gateway"} \
                    and len(series) == 2 * len(reaching):
                with urllib.request.urlopen(f"{prometheus}/api/v1/rules", timeout=5) as answer:
                    groups = json.loads(answer.read())["data"]["groups"]
                assert sum(len(g["rules"]) for g in groups) == 7, groups  # alerts.yml is loaded beside it
                assert reaching == set(SERVICES), reaching
                return reaching
        except OSError as exc:  # not up yet
            last = exc
        assert time.monotonic() < deadline, f"Prometheus never had every service up: {last}"
        time.sleep(2)


def load_through_restarts(client: openai.OpenAI, compose: Compose, clients: int = 3,
                          seconds: float = 45.0) -> list[str | None]:
    """`clients` loops of short requests for `seconds`; the autoscaler's container and NATS's restarted
    meanwhile. One entry per request: None when answered whole, else what went wrong."""
    results: list[str | None] = []
    stop = threading.Event()

    def one_client() -> None:
        while not stop.is_set():
            try:
                answer = client.chat.completions.create(
                    model=ALIAS, messages=[{"role": "user", "content": "Count to three."}], max_tokens=8)
                results.append(None if answer.choices[0].message.content else f"empty answer {answer}")
            except Exception as exc:  # every failure is counted, none ends the loop
                results.append(repr(exc))

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        for _ in range(clients):
            pool.submit(one_client)
        try:
            time.sleep(seconds / 6)
            say("restarting the autoscaler's container mid-load")
            compose("restart", "autoscaler", timeout_s=120)
            time.sleep(seconds / 6)
            say("restarting the NATS container mid-load")
            compose("restart", "nats", timeout_s=120)
            time.sleep(seconds / 2)
        finally:
            stop.set()
    say(f"{len(results)} requests through the restarts, {sum(r is not None for r in results)} failed")
    return results
