"""The bus on a three-server NATS cluster: streams kept on all three, nothing lost when one server dies,
the server caught up when it comes back."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import APIError, NoStreamResponseError, ServiceUnavailableError

from helpers import eventually, wait_until
from services.cluster.embedded.nats import find_nats_server
from services.runtime import open_context
from shared.bus.jetstream import Consumer, connect, ensure_streams, publish
from shared.bus.subjects import Subjects
from shared.bus.telemetry import TelemetryBus
from shared.contracts.backends import BackendType
from shared.contracts.commands import SleepInstance
from shared.contracts.messages import Envelope
from shared.net import free_ports
from shared.settings import Settings

pytestmark = [pytest.mark.processes, pytest.mark.timeout(180)]

NAMES = ("n1", "n2", "n3")
TRANSIENT = (NatsTimeoutError, NoStreamResponseError, ServiceUnavailableError, APIError, asyncio.TimeoutError)
"""What a JetStream call meets while the cluster elects a leader."""


@dataclass
class Node:
    name: str
    port: int
    monitor_port: int
    config: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.config.with_suffix(".log"), "ab") as log:
            self.proc = subprocess.Popen([str(find_nats_server()), "-c", str(self.config)], stdout=subprocess.DEVNULL,
                                         stderr=log, start_new_session=True)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def healthy(self) -> bool:
        try:
            url = f"http://127.0.0.1:{self.monitor_port}/healthz?js-enabled-only=true"
            with urllib.request.urlopen(url, timeout=1) as response:
                return response.status == 200
        except OSError:
            return False


@pytest.fixture
def cluster(tmp_path: Path):
    ports = free_ports(9)
    nodes = []
    for i, name in enumerate(NAMES):
        client, monitor, route = ports[3 * i: 3 * i + 3]
        nodes.append((name, client, monitor, route))
    routes = ", ".join(f"nats-route://127.0.0.1:{route}" for *_, route in nodes)
    started = []
    for name, client, monitor, route in nodes:
        config = tmp_path / f"{name}.conf"
        config.write_text(f"""
server_name: {name}
listen: 127.0.0.1:{client}
http: 127.0.0.1:{monitor}
jetstream {{ store_dir: "{tmp_path / name}" }}
cluster {{ name: modelpool, listen: 127.0.0.1:{route}, routes: [{routes}] }}
""")
        node = Node(name, client, monitor, config)
        node.start()
        started.append(node)
    try:
        assert wait_until(lambda: all(node.healthy() for node in started), 30), \
            "the three NATS servers never all reported JetStream healthy"
        yield started
    finally:
        for node in started:
            node.kill()


async def until_done(call, timeout_s: float = 30.0):
    """`call()` again until the cluster answers it (a leader elected)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await call()
        except TRANSIENT:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.25)


async def test_streams_are_replicated_and_survive_the_loss_of_one_server(cluster: list[Node]):
    settings = Settings.load({"NATS_URL": ",".join(f"nats://127.0.0.1:{n.port}" for n in cluster),
                              "MODELPOOL_STREAM_REPLICAS": "3"})
    subjects = Subjects("cluster_test")
    nc = await connect(settings.nats_url, name="cluster-test")
    try:
        js = nc.jetstream(timeout=2.0)
        # Declared with one copy first, as a pool that started on one server; then raised to three.
        for replicas in (1, settings.stream_replicas):
            await until_done(lambda: ensure_streams(js, subjects, replicas))
            await until_done(lambda: TelemetryBus(nc, js, subjects).ensure(replicas))
        # A reader that does not know the pool's setting (`modelpool status`) leaves the copies as they are.
        await until_done(lambda: TelemetryBus(nc, js, subjects).ensure())
        for stream in (subjects.events_stream, subjects.commands_stream, subjects.dlq_stream, subjects.windows_stream,
                       f"KV_{subjects.heartbeats_bucket}", f"KV_{subjects.control_bucket}"):
            assert (await until_done(lambda: js.stream_info(stream))).config.num_replicas == 3, stream

        async def events_stream():
            return await until_done(lambda: js.stream_info(subjects.events_stream))

        async def three_current_copies():
            info = await events_stream()
            peers = info.cluster.replicas or []
            return info if info.cluster.leader and len(peers) == 2 and all(p.current and not p.offline for p in peers) \
                else None

        # The two new copies join the raised stream's group, and it elects a leader.
        info = await eventually(three_current_copies, timeout=30, interval=0.25)
        subject = subjects.all_events.replace(">", "test")

        async def publish(n: int) -> None:
            # The same message id on a retry: JetStream keeps one copy of a message sent twice.
            await until_done(lambda: js.publish(subject, f"event {n}".encode(), headers={"Nats-Msg-Id": f"m{n}"}))

        for n in range(20):
            await publish(n)
        leader = next(node for node in cluster if node.name == info.cluster.leader)
        leader.kill()
        for n in range(20, 40):  # while a new leader is elected, and after
            await publish(n)
        info = await events_stream()
        assert info.state.messages == 40 and info.cluster.leader != leader.name

        async def caught_up() -> bool:
            peers = (await events_stream()).cluster.replicas or []
            # no lag: the field is omitted
            return any(p.name == leader.name and p.current and not p.offline and not p.lag for p in peers)

        leader.start()  # the same store: it catches up from the others
        await eventually(caught_up, timeout=30, interval=0.5)
        got = []
        consumer = await js.pull_subscribe(subject, durable=None, stream=subjects.events_stream)
        while len(got) < 40:
            got += [m.data.decode() for m in await consumer.fetch(40 - len(got), timeout=5)]
        assert got == [f"event {n}" for n in range(40)]
    finally:
        await nc.close()


def test_stream_replicas_are_bounded():
    with pytest.raises(Exception, match="stream_replicas"):
        Settings.load({"MODELPOOL_STREAM_REPLICAS": "0"})


async def test_a_service_takes_its_commands_from_a_cluster_named_by_every_server(cluster: list[Node], settings):
    """NATS_URL naming the cluster's servers reaches a service's own connection and its consumers' (the broker's)."""
    settings = settings.model_copy(update={
        "nats_url": ",".join(f"nats://127.0.0.1:{n.port}" for n in cluster), "stream_replicas": 3})
    async with contextlib.AsyncExitStack() as stack:
        ctx = await asyncio.wait_for(open_context("cluster-test", settings, stack), 60)
        taken: list[SleepInstance] = []

        async def handler(envelope: Envelope, command) -> None:
            taken.append(command)
            ctx.stop.set()

        subject = ctx.subjects.worker_commands("w-test")
        command = SleepInstance(instance_id="i-1", alias="a", backend_type=BackendType.VLLM, worker_id="w-test", level=1)
        await until_done(lambda: publish(ctx.js, subject, Envelope.wrap(command), ctx.telemetry))
        consumer = Consumer(ctx.js, ctx.subjects, stream=ctx.subjects.commands_stream, durable="cluster-test",
                            filter_subject=subject, registry=ctx.commands, handler=handler, telemetry=ctx.telemetry)
        await asyncio.wait_for(ctx.consume(consumer), 30)
        assert taken == [command]
