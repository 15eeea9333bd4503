"""Failures under load: an engine SIGKILLed, a worker SIGKILLed. Recorded, traffic moves, capacity replaced."""

from __future__ import annotations

import asyncio
import os
import signal

from helpers import eventually
from scenario import Requests, history, instance_rows, steady_load

from services.cluster.chaos import engine_pid

POOL = """
aliases:
  - alias: tiny
    backends:
      llama.cpp: {model_name: tiny, model_path: default, gpu_memory_gb: 0, min_replicas: 0, max_replicas: 2,
                  engine: simulator}
"""


async def running_instances(store) -> dict:
    return {k: v for k, v in instance_rows(await history(store, "tiny")).items() if v["to_state"] == "RUNNING"}


async def test_an_engine_sigkilled_under_load_is_recorded_traffic_moves_and_it_is_replaced(local_pool, store):
    pool = local_pool(POOL, workers={"w1": {"MODELPOOL_WORKER_SLOTS": "4"}})
    tally = Requests()
    load = asyncio.create_task(steady_load(pool.gateway, "tiny", tally, concurrency=6, seconds=30))
    # Six in flight over 4-slot instances: the fast tier grows to two.
    serving = await eventually(lambda: _two_running(store), timeout=30)
    victim_id, victim = sorted(serving.items())[0]
    before = tally.answered
    os.kill(engine_pid(victim["endpoint"]), signal.SIGKILL)

    async def recorded_error():
        rows = [e for e in await history(store, "tiny") if e.type == "InstanceStateChanged"
                and e.payload["instance_id"] == victim_id and e.payload["to_state"] == "ERROR"]
        return rows[0] if rows else None

    error = await eventually(recorded_error, timeout=10)
    assert error.payload["exit_code"] == -signal.SIGKILL
    assert error.payload["log_tail"] and "SIMULATED" in error.payload["log_tail"]
    await load
    assert tally.lost == 0, tally
    assert tally.answered > before + 20  # traffic moved on
    # The failed instance is released and the tier is back to two, on a new instance.
    events = await history(store, "tiny")
    assert victim_id not in instance_rows(events)
    assert len([e for e in events if e.type == "PlacementDecided"]) == 3
    assert len(await running_instances(store)) == 2
    # Errors, if any, are documented ones (counted by status), never a hang or a broken connection.
    assert set(tally.errors) <= {"http 502", "http 503", "stream error"}, tally.errors


async def _two_running(store):
    running = await running_instances(store)
    return running if len(running) == 2 else None


async def test_a_worker_sigkilled_is_recorded_lost_once_and_its_instance_is_replaced_elsewhere(local_pool, store):
    pool = local_pool(POOL, workers={"w1": {}, "w2": {}}, MODELPOOL_WORKER_TIMEOUT_S="3")
    tally = Requests()
    load = asyncio.create_task(steady_load(pool.gateway, "tiny", tally, concurrency=2, seconds=25))
    (first_id, first), = (await eventually(lambda: running_instances(store), timeout=30)).items()
    pool.kill_worker(first["worker_id"])
    survivor = "w2" if first["worker_id"] == "w1" else "w1"

    async def replaced():
        running = await running_instances(store)
        return [r for r in running.values() if r["worker_id"] == survivor] or None

    (replacement,) = await eventually(replaced, timeout=30)
    await load
    events = await history(store, "tiny")
    lost = [e for e in await store.read_stream(f"worker:{first['worker_id']}") if e.type == "WorkerLost"]
    assert len(lost) == 1 and "no heartbeat" in lost[0].payload["reason"]
    gone = [e for e in events if e.type == "InstanceStateChanged" and e.payload["instance_id"] == first_id
            and e.payload["to_state"] == "ERROR"]
    assert gone and f"worker {first['worker_id']} lost" in gone[0].payload["reason"]
    assert tally.lost == 0, tally
    assert tally.instances[replacement["instance_id"]] > 0  # the new instance took the traffic
    assert set(tally.errors) <= {"http 502", "http 503", "stream error"}, tally.errors
