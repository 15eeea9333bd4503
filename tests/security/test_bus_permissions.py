"""Least privilege on the bus: a NATS with modelpool's users (shared/bus/users.py) refuses a client without
credentials, refuses a gateway's command and a worker's word for another worker, and lets every role do what its
code does, and nothing its permissions do not name (the server's log says so: no violation)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import stat
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import nats
import pytest
from faststream.nats import NatsBroker
from helpers import eventually
from nats.errors import Error as NatsError

from services.cluster.embedded import EmbeddedNats
from services.cluster.localpool import LocalPool
from services.ops.migrate import declare_bus
from services.links import ServerLinks
from services.runtime import broker_credentials, connect_refusing_bad_credentials
from shared.bus.auth import BusCredentials, CredentialsError, credentials_from_environment
from shared.bus.jetstream import NATS_OPTIONS, Consumer, connect, connect_once, message_headers, publish, publish_in_order
from shared.bus.subjects import Subjects
from shared.bus.telemetry import TelemetryBus
from shared.bus.users import make_bus_users
from shared.contracts.backends import BackendType, EngineKind
from shared.contracts.commands import PlaceInstance, StartInstance, WakeInstance, command_registry
from shared.contracts.events import WorkerLost, event_registry
from shared.contracts.messages import Envelope
from shared.contracts.states import RoutingState
from shared.contracts.telemetry import ControlOutlook, DemandSignal, GatewayWindow, WorkerHeartbeat
from shared.settings import Settings
from shared.telemetry import Telemetry

WORKERS = ("w1", "w2")


@dataclass
class SecuredBus:
    server: EmbeddedNats
    users: object
    subjects: Subjects

    def credentials(self, user: str) -> BusCredentials:
        return self.users.credentials(user)

    def violations(self, since: int = 0) -> list[str]:
        """What the server refused, from byte `since` of its log on."""
        with open(self.server.log_path, "rb") as log:
            log.seek(since)
            return [line for line in log.read().decode(errors="replace").splitlines() if "Violation" in line]

    def log_size(self) -> int:
        return self.server.log_path.stat().st_size


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredBus]:
    """Our own nats-server with the users of a namespace (two known workers), its streams declared as
    `modelpool migrate` declares them: as the operator."""
    root = tmp_path_factory.mktemp("secured-bus")
    subjects = Subjects(f"t_{secrets.token_hex(6)}")
    users = make_bus_users(root / "users", subjects, workers=WORKERS, shared_worker=True)
    with EmbeddedNats(root / "nats", config=users.server_config) as server:
        settings = Settings.load({}, nats_url=server.url, namespace=subjects.namespace,
                                 nats_credentials_file=str(users.credentials_file("operator")))
        asyncio.run(declare_bus(settings))
        yield SecuredBus(server, users, subjects)


@contextlib.asynccontextmanager
async def connected(bus: SecuredBus, user: str, errors: list[str] | None = None) -> AsyncIterator[nats.NATS]:
    async def remember(exc: Exception) -> None:
        if errors is not None:
            errors.append(str(exc))

    nc = await connect(bus.server.url, name=f"test-{user}", credentials=bus.credentials(user), error_cb=remember,
                       allow_reconnect=False)
    try:
        yield nc
    finally:
        await nc.close()


async def messages_in(bus: SecuredBus, stream: str) -> int:
    async with connected(bus, "operator") as nc:
        return (await nc.jetstream().stream_info(stream)).state.messages


def into(found: list):
    """A subscription's callback keeping each message's subject."""
    async def keep(msg) -> None:
        found.append(msg.subject)

    return keep


def heartbeat(worker_id: str) -> WorkerHeartbeat:
    return WorkerHeartbeat(worker_id=worker_id, at=datetime.now(timezone.utc), interval_s=1.0)


# --------------------------------------------------------------------------- refused


async def test_a_client_without_credentials_or_with_a_wrong_password_is_refused(secured: SecuredBus) -> None:
    for options in ({}, {"user": "gateway", "password": "not-its-password"}, {"user": "nobody", "password": "x"}):
        with pytest.raises(NatsError, match="Authorization Violation"):
            await nats.connect(secured.server.url, allow_reconnect=False, connect_timeout=3, **options)
    # An operator's command says why in one line.
    with pytest.raises(ConnectionError, match="Authorization Violation"):
        await connect_once(secured.server.url, name="test", timeout_s=5)


async def test_a_service_refused_at_its_first_connection_says_so_at_once_naming_the_settings(
        secured: SecuredBus, tmp_path: Path) -> None:
    wrong = tmp_path / "nats.json"
    wrong.write_text(json.dumps({"user": "gateway", "password": "not-its-password"}))
    for environ in ({}, {"MODELPOOL_NATS_CREDENTIALS_FILE": str(wrong)}):
        settings = Settings.load(environ, nats_url=secured.server.url, namespace=secured.subjects.namespace)
        with pytest.raises(CredentialsError, match="MODELPOOL_NATS_CREDENTIALS_FILE") as refused:
            await asyncio.wait_for(connect_refusing_bad_credentials(settings, "test", ServerLinks("test")), 10)
        assert "not-its-password" not in str(refused.value)


async def test_a_gateway_cannot_publish_a_command_nor_read_or_reconfigure_the_commands(secured: SecuredBus) -> None:
    s = secured.subjects
    before, log_at = await messages_in(secured, s.commands_stream), secured.log_size()
    errors: list[str] = []
    async with connected(secured, "gateway", errors) as nc:
        js = nc.jetstream(timeout=1)  # a refused request is never answered: waited for a second
        start = StartInstance(instance_id="evil-1", alias="tiny", backend_type=BackendType.VLLM, worker_id="w1",
                              engine=EngineKind.VLLM, model_name="evil", model_path="/evil", gpu_memory_gb=0,
                              engine_args={"trust-remote-code": True})
        # A JetStream publish into the commands stream: no acknowledgement ever comes, nothing is stored.
        for subject in (s.worker_commands("w1"), s.placement_commands):
            with pytest.raises((NatsError, asyncio.TimeoutError)):
                await publish(js, subject, Envelope.wrap(start), Telemetry("test"))
        await nc.publish(s.worker_commands("w2"), b"{}")  # a plain publish: dropped by the server
        # Nor may it take commands off a worker's queue, or change what the stream keeps or republishes.
        for call in (js.pull_subscribe(s.worker_commands("w1"), durable="worker-w1", stream=s.commands_stream),
                     js.delete_stream(s.commands_stream), js.purge_stream(s.commands_stream)):
            with pytest.raises((NatsError, asyncio.TimeoutError)):
                await asyncio.wait_for(call, 3)
        await nc.flush()
        await asyncio.sleep(0.2)
    assert await messages_in(secured, s.commands_stream) == before
    refused = secured.violations(log_at)
    assert any(f'"{s.worker_commands("w1")}"' in line and "user:gateway" in line for line in refused), refused
    assert any(f'"{s.placement_commands}"' in line for line in refused), refused
    assert any("permissions violation" in e.lower() for e in errors), errors


async def test_a_worker_speaks_only_for_itself(secured: SecuredBus) -> None:
    s = secured.subjects
    async with connected(secured, "worker-w1") as nc:
        js = nc.jetstream(timeout=1)  # a refused request is never answered: waited for a second
        bus = TelemetryBus(nc, js, s, declares=False)
        await bus.put_heartbeat(heartbeat("w1"))
        with pytest.raises((NatsError, asyncio.TimeoutError)):
            await bus.put_heartbeat(heartbeat("w2"))  # another worker's heartbeat
        # Nor may it take another worker's commands, or send commands at all.
        with pytest.raises((NatsError, asyncio.TimeoutError)):
            await js.pull_subscribe(s.worker_commands("w2"), durable="worker-w2", stream=s.commands_stream)
        with pytest.raises((NatsError, asyncio.TimeoutError)):
            await publish(js, s.worker_commands("w2"), Envelope.wrap(WakeInstance(
                instance_id="i", alias="tiny", backend_type=BackendType.VLLM, worker_id="w2")), Telemetry("test"))
    async with connected(secured, "operator") as nc:
        heard = await TelemetryBus(nc, nc.jetstream(), s, declares=False).heartbeats()
    assert "w1" in heard and "w2" not in heard


def test_the_users_files_are_private_kept_and_hold_no_password_in_the_server_config(secured: SecuredBus,
                                                                                     tmp_path: Path) -> None:
    users = secured.users
    config = users.server_config.read_text()
    for user in users.users:
        path = users.credentials_file(user)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
        assert users.credentials(user).password not in config  # only its bcrypt hash
        assert json.loads(path.read_text())["user"] == user
    assert stat.S_IMODE(users.server_config.stat().st_mode) == 0o600
    assert stat.S_IMODE(users.directory.stat().st_mode) == 0o700
    assert config.count('"password": "$2a$') == len(users.users)
    # Made again (every start of `modelpool up`): passwords kept, a new worker's user added.
    again = make_bus_users(users.directory.parent / "again", secured.subjects, workers=["w1"])
    kept = make_bus_users(again.directory, secured.subjects, workers=["w1", "w3"])
    assert kept.credentials("worker-w1") == again.credentials("worker-w1") and "worker-w3" in kept.users
    with pytest.raises(ValueError, match="subject token"):
        make_bus_users(tmp_path / "bad", secured.subjects, workers=["node.example.com"])


def test_credentials_come_from_a_file_or_a_user_and_password_and_a_bad_one_names_its_setting(tmp_path: Path) -> None:
    path = tmp_path / "nats.json"
    path.write_text(json.dumps({"user": "gateway", "password": "p"}))
    assert credentials_from_environment({"MODELPOOL_NATS_CREDENTIALS_FILE": str(path)}) == BusCredentials("gateway", "p")
    assert credentials_from_environment({"MODELPOOL_NATS_USER": "u", "MODELPOOL_NATS_PASSWORD": "q"}).user == "u"
    assert credentials_from_environment({}) is None
    assert "p" not in repr(BusCredentials("gateway", "p"))  # never in a log line
    with pytest.raises(CredentialsError, match="MODELPOOL_NATS_PASSWORD"):
        credentials_from_environment({"MODELPOOL_NATS_USER": "u"})
    with pytest.raises(CredentialsError, match="MODELPOOL_NATS_CREDENTIALS_FILE"):
        credentials_from_environment({"MODELPOOL_NATS_CREDENTIALS_FILE": str(tmp_path / "missing")})
    path.write_text("user=gateway")
    with pytest.raises(CredentialsError, match="not JSON"):
        credentials_from_environment({"MODELPOOL_NATS_CREDENTIALS_FILE": str(path)})


# --------------------------------------------------------------------------- allowed


class Role:
    """One role's connection, JetStream, telemetry bus and FastStream broker, as `services/runtime.py` makes them."""

    def __init__(self, bus: SecuredBus, user: str, declares: bool = False) -> None:
        self.bus, self.user, self.declares = bus, user, declares
        self.credentials = bus.credentials(user)

    async def __aenter__(self) -> "Role":
        self.nc = await connect(self.bus.server.url, name=f"test-{self.user}", credentials=self.credentials)
        self.js = self.nc.jetstream()
        self.telemetry = TelemetryBus(self.nc, self.js, self.bus.subjects, declares=self.declares)
        await self.telemetry.ensure()
        self.broker = NatsBroker(self.bus.server.url, **NATS_OPTIONS, **broker_credentials(self.credentials))
        return self

    def consume(self, stream: str, durable: str, filter_subject: str, registry, got: list[Envelope],
                deliver_new_only: bool = False) -> Consumer:
        async def handler(envelope: Envelope, _) -> None:
            got.append(envelope)

        consumer = Consumer(self.js, self.bus.subjects, stream=stream, durable=durable, filter_subject=filter_subject,
                            registry=registry, handler=handler, telemetry=Telemetry("test"), batch=1,
                            deliver_new_only=deliver_new_only)
        consumer.subscribe(self.broker, self.credentials.inbox_prefix)
        return consumer

    async def __aexit__(self, *exc: object) -> None:
        await self.broker.stop()
        await self.nc.close()


