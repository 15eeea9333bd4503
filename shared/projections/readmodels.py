"""The read models, as reducers over the event log's typed facts.

A projection owns a dict of frozen rows (`rows.py`) keyed by its primary key and
folds events into it, one reducer per event class. `apply` is deterministic and
does no I/O: the projector, a rebuild, a service keeping a copy in memory and
`modelpool replay` all run this same code, so a rebuild from the log is equal to
the live tables by construction — and any difference `replay` finds means a row
was changed behind the log's back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, TypeVar

from shared.contracts.backends import Action, CommandOutcome
from shared.contracts.control import OperatorHold, StartFailure
from shared.contracts.events import (
    EVENTS,
    INSTANCE_ACTIONS,
    AliasConfigured,
    InstanceCommandCompleted,
    InstanceLoadReported,
    InstanceStateChanged,
    MixWeightChanged,
    OperatorAction,
    OperatorCommanded,
    PlacementFailed,
    PlacementRequested,
    PolicyDecided,
    RoutingStateChanged,
    ScalingTargetsChanged,
    SessionBound,
    SessionMigrated,
    SessionReleased,
    WorkerDeregistered,
    WorkerLost,
    WorkerRegistered,
)
from shared.contracts.messages import Event
from shared.contracts.states import InstanceState, RoutingState
from shared.eventlog.store import StoredEvent
from shared.projections.rows import (
    ControlRow,
    InstanceNote,
    InstanceRow,
    PendingCommandRow,
    RoutingRow,
    SessionRow,
    WorkerRow,
    WorkerStatus,
)

R = TypeVar("R")
Rows = dict[str, Any]
"""A projection's rows by key (each projection's row type: `Projection.row`)."""
Reducer = Callable[[dict[str, Any], Any, datetime], Iterable[str]]
"""(rows, the typed event, when it happened) -> the keys it touched (deleted ones included)."""


@dataclass(frozen=True)
class Projection(Generic[R]):
    name: str
    table: str
    row: type[R]
    reducers: dict[str, Reducer]
    """Event type name -> its reducer: one per event class the projection folds."""

    def apply(self, rows: dict[str, R], stored: StoredEvent) -> Iterable[str]:
        """Fold one event into `rows`; return the keys it touched (deleted keys included)."""
        reducer = self.reducers.get(stored.event.TYPE)
        return reducer(rows, stored.event, stored.occurred_at) if reducer else ()


def reducers(*pairs: tuple[type[Event], Reducer]) -> dict[str, Reducer]:
    return {event.TYPE: reduce for event, reduce in pairs}


# --------------------------------------------------------------------------- routing


def _routing_row(rows: dict[str, RoutingRow], alias: str, at: datetime) -> RoutingRow:
    row = rows.get(alias)
    return row if row is not None else RoutingRow(alias, RoutingState.COLD, 0.0, None, None, None, {}, None, at)


def _alias_configured(rows: dict[str, RoutingRow], e: AliasConfigured, at: datetime) -> Iterable[str]:
    row = rows.get(e.alias)
    state = row.state if row is not None else e.config.routing_state
    rows[e.alias] = _routing_row(rows, e.alias, at)._replace(config=e.config, state=state, updated_at=at)
    return (e.alias,)


def _routing_changed(rows: dict[str, RoutingRow], e: RoutingStateChanged, at: datetime) -> Iterable[str]:
    rows[e.alias] = _routing_row(rows, e.alias, at)._replace(
        state=e.to_state, mix_weight=e.mix_weight, switch_reason=e.reason, switched_at=at,
        cooldown_until=e.cooldown_until, updated_at=at)
    return (e.alias,)


def _mix_weight_changed(rows: dict[str, RoutingRow], e: MixWeightChanged, at: datetime) -> Iterable[str]:
    rows[e.alias] = _routing_row(rows, e.alias, at)._replace(mix_weight=e.to_weight, updated_at=at)
    return (e.alias,)


def _targets_changed(rows: dict[str, RoutingRow], e: ScalingTargetsChanged, at: datetime) -> Iterable[str]:
    rows[e.alias] = _routing_row(rows, e.alias, at)._replace(targets=dict(e.targets), updated_at=at)
    return (e.alias,)


ROUTING: Projection[RoutingRow] = Projection("routing", "proj_routing", RoutingRow, reducers(
    (AliasConfigured, _alias_configured),
    (RoutingStateChanged, _routing_changed),
    (MixWeightChanged, _mix_weight_changed),
    (ScalingTargetsChanged, _targets_changed),
))


# --------------------------------------------------------------------------- instances

_RESETS_LOAD = frozenset({InstanceState.STARTING, InstanceState.ERROR, InstanceState.DELETING})


def _instance_state(rows: dict[str, InstanceRow], e: InstanceStateChanged, at: datetime) -> Iterable[str]:
    if e.to_state is InstanceState.ABSENT:
        # Seed 000 §4.2: a deleted instance leaves the instance table; no "stopped" ghosts.
        rows.pop(e.instance_id, None)
        return (e.instance_id,)
    old = rows.get(e.instance_id)
    rows[e.instance_id] = InstanceRow(
        e.instance_id, e.alias, e.backend_type, e.engine, e.worker_id, e.to_state, e.sleep_level,
        0 if old is None or e.to_state in _RESETS_LOAD else old.inflight,
        e.capacity,  # what the engine has now: none while it is not up
        e.endpoint or (old.endpoint if old else None),
        e.internal_endpoint or (old.internal_endpoint if old else None),
        e.role or (old.role if old else None),
        e.reason, at,
    )
    return (e.instance_id,)


def _instance_load(rows: dict[str, InstanceRow], e: InstanceLoadReported, at: datetime) -> Iterable[str]:
    row = rows.get(e.instance_id)
    if row is None:  # a late report about an instance already gone
        return ()
    rows[e.instance_id] = row._replace(inflight=e.inflight, updated_at=at,
                                       capacity=e.capacity if e.capacity is not None else row.capacity)
    return (e.instance_id,)


INSTANCES: Projection[InstanceRow] = Projection("instances", "proj_instances", InstanceRow, reducers(
    (InstanceStateChanged, _instance_state),
    (InstanceLoadReported, _instance_load),
))


# --------------------------------------------------------------------------- sessions


def _session_bound(rows: dict[str, SessionRow], e: SessionBound, at: datetime) -> Iterable[str]:
    rows[e.session_id] = SessionRow(e.session_id, e.alias, e.instance_id, at, None, 0)
    return (e.session_id,)


def _session_migrated(rows: dict[str, SessionRow], e: SessionMigrated, at: datetime) -> Iterable[str]:
    old = rows.get(e.session_id)
    rows[e.session_id] = SessionRow(e.session_id, e.alias, e.to_instance_id, old.bound_at if old else at, at,
                                    (old.migrations if old else 0) + 1)
    return (e.session_id,)


def _session_released(rows: dict[str, SessionRow], e: SessionReleased, at: datetime) -> Iterable[str]:
    rows.pop(e.session_id, None)
    return (e.session_id,)


SESSIONS: Projection[SessionRow] = Projection("sessions", "proj_sessions", SessionRow, reducers(
    (SessionBound, _session_bound),
    (SessionMigrated, _session_migrated),
    (SessionReleased, _session_released),
))


# --------------------------------------------------------------------------- workers


def _worker_registered(rows: dict[str, WorkerRow], e: WorkerRegistered, at: datetime) -> Iterable[str]:
    rows[e.worker_id] = WorkerRow(e.worker_id, e.host, float(e.gpu_memory_gb), e.slots, tuple(e.engines),
                                  WorkerStatus.UP, None, at, at)
    return (e.worker_id,)


def _worker_gone(status: WorkerStatus) -> Reducer:
    def reduce(rows: dict[str, WorkerRow], e: WorkerDeregistered | WorkerLost, at: datetime) -> Iterable[str]:
        row = rows.get(e.worker_id)
        if row is None:
            return ()
        rows[e.worker_id] = row._replace(status=status, reason=e.reason, updated_at=at)
        return (e.worker_id,)

    return reduce


WORKERS: Projection[WorkerRow] = Projection("workers", "proj_workers", WorkerRow, reducers(
    (WorkerRegistered, _worker_registered),
    (WorkerDeregistered, _worker_gone(WorkerStatus.STOPPED)),
    (WorkerLost, _worker_gone(WorkerStatus.LOST)),
))


# --------------------------------------------------------------------------- the controller's view

ALIAS_EVENTS: tuple[type[Event], ...] = tuple(c for c in EVENTS if c.CATEGORY == "alias")
"""Every event of an alias's stream (`alias:<name>`): the row's `version` is that stream's version."""


