"""The worker over real engine processes (the simulator, speaking vLLM's and llama.cpp's HTTP API)."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from helpers import consuming, eventually
from services.worker.engines import EngineLauncher, EngineOptions
from services.worker.service import Worker
from shared.bus import subjects as h
from shared.bus.jetstream import Consumer
from shared.contracts.backends import BackendType, EngineKind
from shared.contracts.commands import DeleteInstance, DrainInstance, SleepInstance, StartInstance, WakeInstance, command_registry
from shared.contracts.messages import Envelope

V, F = BackendType.VLLM, BackendType.LLAMA_CPP


def start(iid: str, backend: BackendType = V, worker: str = "w1") -> StartInstance:
    return StartInstance(instance_id=iid, alias="qwen3-vl-2b", backend_type=backend, worker_id=worker,
                         engine=EngineKind.SIMULATOR, model_name="q", model_path="/m/q", gpu_memory_gb=12)


@pytest.fixture
async def worker(store, telemetry):
    w = Worker(worker_id="w1", store=store, telemetry=telemetry, gpu_memory_gb=80, slots=4,
               launcher=EngineLauncher(EngineOptions(sim_speedup=200.0)), health_timeout_s=60, drain_poll_s=0.05)
    await w.register([EngineKind.SIMULATOR])
    yield w
    await w.shutdown()


async def outcomes(store, iid: str) -> list[tuple[str, str]]:
    return [(e.payload["action"], e.payload["outcome"]) for e in await store.read_stream(f"instance:{iid}")
            if e.type == "InstanceCommandCompleted"]


async def states(store, iid: str) -> list[str]:
    return [e.payload["to_state"] for e in await store.read_stream(f"instance:{iid}") if e.type == "InstanceStateChanged"]


async def test_the_same_command_delivered_twice_has_one_effect(worker, store, bus, settings, telemetry):
    consumer = Consumer(bus.js, bus.subjects, stream=bus.subjects.commands_stream, durable="worker-w1",
                        filter_subject=bus.subjects.worker_commands("w1"), registry=command_registry(),
                        handler=worker.handle, telemetry=telemetry)
    command = Envelope.wrap(start("v1"))
    body = command.model_dump_json().encode()
    # Twice on the bus, past JetStream's de-duplication (as after its window, or a publisher's retry).
    for msg_id in ("first", "second"):
        await bus.js.publish(bus.subjects.worker_commands("w1"), body, headers={h.MSG_ID: msg_id})
    async with consuming(settings.nats_url, consumer):
        await eventually(lambda: consumer.stats.handled == 2)
        await eventually(lambda: outcomes(store, "v1"), timeout=30)
    # And once more straight into the handler, while the first is long finished.
    await worker.handle(command, start("v1"))

    assert await states(store, "v1") == ["STARTING", "RUNNING"]
    assert await outcomes(store, "v1") == [("start", "ok")]
    assert len([i for i in worker.instances.values() if i.process is not None]) == 1
    endpoint = worker.instances["v1"].endpoint
    async with httpx.AsyncClient() as client:
        models = (await client.get(f"{endpoint}/v1/models")).json()
    assert models["data"][0]["id"] == "qwen3-vl-2b"


async def test_two_copies_of_a_command_handled_at_once_have_one_effect(worker, store, monkeypatch):
    """A redelivery can overlap the first delivery (ack wait expired, batch handled concurrently)."""
    contains = store.contains

    async def slow_contains(event_id):  # widen the window between the check and the effect
        await asyncio.sleep(0.05)
        return await contains(event_id)

    monkeypatch.setattr(store, "contains", slow_contains)
    command = Envelope.wrap(start("v1"))
    await asyncio.gather(worker.handle(command, start("v1")), worker.handle(command, start("v1")))
    await eventually(lambda: outcomes(store, "v1"), timeout=30)
    assert await states(store, "v1") == ["STARTING", "RUNNING"]
    assert await outcomes(store, "v1") == [("start", "ok")]


async def test_lifecycle_over_the_engine_http_api(worker, store):
    await worker.handle(Envelope.wrap(start("v1")), start("v1"))
    await eventually(lambda: worker.instances["v1"].state.value == "RUNNING", timeout=30)
    endpoint = worker.instances["v1"].endpoint
    for level in (1, 2):
        cmd = SleepInstance(instance_id="v1", alias="qwen3-vl-2b", backend_type=V, worker_id="w1", level=level)
        await worker.handle(Envelope.wrap(cmd), cmd)
    async with httpx.AsyncClient() as client:
        assert (await client.get(f"{endpoint}/is_sleeping")).json() == {"is_sleeping": True}
        metrics = (await client.get(f"{endpoint}/metrics")).text
        assert re.search(r'vllm:engine_sleep_state\{[^}]*sleep_state="discard_all"\} 1', metrics), "not at level 2"
        wake = WakeInstance(instance_id="v1", alias="qwen3-vl-2b", backend_type=V, worker_id="w1")
        await worker.handle(Envelope.wrap(wake), wake)
        assert (await client.get(f"{endpoint}/is_sleeping")).json() == {"is_sleeping": False}
    drain = DrainInstance(instance_id="v1", alias="qwen3-vl-2b", backend_type=V, worker_id="w1", timeout_s=10)
    await worker.handle(Envelope.wrap(drain), drain)
    await eventually(lambda: outcomes_contains(store, "v1", ("drain", "ok")))
    delete = DeleteInstance(instance_id="v1", alias="qwen3-vl-2b", backend_type=V, worker_id="w1")
    await worker.handle(Envelope.wrap(delete), delete)

    assert await states(store, "v1") == ["STARTING", "RUNNING", "SLEEP_1", "SLEEP_2", "RUNNING", "DRAINING", "DELETING", "ABSENT"]
    assert "v1" not in worker.instances
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient() as client:
            await client.get(f"{endpoint}/health")


async def outcomes_contains(store, iid, item) -> bool:
    return item in await outcomes(store, iid)


async def test_unsupported_and_illegal_actions_are_answered_not_ignored(worker, store):
    await worker.handle(Envelope.wrap(start("f1", F)), start("f1", F))
    await eventually(lambda: worker.instances["f1"].state.value == "RUNNING", timeout=30)
    sleep = SleepInstance(instance_id="f1", alias="qwen3-vl-2b", backend_type=F, worker_id="w1", level=1)
    await worker.handle(Envelope.wrap(sleep), sleep)
    wake = WakeInstance(instance_id="v9", alias="qwen3-vl-2b", backend_type=V, worker_id="w1")
    await worker.handle(Envelope.wrap(wake), wake)
    again = start("f1", F)
    await worker.handle(Envelope.wrap(again), again)  # a second start of a running instance

    events = [e.payload for e in await store.read_stream("instance:f1") if e.type == "InstanceCommandCompleted"]
    sleep_outcome = next(p for p in events if p["action"] == "sleep")
    assert sleep_outcome["outcome"] == "unsupported" and "substitute: drain+delete" in sleep_outcome["detail"]
    start_outcomes = [p for p in events if p["action"] == "start"]
    assert [p["outcome"] for p in start_outcomes] == ["ok", "rejected"]
    assert "RUNNING -> STARTING" in start_outcomes[1]["detail"]
    (wake_outcome,) = [e.payload for e in await store.read_stream("instance:v9")]
    assert wake_outcome["outcome"] == "rejected" and "not on this worker" in wake_outcome["detail"]
    assert await states(store, "f1") == ["STARTING", "RUNNING"]  # neither touched the instance
