"""The pool under load, on simulated engines: up the ramp, down the ladder, and back."""

from __future__ import annotations

from scenario import Requests, history, instance_rows, routing_path, steady_load, wait_for_state

WORKER = {"MODELPOOL_WORKER_GPU_MEMORY_GB": "24", "MODELPOOL_WORKER_SLOTS": "6"}


def pool_file(params: str, fast_max: int = 3, vllm_args: str = "{startup-s: 3}") -> str:
    """A pool of one alias, `tiny`, under the hybrid policy with `params` (its parameters, as YAML flow entries)."""
    return f"""
aliases:
  - alias: tiny
    autoscaling_policy: {{name: hybrid, {params}}}
    backends:
      llama.cpp: {{model_name: tiny, model_path: default, gpu_memory_gb: 0, min_replicas: 0, max_replicas: {fast_max},
                  engine: simulator}}
      vllm: {{model_name: tiny, model_path: /m, gpu_memory_gb: 12, min_replicas: 0, max_replicas: 1, max_model_len: 4096,
             engine: simulator, engine_args: {vllm_args}}}
"""


UP = ["COLD->FAST_ONLY", "FAST_ONLY->WARMING_VLLM", "WARMING_VLLM->MIXED", "MIXED->VLLM_PRIMARY"]


async def test_sustained_noisy_load_walks_the_ramp_step_by_step_reclaims_fast_buffers_and_does_not_flap(local_pool, store):
    pool = local_pool(pool_file("mix_step_s: 2, down_hold_s: 600, llama_scale_down_cooldown_s: 3"),
                      workers={"w1": WORKER})
    tally = Requests()
    await steady_load(pool.gateway, "tiny", tally, concurrency=10, seconds=40, think_s=0.3)
    assert tally.lost == 0 and tally.answered == tally.sent and not tally.errors, tally
    assert set(tally.served_by) == {"llama.cpp", "vllm"}

    events = await history(store, "tiny")
    assert routing_path(events) == UP  # and nothing after: no flap under noisy load
    steps = [(e.payload["from_weight"], e.payload["to_weight"]) for e in events if e.type == "MixWeightChanged"]
    assert steps == [(0.2, 0.5), (0.5, 0.8), (0.8, 1.0)]
    switched = {e.payload["to_state"]: e.occurred_at for e in events if e.type == "RoutingStateChanged"}
    mixed_steps = [e.occurred_at for e in events if e.type == "MixWeightChanged"]
    for earlier, later in zip([switched["MIXED"], *mixed_steps], [*mixed_steps, switched["VLLM_PRIMARY"]]):
        assert (later - earlier).total_seconds() >= 2.0  # each weight held mix_step_s
    # The burst scaled llama.cpp out (10 in flight / 4 slots), vLLM took over, and the buffer went back
    # to the floor: one replica per cooldown, drained before deleted.
    fast_starts = [e for e in events if e.type == "PlacementDecided" and e.payload["backend_type"] == "llama.cpp"]
    assert len(fast_starts) == 3
    drains = [e.occurred_at for e in events if e.type == "InstanceStateChanged" and e.payload["backend_type"] == "llama.cpp"
              and e.payload["to_state"] == "DRAINING"]
    assert len(drains) == 2 and (drains[1] - drains[0]).total_seconds() >= 3.0
    assert all(d > switched["VLLM_PRIMARY"] for d in drains)
    live = instance_rows(events)
    assert sorted(r["backend_type"] for r in live.values()) == ["llama.cpp", "vllm"]


