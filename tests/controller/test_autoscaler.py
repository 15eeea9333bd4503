"""The autoscaler adapter on the real Postgres and NATS: record, apply, resend, verify."""

from __future__ import annotations

import asyncio
import os
import uuid
import subprocess
import sys
from datetime import datetime, timezone

import pytest
from helpers import eventually, fetch
from sqlalchemy import text

from policy.hybrid import HybridPolicy
from services.autoscaler.controller import Controller
from services.ops.verify import verify_decisions
from services.placement.service import Placement
from shared.bus import subjects as h
from shared.bus.telemetry import TelemetryBus
from shared.contracts.backends import Action, BackendType, EngineKind
from shared.contracts.states import InstanceState, RoutingState
from shared.projections.rows import InstanceRow
from shared.contracts.commands import PlaceInstance, StartInstance
from shared.configuration import load_pool_config
from shared.contracts.events import (OperatorAction, OperatorCommanded, PolicyDecided, WorkerRegistered, event_registry,
                                     operator_event_id)
from shared.contracts.messages import Envelope
from shared.contracts.telemetry import DemandSignal, WorkerHeartbeat
from shared.eventlog.lease import AdvisoryLease
from shared.projections.readmodels import CONTROL, ROUTING

POOL = """
aliases:
  - alias: tiny
    backends:
      llama.cpp: {model_name: tiny, model_path: default, gpu_memory_gb: 0, min_replicas: 0, max_replicas: 2, engine: simulator}
      vllm: {model_name: tiny, model_path: /m, gpu_memory_gb: 12, max_replicas: 1, max_model_len: 4096, engine: simulator}
"""


class FlakyJetStream:
    """JetStream whose first `fail` publishes to `subject` are lost on the way (the process died, say)."""

    def __init__(self, js, subject: str, fail: int = 1) -> None:
        self.js, self.subject, self.fail = js, subject, fail

    def __getattr__(self, name):
        return getattr(self.js, name)

    async def publish(self, subject, payload, **kwargs):
        if subject == self.subject and self.fail > 0:
            self.fail -= 1
            raise ConnectionError("lost on the way")
        return await self.js.publish(subject, payload, **kwargs)


@pytest.fixture
async def pool_file(tmp_path):
    path = tmp_path / "pool.yaml"
    path.write_text(POOL)
    return path


@pytest.fixture
async def telemetry_bus(bus):
    tb = TelemetryBus(bus.nc, bus.js, bus.subjects)
    await tb.ensure()
    return tb


def controller(store, bus, settings, telemetry, telemetry_bus, pool_file, js=None, **kwargs) -> Controller:
    return Controller(
        store=store, engine=store.engine, js=js or bus.js, subjects=bus.subjects, telemetry=telemetry,
        telemetry_bus=telemetry_bus, lease=AdvisoryLease(settings.asyncpg_dsn, settings.namespace, "autoscaler"),
        pool=load_pool_config(pool_file, environ={}), tick_s=kwargs.pop("tick_s", 30.0),
        worker_timeout_s=kwargs.pop("worker_timeout_s", 10.0), **kwargs,
    )


async def placement_queue(bus):
    """The placement command queue, read as placement would (a work queue takes one consumer per subject)."""
    return await bus.js.pull_subscribe(bus.subjects.placement_commands, durable=None, stream=bus.subjects.commands_stream)


async def running(c: Controller, stop: asyncio.Event) -> asyncio.Task:
    task = asyncio.create_task(c.run(stop))
    await eventually(lambda: c.ticks >= 1, timeout=20)
    return task


async def test_demand_on_a_cold_alias_is_decided_at_once_recorded_with_its_inputs_and_placed(
        store, bus, settings, telemetry, telemetry_bus, pool_file):
    c = controller(store, bus, settings, telemetry, telemetry_bus, pool_file, tick_s=60.0)
    stop = asyncio.Event()
    task = await running(c, stop)
    loop = asyncio.get_running_loop()
    sent = loop.time()
    await telemetry_bus.publish_demand(DemandSignal(gateway_id="g1", alias="tiny", held=3, at=datetime.now(timezone.utc)))
    await eventually(lambda: c.ticks >= 2, timeout=10)
    assert loop.time() - sent < 2.0  # not the next 60 s tick
    (msg,) = await fetch(await placement_queue(bus), 1)
    stop.set()
    await task

    decided = [e for e in await store.history("tiny") if e.type == PolicyDecided.TYPE]
    cold = decided[-1].payload
    assert cold["decision"]["routing"]["to_state"] == "FAST_ONLY"
    assert cold["snapshot"]["demand"] == 3 and cold["snapshot"]["routing_state"] == "COLD"
    assert cold["policy"] == "hybrid" and cold["policy_version"] == HybridPolicy.version
    (start,) = cold["decision"]["actions"]
    place = PlaceInstance.model_validate(Envelope.model_validate_json(msg.data).payload)
    assert str(place.request_id) == start["command_id"] == msg.headers[h.MSG_ID]
    assert place.instance_id == start["instance_id"] and place.engine is EngineKind.SIMULATOR
    routing = [e for e in await store.history("tiny") if e.type == "RoutingStateChanged"]
    assert routing[-1].causation_id == decided[-1].id  # the switch names the decision that made it

    checked, mismatches = await verify_decisions(store, event_registry())
    assert checked == len(decided) >= 2 and mismatches == []


