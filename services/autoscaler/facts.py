"""The live facts the controller decides from: heartbeats, metric windows and demand off the bus.

`LiveFacts` is fed by the bus (see `controller.py`) and read at every tick; it
keeps only the newest of each, so its memory is bounded by the number of
workers, gateways and aliases, not by load.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from shared.contracts.control import MetricWindow
from shared.contracts.telemetry import (
    DemandSignal,
    GatewayWindow,
    InstanceStatus,
    WorkerHeartbeat,
    merge_windows,
)

WINDOW_GRACE_S = 0.3
"""A window is merged this long after it ends, so every replica's copy has arrived."""
DEMAND_FRESH_S = 2.5
"""Gateways repeat demand every second while they hold requests; older news is stale."""
KEPT_PERIODS = 4
STALE_AFTER_REPORTS = 3
"""A worker not heard from for this many of its report intervals: its instances' reports no longer count
(not a healthy probe, no load); lost only after MODELPOOL_WORKER_TIMEOUT_S."""


def _says_the_same(old: InstanceStatus, new: InstanceStatus) -> bool:
    """Whether two statuses of an instance agree on everything the controller reads of them."""
    return (old.status is new.status and old.inflight_requests == new.inflight_requests and old.capacity == new.capacity
            and old.sleep_level == new.sleep_level and old.last_active_at == new.last_active_at
            and old.healthy == new.healthy)


@dataclass
class LiveFacts:
    heartbeats: dict[str, WorkerHeartbeat] = field(default_factory=dict)
    windows: dict[str, dict[datetime, dict[str, GatewayWindow]]] = field(default_factory=lambda: defaultdict(dict))
    merged: dict[str, dict[datetime, MetricWindow]] = field(default_factory=lambda: defaultdict(dict))
    """alias -> period -> the period's windows merged so far: merged as they arrive, not at every tick."""
    demand: dict[str, dict[str, DemandSignal]] = field(default_factory=lambda: defaultdict(dict))
    _statuses: dict[str, InstanceStatus] = field(default_factory=dict)

    # ------------------------------------------------------------------ feeding

    def heard(self, heartbeat: WorkerHeartbeat) -> None:
        current = self.heartbeats.get(heartbeat.worker_id)
        if current is not None and heartbeat.at < current.at:
            return
        self.heartbeats[heartbeat.worker_id] = heartbeat
        # Keep the per-instance index up to date here, a worker at a time, rather than
        # rebuilding it for every instance at every tick. A status that says what the
        # last one said is kept as the same object: the controller then knows at a
        # glance that nothing changed for that instance.
        previous = self._statuses
        if current is not None:
            for status in current.instances:
                previous.pop(status.instance_id, None)
        for status in heartbeat.instances:
            old = previous.get(status.instance_id)
            if old is None or not _says_the_same(old, status):
                previous[status.instance_id] = status

    def window(self, window: GatewayWindow) -> None:
        periods = self.windows[window.alias]
        by_gateway = periods.setdefault(window.window_start, {})
        by_gateway[window.gateway_id] = window
        merged = self.merged[window.alias]
        merged[window.window_start] = merge_windows(list(by_gateway.values()))
        for old in sorted(periods)[:-KEPT_PERIODS]:
            del periods[old]
            merged.pop(old, None)

    def demanded(self, signal: DemandSignal) -> None:
        self.demand[signal.alias][signal.gateway_id] = signal

    # ------------------------------------------------------------------ reading

    def metrics(self, alias: str, now: datetime) -> MetricWindow | None:
        """The newest period every gateway has had time to report, merged over the gateways."""
        ready = now - timedelta(seconds=WINDOW_GRACE_S)
        newest = None
        for window in (self.merged.get(alias) or {}).values():
            if window.window_end <= ready and (newest is None or window.window_start > newest.window_start):
                newest = window
        return newest

    def waiting(self, alias: str, now: datetime) -> int:
        """Requests the gateways hold for the alias right now."""
        fresh = now - timedelta(seconds=DEMAND_FRESH_S)
        return sum(s.held for s in self.demand.get(alias, {}).values() if s.at >= fresh)

    def statuses(self) -> dict[str, InstanceStatus]:
        """instance id -> its latest status."""
        return self._statuses

    def fresh_workers(self, now: datetime) -> set[str]:
        """Workers heard from within STALE_AFTER_REPORTS of their report intervals: their reports still count."""
        return {w for w, hb in self.heartbeats.items()
                if (now - hb.at).total_seconds() <= STALE_AFTER_REPORTS * hb.interval_s}

    def last_heard(self, worker_id: str) -> datetime | None:
        hb = self.heartbeats.get(worker_id)
        return hb.at if hb else None
