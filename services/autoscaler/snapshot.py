"""Gathering one alias's snapshot from the read models and the live facts (no I/O here)."""

from __future__ import annotations

import operator
import uuid
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from pydantic import TypeAdapter

from shared.contracts.backends import Action, BackendType, EngineKind, Role
from shared.contracts.config import AliasConfig, PolicySettings
from shared.contracts.control import (
    AliasSnapshot,
    InstanceView,
    MetricWindow,
    PendingCommand,
    PolicyState,
    StartFailure,
    new_instance_view,
    new_snapshot,
)
from shared.contracts.states import InstanceState, RoutingState
from shared.contracts.telemetry import InstanceStatus

POLICY_STATE: TypeAdapter[PolicyState] = TypeAdapter(PolicyState)
# Enum lookups by value through dicts: a tick converts every instance's fields, and
# calling an Enum class costs ten times a dict lookup.
_BACKEND = {b.value: b for b in BackendType}
_ENGINE = {e.value: e for e in EngineKind}
_STATE = {s.value: s for s in InstanceState}
_ACTION = {a.value: a for a in Action}
_ROUTING = {r.value: r for r in RoutingState}
_ROLE = {r.value: r for r in Role}
_BY_ID = operator.itemgetter("instance_id")


def _when(value: Any) -> datetime:
    return value if isinstance(value, datetime) else datetime.fromisoformat(value)


def recorded_state(control_row: Mapping[str, Any] | None) -> PolicyState:
    """The policy state after the alias's last recorded decision (a fresh one if there is none)."""
    if not control_row or not control_row.get("state"):
        return PolicyState()
    return POLICY_STATE.validate_python(control_row["state"])


def instance_view(row: Mapping[str, Any], reported: InstanceStatus | None, worker_up: bool, fresh: bool,
                  note: Mapping[str, Any] | None) -> InstanceView:
    """One instance as the log says (`row`) and its worker last reported (`fresh`: recently enough to count)."""
    unsupported: frozenset[Action] = frozenset()
    last_failure = None
    if note:
        unsupported = frozenset(_ACTION[a] for a in note.get("unsupported", ()))
        if note.get("last_failure"):
            action, when = note["last_failure"]
            last_failure = (_ACTION[action], _when(when))
    return new_instance_view(
        row["instance_id"],
        _BACKEND[row["backend_type"]],
        _ENGINE[row["engine"]],
        row["worker_id"],
        _STATE[row["state"]],
        row["updated_at"],
        row["sleep_level"] or 0,
        *_as_reported(row, reported, worker_up, fresh),
        unsupported,
        last_failure,
        _ROLE.get(row.get("role")),
    )


def reported_again(view: InstanceView, row: Mapping[str, Any], reported: InstanceStatus | None, worker_up: bool,
                   fresh: bool) -> InstanceView:
    """`view` with a new report of its worker (its row and notes unchanged)."""
    return new_instance_view(view.instance_id, view.backend, view.engine, view.worker_id, view.state, view.state_since,
                             view.sleep_level, *_as_reported(row, reported, worker_up, fresh), view.unsupported,
                             view.last_failure, view.role)


def _as_reported(row: Mapping[str, Any], reported: InstanceStatus | None, worker_up: bool,
                 fresh: bool) -> tuple[int | None, int, datetime | None, bool]:
    """capacity, inflight, last_active_at and healthy, as the instance's worker reports them."""
    if reported is None:
        return row.get("capacity"), 0, None, False
    return (reported.capacity or row.get("capacity"), reported.inflight_requests if fresh else 0, reported.last_active_at,
            worker_up and fresh and reported.healthy)


def instance_views(rows: Iterable[Mapping[str, Any]], statuses: Mapping[str, InstanceStatus], workers_up: set[str],
                   fresh_workers: set[str], notes: Mapping[str, Any]) -> tuple[InstanceView, ...]:
    """An alias's instance views built afresh, by instance id."""
    return tuple(instance_view(row, statuses.get(row["instance_id"]), row["worker_id"] in workers_up,
                               row["worker_id"] in fresh_workers, notes.get(row["instance_id"]) if notes else None)
                 for row in sorted(rows, key=_BY_ID))


