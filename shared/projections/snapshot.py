"""Gathering one alias's snapshot from the read models and the live facts (no I/O here)."""

from __future__ import annotations

import operator
import uuid
from collections.abc import Iterable, Mapping
from datetime import datetime

from shared.contracts.config import AliasConfig, ControllerConfig
from shared.contracts.building import new_instance_view, new_snapshot
from shared.contracts.control import NO_HOLD, AliasSnapshot, InstanceView, MetricWindow, PendingCommand, PolicyState
from shared.contracts.telemetry import InstanceStatus
from shared.projections.rows import ControlRow, InstanceNote, InstanceRow, RoutingRow

_BY_ID = operator.attrgetter("instance_id")


def recorded_state(control_row: ControlRow | None) -> PolicyState:
    """The policy state after the alias's last recorded decision (a fresh one if there is none)."""
    return control_row.state if control_row is not None and control_row.state is not None else PolicyState()


def instance_view(row: InstanceRow, reported: InstanceStatus | None, worker_up: bool, fresh: bool,
                  note: InstanceNote | None) -> InstanceView:
    """One instance as the log says (`row`) and its worker last reported (`fresh`: recently enough to count)."""
    return new_instance_view(
        row.instance_id, row.backend_type, row.engine, row.worker_id, row.state, row.updated_at, row.sleep_level,
        *_as_reported(row, reported, worker_up, fresh),
        frozenset(note.unsupported) if note else frozenset(), note.last_failure if note else None, row.role,
    )


def reported_again(view: InstanceView, row: InstanceRow, reported: InstanceStatus | None, worker_up: bool,
                   fresh: bool) -> InstanceView:
    """`view` with a new report of its worker (its row and notes unchanged)."""
    return new_instance_view(view.instance_id, view.backend, view.engine, view.worker_id, view.state, view.state_since,
                             view.sleep_level, *_as_reported(row, reported, worker_up, fresh), view.unsupported,
                             view.last_failure, view.role)


def _as_reported(row: InstanceRow, reported: InstanceStatus | None, worker_up: bool,
                 fresh: bool) -> tuple[int | None, int, datetime | None, bool]:
    """capacity, inflight, last_active_at and healthy, as the instance's worker reports them."""
    if reported is None:
        return row.capacity, 0, None, False
    return (reported.capacity or row.capacity, reported.inflight_requests if fresh else 0, reported.last_active_at,
            worker_up and fresh and reported.healthy)


def instance_views(rows: Iterable[InstanceRow], statuses: Mapping[str, InstanceStatus], workers_up: set[str],
                   fresh_workers: set[str], notes: Mapping[str, InstanceNote]) -> tuple[InstanceView, ...]:
    """An alias's instance views built afresh, by instance id."""
    return tuple(instance_view(row, statuses.get(row.instance_id), row.worker_id in workers_up,
                               row.worker_id in fresh_workers, notes.get(row.instance_id))
                 for row in sorted(rows, key=_BY_ID))


def parse_pending(control_row: ControlRow) -> tuple[PendingCommand, ...]:
    return tuple(
        PendingCommand(command_id=uuid.UUID(command_id), action=c.action, backend=c.backend, instance_id=c.instance_id,
                       issued_at=c.issued_at, level=c.level, role=c.role)
        for command_id, c in sorted(control_row.pending.items())
    )


