"""modelpool on several hosts (deploy/compose/cluster.yml), run for real, with the faults a deployment meets.

Three worker hosts, two gateways behind HAProxy, three NATS servers (every stream on all three), the
autoscaler twice, Postgres. The tests run in order on one cluster: it serves from COLD and puts replicas on
different hosts; a gateway replica dies and the other honours its sessions; a NATS server dies and comes back;
the deciding autoscaler dies and the other takes over; a worker host is cut off from the network and healed.
Built and started as test_compose.py does (stand-in base images where no registry is reachable).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import yaml
from compose_cluster import (COLD_ALIAS, NATS_SERVERS, SCHEMA, WARM_ALIAS, Cluster, chat, cut_off_a_worker, healthy,
                             lose_a_gateway, lose_a_nats_server, lose_the_deciding_autoscaler, until, warm_replicas)
from docker_support import REPO, build_standins, ensure_docker_engine, offer_llama_wheel, prune_replaced_images, say

from shared.bus.subjects import Subjects

pytestmark = [pytest.mark.processes, pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(3600)]

STREAMS = Subjects(SCHEMA).all_streams


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    began = time.monotonic()
    ensure_docker_engine()
    images = build_standins()
    offer_llama_wheel()
    cluster = Cluster(images)
    failed_before = request.session.testsfailed
    try:
        say("building the modelpool image")
        cluster.compose("build", "migrate", timeout_s=2400)
        say(f"cluster up ({time.monotonic() - began:.0f} s in)")
        cluster.up()
        say(f"cluster serving after {time.monotonic() - began:.0f} s")
        yield cluster
    finally:
        if request.session.testsfailed > failed_before or not all(healthy(cluster.url(s)) for s in cluster.ports):
            say("services' last logs:\n" + cluster.logs()[-20000:])
            try:
                say("the log's last lifecycle facts:\n" + cluster.timeline())
            except Exception as exc:  # the cluster's Postgres may be what failed
                say(f"the log could not be read: {exc!r}")
        leftovers = cluster.down()
        prune_replaced_images()
        say(f"cluster tests took {time.monotonic() - began:.0f} s")
    assert leftovers == {}, f"left on the engine: {leftovers}"


def test_the_cluster_file_names_the_official_images_and_every_server_of_the_nats_cluster() -> None:
    """What a user gets without setting anything; and no service left on one NATS server or one copy."""
    services = yaml.safe_load((REPO / "deploy" / "compose" / "cluster.yml").read_text())["services"]
    assert {services[s]["image"] for s in NATS_SERVERS} == {"${NATS_IMAGE:-nats:2.10-alpine}"}
    assert services["postgres"]["image"] == "${POSTGRES_IMAGE:-postgres:16}"
    assert services["lb"]["image"] == "${HAPROXY_IMAGE:-haproxy:2.8-alpine}"
    assert services["migrate"]["build"]["args"]["PYTHON_IMAGE"] == "${PYTHON_IMAGE:-python:3.11-slim}"
    modelpool = {name: s for name, s in services.items()
                 if s.get("image") == "modelpool:local" and name not in ("credentials", "database-roles")}
    assert len(modelpool) == 11  # migrate, relay, projector, placement, 2 autoscalers, 3 workers, 2 gateways
    # The cluster secret: made once in its volume, which only the gateways and the workers mount.
    holders = {name for name, s in modelpool.items() if any(v.startswith("credentials:") for v in s.get("volumes", []))}
    assert holders == {"gateway-1", "gateway-2", "worker-1", "worker-2", "worker-3"}
    # Each service mounts its own bus user's volume and no other; every NATS server knows the users.
    for name, service in modelpool.items():
        role = "operator" if name == "migrate" else name if name.startswith("worker-") else name.split("-")[0]
        assert [v for v in service["volumes"] if v.startswith("nats-")] == [f"nats-{role}:/nats-credentials:ro"], name
    assert all("/etc/nats/users/nats-server.conf" in services[s]["command"] for s in NATS_SERVERS)
    # Postgres: the migrations as the schema's owner, every service as the service role, passwords from files.
    for name, service in modelpool.items():
        env = service["environment"]
        role = "modelpool_owner" if name == "migrate" else "modelpool_service"
        assert env["DATABASE_URL"] == f"postgresql://{role}@postgres:5432/modelpool", name
        assert env["MODELPOOL_DATABASE_PASSWORD_FILE"].endswith(("/owner-password", "/service-password")), name
        assert env["NATS_URL"].split(",") == [f"nats://{n}:4222" for n in NATS_SERVERS], name
        assert env["MODELPOOL_STREAM_REPLICAS"] == "3", name
        if name.startswith("worker-"):
            assert env["MODELPOOL_WORKER_HOST"] == name  # engines listen on the host's own address


def test_the_cluster_serves_from_cold_and_puts_replicas_on_different_hosts(cluster: Cluster) -> None:
    client = openai.OpenAI(base_url=f"{cluster.url()}/v1", api_key="none", max_retries=0, timeout=180)
    assert {COLD_ALIAS, WARM_ALIAS} <= {model.id for model in client.models.list()}
    sent = time.monotonic()
    raw = client.chat.completions.with_raw_response.create(
        model=COLD_ALIAS, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8)
    assert raw.parse().choices[0].message.content
    assert raw.headers["x-modelpool-engine"] == "llama.cpp"  # the real engine, on one of the worker hosts
    say(f"answered from COLD in {time.monotonic() - sent:.1f} s by {raw.headers['x-modelpool-instance']}")

    placed = warm_replicas(cluster)
    assert len(set(placed.values())) == 2, f"both replicas on one host: {placed}"
    # The gateways reach engines on the other hosts by the hosts' names.
    for instance in cluster.status()["instances"]:
        if instance["state"] == "RUNNING":
            assert instance["endpoint"].startswith(f"http://{instance['worker_id']}:"), instance
    # Every stream and bucket is kept on all three NATS servers.
    for server in NATS_SERVERS:
        missing = [stream for stream in STREAMS if cluster.stream_state(server, stream) is None]
        assert not missing, f"{server} holds no copy of {missing}"


def test_a_gateway_replica_killed_the_other_serves_and_honours_its_sessions(cluster: Cluster) -> None:
    warm_replicas(cluster)
    sessions = [f"conversation-{n}" for n in range(6)]
    # Sent at once, so the router (least load among the replicas) places them on both.
    with ThreadPoolExecutor(len(sessions)) as pool:
        first = dict(zip(sessions, pool.map(
            lambda session: chat(cluster.url("gateway-1"), WARM_ALIAS, "Hello there.", session), sessions)))
    assert all(error is None for _, error in first.values()), first
    bound = {session: headers["x-modelpool-instance"] for session, (headers, _) in first.items()}
    assert len(set(bound.values())) == 2, f"every session on one instance: {bound}"
    until("the sessions' bindings in the log", lambda: {f"{WARM_ALIAS}/{s}": i for s, i in bound.items()}.items() <= {
        e["session_id"]: e["instance_id"] for e in cluster.events("SessionBound")}.items(), timeout_s=30)

    answered: dict[str, tuple[dict[str, str], str | None]] = {}

    def ask_the_live_replica() -> None:
        for session in bound:
            answered[session] = chat(cluster.url("gateway-2"), WARM_ALIAS, "And again.", session)
    outcome = lose_a_gateway(cluster, while_down=ask_the_live_replica)
    # Only a request the killed replica was answering may fail (no server finishes a response on a connection
    # that dies with it): at most one per client; every one sent after the kill is answered.
    assert outcome.load.sent >= 10 and not outcome.load.failed_since(outcome.since), outcome.load.failed[:5]
    assert len(outcome.load.failed) <= outcome.load.clients, outcome.load.failed[:5]
    for session, instance in bound.items():
        headers, error = answered[session]
        assert error is None and headers["x-modelpool-instance"] == instance, (session, instance, headers, error)
    assert outcome.recovery_s < 30


def test_a_nats_server_killed_nothing_stops_and_it_catches_up(cluster: Cluster) -> None:
    outcome = lose_a_nats_server(cluster)
    assert outcome.facts["served_while_down"] >= 5, "the pool stopped serving while a NATS server was away"
    assert outcome.facts["served_after"] >= 3, "the pool did not serve after the NATS server came back"
    assert not outcome.load.failed, outcome.load.failed[:5]


def test_the_deciding_autoscaler_killed_the_standby_leads_within_seconds(cluster: Cluster) -> None:
    outcome = lose_the_deciding_autoscaler(cluster)
    # Its outlook is refreshed every 5 s: taking over within a second shows within about 6.
    assert outcome.recovery_s < 15
    assert not outcome.load.failed, outcome.load.failed[:5]


def test_a_worker_host_cut_off_is_lost_once_replaced_and_rejoins_when_healed(cluster: Cluster) -> None:
    outcome = cut_off_a_worker(cluster)
    assert outcome.served_during >= 10, "requests stopped being served while a host was cut off"
    assert outcome.load.sent >= 20 and not outcome.load.failed, outcome.load.failed[:5]
    assert outcome.facts["times_recorded_lost"] == 1  # once, not once per retry
    assert outcome.recovery_s <= 30
    assert healthy(cluster.url())