def parse_pending(control_row: Mapping[str, Any]) -> tuple[PendingCommand, ...]:
    return tuple(
        PendingCommand(command_id=uuid.UUID(command_id), action=_ACTION[c["action"]], backend=_BACKEND[c["backend"]],
                       instance_id=c["instance_id"], issued_at=_when(c["issued_at"]), level=c.get("level") or 0,
                       role=_ROLE.get(c.get("role")))
        for command_id, c in sorted((control_row.get("pending") or {}).items())
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
        self._views: dict[str, tuple[Any, InstanceStatus | None, bool, bool, str | None, InstanceView]] = {}
        self._by_alias: dict[str, tuple[InstanceView, ...]] = {}
        self._rows: dict[str, dict[str, Mapping[str, Any]]] = {}
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

    def of(self, alias: str, rows: Iterable[Mapping[str, Any]], notes: Mapping[str, Any]) -> tuple[InstanceView, ...]:
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

    def _check_rows(self, alias: str, rows: Iterable[Mapping[str, Any]], notes: Mapping[str, Any]) -> tuple[InstanceView, ...]:
        cache, statuses = self._views, self._statuses
        up_workers, fresh_workers = self._workers  # type: ignore[misc]
        ordered = sorted(rows, key=_BY_ID)
        self._rows[alias] = {row["instance_id"]: row for row in ordered}
        views = []
        for row in ordered:
            instance_id, worker_id, updated = row["instance_id"], row["worker_id"], row["updated_at"]
            reported = statuses.get(instance_id)
            up, fresh = worker_id in up_workers, worker_id in fresh_workers
            note = notes.get(instance_id) if notes else None
            noted = repr(note) if note else None  # notes change in place: compare what they say
            cached = cache.get(instance_id)
            # Identities first: the facts keep an unchanged status as the same object (a changed
            # one is not compared field by field), and an unchanged row keeps its timestamp.
            if (cached is not None and cached[1] is reported and cached[2] is up and cached[3] is fresh
                    and (cached[0] is updated or cached[0] == updated) and cached[4] == noted):
                views.append(cached[5])
                continue
            view = instance_view(row, reported, up, fresh, note)
            cache[instance_id] = (updated, reported, up, fresh, noted, view)
            views.append(view)
        return tuple(views)

    def pending(self, control_row: Mapping[str, Any]) -> tuple[PendingCommand, ...]:
        """An alias's commands in flight, parsed again only when the set of them changed."""
        commands = control_row.get("pending") or {}
        key = tuple(commands)
        cached = self._pending.get(control_row["alias"])
        if cached is not None and cached[0] == key:
            return cached[1]
        parsed = parse_pending(control_row)
        self._pending[control_row["alias"]] = (key, parsed)
        return parsed

    def forget(self, instance_ids: Iterable[str]) -> None:
        """Instances gone from the log: their cached views go too."""
        for instance_id in instance_ids:
            self._views.pop(instance_id, None)


def build_snapshot(
    *,
    config: AliasConfig,
    settings: PolicySettings,
    routing_row: Mapping[str, Any] | None,
    control_row: Mapping[str, Any] | None,
    instances: tuple[InstanceView, ...],
    metrics: MetricWindow | None,
    demand: int,
    state: PolicyState,
    views: InstanceViews | None = None,
) -> AliasSnapshot:
    """`instances`: from `InstanceViews.of`, or `instance_views` where nothing is kept between snapshots."""
    routing_row = routing_row or {}
    control_row = control_row or {}
    pending = () if not control_row else views.pending(control_row) if views is not None else parse_pending(control_row)
    failures = {
        _BACKEND[backend]: StartFailure(f["instance_id"], _when(f["at"]), f["reason"])
        for backend, f in (control_row.get("start_failures") or {}).items()
    }
    return new_snapshot(
        alias=config.alias,
        version=control_row.get("version", 0),
        config=config,
        settings=settings,
        routing_state=_ROUTING[routing_row.get("state") or config.routing_state.value],
        routing_since=routing_row.get("switched_at"),
        mix_weight=float(routing_row.get("mix_weight") or 0.0),
        targets={_BACKEND[b]: int(n) for b, n in (routing_row.get("targets") or {}).items()},
        state=state,
        instances=instances,
        pending=pending,
        metrics=metrics,
        demand=demand,
        start_failures=failures,
    )