async def test_a_command_lost_between_record_and_publish_is_sent_again_once_and_a_duplicate_has_one_effect(
        store, bus, settings, telemetry, telemetry_bus, pool_file):
    flaky = FlakyJetStream(bus.js, bus.subjects.placement_commands)
    c = controller(store, bus, settings, telemetry, telemetry_bus, pool_file, js=flaky, tick_s=0.3, resend_after_s=1.0)
    stop = asyncio.Event()
    task = await running(c, stop)
    await telemetry_bus.publish_demand(DemandSignal(gateway_id="g1", alias="tiny", held=1, at=datetime.now(timezone.utc)))
    await eventually(lambda: flaky.fail == 0, timeout=10)  # the first send was lost
    queue = await placement_queue(bus)
    (msg,) = await fetch(queue, 1, timeout=10)  # ...and sent again by a later tick
    await asyncio.sleep(1.5)  # more ticks: the copy resent while it waited was dropped by its id
    assert len(await fetch(queue, 2, timeout=1)) == 0
    stop.set()
    await task
    envelope = Envelope.model_validate_json(msg.data)
    (decision,) = [e for e in await store.history("tiny") if e.type == PolicyDecided.TYPE
                   and e.payload["decision"]["actions"]]
    assert str(envelope.id) == decision.payload["decision"]["actions"][0]["command_id"]

    # A duplicate (redelivered after JetStream's window, say) reaches placement twice: one decision, one start.
    await store.append("worker:w1", [Envelope.wrap(WorkerRegistered(worker_id="w1", host="h", gpu_memory_gb=24, slots=4,
                                                                    engines=[EngineKind.SIMULATOR]))])
    placement = Placement(store, bus.js, bus.subjects, telemetry)
    command = PlaceInstance.model_validate(envelope.payload)
    await placement.handle(envelope, command)
    await placement.handle(envelope, command)
    decided = [e for e in await store.history("tiny") if e.type == "PlacementDecided"]
    assert len(decided) == 1
    sub = await bus.js.pull_subscribe(bus.subjects.worker_commands("w1"), durable=None, stream=bus.subjects.commands_stream)
    starts = await sub.fetch(5, timeout=1)
    assert len(starts) == 1 and StartInstance.model_validate(Envelope.model_validate_json(starts[0].data).payload)


async def test_verify_decisions_passes_on_a_real_run_and_fails_after_tampering(
        store, bus, settings, telemetry, telemetry_bus, pool_file, migrated):
    c = controller(store, bus, settings, telemetry, telemetry_bus, pool_file, tick_s=0.2)
    stop = asyncio.Event()
    task = await running(c, stop)
    await telemetry_bus.publish_demand(DemandSignal(gateway_id="g1", alias="tiny", held=2, at=datetime.now(timezone.utc)))
    await eventually(lambda: "tiny" in c.view[ROUTING] and c.view[ROUTING]["tiny"].state is RoutingState.FAST_ONLY,
                     timeout=10)
    stop.set()
    await task
    env = {**os.environ, "DATABASE_URL": settings.database_url, "NATS_URL": settings.nats_url,
           "MODELPOOL_NAMESPACE": settings.namespace}
    command = [sys.executable, "-m", "services.cli", "replay", "--verify-decisions"]
    ok = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert "verified" in ok.stdout

    async with store.engine.begin() as conn:  # what an intruder with the database's keys could do
        await conn.execute(text("ALTER TABLE events DISABLE TRIGGER events_append_only"))
        await conn.execute(text(
            "UPDATE events SET payload = jsonb_set(payload, '{decision,targets,llama.cpp}', '2')"
            " WHERE type = 'PolicyDecided' AND payload->'decision'->'routing'->>'to_state' = 'FAST_ONLY'"))
        await conn.execute(text("ALTER TABLE events ENABLE TRIGGER events_append_only"))
    tampered = subprocess.run(command + ["tiny"], env=env, capture_output=True, text=True, timeout=60)
    assert tampered.returncode == 1
    assert "decision.targets.llama.cpp: recorded 2, code says 1" in tampered.stderr


