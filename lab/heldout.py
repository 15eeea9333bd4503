"""Every policy scored on a day its parameters never saw.

Parameters tuned on a day and scored on that same day measure how well the
search fits the day, not how the policy does tomorrow. So the hybrid is
calibrated on one day (`modelpool calibrate`'s pipeline, `calibrate_on`) and
every policy runs on another, of another seed and shape (`held_out_days`), or
on any other trace (`score_policies`):

- the hybrid with the calibrated parameters, and with seed 000's defaults;
- HeteroScale, its target from the same calibration (0.7 x the saturated decode rate);
- utilization and latency at their defaults;
- periodic, an hourly schedule sized from the scored day's own arrivals for the
  utilisation HeteroScale targets: each hour, the decode tokens per second its
  requests ask for over HeteroScale's target per instance (0.7 x the saturated
  decode rate, the same calibration), so each instance runs at 70 % of its
  saturated rate on the hour's mean and has 30 % headroom; each hour's
  instances started a vLLM start-up ahead of it. A schedule that knows the day
  in advance and scales as HeteroScale would on each hour's mean;
- always-on vLLM, the fewest instances that meet the calibrated hybrid's SLO
  attainment (doubling, then bisection).

Each is reported with its SLO attainment, GPU-memory-seconds, scale actions and
its GPU memory over the always-on pool's.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lab import workloads
from lab.calibrate import Calibration
from lab.config import LabSettings, tier_models
from lab.results import RunResult, brief, run
from shared.contracts.backends import BackendType
from shared.contracts.config import AliasConfig, ControllerConfig
from shared.contracts.policies import HeteroScaleConfig
from shared.contracts.trace import TraceRequest

CALIBRATION_DAY = {"peak_rate": 12, "trough_rate": 0.02, "output_tokens": 2048, "peakiness": 3}
"""Busy afternoons, quiet nights: peak 12 requests/s at 4 pm, 0.02 at 4 am, answers of 2,048 tokens median."""
SCORED_DAY = {**CALIBRATION_DAY, "peakiness": 2, "trough_at_s": 7 * 3600, "bursts": 8, "burst_s": 900,
              "burst_peak_share": 0.5}
"""The same service on another day: peak at 7 pm, a broader busy period (peakiness 2), and eight 15-minute bursts
at random times, each adding half the peak rate (6 requests/s) wherever it lands, which the calibration day does
not have."""
MOONCAKE_DAY = {"peak_rate": SCORED_DAY["peak_rate"], "output_tokens": SCORED_DAY["output_tokens"]}
"""A day at the Mooncake conversation trace's arrival rate (`mooncake-day`: its hour's curve over 24 h), its peak
the scored day's and its requests' lengths the diurnal days' (prompts 512 tokens median, answers 2,048), so
that the SLO is within reach and the day measures the scaling, not prompt length."""
CALIBRATION_COMPRESS = 12
"""The calibration's search runs the calibration day compressed 12-fold (24 h in 2 h), as `modelpool calibrate`
would be run for a quick answer."""
HOUR_S = 3600.0
LARGEST_ALWAYS_ON = 64

KEYS = ("hybrid", "hybrid_defaults", "heteroscale", "utilization", "latency", "periodic", "always_on")
"""The policies of a comparison, in the order of its table."""


@dataclass(frozen=True)
class Day:
    seed: int
    shape: dict[str, float]
    """The workload's settings."""
    workload: str = "diurnal"

    def trace(self, compress: float = 1.0) -> list[TraceRequest]:
        settings = {**self.shape, **({"compress": compress} if compress != 1.0 else {})}
        return workloads.load(self.workload, self.seed, {k: str(v) for k, v in settings.items()})[1]


def held_out_days(seed: int) -> tuple[Day, Day]:
    """(the day calibrated on, the day scored): another seed, peak hour, peakiness and burst pattern."""
    return Day(seed, CALIBRATION_DAY), Day(seed + 1, SCORED_DAY)


@dataclass
class Comparison:
    runs: dict[str, RunResult]
    """By `KEYS`, each run's `policy` its label."""
    always_on_instances: int
    always_on_tried: list[dict[str, Any]]
    periodic_schedule: list[tuple[float, int]]
    periodic_target_tps: float
    """The decode tokens per second per instance the periodic schedule is sized for (HeteroScale's target)."""
    requests: int

    def table(self) -> dict[str, Any]:
        always = self.runs["always_on"].summary["gpu_mem_s"]
        return {
            "requests": self.requests,
            "runs": {k: {"label": r.policy, **brief(r),
                         "gpu_mem_ratio_to_always_on": round(r.summary["gpu_mem_s"] / always, 3)}
                     for k, r in self.runs.items()},
            "always_on_instances": self.always_on_instances, "always_on_tried": self.always_on_tried,
            "periodic_schedule": self.periodic_schedule, "periodic_target_tps": self.periodic_target_tps,
        }