def _control_alias_event(rows: dict[str, ControlRow], e: Any, at: datetime) -> Iterable[str]:
    row = rows.get(e.alias) or ControlRow(e.alias)
    row = row._replace(version=row.version + 1, updated_at=at)
    if isinstance(e, PolicyDecided):
        pending = dict(row.pending)
        for a in e.decision.actions:
            pending[str(a.command_id)] = PendingCommandRow(a.action, a.backend, a.instance_id, a.worker_id, a.level,
                                                           at, False, a.role)
        row = row._replace(policy=e.policy, state=e.decision.state, decided_at=e.decided_at, pending=pending)
    elif isinstance(e, OperatorCommanded):
        row = row._replace(operator=held(row.operator, e))
        if e.action in INSTANCE_ACTIONS and e.command_id and e.instance_id and e.backend_type:
            # In flight from now on, as the controller's own are: the autoscaler sends it, and holds the
            # instance's other commands back until its outcome is in the log.
            row = row._replace(pending={**row.pending, str(e.command_id): PendingCommandRow(
                INSTANCE_ACTIONS[e.action], e.backend_type, e.instance_id, e.worker_id, e.level or 0, at, False,
                None, f"{e.operator}: {e.reason}")})
    rows[e.alias] = row
    return (e.alias,)


