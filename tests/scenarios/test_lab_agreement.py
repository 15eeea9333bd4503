"""The lab agrees with the pool: one trace and pool file through the real services and through the lab."""

from __future__ import annotations

from lab import workloads
from lab.agreement import compare, lab_run, pool_run

POOL = """
aliases:
  - alias: agree
    autoscaling_policy: {name: hybrid, mix_step_s: 3, down_hold_s: 600}
    backends:
      llama.cpp: {model_name: agree, model_path: default, gpu_memory_gb: 6, min_replicas: 0, max_replicas: 2,
                  engine: simulator}
      vllm: {model_name: agree, model_path: /m, gpu_memory_gb: 12, min_replicas: 0, max_replicas: 1,
             max_model_len: 4096, engine: simulator, engine_args: {startup-s: 6}}
"""


async def test_the_lab_takes_the_pools_path_at_the_pools_times_with_its_latencies(migrated, store, tmp_path):
    _, trace = workloads.load("sustained", 3, {"rate": "3", "duration_s": "45", "input_tokens": "200",
                                               "output_tokens": "48"})
    pool = await pool_run(migrated.database_url, migrated.nats_url, migrated.namespace, POOL, tmp_path / "pool", trace,
                          store, tick_s=0.5, window_s=1.0,
                          worker={"MODELPOOL_WORKER_GPU_MEMORY_GB": "24", "MODELPOOL_WORKER_SLOTS": "6"})
    # The lab is given the starts the pool measured: how fast this machine brings up a process is not the lab's to
    # model, and under the whole suite's load it was 1-4 s over the configured delay.
    assert set(pool["starts"]) == {"llama.cpp", "vllm"}, pool["starts"]
    assert pool["starts"]["vllm"] >= 6, pool["starts"]
    lab = lab_run(POOL, trace, tick_s=0.5, window_s=1.0, worker_gb=24, worker_slots=6, startup_s=pool["starts"])
    result = compare(pool, lab)
    print(pool["starts"], result)
    assert result["lost"] == {"pool": 0, "lab": 0} and result["answered"]["pool"] == result["answered"]["lab"] == len(trace)
    assert result["same_path"], result["switches"]
    assert [s["pool"] for s in result["switches"]][:2] == ["COLD->FAST_ONLY", "FAST_ONLY->WARMING_VLLM"]
    # Measured on 2026-11-26 with the configured starts: switches within 2.7 s, later 3.6-3.7 s inside the whole
    # suite (the pool's engine processes slower to come up). Given the measured starts (2026-11-27): within 0.9 s,
    # e2e p50 within 9 % and p90 within 10 % (the pool is real processes sharing two cores with the test; the lab
    # is virtual time), hence these margins, which also cover the suite's load.
    assert all(abs(s["gap_s"]) <= 3.5 for s in result["switches"]), result["switches"]
    for q, margin in (("p50", 0.15), ("p90", 0.5)):
        e2e = result["e2e"][q]
        assert abs(e2e["lab"] / e2e["pool"] - 1) < margin, result["e2e"]
