"""The policy lab: its speed, the hybrid policy against an always-on vLLM pool, HeteroScale against the baselines,
and how well the lab agrees with the pool.

Every cluster here is the lab's (`lab/`): lab models of the simulated engines'
profiles, no engine process, virtual time. The agreement section alone runs the
real pool (every service as a process, simulated engines) on Postgres and NATS.

1. speed: a 24 h diurnal day (busy hours, quiet nights) under HeteroScale sized
   to reach 100 instances at the peak (`target_decode_tps_per_instance` 300,
   `max_instances` 100), on one core; `--repeats` runs, median and spread.
2. memory at the same SLO, on the same day: the hybrid policy with calibrated
   parameters (`modelpool calibrate`: estimates from a day compressed 12-fold,
   seed 000 §13.7's initial values, a search on that compressed day) against an
   always-on vLLM pool of the fewest instances that meets the hybrid's SLO
   attainment; GPU-memory-seconds (the integral of M_t, §13.4) as a ratio.
   Seed 000's default parameters are run too, for reference.
3. the bursty trace: hybrid, HeteroScale (its target from the same calibration,
   0.7 x the saturated decode rate), utilization, latency, and periodic (a
   constant schedule sized for the trace's mean load): SLO attainment and scale
   actions per policy.
4. agreement: one trace and pool file through the real pool and the lab, the
   lab once with the engines' configured start-up delays and once given the
   starts the pool measured (decision to RUNNING: an engine process comes up
   later than its configured delay, which the lab does not model).
   `--agreement-only` runs this section alone (about four minutes).

    .venv/bin/python bench/lab.py --plot-dir docs/img

Progress on stderr; the last line on stdout is the JSON summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# This script is bench/lab.py: its own directory must not hide the `lab` package.
sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench")]

from lab import workloads  # noqa: E402
from lab.calibrate import estimate, initial_parameters, search  # noqa: E402
from lab.config import LabSettings, apply_sets, load_lab_pool, parse_sets  # noqa: E402
from lab.results import RunResult, run  # noqa: E402

sys.path.append(str(ROOT / "bench"))  # the bench harness, once `lab` is the package

DAY = {"peak_rate": 12, "trough_rate": 0.02, "output_tokens": 2048, "peakiness": 3}
BURSTY = {"requests": 4000, "span_s": 900, "bursts": 6, "burst_s": 20, "burst_share": 0.5, "input_tokens": 1000,
          "output_tokens": 256}
POLICIES = ("hybrid", "heteroscale", "utilization", "latency", "periodic")


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def lab_run(policy: str, workload: str, shape: dict[str, Any], sets: list[str], seed: int = 0,
            trace: list | None = None) -> RunResult:
    pool = load_lab_pool(str(ROOT / "config" / "lab.yaml"))
    alias, pool, lab = apply_sets(pool, None, parse_sets([f"autoscaling_policy={policy}", *sets]), LabSettings(seed=seed))
    if trace is None:
        _, trace = workloads.load(workload, seed, {k: str(v) for k, v in shape.items()})
    return run(alias, pool.controller, lab, trace)


def brief(r: RunResult) -> dict[str, Any]:
    s = r.summary
    return {k: s[k] for k in ("requests", "lost", "slo_attainment", "ttft_s", "e2e_s", "scale_actions",
                              "routing_switches", "gpu_mem_s", "objective", "wall_s")}


def speed(repeats: int) -> dict[str, Any]:
    try:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core, as the target says
    except (AttributeError, OSError):
        pass
    _, trace = workloads.load("diurnal", 0, {k: str(v) for k, v in DAY.items()})
    walls, peaks = [], []
    for k in range(repeats):
        started = time.perf_counter()
        r = lab_run("heteroscale", "diurnal", DAY, ["heteroscale.target_decode_tps_per_instance=300",
                                                    "heteroscale.max_instances=100"], trace=trace)
        walls.append(time.perf_counter() - started)
        peaks.append(max(sum(s.awake.values()) for s in r.samples))
        say(f"speed {k + 1}/{repeats}: {len(trace)} requests, 24 h, peak {peaks[-1]} instances, {walls[-1]:.1f} s")
    os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
    return {"requests": len(trace), "peak_instances": max(peaks), "seconds": [round(w, 2) for w in walls],
            "median_s": round(statistics.median(walls), 2)}


def calibrated(seed: int) -> tuple[dict[str, Any], float | None, list[str]]:
    """Hybrid parameters the way `modelpool calibrate` finds them, on the day compressed 12-fold."""
    compressed = {**DAY, "compress": 12}
    recorded = lab_run("hybrid", "diurnal", compressed, [], seed)
    e = estimate(recorded.record)
    lab = LabSettings(seed=seed)
    init = initial_parameters(e, lab.objective.beta, lab.objective.gamma, 0.001)
    pool = load_lab_pool(str(ROOT / "config" / "lab.yaml"))
    alias, pool, lab = apply_sets(pool, None, parse_sets([]), lab)
    _, trace = workloads.load("diurnal", seed, {k: str(v) for k, v in compressed.items()})
    best, history = search(alias, pool.controller, lab, trace, init.params, rounds=8)
    say(f"calibrated on the compressed day in {len(history)} lab runs: {best}")
    return best, init.heteroscale_target_tps, init.derivation


def memory(seed: int, best: dict[str, Any]) -> dict[str, Any]:
    _, trace = workloads.load("diurnal", seed, {k: str(v) for k, v in DAY.items()})
    hybrid = lab_run("hybrid", "diurnal", DAY, [f"hybrid.{k}={v}" for k, v in best.items()], seed, trace)
    default = lab_run("hybrid", "diurnal", DAY, [], seed, trace)
    say(f"hybrid calibrated: SLO {hybrid.summary['slo_attainment']:.2%}, {hybrid.summary['gpu_mem_s'] / 3600:.0f} GB·h; "
        f"defaults: {default.summary['slo_attainment']:.2%}, {default.summary['gpu_mem_s'] / 3600:.0f} GB·h")
    target = hybrid.summary["slo_attainment"]
    runs: dict[int, RunResult] = {}

    def always_on(n: int) -> RunResult:
        if n not in runs:
            runs[n] = lab_run("periodic", "diurnal", DAY, [f"periodic.schedule=[[0,{n}]]", f"periodic.min_instances={n}",
                                                           f"periodic.max_instances={n}"], seed, trace)
            say(f"always-on {n} vLLM: SLO {runs[n].summary['slo_attainment']:.2%}")
        return runs[n]

    # The fewest always-on instances that meet the hybrid's attainment: doubling, then bisection.
    high = 1
    while always_on(high).summary["slo_attainment"] < target:
        high *= 2
        assert high <= 64, "no always-on pool up to 64 instances meets the hybrid's SLO"
    low = high // 2
    while high - low > 1:
        mid = (low + high) // 2
        if always_on(mid).summary["slo_attainment"] >= target:
            high = mid
        else:
            low = mid
    n, always = high, runs[high]
    tried = [{"instances": k, "slo_attainment": r.summary["slo_attainment"]} for k, r in sorted(runs.items())]
    ratio = hybrid.summary["gpu_mem_s"] / always.summary["gpu_mem_s"]
    hybrid.policy, default.policy, always.policy = "hybrid, calibrated", "hybrid, seed 000 defaults", f"always-on, {n} vLLM"
    return {"hybrid": brief(hybrid), "hybrid_defaults": brief(default), "always_on": brief(always),
            "always_on_instances": n, "always_on_tried": tried, "ratio": round(ratio, 3),
            "ratio_defaults": round(default.summary["gpu_mem_s"] / always.summary["gpu_mem_s"], 3),
            "_runs": [hybrid, default, always]}


def bursty(seed: int, target_tps: float | None) -> dict[str, Any]:
    _, trace = workloads.load("bursty", seed, {k: str(v) for k, v in BURSTY.items()})
    # periodic: constant, sized as an operator would from the trace's mean load (Little: rate x E2E / capacity)
    probe = lab_run("periodic", "bursty", BURSTY, ["periodic.schedule=[[0,8]]", "periodic.min_instances=8"], seed, trace)
    mean_e2e = probe.summary["e2e_s"]["p50"] or 1.0
    rate = len(trace) / BURSTY["span_s"]
    n = max(1, math.ceil(rate * mean_e2e / 38))
    sets = {
        "hybrid": [],
        "heteroscale": [f"heteroscale.target_decode_tps_per_instance={target_tps}"] if target_tps else [],
        "utilization": [],
        "latency": [],
        "periodic": [f"periodic.schedule=[[0,{n}]]", f"periodic.min_instances={n}"],
    }
    runs = {}
    for policy in POLICIES:
        runs[policy] = lab_run(policy, "bursty", BURSTY, sets[policy], seed, trace)
        s = runs[policy].summary
        say(f"bursty {policy}: SLO {s['slo_attainment']:.2%}, {s['scale_actions']} scale actions, "
            f"{s['gpu_mem_s'] / 3600:.1f} GB·h")
    return {"requests": len(trace), "periodic_instances": n, "runs": {p: brief(r) for p, r in runs.items()},
            "_runs": list(runs.values())}


async def agreement(seed: int) -> dict[str, Any]:
    from lab.agreement import compare, lab_run as agreement_lab_run, pool_run
    from harness import drop_namespace
    from shared.contracts.events import event_registry
    from shared.eventlog.db import create_engine, migrate_async
    from shared.eventlog.store import make_store
    from shared.settings import Settings

    pool_yaml = (ROOT / "bench" / "lab_agreement.yaml").read_text()
    _, trace = workloads.load("sustained", seed, {"rate": "3", "duration_s": "120", "input_tokens": "300",
                                                  "output_tokens": "96"})
    settings = Settings.load({}, namespace=f"bench_lab_{secrets.token_hex(4)}")
    await migrate_async(settings)
    engine = create_engine(settings, pool_size=2)
    try:
        store = make_store(engine, event_registry(), settings.namespace)
        with tempfile.TemporaryDirectory() as work:
            pool = await pool_run(settings.database_url, settings.nats_url, settings.namespace, pool_yaml, Path(work),
                                  trace, store, tick_s=0.5, window_s=1.0,
                                  worker={"MODELPOOL_WORKER_GPU_MEMORY_GB": "48", "MODELPOOL_WORKER_SLOTS": "8"})
    finally:
        await engine.dispose()
        await drop_namespace(settings)
    sizes = dict(tick_s=0.5, window_s=1.0, worker_gb=48, worker_slots=8)
    result = compare(pool, agreement_lab_run(pool_yaml, trace, **sizes))
    given = compare(pool, agreement_lab_run(pool_yaml, trace, **sizes, startup_s=pool["starts"]))
    say(f"agreement: {json.dumps(result)}")
    say(f"agreement given the measured starts {pool['starts']}: {json.dumps(given)}")
    return {"requests": len(trace), **result, "measured_starts_s": pool["starts"], "given_measured_starts": given}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot-dir", type=Path, help="write lab_diurnal.png and lab_bursty.png here")
    parser.add_argument("--no-agreement", action="store_true", help="skip the run through the real pool")
    parser.add_argument("--agreement-only", action="store_true", help="only the run through the real pool")
    args = parser.parse_args()
    if args.agreement_only:
        print(json.dumps(asyncio.run(agreement(args.seed))))
        return

    fast = speed(args.repeats)
    best, target_tps, derivation = calibrated(args.seed)
    mem = memory(args.seed, best)
    burst = bursty(args.seed, target_tps)
    agree = None if args.no_agreement else asyncio.run(agreement(args.seed))
    if args.plot_dir:
        from lab.plots import plot_runs

        args.plot_dir.mkdir(parents=True, exist_ok=True)
        plot_runs(mem["_runs"], args.plot_dir / "lab_diurnal.png",
                  "modelpool lab: 24 h diurnal day: hybrid (calibrated, then seed 000 defaults) and always-on vLLM")
        plot_runs(burst["_runs"], args.plot_dir / "lab_bursty.png", "modelpool lab: bursty trace, five policies")
    mem.pop("_runs")
    burst.pop("_runs")
    runs = burst["runs"]
    print(json.dumps({"speed": fast, "calibrated": {"settings": best, "heteroscale_target_tps": target_tps,
                                                    "derivation": derivation},
                      "memory": mem, "bursty": burst, "agreement": agree}, indent=1))
    print(json.dumps({
        "lab_seconds_24h_100": fast["median_s"],
        "lab_seconds_24h_100_spread": [min(fast["seconds"]), max(fast["seconds"])],
        "gpu_mem_s_ratio_hybrid_vs_always_on": mem["ratio"],
        "slo_attainment": {p: runs[p]["slo_attainment"] for p in POLICIES},
        "scale_actions": {p: runs[p]["scale_actions"] for p in POLICIES},
    }))


if __name__ == "__main__":
    main()