async def test_every_role_does_what_its_code_does_without_a_violation(secured: SecuredBus) -> None:
    s, log_at = secured.subjects, secured.log_size()
    now = datetime.now(timezone.utc)
    telemetry = Telemetry("test")
    async with (Role(secured, "relay") as relay, Role(secured, "projector") as projector,
                Role(secured, "placement") as placement, Role(secured, "autoscaler", declares=True) as autoscaler,
                Role(secured, "worker-w1") as worker, Role(secured, "gateway") as gateway,
                Role(secured, "operator", declares=True) as operator):
        # The durable consumers, as each service's FastStream broker runs them.
        projected, requested, commanded = [], [], []
        projector.consume(s.events_stream, "projector", s.all_events, event_registry(), projected,
                          deliver_new_only=True)
        placement.consume(s.commands_stream, "placement", s.placement_commands, command_registry(), requested)
        worker_consumer = worker.consume(s.commands_stream, "worker-w1", s.worker_commands("w1"), command_registry(),
                                         commanded)
        for role in (projector, placement, worker):
            await role.broker.start()

        async def consumers_ready() -> bool:  # FastStream creates them in the background: the projector's takes
            with contextlib.suppress(NatsError):  # only what comes after it
                for role, stream, name in ((projector, s.events_stream, "projector"),
                                           (placement, s.commands_stream, "placement"),
                                           (worker, s.commands_stream, "worker-w1")):
                    await role.js.consumer_info(stream, name)  # as each asks of its own
                return True
            return False

        await eventually(consumers_ready, timeout=10)

        # The gateway follows the log's announcements and the other gateways' usage; the autoscaler demand and
        # operators' commands.
        announced, usage, demanded, operated = [], [], [], []
        await gateway.nc.subscribe(s.all_events, cb=into(announced))
        await gateway.nc.subscribe(s.all_usage, cb=into(usage))
        await autoscaler.telemetry.subscribe_demand(demanded.append)
        await autoscaler.nc.subscribe(s.event("alias:", "OperatorCommanded"), cb=into(operated))
        for role in (gateway, autoscaler):
            await role.nc.flush()  # the subscriptions are the server's before anything is published

        # relay: committed events to the bus.
        lost = Envelope.wrap(WorkerLost(worker_id="w9", reason="test"))
        await publish_in_order(relay.js, [(s.event(lost.stream_id, lost.type), lost.model_dump_json().encode(),
                                           message_headers(str(lost.id), lost.type, lost.version, 1, telemetry))])
        # autoscaler: a placement request, a worker's command, its outlook; the heartbeats it reads.
        place = PlaceInstance(request_id=uuid.uuid4(), instance_id="tiny-fast-1", alias="tiny",
                              backend_type=BackendType.LLAMA_CPP, engine=EngineKind.SIMULATOR, model_name="tiny",
                              model_path="default", gpu_memory_gb=0)
        await publish(autoscaler.js, s.placement_commands, Envelope.wrap(place, id=place.request_id), telemetry)
        await publish(autoscaler.js, s.worker_commands("w1"), Envelope.wrap(WakeInstance(
            instance_id="tiny-slow-1", alias="tiny", backend_type=BackendType.VLLM, worker_id="w1")), telemetry)
        await autoscaler.telemetry.put_outlook(ControlOutlook(alias="tiny", at=now, leader="test", policy="hybrid",
                                                              routing_state=RoutingState.COLD))
        # placement: the start, to the worker it chose.
        await eventually(lambda: requested, timeout=10)
        await publish(placement.js, s.worker_commands("w1"), Envelope.wrap(StartInstance(
            instance_id="tiny-fast-1", alias="tiny", backend_type=BackendType.LLAMA_CPP, worker_id="w1",
            engine=EngineKind.SIMULATOR, model_name="tiny", model_path="default", gpu_memory_gb=0)), telemetry)
        # worker: its heartbeat; a message it cannot read goes to its dead letters.
        await worker.telemetry.put_heartbeat(heartbeat("w1"))
        await autoscaler.js.publish(s.worker_commands("w1"), b"not json")
        # gateway: windows, demand, usage; the console's reads.
        window = GatewayWindow(gateway_id="g1", alias="tiny", window_start=now - timedelta(seconds=2), window_end=now,
                               arrivals=3)
        await gateway.telemetry.publish_window(window)
        await gateway.telemetry.publish_demand(DemandSignal(gateway_id="g1", alias="tiny", held=1, at=now))
        await gateway.nc.publish(s.usage_of("g1"), b"{}")

        await eventually(lambda: len(commanded) == 2 and worker_consumer.stats.dead_lettered == 1, timeout=10)
        await eventually(lambda: projected and announced and demanded and usage, timeout=10)
        assert {e.type for e in commanded} == {"WakeInstance", "StartInstance"} and projected[0].id == lost.id
        assert (await autoscaler.telemetry.heartbeat_of("w1")).worker_id == "w1"
        heard: list[WorkerHeartbeat] = []
        stop = asyncio.Event()
        watching = asyncio.create_task(autoscaler.telemetry.watch_heartbeats(heard.append, stop))
        windows: list[GatewayWindow] = []
        following = [asyncio.create_task(role.telemetry.follow_windows(windows.append, stop))
                     for role in (autoscaler, gateway)]
        await eventually(lambda: heard and len(windows) == 2, timeout=10)
        stop.set()
        await asyncio.gather(watching, *following)
        for role in (gateway, operator):  # the console's chart and `modelpool history --plot`; status and top
            assert [w.arrivals for w in await role.telemetry.read_windows(now - timedelta(minutes=1))] == [3]
            assert "w1" in await role.telemetry.heartbeats() and "tiny" in await role.telemetry.outlooks()
        assert await messages_in(secured, s.dlq_stream) == 1  # the worker's
        # An operator's command, as the relay announces it, wakes the autoscaler.
        await relay.nc.publish(s.event("alias:tiny", "OperatorCommanded"), lost.model_dump_json().encode())
        await eventually(lambda: operated, timeout=5)
    assert secured.violations(log_at) == []