async def test_the_control_view_counts_the_alias_stream_and_tracks_commands_until_their_outcome(
        store, bus, settings, telemetry, telemetry_bus, pool_file):
    c = controller(store, bus, settings, telemetry, telemetry_bus, pool_file, tick_s=0.2)
    stop = asyncio.Event()
    task = await running(c, stop)
    await telemetry_bus.publish_demand(DemandSignal(gateway_id="g1", alias="tiny", held=2, at=datetime.now(timezone.utc)))
    await eventually(lambda: "tiny" in c.view[CONTROL] and c.view[CONTROL]["tiny"].pending, timeout=10)
    stop.set()
    await task
    row = c.view[CONTROL]["tiny"]
    assert row.version == await store.stream_version("alias:tiny")
    (pending,) = row.pending.values()
    assert pending.action is Action.START and pending.acked is False


def operator_sleep(command_id: uuid.UUID, instance_id: str) -> Envelope:
    """An operator's sleep as the gateway records it: the command's id and the instance's worker; nothing sent."""
    return Envelope.wrap(OperatorCommanded(
        alias="tiny", action=OperatorAction.SLEEP, operator="ops-dana", reason="free the GPU", instance_id=instance_id,
        backend_type=BackendType.VLLM, level=1, command_id=command_id, worker_id="w1"), id=operator_event_id(command_id))


async def test_an_operator_action_recorded_in_the_log_is_sent_by_the_autoscaler_once_across_a_restart(
        store, bus, settings, telemetry, telemetry_bus, pool_file):
    queue = await bus.js.pull_subscribe(bus.subjects.worker_commands("w1"), durable=None,
                                        stream=bus.subjects.commands_stream)
    # Recorded while no autoscaler ran: the first one to lead sends it, the event its cause.
    first = uuid.uuid4()
    (cause,) = await store.append("alias:tiny", [operator_sleep(first, "tiny-slow-1")])
    c = controller(store, bus, settings, telemetry, telemetry_bus, pool_file, tick_s=60.0)
    stop = asyncio.Event()
    task = await running(c, stop)
    (msg,) = await fetch(queue, 1, timeout=10)
    envelope = Envelope.model_validate_json(msg.data)
    assert (envelope.type, envelope.id, envelope.causation_id) == ("SleepInstance", first, cause.id)
    assert envelope.payload["reason"] == "operator ops-dana: free the GPU" and envelope.payload["level"] == 1
    assert envelope.payload["instance_id"] == "tiny-slow-1" and msg.headers[h.MSG_ID] == str(first)
    assert c.view[CONTROL]["tiny"].pending[str(first)].operator == "ops-dana: free the GPU"  # in flight

    # One recorded while it leads is sent as soon as the relay announces it, not at the next (60 s) tick.
    second = uuid.uuid4()
    (stored,) = await store.append("alias:tiny", [operator_sleep(second, "tiny-slow-2")])
    await bus.nc.publish(bus.subjects.event(stored.stream_id, stored.type), stored.model_dump_json().encode())
    (msg,) = await fetch(queue, 1, timeout=5)
    assert Envelope.model_validate_json(msg.data).id == second
    stop.set()
    await task

    # A new leader (a restart) sends both again, as neither has an outcome in the log: their worker gets each
    # once (JetStream drops a copy by its id; past its window the worker's markers would).
    again = controller(store, bus, settings, telemetry, telemetry_bus, pool_file, tick_s=0.3)
    stop = asyncio.Event()
    task = await running(again, stop)
    await eventually(lambda: again.ticks >= 3, timeout=10)
    stop.set()
    await task
    assert {str(first), str(second)} <= {str(cid) for cid in again.sent_at}
    assert await fetch(queue, 2, timeout=1) == []


HETERO = """
aliases:
  - alias: pd
    backends:
      vllm: {model_name: pd, model_path: /m, gpu_memory_gb: 12, max_replicas: 8, max_model_len: 4096, engine: simulator}
    autoscaling_policy: {name: heteroscale, min_instances: 0}
"""


