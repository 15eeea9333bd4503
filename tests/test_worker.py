"""The worker over real engine processes (the simulator, speaking vLLM's and llama.cpp's HTTP API;
once the real llama.cpp engine): commands, status reports, heartbeats, engines that die."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from datetime import datetime, timezone

import httpx
import pytest

from helpers import CLUSTER_KEY, consuming, eventually
from services.engines.simulated.config import EngineConfig
from services.worker.engines import EngineLauncher, EngineOptions, kill_leftover_engines, leftover_engines
from services.worker.main import command_consumer
from services.worker.service import Worker
from shared.bus import subjects as h
from shared.bus.jetstream import Consumer, publish
from shared.bus.telemetry import TelemetryBus
from shared.contracts.backends import BackendType, EngineKind, Role
from shared.contracts.commands import (
    DeleteInstance,
    DrainInstance,
    InstanceCommand,
    SleepInstance,
    StartInstance,
    WakeInstance,
    command_registry,
)
from shared.contracts.config import AliasConfig, BackendConfig
from shared.contracts.events import AliasConfigured, InstanceStateChanged, WorkerLost
from shared.contracts.messages import Envelope
from shared.contracts.states import InstanceState as S
from shared.internal_auth import sign

V, F = BackendType.VLLM, BackendType.LLAMA_CPP
SLOW_VLLM_START = "MODELPOOL_SIM_VLLM_STARTUP_S"


def start(iid: str, backend: BackendType = V, worker: str = "w1", engine: EngineKind = EngineKind.SIMULATOR,
          model_path: str = "/m/q", max_model_len: int | None = None, role: Role | None = None) -> StartInstance:
    return StartInstance(instance_id=iid, alias="qwen3-vl-2b", backend_type=backend, worker_id=worker, engine=engine,
                         model_name="q", model_path=model_path, gpu_memory_gb=12, max_model_len=max_model_len, role=role)


def sleep(iid: str, level: int) -> SleepInstance:
    return SleepInstance(instance_id=iid, alias="qwen3-vl-2b", backend_type=V, worker_id="w1", level=level)


def delete(iid: str, backend: BackendType = V) -> DeleteInstance:
    return DeleteInstance(instance_id=iid, alias="qwen3-vl-2b", backend_type=backend, worker_id="w1")


class Configurations:
    """Records the alias configuration each start asks for (its backend's, beside the others started), as the
    autoscaler records it before anything is placed: a worker starts nothing else (services/worker/allowed.py;
    its refusals are tested in tests/security)."""

    def __init__(self, store) -> None:
        self.store = store
        self.backends: dict[BackendType, BackendConfig] = {}
        self.lock = asyncio.Lock()  # concurrent starts: each recorded configuration holds every backend so far

    async def record(self, cmd: StartInstance) -> None:
        async with self.lock:
            self.backends[cmd.backend_type] = BackendConfig(
                model_name=cmd.model_name, model_path=cmd.model_path, gpu_memory_gb=cmd.gpu_memory_gb, max_replicas=4,
                engine=cmd.engine, engine_args=cmd.engine_args)
            config = AliasConfig(alias=cmd.alias, backends=dict(self.backends))
            await self.store.append(f"alias:{cmd.alias}", [Envelope.wrap(AliasConfigured(alias=cmd.alias, config=config))])


async def run(worker: Worker, command: InstanceCommand) -> None:
    await worker.handle(Envelope.wrap(command), command)


async def running(worker: Worker, command: StartInstance, timeout: float = 30) -> None:
    await run(worker, command)
    await eventually(lambda: worker.instances[command.instance_id].state is S.RUNNING, timeout=timeout)


@pytest.fixture
async def make_worker(store, telemetry, tmp_path):
    """Workers named w1 on this test's log; engines 200 times faster than real time unless asked otherwise."""
    made: list[Worker] = []

    async def make(sim_speedup: float = 200.0, hang_timeout_s: float = 10.0, marker: str = "", **options) -> Worker:
        launcher = EngineLauncher(EngineOptions(log_dir=tmp_path / "engines", sim_speedup=sim_speedup,
                                                cluster_secret=CLUSTER_KEY, **options), marker)
        w = Worker(worker_id="w1", store=store, telemetry=telemetry, gpu_memory_gb=80, slots=4, launcher=launcher,
                   health_timeout_s=60, hang_timeout_s=hang_timeout_s, drain_poll_s=0.05, report_interval_s=0.2)
        await w.register([EngineKind.SIMULATOR, EngineKind.LLAMA_CPP])
        handle, configurations = w.handle, Configurations(store)

        async def configured_then_handled(envelope: Envelope, command: InstanceCommand) -> None:
            if isinstance(command, StartInstance):
                await configurations.record(command)
            await handle(envelope, command)

        w.handle = configured_then_handled  # type: ignore[method-assign]
        made.append(w)
        return w

    yield make
    for w in made:
        await w.shutdown()


@pytest.fixture
async def worker(make_worker):
    return await make_worker()


async def outcomes(store, iid: str) -> list[tuple[str, str]]:
    return [(e.payload["action"], e.payload["outcome"]) for e in await store.read_stream(f"instance:{iid}")
            if e.type == "InstanceCommandCompleted"]


async def changes(store, iid: str) -> list[Envelope]:
    return [e for e in await store.read_stream(f"instance:{iid}") if e.type == "InstanceStateChanged"]


async def states(store, iid: str) -> list[str]:
    return [e.payload["to_state"] for e in await changes(store, iid)]


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
    assert all(e.payload["role"] is None for e in await changes(store, "v1"))
    assert await outcomes(store, "v1") == [("start", "ok")]
    assert len([i for i in worker.instances.values() if i.process is not None]) == 1
    endpoint = worker.instances["v1"].endpoint
    internal = worker.instances["v1"].process.internal_endpoint
    async with httpx.AsyncClient() as client:
        models = (await client.get(f"{endpoint}/v1/models")).json()
        assert (await client.get(f"{internal}/health")).status_code == 200  # the KV port, recorded apart
    assert models["data"][0]["id"] == "qwen3-vl-2b"
    running = (await changes(store, "v1"))[-1].payload
    assert running["internal_endpoint"] == internal != running["endpoint"]


async def test_an_instance_started_with_a_role_records_it_in_every_state_change(worker, store):
    command = start("d1", role=Role.DECODE)
    await worker.handle(Envelope.wrap(command), command)
    await eventually(lambda: outcomes(store, "d1"), timeout=30)
    assert [(e.payload["to_state"], e.payload["role"]) for e in await changes(store, "d1")] == [
        ("STARTING", "decode"), ("RUNNING", "decode")]


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
        # Its development endpoints answer the worker's signed calls, no one else's (services/engines/vllm_guard.py).
        for path in ("/sleep?level=1", "/wake_up", "/collective_rpc", "/reset_prefix_cache"):
            refused = await client.post(f"{endpoint}{path}", json={"method": "reload_weights"})
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "unsigned_internal_call", path
        assert (await client.get(f"{endpoint}/is_sleeping", headers=sign(CLUSTER_KEY, "GET", "/is_sleeping"))).json() \
            == {"is_sleeping": True}
        metrics = (await client.get(f"{endpoint}/metrics")).text
        assert re.search(r'vllm:engine_sleep_state\{[^}]*sleep_state="discard_all"\} 1', metrics), "not at level 2"
        wake = WakeInstance(instance_id="v1", alias="qwen3-vl-2b", backend_type=V, worker_id="w1")
        await worker.handle(Envelope.wrap(wake), wake)
        assert (await client.get(f"{endpoint}/is_sleeping", headers=sign(CLUSTER_KEY, "GET", "/is_sleeping"))).json() \
            == {"is_sleeping": False}
        # Woken from level 2 with its weights loaded again: it answers (a plain /wake_up would leave them empty).
        answer = await client.post(f"{endpoint}/v1/chat/completions", timeout=30, json={
            "model": "qwen3-vl-2b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] > 0
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


async def test_a_start_records_when_the_engine_answers_and_loads_its_model(make_worker, store):
    """llama.cpp answers 503 while it loads: the worker records it once; vLLM binds its port only once loaded."""
    worker = await make_worker(sim_speedup=1.0, sim_startup_s=1.0)
    await asyncio.gather(running(worker, start("f1", F)), running(worker, start("v1", V)))
    f1 = [e.type if e.type != "InstanceStateChanged" else e.payload["to_state"]
          for e in await store.read_stream("instance:f1") if e.type != "InstanceCommandCompleted"]
    assert f1 == ["STARTING", "InstanceLoading", "RUNNING"]
    assert "InstanceLoading" not in {e.type for e in await store.read_stream("instance:v1")}


async def test_a_drain_from_sleep_records_the_level_it_sleeps_at(worker, store):
    # The controller reads it: an instance drained from sleep has no KV left to hand over, and is deleted at once.
    await worker.handle(Envelope.wrap(start("v1")), start("v1"))
    await eventually(lambda: worker.instances["v1"].state.value == "RUNNING", timeout=30)
    for level in (1, 2):
        cmd = SleepInstance(instance_id="v1", alias="qwen3-vl-2b", backend_type=V, worker_id="w1", level=level)
        await worker.handle(Envelope.wrap(cmd), cmd)
    drain = DrainInstance(instance_id="v1", alias="qwen3-vl-2b", backend_type=V, worker_id="w1", timeout_s=10)
    await worker.handle(Envelope.wrap(drain), drain)
    await eventually(lambda: outcomes_contains(store, "v1", ("drain", "ok")))
    recorded = [(e.payload["to_state"], e.payload["sleep_level"]) for e in await changes(store, "v1")]
    assert recorded == [("STARTING", 0), ("RUNNING", 0), ("SLEEP_1", 1), ("SLEEP_2", 2), ("DRAINING", 2)]


async def outcomes_contains(store, iid, item, times: int = 1) -> bool:
    return (await outcomes(store, iid)).count(item) >= times


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


# ---------------------------------------------------------------------------- commands side by side


async def test_a_long_wake_holds_up_no_start_of_another_instance(worker, store, bus, settings, telemetry, monkeypatch):
    # Only the simulated vLLM wakes slowly: 1200 simulated seconds, 6 s at this speed-up.
    monkeypatch.setenv("MODELPOOL_SIM_VLLM_WAKE_L1_S", "1200")
    await running(worker, start("a"))
    await run(worker, sleep("a", 1))
    wake = WakeInstance(instance_id="a", alias="qwen3-vl-2b", backend_type=V, worker_id="w1")
    # The wake is sent first; the next sleep of `a` must wait for it (before it, it would be
    # refused as SLEEP_1 -> SLEEP_1), the start of `b` must not.
    for command in (wake, start("b", F), sleep("a", 1)):
        await publish(bus.js, bus.subjects.worker_commands("w1"), Envelope.wrap(command), telemetry)
    consumer = command_consumer(worker, bus.js, bus.subjects, command_registry(), telemetry)
    try:
        async with consuming(settings.nats_url, consumer):
            await eventually(lambda: outcomes_contains(store, "a", ("sleep", "ok"), times=2), timeout=60)
    finally:
        await consumer.stop()

    assert await states(store, "a") == ["STARTING", "RUNNING", "SLEEP_1", "RUNNING", "SLEEP_1"]
    assert await outcomes(store, "a") == [("start", "ok"), ("sleep", "ok"), ("wake", "ok"), ("sleep", "ok")]
    a_awake = (await changes(store, "a"))[3].occurred_at
    b_running = next(e for e in await changes(store, "b") if e.payload["to_state"] == "RUNNING").occurred_at
    assert b_running < a_awake, f"b ran at {b_running}, only after a's wake ended at {a_awake}"


async def states_end(store, iid: str, state: str) -> bool:
    found = await states(store, iid)
    return bool(found) and found[-1] == state


async def test_a_delete_cancels_a_start_in_progress(worker, store, monkeypatch):
    monkeypatch.setenv(SLOW_VLLM_START, "20000")  # 100 s at this speed-up
    await run(worker, start("v1"))
    process = worker.instances["v1"].process
    assert process is not None and process.alive
    await run(worker, delete("v1"))

    assert not process.alive and "v1" not in worker.instances
    await asyncio.sleep(1.0)  # room for the background start to record anything, which it must not
    assert await states(store, "v1") == ["STARTING", "DELETING", "ABSENT"]
    assert await outcomes(store, "v1") == [("delete", "ok")]


# ---------------------------------------------------------------------------- status from the engines


async def busy(worker: Worker, iid: str):
    status = await worker.status_of(worker.instances[iid])
    return status if status.inflight_requests >= 1 and status.decode_tokens_per_s else None


@pytest.mark.parametrize("backend", [V, F])
async def test_status_is_read_from_the_engines_own_api_with_its_capacity(make_worker, backend):
    # Slow enough that one long answer is seen in flight: 20 times real time.
    worker = await make_worker(sim_speedup=20.0, sim_startup_s=2.0)
    await running(worker, start("i1", backend, max_model_len=4096))
    inst = worker.instances["i1"]
    config = EngineConfig.resolve(backend.value, env={}, max_model_len=4096)
    # vLLM: full-length requests its KV cache holds; llama.cpp: its slots.
    capacity = config.num_gpu_blocks * config.block_size // 4096 if backend is V else config.max_num_seqs
    assert capacity > 1

    assert (await changes(worker.store, "i1"))[-1].payload["capacity"] == capacity  # recorded with RUNNING
    idle = await worker.status_of(inst)
    assert (idle.status, idle.backend_type, idle.capacity, idle.inflight_requests) == (S.RUNNING, backend, capacity, 0)
    assert idle.healthy and idle.error is None and idle.last_active_at is None and idle.kv_usage == 0

    body = {"model": "qwen3-vl-2b", "messages": [{"role": "user", "content": "tell me a long story"}]}
    async with httpx.AsyncClient(base_url=inst.endpoint, timeout=60) as client:
        long = asyncio.create_task(client.post("/v1/chat/completions", json={**body, "max_tokens": 2000, "ignore_eos": True}))
        during = await eventually(lambda: busy(worker, "i1"), timeout=20)
        assert (await long).status_code == 200
        for _ in range(3):
            assert (await client.post("/v1/chat/completions", json={**body, "max_tokens": 8})).status_code == 200
    after = await worker.status_of(inst)

    assert during.kv_usage > 0 and during.last_active_at is not None
    assert after.inflight_requests == 0 and after.kv_usage == 0 and after.last_active_at >= during.last_active_at
    if backend is V:
        assert 0 < after.ttft_p95_s <= after.e2e_p95_s
        await run(worker, sleep("i1", 1))
        asleep = await worker.status_of(inst)
        assert (asleep.status, asleep.sleep_level, asleep.capacity, asleep.healthy) == (S.SLEEP_1, 1, capacity, True)
    else:  # llama-server, which this profile mimics, has no latency histograms
        assert after.ttft_p95_s is None and after.e2e_p95_s is None


async def test_status_of_the_real_llamacpp_engine_counts_its_sequence_slots(make_worker):
    worker = await make_worker(llama_threads=1)
    await running(worker, start("f1", F, engine=EngineKind.LLAMA_CPP, model_path="default"), timeout=120)
    inst = worker.instances["f1"]
    async with httpx.AsyncClient(base_url=inst.endpoint, timeout=60) as client:
        answer = await client.post("/v1/chat/completions", json={
            "model": "qwen3-vl-2b", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8})
    assert answer.status_code == 200 and answer.headers["x-modelpool-engine"] == "llama.cpp"

    status = await worker.status_of(inst)
    assert (status.status, status.engine, status.capacity, status.healthy) == (S.RUNNING, EngineKind.LLAMA_CPP, 8, True)
    assert status.inflight_requests == 0 and status.last_active_at is not None
    assert status.ttft_p95_s is not None and status.ttft_p95_s > 0 and status.e2e_p95_s is None


async def test_status_of_the_real_llama_server_counts_its_slots_from_its_own_api(make_worker):
    """llama.cpp's C++ server, as the worker runs it: capacity from `/slots`, load from its `llamacpp:` metrics."""
    worker = await make_worker(llama_threads=1)
    spec = start("s1", F, engine=EngineKind.LLAMA_SERVER, model_path="default")
    await running(worker, spec.model_copy(update={"engine_args": {"parallel": 3, "ctx-size": 3072}}), timeout=120)
    inst = worker.instances["s1"]
    assert inst.process is not None and inst.process.internal_endpoint  # its slot files move sessions' KV
    async with httpx.AsyncClient(base_url=inst.endpoint, timeout=60) as client:
        answer = await client.post("/v1/chat/completions", json={
            "model": "qwen3-vl-2b", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8})
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] > 0

    status = await worker.status_of(inst)
    assert (status.status, status.engine, status.capacity, status.healthy) == (S.RUNNING, EngineKind.LLAMA_SERVER, 3, True)
    assert status.inflight_requests == 0 and status.last_active_at is not None
    assert status.ttft_p95_s is None  # llama-server keeps no latency histograms


async def test_heartbeats_reach_the_bucket_with_every_instance(make_worker, bus, monkeypatch):
    worker = await make_worker()
    telemetry_bus = TelemetryBus(bus.nc, bus.js, bus.subjects)
    await telemetry_bus.ensure()
    monkeypatch.setenv(SLOW_VLLM_START, "20000")
    await run(worker, start("starting"))
    monkeypatch.delenv(SLOW_VLLM_START)
    await running(worker, start("sleeping"))
    await run(worker, sleep("sleeping", 1))
    await run(worker, sleep("sleeping", 2))
    await running(worker, start("fast", F))

    stop = asyncio.Event()
    sending = asyncio.create_task(worker.send_heartbeats(telemetry_bus, stop))
    try:
        first = await eventually(lambda: heartbeat_of(telemetry_bus, "w1"), timeout=10)
        later = await eventually(lambda: heartbeat_of(telemetry_bus, "w1", after=first.at), timeout=10)
    finally:
        stop.set()
        await sending

    assert later.interval_s == 0.2 and (later.at - first.at).total_seconds() < 2
    assert later.at <= datetime.now(timezone.utc)
    by_id = {status.instance_id: status for status in later.instances}
    assert set(by_id) == {"starting", "sleeping", "fast"}
    assert by_id["starting"].status is S.STARTING and by_id["starting"].capacity is None
    assert (by_id["sleeping"].status, by_id["sleeping"].sleep_level, by_id["sleeping"].healthy) == (S.SLEEP_2, 2, True)
    assert by_id["sleeping"].capacity and by_id["sleeping"].capacity > 0
    assert (by_id["fast"].status, by_id["fast"].capacity, by_id["fast"].healthy) == (S.RUNNING, 4, True)


async def heartbeat_of(telemetry_bus: TelemetryBus, worker_id: str, after: datetime | None = None):
    heartbeat = (await telemetry_bus.heartbeats()).get(worker_id)
    return heartbeat if heartbeat and (after is None or heartbeat.at > after) else None


async def test_load_appends_no_events(make_worker, store):
    worker = await make_worker(sim_speedup=20.0, sim_startup_s=2.0)
    await running(worker, start("f1", F))
    recorded = await store.stream_version("instance:f1")
    body = {"model": "qwen3-vl-2b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=worker.instances["f1"].endpoint, timeout=60) as client:
        load = [asyncio.create_task(client.post("/v1/chat/completions", json=body)) for _ in range(6)]
        seen = await eventually(lambda: busy(worker, "f1"), timeout=20)
        for _ in range(5):  # status reports while the load comes and goes
            await worker.heartbeat()
        assert all(r.status_code == 200 for r in await asyncio.gather(*load))
    await worker.heartbeat()

    assert seen.inflight_requests >= 1
    assert await store.stream_version("instance:f1") == recorded
    assert "InstanceLoadReported" not in {e.type for e in await store.read_stream("instance:f1")}


# ---------------------------------------------------------------------------- engines that die


async def test_an_engine_killed_while_running_is_recorded_as_error_with_exit_code_and_output(worker, store):
    await running(worker, start("v1"))
    process = worker.instances["v1"].process
    killed_at = time.time()
    os.kill(process.process.pid, signal.SIGKILL)

    await eventually(lambda: states_end(store, "v1", "ERROR"), timeout=5)
    error = (await changes(store, "v1"))[-1]
    assert error.occurred_at.timestamp() - killed_at < 3
    assert error.payload["from_state"] == "RUNNING" and error.payload["exit_code"] == -signal.SIGKILL
    assert "engine exited with code -9" in error.payload["reason"]
    assert "SIMULATED vllm engine" in error.payload["log_tail"]  # the engine's own start-up line
    status = await worker.status_of(worker.instances["v1"])
    assert status.status is S.ERROR and not status.healthy and "code -9" in status.error


async def test_a_sleeping_engine_that_dies_is_recorded_on_to_absent(worker, store):
    await running(worker, start("v1"))
    await run(worker, sleep("v1", 1))
    os.kill(worker.instances["v1"].process.process.pid, signal.SIGKILL)

    await eventually(lambda: states_end(store, "v1", "ABSENT"), timeout=5)
    assert await states(store, "v1") == ["STARTING", "RUNNING", "SLEEP_1", "DELETING", "ABSENT"]
    for change in (await changes(store, "v1"))[-2:]:
        assert change.payload["exit_code"] == -signal.SIGKILL and "SIMULATED vllm" in change.payload["log_tail"]
    assert "v1" not in worker.instances


async def test_a_start_that_fails_is_recorded_with_the_engines_exit_code_and_output(worker, store, monkeypatch):
    monkeypatch.setenv("MODELPOOL_SIM_VLLM_FAIL_START", "1")
    await run(worker, start("v1"))
    await eventually(lambda: states_end(store, "v1", "ERROR"), timeout=30)

    error = (await changes(store, "v1"))[-1].payload
    assert error["from_state"] == "STARTING" and error["exit_code"] == 1
    assert "engine exited with code 1 while starting" in error["reason"]
    assert error["log_tail"].splitlines()[-1].endswith("was told to fail its start (fail_start); exiting with code 1")
    assert await outcomes(store, "v1") == [("start", "failed")]


# --------------------------------------------------------------------------- faults the worker outlives


async def test_an_engine_death_seen_while_the_log_is_away_is_recorded_once_it_is_back(worker, store, monkeypatch):
    await running(worker, start("v1"))
    real_append, refused = store.append, []

    async def away(*args, **kwargs):  # Postgres is down for the next five appends
        if len(refused) < 5:
            refused.append(1)
            raise ConnectionRefusedError("connect call failed")
        return await real_append(*args, **kwargs)

    monkeypatch.setattr(store, "append", away)
    os.kill(worker.instances["v1"].process.process.pid, signal.SIGKILL)
    await eventually(lambda: states_end(store, "v1", "ERROR"), timeout=30)
    assert len(refused) == 5 and await states(store, "v1") == ["STARTING", "RUNNING", "ERROR"]


async def test_a_hung_engine_is_recorded_error_with_the_reason_and_killed(make_worker, store):
    worker = await make_worker(hang_timeout_s=1.5)
    await running(worker, start("v1"))
    process = worker.instances["v1"].process
    stopped_at = time.monotonic()
    os.kill(process.process.pid, signal.SIGSTOP)  # alive, answering nothing
    await eventually(lambda: states_end(store, "v1", "ERROR"), timeout=15)
    assert time.monotonic() - stopped_at < 1.5 + 4
    error = (await changes(store, "v1"))[-1].payload
    assert "engine hung: no answer from /health" in error["reason"] and error["exit_code"] == -signal.SIGKILL
    await eventually(lambda: process.process.returncode is not None, timeout=5)


async def test_a_worker_recorded_lost_registers_again_and_gives_its_instances_up(worker, store):
    await running(worker, start("v1"))
    engine = worker.instances["v1"].process
    # What the controller records for a worker it stopped hearing from (cut off from the bus, say).
    await store.append("worker:w1", [Envelope.wrap(WorkerLost(worker_id="w1", reason="no heartbeat for 12 s"))])
    await store.append("instance:v1", [Envelope.wrap(InstanceStateChanged(
        instance_id="v1", alias="qwen3-vl-2b", backend_type=V, engine=EngineKind.SIMULATOR, worker_id="w1",
        from_state=S.RUNNING, to_state=S.ERROR, reason="worker w1 lost (no heartbeat for 12 s)"))])
    stop = asyncio.Event()
    keeping = asyncio.create_task(worker.keep_registered([EngineKind.SIMULATOR], stop, every_s=0.1))

    async def registered_again() -> bool:
        return (await store.last_of("worker:w1")).type == "WorkerRegistered"

    await eventually(registered_again, timeout=10)
    stop.set()
    await keeping
    assert worker.instances["v1"].state is S.ERROR and worker.instances["v1"].process is None
    assert not engine.alive  # its engine given up with it: the controller replaces the instance
    await run(worker, delete("v1"))  # and releases it, as for any failed instance
    assert await states(store, "v1") == ["STARTING", "RUNNING", "ERROR", "DELETING", "ABSENT"]


async def test_engines_left_by_an_earlier_life_of_the_worker_are_found_by_their_mark_and_killed(make_worker):
    worker = await make_worker(marker="ns/w1")
    await running(worker, start("v1"))
    engine = worker.instances["v1"].process.process
    os.kill(engine.pid, signal.SIGSTOP)  # one that would not even heed its parent-death signal
    assert leftover_engines("ns/w2") == [] and leftover_engines("ns/w1") == [engine.pid]
    assert kill_leftover_engines("ns/w1") == [engine.pid]
    assert await asyncio.wait_for(engine.wait(), 5) == -signal.SIGKILL