# --------------------------------------------------------------------------- a whole pool


POOL = """
aliases:
  - alias: tiny
    backends:
      llama.cpp: {model_name: tiny, model_path: default, gpu_memory_gb: 0, min_replicas: 0, max_replicas: 1,
                  engine: simulator}
"""


async def test_a_whole_pool_serves_and_takes_an_operators_drain_with_permissions_on(migrated, store, tmp_path) -> None:
    """Every service as a real process, each as its own user on a NATS that refuses anything else; the gateway's
    drain goes to the worker through the autoscaler."""
    subjects = Subjects(migrated.namespace)
    users = make_bus_users(tmp_path / "users", subjects, workers=["w1"])
    admin_port, token = free_admin_port(), "admin-token-" + secrets.token_hex(8)
    with EmbeddedNats(tmp_path / "nats", config=users.server_config) as server:
        log_at = server.log_path.stat().st_size
        pool = LocalPool(migrated.database_url, server.url, migrated.namespace, POOL, tmp_path / "pool",
                         env={"MODELPOOL_METRIC_WINDOW_S": "1", "MODELPOOL_CONTROL_TICK_S": "0.5",
                              "MODELPOOL_ADMIN_TOKEN": token, "MODELPOOL_ADMIN_PORT": str(admin_port)},
                         bus_users=users)
        try:
            pool.start()
            async with httpx.AsyncClient(timeout=60) as client:
                answer = await client.post(f"{pool.gateway}/chat/completions", json={
                    "model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
                assert answer.status_code == 200, answer.text
                instance = answer.headers["x-modelpool-instance"]
                drained = await client.post(f"http://127.0.0.1:{admin_port}/admin/instances/{instance}/drain",
                                            json={"operator": "ops-ana", "reason": "rotate the host"},
                                            headers={"authorization": f"Bearer {token}"})
                assert drained.status_code == 202, drained.text

            async def drained_by_the_operator():
                changes = [e for e in await store.read_stream(f"instance:{instance}")
                           if e.type == "InstanceStateChanged" and e.payload["to_state"] == "DRAINING"]
                return changes[0] if changes else None

            change = await eventually(drained_by_the_operator, timeout=30)
            assert change.payload["reason"] == "operator ops-ana: rotate the host"
            assert change.payload["command_id"] == drained.json()["command_id"]
        except BaseException:
            print(pool.logs())
            raise
        finally:
            pool.stop()
        refused = [line for line in server.log_path.read_text(errors="replace")[log_at:].splitlines()
                   if "Violation" in line]
    assert refused == []


def free_admin_port() -> int:
    from shared.net import free_port

    return free_port()
