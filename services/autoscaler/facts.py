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
CHANGES_KEPT = 100_000
"""Changed instances noted for the controller at most; past this (no leader reading them) "any may have"."""
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
    received: dict[str, datetime] = field(default_factory=dict)
    """worker id -> when this controller last heard a new heartbeat of it, on the controller's own clock.
    Freshness and loss are judged by this, never by the heartbeat's `at`: a worker's clock may be off ours."""
    windows: dict[str, dict[datetime, dict[str, GatewayWindow]]] = field(default_factory=lambda: defaultdict(dict))
    merged: dict[str, dict[datetime, MetricWindow]] = field(default_factory=lambda: defaultdict(dict))
    """alias -> period -> the period's windows merged so far: merged as they arrive, not at every tick."""
    demand: dict[str, dict[str, DemandSignal]] = field(default_factory=lambda: defaultdict(dict))
    _statuses: dict[str, InstanceStatus] = field(default_factory=dict)
    _changed: dict[str, str] | None = None
    """instance id -> alias, for each instance whose status changed since `take_changes`; None: any may have."""
    _cut_at: datetime | None = None
    _cut: tuple[datetime, datetime] | None = None

    # ------------------------------------------------------------------ feeding

    def heard(self, heartbeat: WorkerHeartbeat, received_at: datetime) -> None:
        """A heartbeat arrived at `received_at` (the controller's clock); one older than the worker's last (by
        the worker's own clock) is ignored, and one already known changes nothing."""
        current = self.heartbeats.get(heartbeat.worker_id)
        if current is not None and heartbeat.at <= current.at:
            return
        self.heartbeats[heartbeat.worker_id] = heartbeat
        self.received[heartbeat.worker_id] = received_at
        # Keep the per-instance index up to date here, a worker at a time, rather than
        # rebuilding it for every instance at every tick. A status that says what the
        # last one said is kept as the same object, and only the others are noted as
        # changed: the controller rebuilds its view of those instances alone.
        statuses = self._statuses
        gone = {s.instance_id: s.alias for s in current.instances} if current is not None else {}
        for status in heartbeat.instances:
            gone.pop(status.instance_id, None)
            old = statuses.get(status.instance_id)
            if old is None or not _says_the_same(old, status):
                statuses[status.instance_id] = status
                self._note_change(status.instance_id, status.alias)
        for instance_id, alias in gone.items():
            statuses.pop(instance_id, None)
            self._note_change(instance_id, alias)

    def _note_change(self, instance_id: str, alias: str) -> None:
        if self._changed is not None:
            self._changed[instance_id] = alias
            if len(self._changed) > CHANGES_KEPT:  # nobody reads them (a standby): say "everything" instead
                self._changed = None

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
        ready = self._cutoffs(now)[0]
        newest = None
        for window in (self.merged.get(alias) or {}).values():
            if window.window_end <= ready and (newest is None or window.window_start > newest.window_start):
                newest = window
        return newest

    def waiting(self, alias: str, now: datetime) -> int:
        """Requests the gateways hold for the alias right now."""
        signals = self.demand.get(alias)
        if not signals:
            return 0
        fresh = self._cutoffs(now)[1]
        return sum(s.held for s in signals.values() if s.at >= fresh)

    def _cutoffs(self, now: datetime) -> tuple[datetime, datetime]:
        """(windows ended by, demand heard since) for `now`: worked out once per tick, not once per alias."""
        if self._cut_at != now:
            self._cut_at, self._cut = now, (now - timedelta(seconds=WINDOW_GRACE_S), now - timedelta(seconds=DEMAND_FRESH_S))
        return self._cut

    def take_changes(self) -> dict[str, str] | None:
        """The instances whose status changed since the last call (id -> alias); None when any may have."""
        changed, self._changed = self._changed, {}
        return changed

    def statuses(self) -> dict[str, InstanceStatus]:
        """instance id -> its latest status."""
        return self._statuses

    def fresh_workers(self, now: datetime) -> set[str]:
        """Workers heard from within STALE_AFTER_REPORTS of their report intervals: their reports still count."""
        return {w for w, hb in self.heartbeats.items()
                if (now - self.received[w]).total_seconds() <= STALE_AFTER_REPORTS * hb.interval_s}

    def last_heard(self, worker_id: str) -> datetime | None:
        """When this controller last heard a new heartbeat of the worker (its own clock)."""
        return self.received.get(worker_id)
