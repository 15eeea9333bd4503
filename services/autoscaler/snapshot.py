"""Gathering one alias's snapshot from the read models and the live facts (no I/O here)."""

from __future__ import annotations

import operator
import uuid
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from pydantic import TypeAdapter

from shared.contracts.backends import Action, BackendType, EngineKind
from shared.contracts.config import AliasConfig, PolicySettings
from shared.contracts.control import (
    AliasSnapshot,
    InstanceView,
    MetricWindow,
    PendingCommand,
    PolicyState,
    StartFailure,
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
    return InstanceView(
        row["instance_id"],
        _BACKEND[row["backend_type"]],
        _ENGINE[row["engine"]],
        row["worker_id"],
        _STATE[row["state"]],
        row["updated_at"],
        row["sleep_level"] or 0,
        (reported.capacity if reported is not None and reported.capacity else None) or row.get("capacity"),
        reported.inflight_requests if reported is not None and fresh else 0,
        reported.last_active_at if reported is not None else None,
        worker_up and fresh and reported is not None and reported.healthy,
        unsupported,
        last_failure,
    )


def parse_pending(control_row: Mapping[str, Any]) -> tuple[PendingCommand, ...]:
    return tuple(
        PendingCommand(command_id=uuid.UUID(command_id), action=_ACTION[c["action"]], backend=_BACKEND[c["backend"]],
                       instance_id=c["instance_id"], issued_at=_when(c["issued_at"]), level=c.get("level") or 0)
        for command_id, c in sorted((control_row.get("pending") or {}).items())
    )


class InstanceViews:
    """Instance views kept from one tick to the next, rebuilt only when what they show changed.

    Most instances look the same from one tick to the next (an idle one, one
    asleep): an instance's row changes with its `updated_at`, and the facts keep
    an unchanged status as the same object, so a few identity checks tell
    whether the last view still holds — cheaper than building it again.
    """

    def __init__(self) -> None:
        self._views: dict[str, tuple[Any, InstanceStatus | None, bool, bool, str | None, InstanceView]] = {}
        self._pending: dict[str, tuple[tuple[str, ...], tuple[PendingCommand, ...]]] = {}

    def of(self, rows: Iterable[Mapping[str, Any]], statuses: Mapping[str, InstanceStatus], workers_up: set[str],
           fresh_workers: set[str], notes: Mapping[str, Any]) -> tuple[InstanceView, ...]:
        views = []
        cache = self._views
        for row in rows:
            instance_id, worker_id, updated = row["instance_id"], row["worker_id"], row["updated_at"]
            reported = statuses.get(instance_id)
            up, fresh = worker_id in workers_up, worker_id in fresh_workers
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

    def forget_except(self, instance_ids: set[str]) -> None:
        for gone in self._views.keys() - instance_ids:
            del self._views[gone]


def build_snapshot(
    *,
    config: AliasConfig,
    settings: PolicySettings,
    routing_row: Mapping[str, Any] | None,
    control_row: Mapping[str, Any] | None,
    instance_rows: Iterable[Mapping[str, Any]],
    statuses: Mapping[str, InstanceStatus],
    workers_up: set[str],
    fresh_workers: set[str],
    metrics: MetricWindow | None,
    demand: int,
    state: PolicyState,
    now: datetime,
    policy: str = "hybrid",
    views: InstanceViews | None = None,
) -> AliasSnapshot:
    routing_row = routing_row or {}
    control_row = control_row or {}
    notes = control_row.get("notes") or {}
    rows = sorted(instance_rows, key=_BY_ID)
    if views is not None:
        instances = views.of(rows, statuses, workers_up, fresh_workers, notes)
    else:
        instances = tuple(instance_view(row, statuses.get(row["instance_id"]), row["worker_id"] in workers_up,
                                        row["worker_id"] in fresh_workers, notes.get(row["instance_id"])) for row in rows)
    pending = () if not control_row else views.pending(control_row) if views is not None else parse_pending(control_row)
    failures = {
        _BACKEND[backend]: StartFailure(f["instance_id"], _when(f["at"]), f["reason"])
        for backend, f in (control_row.get("start_failures") or {}).items()
    }
    return AliasSnapshot(
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
        policy=policy,
    )