async def test_load_falls_fast_first_then_vllm_sleeps_and_returning_load_wakes_it_then_it_is_deleted(local_pool, store):
    pool = local_pool(pool_file("mix_step_s: 1, down_hold_s: 3, llama_scale_down_cooldown_s: 1,"
                                " vllm_sleep_l1_idle_s: 3, vllm_sleep_l2_idle_s: 6, vllm_delete_idle_s: 12,"
                                " cold_idle_s: 600"),
                      workers={"w1": WORKER})
    tally = Requests()
    await steady_load(pool.gateway, "tiny", tally, concurrency=8, seconds=20)
    assert routing_path(await history(store, "tiny")) == UP

    # Load falls: the fast buffer goes first (while vLLM still carries the load), then the alias goes
    # FAST_ONLY and the idle vLLM walks the ladder.
    await wait_for_state(store, "tiny", "FAST_ONLY", timeout=30)

    async def asleep(level: str):
        events = await history(store, "tiny")
        return [e for e in events if e.type == "InstanceStateChanged" and e.payload["to_state"] == level]

    from helpers import eventually

    await eventually(lambda: asleep("SLEEP_2"), timeout=30)
    events = await history(store, "tiny")
    fast_drains = [e.position for e in events if e.type == "InstanceStateChanged"
                   and e.payload["backend_type"] == "llama.cpp" and e.payload["to_state"] == "DRAINING"]
    (sleep_1,) = await asleep("SLEEP_1")
    assert fast_drains and max(fast_drains) < sleep_1.position  # fast first, then vLLM
    (vllm,) = [r for r in instance_rows(events).values() if r["backend_type"] == "vllm"]
    assert vllm["to_state"] == "SLEEP_2"

    # Load returns mid-ladder: the sleeping vLLM is woken, not a new one started.
    await steady_load(pool.gateway, "tiny", tally, concurrency=8, seconds=12)
    events = await history(store, "tiny")
    slow_places = [e for e in events if e.type == "PlacementDecided" and e.payload["backend_type"] == "vllm"]
    assert len(slow_places) == 1
    woken = [e for e in events if e.type == "InstanceStateChanged" and e.payload["instance_id"] == vllm["instance_id"]
             and e.payload["from_state"] == "SLEEP_2" and e.payload["to_state"] == "RUNNING"]
    assert len(woken) == 1
    again = routing_path(events)[len(UP) + 1:]  # after VLLM_PRIMARY->FAST_ONLY
    assert again[:2] == ["FAST_ONLY->WARMING_VLLM", "WARMING_VLLM->MIXED"], again

    # And when it falls for good, the ladder runs to the end: deleted.
    async def deleted():
        return vllm["instance_id"] not in instance_rows(await history(store, "tiny"))

    await eventually(deleted, timeout=60, interval=0.5)
    assert tally.lost == 0 and not tally.errors and tally.answered == tally.sent, tally


async def test_vllm_failing_to_start_degrades_llamacpp_serves_throughout_and_it_is_retried_at_the_window(local_pool, store):
    pool = local_pool(pool_file("retry_s: 4", fast_max=2, vllm_args="{startup-s: 1, fail-start: true}"),
                      workers={"w1": WORKER})
    tally = Requests()
    await steady_load(pool.gateway, "tiny", tally, concurrency=6, seconds=22)
    assert tally.lost == 0 and not tally.errors and tally.answered == tally.sent, tally
    assert set(tally.served_by) == {"llama.cpp"}  # served by llama.cpp throughout

    events = await history(store, "tiny")
    path = routing_path(events)
    assert path[:3] == ["COLD->FAST_ONLY", "FAST_ONLY->WARMING_VLLM", "WARMING_VLLM->DEGRADED_FAST"]
    assert "DEGRADED_FAST->WARMING_VLLM" in path  # retried...
    switches = [e for e in events if e.type == "RoutingStateChanged"]
    degraded = next(e for e in switches if e.payload["to_state"] == "DEGRADED_FAST")
    retried = next(e for e in switches if e.payload["from_state"] == "DEGRADED_FAST")
    assert (retried.occurred_at - degraded.occurred_at).total_seconds() >= 4.0  # ...at the window, not before
    assert "failed" in degraded.payload["reason"]
    failed = [e for e in events if e.type == "InstanceStateChanged" and e.payload["to_state"] == "ERROR"]
    assert failed and failed[0].payload["exit_code"] == 1 and "told to fail" in (failed[0].payload["log_tail"] or "")
