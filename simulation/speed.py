"""Simulator speed, for the benchmarks: how many batches and requests the core simulates per second.

Measures the pure core with the arrival feed (no recording, no I/O), on the
default configuration scaled by `scale` (arrival rate, M_total and B times
`scale`, d_1 divided by it, as in the fluid-limit experiment).
"""

from __future__ import annotations

import time
from typing import Any

from simulation.config import load_config
from simulation.core import DecodeSystem, SimRequest, SystemParams
from simulation.workload import generate

# default workload of `modelpool sim generate`: near the default system's capacity
DEFAULT_RATE = 1.2
DEFAULT_PREFILL = "uniform:20:200"
DEFAULT_DECODE = "uniform:10:100"


def default_params(scale: int = 1) -> SystemParams:
    base = load_config(None, env={}).params()
    return SystemParams(M_total=base.M_total * scale, B=base.B * scale, d_0=base.d_0, d_1=base.d_1 / scale,
                        mode=base.mode, strategy=base.strategy, victim_policy=base.victim_policy)


def measure_sim_speed(
    scale: int = 1,
    n_requests: int | None = None,
    seconds: float = 5.0,
    *,
    running_points: tuple[int, ...] = (10, 100, 1_000, 10_000),
    point_seconds: float = 0.5,
    seed: int = 0,
) -> dict[str, Any]:
    """Simulated batches/s and requests/s at lambda x `scale`, plus a scaling curve vs RUNNING size.

    Stops after `seconds` of wall time or when all `n_requests` completed
    (default: max(20,000, 2,000 x scale) requests, so a run lasts long enough to time).
    """
    if scale < 1:
        raise ValueError("scale must be >= 1")
    n = n_requests if n_requests is not None else max(20_000, 2_000 * scale)
    params = default_params(scale)
    specs = generate(n, DEFAULT_RATE * scale, seed=seed, prefill=DEFAULT_PREFILL, decode=DEFAULT_DECODE)
    requests = [SimRequest(str(i), s.arrival_time, s.prefill_length, s.decode_length) for i, s in enumerate(specs)]
    system = DecodeSystem(params)
    t, i = 0.0, 0
    completed = batches = tokens = 0
    running_sum = 0
    start = time.perf_counter()
    deadline = start + seconds
    while time.perf_counter() < deadline:
        while i < n and requests[i].arrival_time <= t:
            system.add(requests[i])
            i += 1
        res = system.step(t)
        if res is None:
            if i >= n:
                break
            t = requests[i].arrival_time
            continue
        t = res.end_time
        batches += 1
        completed += len(res.completed)
        tokens += len(res.decoded)
        running_sum += res.running
    wall = time.perf_counter() - start
    return {
        "scale": scale,
        "arrival_rate": DEFAULT_RATE * scale,
        "M_total": params.M_total,
        "B": params.B,
        "requests": n,
        "requests_completed": completed,
        "batches": batches,
        "simulated_time": t,
        "wall_seconds": wall,
        "mean_running": running_sum / batches if batches else 0.0,
        "sim_batches_per_s": batches / wall,
        "sim_requests_per_s": completed / wall,
        "sim_tokens_per_s": tokens / wall,
        "scaling": [running_curve_point(k, point_seconds) for k in running_points],
    }


def running_curve_point(running: int, seconds: float = 0.5, decode_tokens: int = 100_000) -> dict[str, float]:
    """Batches/s and decode tokens/s with `running` requests decoding in every batch.

    A request that completes is replaced at once, so the batch stays `running` wide however
    fast the machine steps through `decode_tokens`.
    """
    params = SystemParams(M_total=running * (decode_tokens + 200), B=running + 1, d_0=0.01, d_1=0.0001)
    system = DecodeSystem(params)
    added = 0
    for _ in range(running):
        system.add(SimRequest(str(added), 0.0, 100, decode_tokens))
        added += 1
    t = 0.0
    batches = tokens = 0
    start = time.perf_counter()
    deadline = start + seconds
    while time.perf_counter() < deadline:
        res = system.step(t)
        assert res is not None, "every completed request was replaced: the system is never idle"
        t = res.end_time
        batches += 1
        tokens += len(res.decoded)
        for _ in res.completed:
            system.add(SimRequest(str(added), t, 100, decode_tokens))
            added += 1
    wall = time.perf_counter() - start
    return {"running": running, "batches_per_s": batches / wall, "tokens_per_s": tokens / wall}
