"""The policy lab: its speed, every policy on a day its parameters never saw, HeteroScale against the baselines
on a bursty trace, and how well the lab agrees with the pool.

Every cluster here is the lab's (`lab/`): lab models of the simulated engines'
profiles, no engine process, virtual time. The agreement section alone runs the
real pool (every service as a process, simulated engines) on Postgres and NATS.

1. speed: a 24 h diurnal day (busy hours, quiet nights) under HeteroScale sized
   to reach 100 instances at the peak (`target_decode_tps_per_instance` 300,
   `max_instances` 100), on one core; `--repeats` runs, median and spread.
2. heldout: the hybrid calibrated (`modelpool calibrate`'s pipeline,
   `lab.calibrate.calibrate_on`) on the calibration day compressed 12-fold, then
   every policy (`lab/heldout.py`: hybrid calibrated and at seed 000's defaults,
   HeteroScale with the calibrated target, utilization, latency, periodic hour
   by hour at HeteroScale's target, always-on vLLM sized to the hybrid's SLO
   attainment) on another day: another seed, peak hour, peakiness and bursts.
3. mooncake: the same policies and calibration on a day at the Mooncake
   conversation trace's arrival rate: the rate curve of its hour, read off the
   released file (`simulation/mooncake_rate.py`), or of the file given with
   `--trace`, stretched over 24 h and scaled to the held-out day's peak, with
   the diurnal days' request lengths (`lab.heldout.MOONCAKE_DAY`).
4. bursty: hybrid, HeteroScale (its target from the same calibration), utilization,
   latency, and periodic (a constant schedule sized for the trace's mean load):
   SLO attainment and scale actions per policy.
5. agreement: one trace and pool file through the real pool and the lab, the
   lab once with the engines' configured start-up delays and once given the
   starts the pool measured (decision to RUNNING: an engine process comes up
   later than its configured delay, which the lab does not model); about four minutes.

    .venv/bin/python bench/lab.py --plot-dir docs/img
    .venv/bin/python bench/lab.py --sections heldout,mooncake --trace conversation_trace.jsonl

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
from lab.calibrate import Calibration, calibrate_on  # noqa: E402
from lab.config import LabSettings, apply_sets, load_lab_pool, parse_sets  # noqa: E402
from lab.heldout import (CALIBRATION_COMPRESS, CALIBRATION_DAY, MOONCAKE_DAY, Comparison, KEYS,  # noqa: E402
                         Day, held_out_days, score_policies)
from lab.results import RunResult, brief, run  # noqa: E402
from shared.contracts.config import AliasConfig, ControllerConfig  # noqa: E402
from shared.contracts.mooncake import read_mooncake  # noqa: E402
from simulation.mooncake_rate import rate_from_timestamps  # noqa: E402

sys.path.append(str(ROOT / "bench"))  # the bench harness, once `lab` is the package

BURSTY = {"requests": 4000, "span_s": 900, "bursts": 6, "burst_s": 20, "burst_share": 0.5, "input_tokens": 1000,
          "output_tokens": 256}
POLICIES = ("hybrid", "heteroscale", "utilization", "latency", "periodic")
SECTIONS = ("speed", "heldout", "mooncake", "bursty", "agreement")


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def lab_pool(seed: int) -> tuple[AliasConfig, ControllerConfig, LabSettings]:
    pool = load_lab_pool(str(ROOT / "config" / "lab.yaml"))
    alias, pool, lab = apply_sets(pool, None, parse_sets([]), LabSettings(seed=seed))
    return alias, pool.controller, lab


def lab_run(policy: str, workload: str, shape: dict[str, Any], sets: list[str], seed: int = 0,
            trace: list | None = None) -> RunResult:
    pool = load_lab_pool(str(ROOT / "config" / "lab.yaml"))
    alias, pool, lab = apply_sets(pool, None, parse_sets([f"autoscaling_policy={policy}", *sets]), LabSettings(seed=seed))
    if trace is None:
        _, trace = workloads.load(workload, seed, {k: str(v) for k, v in shape.items()})
    return run(alias, pool.controller, lab, trace)


def speed(repeats: int) -> dict[str, Any]:
    try:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core, as the target says
    except (AttributeError, OSError):
        pass
    _, trace = workloads.load("diurnal", 0, {k: str(v) for k, v in CALIBRATION_DAY.items()})
    walls, peaks = [], []
    for k in range(repeats):
        started = time.perf_counter()
        r = lab_run("heteroscale", "diurnal", CALIBRATION_DAY, ["heteroscale.target_decode_tps_per_instance=300",
                                                                "heteroscale.max_instances=100"], trace=trace)
        walls.append(time.perf_counter() - started)
        peaks.append(max(sum(s.awake.values()) for s in r.samples))
        say(f"speed {k + 1}/{repeats}: {len(trace)} requests, 24 h, peak {peaks[-1]} instances, {walls[-1]:.1f} s")
    os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
    return {"requests": len(trace), "peak_instances": max(peaks), "seconds": [round(w, 2) for w in walls],
            "median_s": round(statistics.median(walls), 2)}


def calibrated(seed: int) -> Calibration:
    """Hybrid parameters the way `modelpool calibrate` finds them, on the calibration day compressed 12-fold."""
    day, _ = held_out_days(seed)
    calibration = calibrate_on(*lab_pool(day.seed), day.trace(CALIBRATION_COMPRESS))
    say(f"calibrated on the calibration day (seed {day.seed}, compressed {CALIBRATION_COMPRESS}-fold) in "
        f"{calibration.lab_runs} lab runs: {calibration.params}")
    return calibration


def heldout(seed: int, calibration: Calibration) -> Comparison:
    _, day = held_out_days(seed)
    trace = day.trace()
    say(f"held-out day (seed {day.seed}, {day.shape}): {len(trace)} requests")
    return score_policies(*lab_pool(day.seed), trace, calibration, say=lambda text: say(f"held-out day: {text}"))


def mooncake_day(seed: int, calibration: Calibration, trace_file: Path | None) -> Comparison:
    """A day at the Mooncake conversation hour's arrival rate (the released file's, read off it in samples, or
    `trace_file`'s own timestamps'), stretched over 24 h, at the held-out day's peak and lengths."""
    day = Day(held_out_days(seed)[1].seed, MOONCAKE_DAY, "mooncake-day")
    if trace_file:
        curve = rate_from_timestamps([r.timestamp for r in read_mooncake(trace_file)])
        trace = workloads.curve_day(curve, day.seed, {k: str(v) for k, v in day.shape.items()})
    else:
        trace = day.trace()
    say(f"Mooncake day ({trace_file or 'the released conversation trace'}'s rate, {day.shape}): {len(trace)} requests")
    return score_policies(*lab_pool(day.seed), trace, calibration, say=lambda text: say(f"Mooncake day: {text}"))


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
    parser.add_argument("--plot-dir", type=Path,
                        help="write lab_heldout.png, lab_mooncake_day.png and lab_bursty.png here")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated, of {', '.join(SECTIONS)} (default all)")
    parser.add_argument("--trace", type=Path, help="a Mooncake-format file (the released conversation trace) for the "
                                                   "Mooncake day, in place of one generated to its statistics")
    args = parser.parse_args()
    sections = [x for x in args.sections.split(",") if x]
    if unknown := set(sections) - set(SECTIONS):
        parser.error(f"unknown section(s) {', '.join(sorted(unknown))}; known: {', '.join(SECTIONS)}")

    out: dict[str, Any] = {}
    summary: dict[str, Any] = {}
    plots: list[tuple[list[RunResult], str, str]] = []
    if "speed" in sections:
        out["speed"] = fast = speed(args.repeats)
        summary |= {"lab_seconds_24h_100": fast["median_s"],
                    "lab_seconds_24h_100_spread": [min(fast["seconds"]), max(fast["seconds"])]}
    calibration = calibrated(args.seed) if {"heldout", "mooncake", "bursty"} & set(sections) else None
    if calibration:
        out["calibrated"] = {"settings": calibration.params,
                             "heteroscale_target_tps": calibration.heteroscale_target_tps,
                             "lab_runs": calibration.lab_runs, "derivation": calibration.derivation}
    for name, figure, title, compare in (
            ("heldout", "lab_heldout.png", "the held-out day (calibrated on another)",
             lambda: heldout(args.seed, calibration)),
            ("mooncake", "lab_mooncake_day.png", "a day at the Mooncake conversation trace's arrival rate",
             lambda: mooncake_day(args.seed, calibration, args.trace))):
        if name not in sections:
            continue
        comparison = compare()
        out[name] = table = comparison.table()
        summary[name] = {k: {m: table["runs"][k][m] for m in ("slo_attainment", "gpu_mem_s", "scale_actions",
                                                               "gpu_mem_ratio_to_always_on")} for k in KEYS}
        plots.append((list(comparison.runs.values()), figure, f"modelpool lab: {title}, every policy"))
    if "heldout" in sections:
        # The hybrid's GPU memory over the always-on pool's, now on the day it was not calibrated on.
        summary["gpu_mem_s_ratio_hybrid_vs_always_on"] = out["heldout"]["runs"]["hybrid"]["gpu_mem_ratio_to_always_on"]
    if "bursty" in sections:
        burst = bursty(args.seed, calibration.heteroscale_target_tps)
        plots.append((burst.pop("_runs"), "lab_bursty.png", "modelpool lab: bursty trace, five policies"))
        out["bursty"] = burst
        summary |= {"slo_attainment": {p: burst["runs"][p]["slo_attainment"] for p in POLICIES},
                    "scale_actions": {p: burst["runs"][p]["scale_actions"] for p in POLICIES}}
    if "agreement" in sections:
        out["agreement"] = asyncio.run(agreement(args.seed))
    if args.plot_dir:
        from lab.plots import plot_runs

        args.plot_dir.mkdir(parents=True, exist_ok=True)
        for runs, filename, title in plots:
            plot_runs(runs, args.plot_dir / filename, title)
    print(json.dumps(out, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
