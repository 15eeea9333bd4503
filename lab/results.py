"""One lab run: set up, run, summarise (the numbers `modelpool lab` prints, writes and plots)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lab.cluster import Cluster
from lab.outcomes import LogLine, WindowSample, RequestResult
from lab.config import LabSettings, tier_models
from lab.record import RunRecord
from shared.contracts.config import AliasConfig, ControllerConfig
from shared.contracts.control import Decision
from shared.contracts.trace import TraceRequest


@dataclass
class RunResult:
    policy: str
    alias: AliasConfig
    served: list[RequestResult]
    samples: list[WindowSample]
    log: list[LogLine]
    record: RunRecord
    summary: dict[str, Any] = field(default_factory=dict)


def run(alias: AliasConfig, controller: ControllerConfig, lab: LabSettings, trace: list[TraceRequest], *,
        progress: Callable[[float], None] | None = None,
        on_decision: Callable[[float, Decision], None] | None = None) -> RunResult:
    tiers = tier_models(alias)
    cluster = Cluster(alias, controller, tiers, lab, trace, progress=progress, on_decision=on_decision)
    started = time.perf_counter()
    cluster.run()
    wall = time.perf_counter() - started
    result = RunResult(alias.autoscaling_policy.name, alias, cluster.served, cluster.samples, cluster.log, cluster.record)
    result.summary = summarise(cluster, lab, wall)
    return result


BRIEF = ("requests", "lost", "slo_attainment", "ttft_s", "e2e_s", "scale_actions", "routing_switches", "gpu_mem_s",
         "objective", "wall_s")


def brief(result: RunResult) -> dict[str, Any]:
    """The summary's measures a comparison's table shows."""
    return {k: result.summary[k] for k in BRIEF}


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None, "p99": None}
    a = np.asarray(values)
    return {f"p{q}": round(float(np.percentile(a, q)), 4) for q in (50, 95, 99)}


def summarise(cluster: Cluster, lab: LabSettings, wall_s: float) -> dict[str, Any]:
    served = cluster.served
    answered = [s for s in served if s.lost is None]
    ttft = [s.ttft for s in answered if s.ttft is not None]
    e2e = [s.e2e for s in answered if s.e2e is not None]
    met = sum(1 for s in answered if s.ttft is not None and s.ttft <= lab.ttft_slo_s
              and (s.tbt is None or s.tbt <= lab.tbt_slo_s))
    horizon = cluster.samples[-1].t if cluster.samples else 0.0
    first = min((s.arrival for s in served), default=0.0)
    last_done = max((s.arrival + s.e2e for s in answered if s.e2e is not None), default=first)
    scale_actions = sum(1 for line in cluster.log if line.action == "autoscaling_decision")
    switches = sum(1 for line in cluster.log if line.action == "routing_switch")
    objective = float(np.mean([s.objective for s in cluster.samples])) if cluster.samples else 0.0
    return {
        "policy": cluster.alias.autoscaling_policy.name,
        "engines": {b.value: m.engine for b, m in cluster.tiers.items()},
        "requests": len(served),
        "answered": len(answered),
        "lost": len(served) - len(answered),
        "lost_reasons": dict(Counter(s.lost for s in served if s.lost)),
        "served_by": dict(Counter(s.backend or "-" for s in answered)),
        "ttft_s": _percentiles(ttft),
        "e2e_s": _percentiles(e2e),
        "slo_attainment": round(met / len(served), 4) if served else None,
        "throughput_rps": round(len(answered) / max(1e-9, last_done - first), 4),
        "scale_actions": scale_actions,
        "routing_switches": switches,
        "session_moves": cluster.session_moves,
        "commands": cluster.commands,
        "gpu_mem_s": round(cluster.memory_gb_s, 1),
        "gpu_mem_gb_mean": round(cluster.memory_gb_s / max(1e-9, horizon), 3),
        "objective": round(objective, 4),
        "virtual_s": round(horizon, 1),
        "wall_s": round(wall_s, 2),
    }

