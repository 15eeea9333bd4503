"""Read models: projector, rebuild equality, and the audit commands (replay, history, status)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone

from sqlalchemy import text

from shared.contracts.backends import BackendType, EngineKind
from shared.contracts.config import AliasConfig
from shared.contracts.events import (
    AliasConfigured,
    InstanceLoadReported,
    InstanceStateChanged,
    MetricWindow,
    MixWeightChanged,
    RoutingStateChanged,
    ScalingTargetsChanged,
    SessionBound,
    SessionMigrated,
    SessionReleased,
    WorkerLost,
    WorkerRegistered,
)
from shared.contracts.messages import Envelope
from shared.contracts.states import InstanceState as I, RoutingState as R
from shared.projections.projector import Projector, rebuild
from shared.projections.readmodels import ALL_PROJECTIONS
from shared.projections.rows import WorkerStatus

F, V = BackendType.LLAMA_CPP, BackendType.VLLM
from services.ops.replay import replay

ALIAS = "qwen3-vl-2b"
CONFIG = AliasConfig.model_validate(
    {
        "alias": ALIAS,
        "backends": {
            "llama.cpp": {"model_name": "q", "model_path": "/m/q.gguf", "gpu_memory_gb": 6, "min_replicas": 1, "max_replicas": 4},
            "vllm": {"model_name": "q", "model_path": "/m/q", "gpu_memory_gb": 12, "max_replicas": 2, "engine": "simulator"},
        },
    }
)
T0 = datetime(2026, 11, 22, 10, 0, tzinfo=timezone.utc)


def window(inflight: float) -> MetricWindow:
    return MetricWindow(window_start=T0, window_end=T0 + timedelta(seconds=5), requests=12, inflight_fast=inflight,
                        queue_wait_p95_s=0.8, e2e_p95_fast_s=4.2)


def instance(iid: str, backend: BackendType, a: I, b: I, reason: str, **kw) -> Envelope:
    engine = EngineKind.SIMULATOR if backend is BackendType.VLLM else EngineKind.LLAMA_CPP
    return Envelope.wrap(InstanceStateChanged(instance_id=iid, alias=ALIAS, backend_type=backend, engine=engine, worker_id="w1",
                                              from_state=a, to_state=b, reason=reason, **kw))


async def record_a_day(store) -> None:
    """A realistic slice of life of one alias, as the services would record it."""
    F, V = BackendType.LLAMA_CPP, BackendType.VLLM
    await store.append("worker:w1", [Envelope.wrap(WorkerRegistered(worker_id="w1", host="gpu-a", gpu_memory_gb=80, slots=4,
                                                                    engines=[EngineKind.LLAMA_CPP, EngineKind.SIMULATOR]))])
    await store.append("worker:w2", [Envelope.wrap(WorkerRegistered(worker_id="w2", host="gpu-b", gpu_memory_gb=24, slots=2,
                                                                    engines=[EngineKind.LLAMA_CPP]))])
    await store.append(f"alias:{ALIAS}", [Envelope.wrap(AliasConfigured(alias=ALIAS, config=CONFIG))])
    for e in (instance("f1", F, I.ABSENT, I.STARTING, "first request"), instance("f1", F, I.STARTING, I.RUNNING, "healthy", endpoint="http://h:1")):
        await store.append("instance:f1", [e])
    await store.append(f"alias:{ALIAS}", [Envelope.wrap(RoutingStateChanged(
        alias=ALIAS, from_state=R.COLD, to_state=R.FAST_ONLY, reason="first request", mix_weight=0, policy="hybrid"))])
    await store.append("instance:f1", [Envelope.wrap(InstanceLoadReported(instance_id="f1", alias=ALIAS, inflight=3, capacity=4))])
    await store.append(f"alias:{ALIAS}", [
        Envelope.wrap(RoutingStateChanged(alias=ALIAS, from_state=R.FAST_ONLY, to_state=R.WARMING_VLLM, mix_weight=0,
                                          reason="inflight_fast >= C_up for 2 windows", policy="hybrid", metrics=window(3),
                                          inputs={"C_up": 3, "consecutive": 2}, cooldown_until=T0 + timedelta(seconds=30))),
        Envelope.wrap(ScalingTargetsChanged(alias=ALIAS, targets={F: 2, V: 1}, reason="warm vLLM", policy="hybrid")),
    ])
    for a, b in ((I.ABSENT, I.STARTING), (I.STARTING, I.RUNNING), (I.RUNNING, I.SLEEP_1), (I.SLEEP_1, I.RUNNING)):
        await store.append("instance:v1", [instance("v1", V, a, b, "autoscaler", endpoint="http://h:2",
                                                     sleep_level=1 if b is I.SLEEP_1 else 0)])
    await store.append(f"alias:{ALIAS}", [
        Envelope.wrap(RoutingStateChanged(alias=ALIAS, from_state=R.WARMING_VLLM, to_state=R.MIXED, mix_weight=0.2,
                                          reason="vLLM healthy 3 probes", policy="hybrid")),
        Envelope.wrap(MixWeightChanged(alias=ALIAS, from_weight=0.2, to_weight=0.5, reason="stable", policy="hybrid")),
    ])
    await store.append("session:s1", [Envelope.wrap(SessionBound(session_id="s1", alias=ALIAS, instance_id="f1"))])
    await store.append("session:s1", [Envelope.wrap(SessionMigrated(session_id="s1", alias=ALIAS, from_instance_id="f1",
                                                                   to_instance_id="v1", reason="f1 hot", metrics={"load": 0.9}))])
    await store.append("session:s2", [Envelope.wrap(SessionBound(session_id="s2", alias=ALIAS, instance_id="f1"))])
    await store.append("session:s2", [Envelope.wrap(SessionReleased(session_id="s2", alias=ALIAS, reason="idle"))])
    await store.append("instance:f2", [instance("f2", F, I.ABSENT, I.STARTING, "burst")])
    await store.append("instance:f2", [instance("f2", F, I.STARTING, I.RUNNING, "healthy")])
    for a, b in ((I.RUNNING, I.DRAINING), (I.DRAINING, I.DELETING), (I.DELETING, I.ABSENT)):
        await store.append("instance:f2", [instance("f2", F, a, b, "buffer replica no longer needed")])
    await store.append("worker:w2", [Envelope.wrap(WorkerLost(worker_id="w2", reason="no heartbeat for 10 s"))])


async def test_projector_builds_the_read_models(store, settings):
    await record_a_day(store)
    projector = Projector(store, store.engine)
    await projector.load()
    applied = await projector.catch_up()
    assert applied > 0

    routing = projector.rows["routing"][ALIAS]
    assert routing.state is R.MIXED and routing.mix_weight == 0.5
    assert routing.switch_reason == "vLLM healthy 3 probes" and routing.targets == {F: 2, V: 1}
    instances = projector.rows["instances"]
    assert set(instances) == {"f1", "v1"}  # f2 was deleted: gone, not a ghost
    assert instances["f1"].inflight == 3 and instances["f1"].capacity == 4
    assert instances["v1"].state is I.RUNNING and instances["v1"].sleep_level == 0
    sessions = projector.rows["sessions"]
    assert set(sessions) == {"s1"} and sessions["s1"].instance_id == "v1" and sessions["s1"].migrations == 1
    assert projector.rows["workers"]["w2"].status is WorkerStatus.LOST

    # A restarted projector resumes at its position and finds nothing to do.
    again = Projector(store, store.engine)
    await again.load()
    assert again.position == projector.position and await again.catch_up() == 0

    # What is in the tables equals a rebuild from the log.
    rebuilt, last, count = await rebuild(store, ALL_PROJECTIONS)
    assert last == projector.position and count == applied
    report = await replay(settings)
    assert report.consistent, [d.describe() for d in report.differences]
    assert report.rows == {"routing": 1, "instances": 2, "sessions": 1, "workers": 2, "control": 1}


def _cli(settings, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DATABASE_URL": settings.database_url, "NATS_URL": settings.nats_url,
           "MODELPOOL_NAMESPACE": settings.namespace}
    return subprocess.run([sys.executable, "-m", "services.cli", *args], env=env, capture_output=True, text=True, timeout=60)


async def test_replay_command_detects_a_tampered_projection(store, settings):
    await record_a_day(store)
    projector = Projector(store, store.engine)
    await projector.load()
    await projector.catch_up()

    ok = _cli(settings, "replay")
    assert ok.returncode == 0, ok.stderr
    assert "consistent" in ok.stdout

    async with store.engine.begin() as conn:
        await conn.execute(text("UPDATE proj_routing SET state = 'VLLM_PRIMARY' WHERE alias = :a"), {"a": ALIAS})
        await conn.execute(text("DELETE FROM proj_sessions"))
    bad = _cli(settings, "replay")
    assert bad.returncode == 1
    assert f"routing {ALIAS}: changed — state: live='VLLM_PRIMARY' log='MIXED'" in bad.stderr
    assert "sessions s1: in the log but missing from the live table" in bad.stderr

    report = json.loads(_cli(settings, "replay", "--json").stdout)
    assert report["consistent"] is False and len(report["differences"]) == 2


async def test_history_and_status_commands(store, settings):
    await record_a_day(store)
    projector = Projector(store, store.engine)
    await projector.load()
    await projector.catch_up()

    history = _cli(settings, "history", ALIAS)
    assert history.returncode == 0, history.stderr
    lines = history.stdout.splitlines()
    assert any("routing FAST_ONLY -> WARMING_VLLM" in line and "inflight_fast >= C_up for 2 windows" in line for line in lines)
    assert any('"C_up": 3' in line for line in lines)  # the inputs behind the decision
    assert any('"queue_wait_p95_s": 0.8' in line for line in lines)  # and its metric snapshot
    assert any("instance f2 (llama.cpp on w1) DELETING -> ABSENT" in line for line in lines)
    assert any("session s1 migrated f1 -> v1: f1 hot" in line for line in lines)

    as_json = [json.loads(line) for line in _cli(settings, "history", ALIAS, "--json").stdout.splitlines()]
    assert [e["position"] for e in as_json] == sorted(e["position"] for e in as_json)
    assert {e["type"] for e in as_json} >= {"RoutingStateChanged", "InstanceStateChanged", "SessionMigrated", "AliasConfigured"}
    late = _cli(settings, "history", ALIAS, "--since", (datetime.now(timezone.utc) + timedelta(days=1)).isoformat())
    assert "no events" in late.stdout

    status = _cli(settings, "status")
    assert status.returncode == 0, status.stderr
    assert "MIXED" in status.stdout and "gpu-a" in status.stdout and "simulator (simulated)" in status.stdout
    data = json.loads(_cli(settings, "status", "--json").stdout)
    assert [a["alias"] for a in data["aliases"]] == [ALIAS]
    assert {i["instance_id"] for i in data["instances"]} == {"f1", "v1"}


async def test_a_service_loads_the_projection_then_follows_the_log(store, bus, settings):
    """LiveView: rows and position from the projector's tables, then every later event, woken by the bus."""
    import asyncio

    from helpers import eventually
    from shared.bus.relay import Relay
    from shared.projections.live import LiveView
    from shared.projections.readmodels import INSTANCES, ROUTING
    from shared.telemetry import Telemetry

    await record_a_day(store)
    projector = Projector(store, store.engine)
    await projector.load()
    await projector.catch_up()

    view = LiveView(store, store.engine, [ROUTING, INSTANCES])
    await view.load()
    assert view.position == projector.position
    assert view[ROUTING][ALIAS].state is R.MIXED and set(view[INSTANCES]) == {"f1", "v1"}

    stop = asyncio.Event()
    relay = Relay(store, bus.js, bus.subjects, Telemetry("t"), listen_dsn=settings.asyncpg_dsn,
                  listen_args=settings.database_connect_args, schema=settings.namespace,
                  poll_interval_s=0.2)
    tasks = [asyncio.create_task(relay.run(stop)), asyncio.create_task(view.follow(bus.nc, bus.subjects, stop, poll_interval_s=30))]
    await store.append(f"alias:{ALIAS}", [Envelope.wrap(RoutingStateChanged(
        alias=ALIAS, from_state=R.MIXED, to_state=R.VLLM_PRIMARY, reason="ramp done", mix_weight=1.0, policy="hybrid"))])
    # The slow poll is 30 s: seeing this quickly means the bus woke the view.
    await eventually(lambda: view[ROUTING][ALIAS].state is R.VLLM_PRIMARY, timeout=5)
    stop.set()
    await asyncio.gather(*tasks)
    rebuilt, last, _ = await rebuild(store, [ROUTING, INSTANCES])
    assert view.position == last and view[ROUTING] == rebuilt["routing"] and view[INSTANCES] == rebuilt["instances"]