def held(hold: OperatorHold, e: OperatorCommanded) -> OperatorHold:
    """What operators ask of the controller once `e` is recorded (instance actions change nothing here)."""
    if e.action is OperatorAction.PAUSE:
        return OperatorHold(f"{e.operator}: {e.reason}", hold.min_replicas)
    if e.action is OperatorAction.RESUME:
        return OperatorHold(None, hold.min_replicas)
    if e.action is OperatorAction.PIN and e.backend_type is not None and e.min_replicas is not None:
        return OperatorHold(hold.paused, {**hold.min_replicas, e.backend_type: e.min_replicas})
    if e.action is OperatorAction.UNPIN:
        return OperatorHold(hold.paused, {b: n for b, n in hold.min_replicas.items() if b is not e.backend_type})
    return hold


def _control_placement_requested(rows: dict[str, ControlRow], e: PlacementRequested, at: datetime) -> Iterable[str]:
    row = rows.get(e.alias)
    command = row.pending.get(str(e.request_id)) if row else None
    if row is None or command is None:
        return ()
    rows[e.alias] = row._replace(pending={**row.pending, str(e.request_id): command._replace(acked=True)})
    return (e.alias,)


def _control_placement_failed(rows: dict[str, ControlRow], e: PlacementFailed, at: datetime) -> Iterable[str]:
    row = rows.get(e.alias) or ControlRow(e.alias)
    pending = {c: p for c, p in row.pending.items() if c != str(e.request_id)}
    failures = {**row.start_failures, e.backend_type: StartFailure(e.instance_id, at, e.reason)}
    rows[e.alias] = row._replace(pending=pending, start_failures=failures, updated_at=at)
    return (e.alias,)


def _control_instance_changed(rows: dict[str, ControlRow], e: InstanceStateChanged, at: datetime) -> Iterable[str]:
    row = rows.get(e.alias) or ControlRow(e.alias)
    failed = e.from_state is InstanceState.STARTING and e.to_state is InstanceState.ERROR
    forgotten = e.to_state is InstanceState.ABSENT and e.instance_id in row.notes
    if not (row.pending or failed or forgotten):  # most transitions: nothing the controller waits for
        rows[e.alias] = row._replace(updated_at=at)
        return (e.alias,)
    command_id = str(e.command_id) if e.command_id else None
    pending = {}
    for cid, command in row.pending.items():
        # A start is done once its instance is in the log: from then on the instance
        # itself is what counts, and it must be free to take a cancel.
        if command.instance_id == e.instance_id and (command.action is Action.START
                                                     or e.to_state is InstanceState.ABSENT):
            continue
        pending[cid] = command._replace(acked=True) if cid == command_id else command
    failures, notes = row.start_failures, row.notes
    if failed:
        failures = {**failures, e.backend_type: StartFailure(e.instance_id, at, e.reason)}
    if forgotten:
        notes = {i: n for i, n in notes.items() if i != e.instance_id}
    rows[e.alias] = row._replace(pending=pending, start_failures=failures, notes=notes, updated_at=at)
    return (e.alias,)


def _control_command_completed(rows: dict[str, ControlRow], e: InstanceCommandCompleted, at: datetime) -> Iterable[str]:
    row = rows.get(e.alias)
    if row is None or str(e.command_id) not in row.pending:
        return ()
    note = row.notes.get(e.instance_id) or InstanceNote()
    if e.outcome is CommandOutcome.UNSUPPORTED and e.action not in note.unsupported:
        note = note._replace(unsupported=(*note.unsupported, e.action))
    elif e.outcome in (CommandOutcome.FAILED, CommandOutcome.REJECTED):
        note = note._replace(last_failure=(e.action, at))
    rows[e.alias] = row._replace(pending={c: p for c, p in row.pending.items() if c != str(e.command_id)},
                                 notes={**row.notes, e.instance_id: note}, updated_at=at)
    return (e.alias,)


def _control_worker_lost(rows: dict[str, ControlRow], e: WorkerLost, at: datetime) -> Iterable[str]:
    """Commands sent to a lost worker will not be answered: stop waiting for them."""
    touched = []
    for alias, row in list(rows.items()):
        kept = {c: p for c, p in row.pending.items() if p.worker_id != e.worker_id}
        if len(kept) != len(row.pending):
            rows[alias] = row._replace(pending=kept, updated_at=at)
            touched.append(alias)
    return touched


CONTROL: Projection[ControlRow] = Projection("control", "proj_control", ControlRow, reducers(
    *((event, _control_alias_event) for event in ALIAS_EVENTS),
    (PlacementRequested, _control_placement_requested),
    (PlacementFailed, _control_placement_failed),
    (InstanceStateChanged, _control_instance_changed),
    (InstanceCommandCompleted, _control_command_completed),
    (WorkerLost, _control_worker_lost),
))

ALL_PROJECTIONS: tuple[Projection[Any], ...] = (ROUTING, INSTANCES, SESSIONS, WORKERS, CONTROL)

