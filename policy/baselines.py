"""The baselines seed 001 compares HeteroScale with: utilization, latency and periodic.

- utilization (Kubernetes' HPA rule): u = requests on the tier and waiting for
  it / the tier's request slots; desired = ceil(current x u / target_utilization),
  unchanged while u / target is within 1 +- tolerance;
- latency: a step controller; + `step` instances when the window's TTFT p95 or
  TBT p95 is above its SLO, - `step` when both are below `scale_in_below` of it;
- periodic: a fixed schedule of instances by time of day (of `period_s`), as
  an operator sets it from last week's traffic; it reads no load at all.
"""

from __future__ import annotations

import math
from datetime import datetime

from policy.census import TierCensus
from policy.load import Load
from policy.replicas import Count, ReplicaPolicy, served_inflight
from policy.text import fmt
from shared.contracts.backends import BackendType
from shared.contracts.policies import LatencyConfig, PeriodicConfig, UtilizationConfig
from shared.contracts.control import AliasSnapshot
from shared.contracts.states import InstanceState


class UtilizationPolicy(ReplicaPolicy[UtilizationConfig]):
    name = "utilization"
    config_type = UtilizationConfig

    def count(self, s: AliasSnapshot, cfg: UtilizationConfig, backend: BackendType, load: Load, c: TierCensus,
              now: datetime) -> Count:
        current = c.supply
        running = [i for i in c.awake if i.state is InstanceState.RUNNING]
        slots = sum(i.capacity or 1 for i in running)
        used = served_inflight(load, backend)
        if not slots:
            n = max(current, 1 if load.busy else 0)
            return Count(n, f"no running {backend.value} instance to measure: {n}")
        u = used / slots
        ratio = u / cfg.target_utilization
        head = f"utilization {fmt(used)}/{slots} = {u:.2f}, target {fmt(cfg.target_utilization)}"
        if abs(ratio - 1) <= cfg.tolerance:
            return Count(current, f"hold, {head} (within {fmt(cfg.tolerance)})")
        desired = math.ceil(round(len(running) * ratio, 9))
        kind = "scale_out" if desired > current else "scale_in" if desired < current else "hold"
        return Count(desired, f"{kind} {current}->{desired}, {head}: ceil({len(running)} x {ratio:.2f})")


class LatencyPolicy(ReplicaPolicy[LatencyConfig]):
    name = "latency"
    config_type = LatencyConfig

    def count(self, s: AliasSnapshot, cfg: LatencyConfig, backend: BackendType, load: Load, c: TierCensus,
              now: datetime) -> Count:
        current = c.supply
        m = s.metrics
        if m is None:
            return Count(current, "no metric window yet: hold")
        ttft, tbt = m.ttft_p95_s, m.tbt_p95_s
        head = f"ttft_p95={fmt(ttft)}s (SLO {fmt(cfg.ttft_slo)}), tbt_p95={fmt(tbt)}s (SLO {fmt(cfg.tbt_slo)})"
        if (ttft is not None and ttft > cfg.ttft_slo) or (tbt is not None and tbt > cfg.tbt_slo):
            return Count(current + cfg.step, f"scale_out {current}->{current + cfg.step}, {head}")
        low_ttft = ttft is None or ttft < cfg.scale_in_below * cfg.ttft_slo
        low_tbt = tbt is None or tbt < cfg.scale_in_below * cfg.tbt_slo
        if low_ttft and low_tbt and load.queued == 0 and current:
            n = max(0, current - cfg.step)
            return Count(n, f"scale_in {current}->{n}, {head}: both below {fmt(cfg.scale_in_below)} x SLO")
        return Count(current, f"hold, {head}")


class PeriodicPolicy(ReplicaPolicy[PeriodicConfig]):
    name = "periodic"
    config_type = PeriodicConfig

    def count(self, s: AliasSnapshot, cfg: PeriodicConfig, backend: BackendType, load: Load, c: TierCensus,
              now: datetime) -> Count:
        offset = now.timestamp() % cfg.period_s
        n = cfg.replicas_at(offset)
        kind = "scale_out" if n > c.supply else "scale_in" if n < c.supply else "hold"
        return Count(n, f"{kind} {c.supply}->{n}, schedule at {fmt(offset)} s of {fmt(cfg.period_s)} s")