async def test_a_view_tells_a_watcher_which_rows_the_log_touched(store):
    """The controller rebuilds only the instance views whose rows changed: the view names them."""
    from shared.projections.live import LiveView
    from shared.projections.readmodels import CONTROL, INSTANCES

    await record_a_day(store)
    view = LiveView(store, store.engine, [INSTANCES, CONTROL])
    touched = view.watch_keys(INSTANCES)
    await view.load()
    assert touched == {"f1", "f2", "v1"}  # after a load, every row counts as touched (f2: deleted)
    touched.clear()
    await store.append("instance:v1", [Envelope.wrap(InstanceStateChanged(
        instance_id="v1", alias=ALIAS, backend_type=BackendType.VLLM, engine=EngineKind.SIMULATOR, worker_id="w1",
        from_state=I.RUNNING, to_state=I.DRAINING, reason="idle"))])
    await view.catch_up()
    assert touched == {"v1"} and view[INSTANCES]["v1"].state is I.DRAINING


async def test_a_failed_projection_write_does_not_fold_events_twice(store, monkeypatch):
    import shared.projections.projector as projector_module

    await store.append("session:s1", [Envelope.wrap(SessionBound(session_id="s1", alias=ALIAS, instance_id="f1"))])
    projector = Projector(store, store.engine)
    await projector.load()
    await projector.catch_up()
    await store.append("session:s1", [Envelope.wrap(SessionMigrated(session_id="s1", alias=ALIAS, from_instance_id="f1",
                                                                   to_instance_id="v1", reason="hot"))])
    real_write = projector_module.write_rows
    calls = 0

    async def failing_once(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ConnectionError("database went away")
        return await real_write(*args, **kwargs)

    monkeypatch.setattr(projector_module, "write_rows", failing_once)
    import pytest

    with pytest.raises(ConnectionError):
        await projector.catch_up()
    await projector.catch_up()  # the retry
    assert projector.rows["sessions"]["s1"].migrations == 1
    async with store.engine.connect() as conn:
        stored = (await conn.execute(text("SELECT migrations FROM proj_sessions WHERE session_id = 's1'"))).scalar_one()
    assert stored == 1


async def test_the_read_models_fold_the_same_from_either_log(any_store):
    await record_a_day(any_store)
    rows, last, count = await rebuild(any_store, ALL_PROJECTIONS)
    assert last == await any_store.head_position() and count == last
    routing = rows["routing"][ALIAS]
    assert routing.state is R.MIXED and routing.mix_weight == 0.5 and routing.targets == {F: 2, V: 1}
    assert set(rows["instances"]) == {"f1", "v1"} and rows["instances"]["f1"].capacity == 4
    assert rows["sessions"]["s1"].instance_id == "v1" and rows["workers"]["w2"].status is WorkerStatus.LOST