def with_policy(alias: AliasConfig, policy: dict[str, Any]) -> AliasConfig:
    return AliasConfig.model_validate({**alias.model_dump(mode="json"), "autoscaling_policy": policy})


def score_policies(alias: AliasConfig, controller: ControllerConfig, lab: LabSettings, trace: list[TraceRequest],
                   calibration: Calibration, say: Callable[[str], None] = lambda _: None) -> Comparison:
    """Every policy on `trace`, the hybrid's and HeteroScale's parameters from `calibration` (made on another trace)."""

    def scored(label: str, policy: dict[str, Any]) -> RunResult:
        result = run(with_policy(alias, policy), controller, lab, trace)
        result.policy = label
        s = result.summary
        say(f"{label}: SLO {s['slo_attainment']:.2%}, {s['gpu_mem_s'] / 3600:,.0f} GB·h, "
            f"{s['scale_actions']} scale actions")
        return result

    # With no saturated rate in the calibration's record, HeteroScale runs (and periodic is sized) at its default.
    target = calibration.heteroscale_target_tps or HeteroScaleConfig().target_decode_tps_per_instance
    slow = tier_models(alias)[BackendType.VLLM]
    schedule = hourly_schedule(trace, target, lead_s=slow.startup_s)
    runs = {
        "hybrid": scored("hybrid, calibrated", {"name": "hybrid", **calibration.params}),
        "hybrid_defaults": scored("hybrid, seed 000 defaults", {"name": "hybrid"}),
        "heteroscale": scored("heteroscale", {"name": "heteroscale", "target_decode_tps_per_instance": target}),
        "utilization": scored("utilization", {"name": "utilization"}),
        "latency": scored("latency", {"name": "latency"}),
        "periodic": scored("periodic, hourly at HeteroScale's target", {
            "name": "periodic", "schedule": [list(entry) for entry in schedule], "min_instances": 1,
            "max_instances": max(n for _, n in schedule)}),
    }

    tried: dict[int, RunResult] = {}

    def always_on(n: int) -> RunResult:
        if n not in tried:
            tried[n] = scored(f"always-on, {n} vLLM", {"name": "periodic", "schedule": [[0, n]], "min_instances": n,
                                                       "max_instances": n})
        return tried[n]

    # The fewest always-on instances that meet the calibrated hybrid's attainment: doubling, then bisection.
    goal = runs["hybrid"].summary["slo_attainment"]
    high = 1
    while always_on(high).summary["slo_attainment"] < goal:
        if high >= LARGEST_ALWAYS_ON:
            raise RuntimeError(f"no always-on pool up to {LARGEST_ALWAYS_ON} instances meets the hybrid's "
                               f"SLO attainment")
        high *= 2
    low = high // 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if always_on(mid).summary["slo_attainment"] >= goal else (mid, high)
    runs["always_on"] = tried[high]
    return Comparison(
        runs={k: runs[k] for k in KEYS}, always_on_instances=high,
        always_on_tried=[{"instances": k, "slo_attainment": r.summary["slo_attainment"]}
                         for k, r in sorted(tried.items())],
        periodic_schedule=schedule, periodic_target_tps=target, requests=len(trace))


def hourly_schedule(trace: list[TraceRequest], target_decode_tps: float, lead_s: float,
                    hour_s: float = HOUR_S) -> list[tuple[float, int]]:
    """Instances per hour of the day for the trace's own arrivals (a later turn counted at its session's start
    plus the delays before it): ceil(the hour's answer tokens per second / `target_decode_tps`), at least one;
    each hour's count from `lead_s` before the hour, so its instances are up when it begins. Hours repeat by the
    day."""
    tokens: Counter[int] = Counter()
    clock: dict[str, float] = {}
    for r in trace:
        clock[r.session_id] = (0.0 if r.turn == 0 else clock[r.session_id]) + r.delay_s
        tokens[int(clock[r.session_id] // hour_s) % round(86_400 / hour_s)] += r.output_tokens
    hours = round(86_400 / hour_s)
    counts = [max(1, math.ceil(tokens[h] / hour_s / target_decode_tps)) for h in range(hours)]
    # Hour 0's instances are up from the start: the lead would put them at the end of the previous day.
    schedule = [(0.0, counts[0])] + [(h * hour_s - lead_s, counts[h]) for h in range(1, hours)]
    merged: list[tuple[float, int]] = []
    for at, n in schedule:
        if not merged or merged[-1][1] != n:
            merged.append((at, n))
    return merged