async def test_a_heteroscale_alias_places_prefill_and_decode_instances_and_reads_their_roles_back(
        store, bus, settings, telemetry, telemetry_bus, tmp_path):
    from shared.projections.snapshot import instance_view
    from shared.contracts.backends import Role

    path = tmp_path / "pool.yaml"
    path.write_text(HETERO)
    c = controller(store, bus, settings, telemetry, telemetry_bus, path, tick_s=60.0)
    stop = asyncio.Event()
    task = await running(c, stop)
    await telemetry_bus.publish_demand(DemandSignal(gateway_id="g1", alias="pd", held=2, at=datetime.now(timezone.utc)))
    await eventually(lambda: c.ticks >= 2, timeout=10)
    placed = [PlaceInstance.model_validate(Envelope.model_validate_json(m.data).payload)
              for m in await fetch(await placement_queue(bus), 2)]
    stop.set()
    await task
    assert sorted(p.role.value for p in placed) == ["decode", "prefill"]
    decided = [e for e in await store.history("pd") if e.type == PolicyDecided.TYPE][-1].payload
    assert decided["policy"] == "heteroscale" and decided["decision"]["roles"] == {"prefill": 1, "decode": 1}
    row = InstanceRow(placed[0].instance_id, "pd", BackendType.VLLM, EngineKind.SIMULATOR, "w1", InstanceState.RUNNING,
                      0, 0, None, None, None, placed[0].role, "started", datetime.now(timezone.utc))
    assert instance_view(row, None, True, True, None).role is Role(placed[0].role.value)


async def test_silence_heard_over_a_bus_that_is_away_or_just_back_is_no_death(
        store, bus, settings, telemetry, telemetry_bus, pool_file):
    await store.append("worker:w9", [Envelope.wrap(WorkerRegistered(worker_id="w9", host="h", gpu_memory_gb=24, slots=4,
                                                                    engines=[EngineKind.SIMULATOR]))])
    link = {"up_for_s": 0.0}  # this controller's own NATS link: down, or back a moment ago
    c = controller(store, bus, settings, telemetry, telemetry_bus, pool_file, tick_s=0.2, worker_timeout_s=1.0,
                   bus_up_for_s=lambda: link["up_for_s"])
    stop = asyncio.Event()
    task = await running(c, stop)

    async def lost() -> list:
        return [e for e in await store.read_stream("worker:w9") if e.type == "WorkerLost"]

    await asyncio.sleep(3.0)  # w9 has been silent for three timeouts, but so has the bus
    assert await lost() == []
    link["up_for_s"] = 0.9
    await asyncio.sleep(1.0)
    assert await lost() == []  # back for less than one timeout: not heard from yet is not dead
    link["up_for_s"] = 2.0
    await asyncio.sleep(1.0)
    # Back for two timeouts, but w9 has been silent since before: a silence this controller shared, judged after
    # three (each client finds a paused or restarted server again at its own moment).
    assert await lost() == []
    link["up_for_s"] = 5.0
    (recorded,) = await eventually(lost, timeout=5)
    stop.set()
    await task
    assert "no heartbeat" in recorded.payload["reason"]


async def test_a_silence_several_workers_share_is_judged_only_after_three_timeouts(
        store, bus, settings, telemetry, telemetry_bus, pool_file):
    """Several workers silent at once is likelier the bus (a NATS server of a cluster lost: the workers it served
    reconnect elsewhere while the heartbeat bucket elects a leader) than all of them dead: they are given three
    timeouts, while the worker still heard stays up."""
    for worker in ("w7", "w8", "w9"):
        await store.append(f"worker:{worker}", [Envelope.wrap(WorkerRegistered(
            worker_id=worker, host="h", gpu_memory_gb=24, slots=4, engines=[EngineKind.SIMULATOR]))])
    c = controller(store, bus, settings, telemetry, telemetry_bus, pool_file, tick_s=0.2, worker_timeout_s=1.0,
                   bus_up_for_s=lambda: 100.0)
    stop = asyncio.Event()

    async def w7_beats() -> None:  # the worker whose NATS server stayed up
        while not stop.is_set():
            await telemetry_bus.put_heartbeat(WorkerHeartbeat(worker_id="w7", at=datetime.now(timezone.utc),
                                                              interval_s=0.2))
            await asyncio.sleep(0.2)
    beating = asyncio.create_task(w7_beats())
    task = await running(c, stop)

    async def lost() -> set[str]:
        return {w for w in ("w7", "w8", "w9")
                if any(e.type == "WorkerLost" for e in await store.read_stream(f"worker:{w}"))}

    await asyncio.sleep(2.2)  # w8 and w9 silent past two timeouts (the first of them the new leader's grace)
    assert await lost() == set()

    async def both() -> bool:
        return await lost() == {"w8", "w9"}

    await eventually(both, timeout=5)
    stop.set()
    await task
    await beating
