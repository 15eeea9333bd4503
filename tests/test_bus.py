"""The bus against a real NATS JetStream: relay after commit, dead letters, trace context, idempotent consumers."""

from __future__ import annotations

import asyncio

import asyncpg

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from helpers import consuming, eventually, fetch
from shared.bus import subjects as h
from shared.bus.jetstream import Consumer, publish
from shared.bus.relay import Relay
from shared.contracts.backends import BackendType
from shared.contracts.commands import ProbeInstance, command_registry
from shared.contracts.events import SessionBound
from shared.contracts.messages import Envelope
from shared.telemetry import Telemetry


def session_event(n: int) -> Envelope:
    return Envelope.wrap(SessionBound(session_id=f"s{n}", alias="a", instance_id=f"i{n}"))


def probe(worker: str = "w1", n: int = 0) -> Envelope:
    return Envelope.wrap(ProbeInstance(instance_id=f"i{n}", alias="a", backend_type=BackendType.VLLM, worker_id=worker))


async def collect(bus, subject: str, n: int, timeout: float = 10.0) -> list:
    return await fetch(await bus.js.pull_subscribe(subject, durable=None, stream=None), n, timeout)


async def test_relay_publishes_committed_events_once_in_order(store, bus, settings, telemetry):
    stored = []
    for n in range(20):
        stored += await store.append(f"session:s{n}", [session_event(n)])
    relay = Relay(store, bus.js, bus.subjects, telemetry, listen_dsn=settings.asyncpg_dsn,
                  listen_args=settings.database_connect_args, schema=settings.namespace)
    stop = asyncio.Event()
    task = asyncio.create_task(relay.run(stop))
    await eventually(lambda: (relay.position == stored[-1].position))
    # A later append is picked up through LISTEN/NOTIFY.
    late = await store.append("session:s99", [session_event(99)])
    await eventually(lambda: (relay.position == late[0].position))
    stop.set()
    await task

    # Run the same tail again from scratch, as a relay restarted before saving its position would:
    # JetStream drops the repeats by Nats-Msg-Id.
    relay2 = Relay(store, bus.js, bus.subjects, telemetry, listen_dsn=settings.asyncpg_dsn,
                   listen_args=settings.database_connect_args, schema=settings.namespace)
    conn = await asyncpg.connect(settings.asyncpg_dsn, server_settings={"search_path": settings.namespace},
                                 **settings.database_connect_args)
    assert await relay2.relay_once(conn) == 21
    await conn.close()

    info = await bus.js.stream_info(bus.subjects.events_stream)
    assert info.state.messages == 21
    msgs = await collect(bus, bus.subjects.all_events, 21)
    positions = [int(m.headers[h.POSITION]) for m in msgs]
    assert positions == sorted(positions) == [e.position for e in stored + late]
    assert msgs[0].headers[h.MSG_ID] == str(stored[0].id)
    assert Envelope.model_validate_json(msgs[0].data).payload["session_id"] == "s0"


async def test_poison_messages_go_to_dead_letter_and_the_consumer_keeps_going(bus, settings, telemetry):
    handled: list[str] = []

    async def handler(envelope, command):
        handled.append(command.instance_id)

    consumer = Consumer(
        bus.js, bus.subjects, stream=bus.subjects.commands_stream, durable="worker-w1",
        filter_subject=bus.subjects.worker_commands("w1"), registry=command_registry(), handler=handler, telemetry=telemetry,
    )
    subject = bus.subjects.worker_commands("w1")
    await bus.js.publish(subject, b"{not json", headers={h.MSG_ID: "p1"})
    unknown = probe().model_copy(update={"type": "LaunchMissiles"})
    await bus.js.publish(subject, unknown.model_dump_json().encode(), headers={h.MSG_ID: "p2"})
    invalid = probe().model_copy(update={"payload": {**probe().payload, "backend_type": "tgi"}})
    await bus.js.publish(subject, invalid.model_dump_json().encode(), headers={h.MSG_ID: "p3"})
    good = probe(n=7)
    await publish(bus.js, subject, good, telemetry)

    async with consuming(settings.nats_url, consumer):
        await eventually(lambda: handled == ["i7"])
        await eventually(lambda: consumer.stats.dead_lettered == 3)

    dead = await collect(bus, bus.subjects.dead_letter("worker-w1"), 3)
    dead.sort(key=lambda m: int(m.headers[h.DLQ_SEQUENCE]))  # in the order they were sent
    reasons = [m.headers[h.DLQ_REASON] for m in dead]
    assert "unparseable" in reasons[0]
    assert "unknown message type 'LaunchMissiles'" in reasons[1]
    assert "invalid ProbeInstance" in reasons[2] and "backend_type" in reasons[2]
    assert dead[0].data == b"{not json"  # the message itself is kept, untouched
    assert all(m.headers[h.DLQ_SUBJECT] == subject for m in dead)
    # Nothing is left pending for redelivery.
    info = await bus.js.consumer_info(bus.subjects.commands_stream, "worker-w1")
    assert info.num_ack_pending == 0 and info.num_pending == 0