class InstanceViews:
    """Each alias's instance views, kept from one tick to the next and rebuilt only where something changed.

    A tick sees thousands of instances and most look as they did a second ago, so
    the views are not rebuilt from every row at every tick. The owner says what
    changed before each tick (`begin`): which instances' worker reports (from the
    live facts), and which aliases' rows or notes (from the log). An alias with
    neither keeps its views; one with changed reports only rebuilds those
    instances'; one with changed rows is checked row by row, where an unchanged
    row (same `updated_at`) with an unchanged report keeps its view. A change in
    which workers are up or fresh (rare) has every alias checked row by row.
    """

    def __init__(self) -> None:
        self._views: dict[str, tuple[InstanceRow, InstanceStatus | None, bool, bool, InstanceNote | None,
                                     InstanceView]] = {}
        self._by_alias: dict[str, tuple[InstanceView, ...]] = {}
        self._rows: dict[str, dict[str, InstanceRow]] = {}
        """alias -> instance id -> the row its view was built from."""
        self._reported: dict[str, set[str]] = {}
        """alias -> instances whose reports changed since their views were built."""
        self._workers: tuple[frozenset[str], frozenset[str]] | None = None
        self._statuses: Mapping[str, InstanceStatus] = {}
        self._pending: dict[str, tuple[tuple[str, ...], tuple[PendingCommand, ...]]] = {}

    def begin(self, statuses: Mapping[str, InstanceStatus], workers_up: set[str], fresh_workers: set[str],
              changed_reports: Mapping[str, str] | None, changed_aliases: Iterable[str] | None) -> None:
        """Before a tick: the reports now, the workers up and fresh, and what changed since the last tick.

        `changed_reports`: instance id -> alias for each changed report; `changed_aliases`: aliases
        whose instance rows or notes changed. None for either: anything may have changed.
        """
        self._statuses = statuses
        workers = (frozenset(workers_up), frozenset(fresh_workers))
        if changed_reports is None or changed_aliases is None or workers != self._workers:
            self._by_alias.clear()
            self._reported.clear()
        else:
            for alias in changed_aliases:
                self._by_alias.pop(alias, None)
            for instance_id, alias in changed_reports.items():
                if alias in self._by_alias:
                    self._reported.setdefault(alias, set()).add(instance_id)
        self._workers = workers

    def of(self, alias: str, rows: Iterable[InstanceRow], notes: Mapping[str, InstanceNote]) -> tuple[InstanceView, ...]:
        """The alias's instance views, by instance id. `rows` is only read when they changed."""
        views = self._by_alias.get(alias)
        if views is None:
            self._reported.pop(alias, None)
            views = self._check_rows(alias, rows, notes)
        else:
            reported = self._reported.pop(alias, None)
            if reported:
                views = self._rebuild(alias, views, reported)
        self._by_alias[alias] = views
        return views

    def _rebuild(self, alias: str, views: tuple[InstanceView, ...], changed: set[str]) -> tuple[InstanceView, ...]:
        rows, statuses = self._rows[alias], self._statuses
        up, fresh = self._workers  # type: ignore[misc]
        rebuilt = []
        for view in views:
            if view.instance_id in changed:
                row, reported = rows[view.instance_id], statuses.get(view.instance_id)
                worker_up, worker_fresh = view.worker_id in up, view.worker_id in fresh
                view = reported_again(view, row, reported, worker_up, worker_fresh)
                cached = self._views[view.instance_id]
                self._views[view.instance_id] = (cached[0], reported, worker_up, worker_fresh, cached[4], view)
            rebuilt.append(view)
        return tuple(rebuilt)

    def _check_rows(self, alias: str, rows: Iterable[InstanceRow], notes: Mapping[str, InstanceNote]) -> tuple[InstanceView, ...]:
        cache, statuses = self._views, self._statuses
        up_workers, fresh_workers = self._workers  # type: ignore[misc]
        ordered = sorted(rows, key=_BY_ID)
        self._rows[alias] = {row.instance_id: row for row in ordered}
        views = []
        for row in ordered:
            instance_id, worker_id = row.instance_id, row.worker_id
            reported = statuses.get(instance_id)
            up, fresh = worker_id in up_workers, worker_id in fresh_workers
            note = notes.get(instance_id)
            cached = cache.get(instance_id)
            # Identities first: rows are frozen (a changed row is a new object), and the facts keep an
            # unchanged status as the same object (a changed one is not compared field by field).
            if (cached is not None and cached[0] is row and cached[1] is reported and cached[2] is up
                    and cached[3] is fresh and cached[4] == note):
                views.append(cached[5])
                continue
            view = instance_view(row, reported, up, fresh, note)
            cache[instance_id] = (row, reported, up, fresh, note, view)
            views.append(view)
        return tuple(views)

    def pending(self, control_row: ControlRow) -> tuple[PendingCommand, ...]:
        """An alias's commands in flight, parsed again only when the set of them changed."""
        key = tuple(control_row.pending)
        cached = self._pending.get(control_row.alias)
        if cached is not None and cached[0] == key:
            return cached[1]
        parsed = parse_pending(control_row)
        self._pending[control_row.alias] = (key, parsed)
        return parsed

    def forget(self, instance_ids: Iterable[str]) -> None:
        """Instances gone from the log: their cached views go too."""
        for instance_id in instance_ids:
            self._views.pop(instance_id, None)


def build_snapshot(
    *,
    config: AliasConfig,
    controller: ControllerConfig,
    routing_row: RoutingRow | None,
    control_row: ControlRow | None,
    instances: tuple[InstanceView, ...],
    metrics: MetricWindow | None,
    demand: int,
    state: PolicyState,
    views: InstanceViews | None = None,
) -> AliasSnapshot:
    """`instances`: from `InstanceViews.of`, or `instance_views` where nothing is kept between snapshots."""
    pending = () if control_row is None else views.pending(control_row) if views is not None else parse_pending(control_row)
    return new_snapshot(
        alias=config.alias,
        version=control_row.version if control_row else 0,
        config=config,
        controller=controller,
        routing_state=routing_row.state if routing_row else config.routing_state,
        routing_since=routing_row.switched_at if routing_row else None,
        mix_weight=routing_row.mix_weight if routing_row else 0.0,
        targets=dict(routing_row.targets) if routing_row else {},
        state=state,
        instances=instances,
        pending=pending,
        metrics=metrics,
        demand=demand,
        start_failures=dict(control_row.start_failures) if control_row else {},
        operator=control_row.operator if control_row else NO_HOLD,
    )