async def test_failing_handler_is_retried_then_dead_lettered(bus, settings, telemetry):
    attempts = 0

    async def handler(envelope, command):
        nonlocal attempts
        attempts += 1
        raise RuntimeError("a bug in the handler")

    consumer = Consumer(
        bus.js, bus.subjects, stream=bus.subjects.commands_stream, durable="placement",
        filter_subject=bus.subjects.placement_commands, registry=command_registry(), handler=handler,
        telemetry=telemetry, max_deliver=3,
    )
    await publish(bus.js, bus.subjects.placement_commands, probe(), telemetry)
    async with consuming(settings.nats_url, consumer):
        await eventually(lambda: consumer.stats.dead_lettered == 1, timeout=20)
    assert attempts == 3
    dead = await collect(bus, bus.subjects.dead_letter("placement"), 1)
    assert "handler failed 3 times" in dead[0].headers[h.DLQ_REASON]


async def test_trace_context_travels_in_headers(bus, settings):
    produced, consumed = InMemorySpanExporter(), InMemorySpanExporter()
    producer = Telemetry("producer", span_exporter=produced)
    consumer_telemetry = Telemetry("consumer", span_exporter=consumed)
    with producer.span("send command") as span:
        trace_id = span.get_span_context().trace_id
        await publish(bus.js, bus.subjects.worker_commands("w1"), probe(), producer)

    seen = []

    async def handler(envelope, command):
        from opentelemetry import trace

        seen.append(trace.get_current_span().get_span_context().trace_id)

    consumer = Consumer(
        bus.js, bus.subjects, stream=bus.subjects.commands_stream, durable="worker-w1",
        filter_subject=bus.subjects.worker_commands("w1"), registry=command_registry(), handler=handler,
        telemetry=consumer_telemetry,
    )
    async with consuming(settings.nats_url, consumer):
        await eventually(lambda: len(seen) == 1)
    assert seen == [trace_id]
    producer.shutdown()
    consumer_telemetry.shutdown()
    (sent,) = produced.get_finished_spans()
    (handled,) = consumed.get_finished_spans()
    assert handled.name == "worker-w1 ProbeInstance" and handled.parent.span_id == sent.context.span_id


async def test_a_handler_waiting_for_its_database_is_retried_past_max_deliver_never_dead_lettered(bus, settings, telemetry):
    attempts = 0

    async def handler(envelope, command):
        nonlocal attempts
        attempts += 1
        if attempts <= 6:  # twice max_deliver: Postgres is away that long
            raise ConnectionRefusedError("connect call failed ('127.0.0.1', 5432)")

    consumer = Consumer(
        bus.js, bus.subjects, stream=bus.subjects.commands_stream, durable="placement",
        filter_subject=bus.subjects.placement_commands, registry=command_registry(), handler=handler,
        telemetry=telemetry, max_deliver=3,
    )
    await publish(bus.js, bus.subjects.placement_commands, probe(), telemetry)
    async with consuming(settings.nats_url, consumer):
        await eventually(lambda: consumer.stats.handled == 1, timeout=30)
    assert attempts == 7 and consumer.stats.dead_lettered == 0 and consumer.stats.retried == 6
    info = await bus.js.consumer_info(bus.subjects.commands_stream, "placement")
    assert info.num_ack_pending == 0 and info.num_pending == 0
