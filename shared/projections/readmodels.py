"""The read models, as reducers over the event log.

A projection owns a dict of rows keyed by its primary key and folds events into
it. `apply` is deterministic and does no I/O: the live projector, a rebuild, a
service keeping a copy in memory and `modelpool replay` all run this same code,
so a rebuild from the log is equal to the live tables by construction — and any
difference `replay` finds means a row was changed behind the log's back.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable

from shared.contracts.events import EVENTS
from shared.eventlog.store import RawEvent

Row = dict[str, Any]
Rows = dict[str, Row]


@dataclass(frozen=True)
class Projection:
    name: str
    table: str
    key: str
    columns: tuple[str, ...]
    json_columns: frozenset[str]
    time_columns: frozenset[str]
    reducers: dict[str, Callable[[Rows, RawEvent], Iterable[str]]]

    def apply(self, rows: Rows, event: RawEvent) -> Iterable[str]:
        """Fold one event into `rows`; return the keys it touched (deleted keys included)."""
        reducer = self.reducers.get(event.type)
        return reducer(rows, event) if reducer else ()


def _time(value: str | None) -> datetime | None:
    """Timestamps inside payloads arrive as ISO text; rows hold datetimes, like the columns."""
    return datetime.fromisoformat(value) if value else None


# --------------------------------------------------------------------------- routing


def _routing_row(rows: Rows, alias: str, event: RawEvent) -> Row:
    row = rows.get(alias)
    if row is None:
        row = rows[alias] = {
            "alias": alias,
            "state": "COLD",
            "mix_weight": 0.0,
            "switch_reason": None,
            "switched_at": None,
            "cooldown_until": None,
            "targets": {},
            "config": None,
            "updated_at": event.occurred_at,
        }
    row["updated_at"] = event.occurred_at
    return row


def _alias_configured(rows: Rows, event: RawEvent) -> Iterable[str]:
    p = event.payload
    existed = p["alias"] in rows
    row = _routing_row(rows, p["alias"], event)
    if not existed:
        row["state"] = p["config"].get("routing_state", "COLD")
    row["config"] = p["config"]
    return (p["alias"],)


def _routing_changed(rows: Rows, event: RawEvent) -> Iterable[str]:
    p = event.payload
    row = _routing_row(rows, p["alias"], event)
    row.update(
        state=p["to_state"],
        mix_weight=p["mix_weight"],
        switch_reason=p["reason"],
        switched_at=event.occurred_at,
        cooldown_until=_time(p.get("cooldown_until")),
    )
    return (p["alias"],)


def _mix_weight_changed(rows: Rows, event: RawEvent) -> Iterable[str]:
    p = event.payload
    _routing_row(rows, p["alias"], event)["mix_weight"] = p["to_weight"]
    return (p["alias"],)


def _targets_changed(rows: Rows, event: RawEvent) -> Iterable[str]:
    p = event.payload
    _routing_row(rows, p["alias"], event)["targets"] = dict(p["targets"])
    return (p["alias"],)


ROUTING = Projection(
    name="routing",
    table="proj_routing",
    key="alias",
    columns=("alias", "state", "mix_weight", "switch_reason", "switched_at", "cooldown_until", "targets", "config", "updated_at"),
    json_columns=frozenset({"targets", "config"}),
    time_columns=frozenset({"switched_at", "cooldown_until", "updated_at"}),
    reducers={
        "AliasConfigured": _alias_configured,
        "RoutingStateChanged": _routing_changed,
        "MixWeightChanged": _mix_weight_changed,
        "ScalingTargetsChanged": _targets_changed,
    },
)


# --------------------------------------------------------------------------- instances


def _instance_state(rows: Rows, event: RawEvent) -> Iterable[str]:
    p = event.payload
    key = p["instance_id"]
    if p["to_state"] == "ABSENT":
        # Seed 000 §4.2: a deleted instance leaves the instance table; no "stopped" ghosts.
        rows.pop(key, None)
        return (key,)
    row = rows.get(key)
    if row is None:
        row = rows[key] = {"instance_id": key, "inflight": 0}
    row.update(
        alias=p["alias"],
        backend_type=p["backend_type"],
        engine=p["engine"],
        worker_id=p["worker_id"],
        state=p["to_state"],
        sleep_level=p.get("sleep_level", 0),
        capacity=p.get("capacity", row.get("capacity")),
        endpoint=p.get("endpoint") or row.get("endpoint"),
        internal_endpoint=p.get("internal_endpoint") or row.get("internal_endpoint"),
        role=p.get("role") or row.get("role"),
        reason=p["reason"],
        updated_at=event.occurred_at,
    )
    if p["to_state"] in ("STARTING", "ERROR", "DELETING"):
        row["inflight"] = 0
    return (key,)


def _instance_load(rows: Rows, event: RawEvent) -> Iterable[str]:
    p = event.payload
    row = rows.get(p["instance_id"])
    if row is None:  # a late report about an instance already gone
        return ()
    row["inflight"] = p["inflight"]
    if p.get("capacity") is not None:
        row["capacity"] = p["capacity"]
    row["updated_at"] = event.occurred_at
    return (p["instance_id"],)


INSTANCES = Projection(
    name="instances",
    table="proj_instances",
    key="instance_id",
    columns=(
        "instance_id",
        "alias",
        "backend_type",
        "engine",
        "worker_id",
        "state",
        "sleep_level",
        "inflight",
        "capacity",
        "endpoint",
        "internal_endpoint",
        "role",
        "reason",
        "updated_at",
    ),
    json_columns=frozenset(),
    time_columns=frozenset({"updated_at"}),
    reducers={"InstanceStateChanged": _instance_state, "InstanceLoadReported": _instance_load},
)


# --------------------------------------------------------------------------- sessions


def _session_bound(rows: Rows, event: RawEvent) -> Iterable[str]:
    p = event.payload
    rows[p["session_id"]] = {
        "session_id": p["session_id"],
        "alias": p["alias"],
        "instance_id": p["instance_id"],
        "bound_at": event.occurred_at,
        "last_migrated_at": None,
        "migrations": 0,
    }
    return (p["session_id"],)


def _session_migrated(rows: Rows, event: RawEvent) -> Iterable[str]:
    p = event.payload
    row = rows.get(p["session_id"])
    if row is None:
        row = rows[p["session_id"]] = {
            "session_id": p["session_id"],
            "alias": p["alias"],
            "bound_at": event.occurred_at,
            "migrations": 0,
        }
    row.update(instance_id=p["to_instance_id"], last_migrated_at=event.occurred_at, migrations=row["migrations"] + 1)
    return (p["session_id"],)


def _session_released(rows: Rows, event: RawEvent) -> Iterable[str]:
    rows.pop(event.payload["session_id"], None)
    return (event.payload["session_id"],)


SESSIONS = Projection(
    name="sessions",
    table="proj_sessions",
    key="session_id",
    columns=("session_id", "alias", "instance_id", "bound_at", "last_migrated_at", "migrations"),
    json_columns=frozenset(),
    time_columns=frozenset({"bound_at", "last_migrated_at"}),
    reducers={"SessionBound": _session_bound, "SessionMigrated": _session_migrated, "SessionReleased": _session_released},
)


# --------------------------------------------------------------------------- workers


def _worker_registered(rows: Rows, event: RawEvent) -> Iterable[str]:
    p = event.payload
    rows[p["worker_id"]] = {
        "worker_id": p["worker_id"],
        "host": p["host"],
        "gpu_memory_gb": float(p["gpu_memory_gb"]),
        "slots": p["slots"],
        "engines": list(p["engines"]),
        "status": "up",
        "reason": None,
        "registered_at": event.occurred_at,
        "updated_at": event.occurred_at,
    }
    return (p["worker_id"],)


def _worker_gone(status: str) -> Callable[[Rows, RawEvent], Iterable[str]]:
    def reduce(rows: Rows, event: RawEvent) -> Iterable[str]:
        row = rows.get(event.payload["worker_id"])
        if row is None:
            return ()
        row.update(status=status, reason=event.payload["reason"], updated_at=event.occurred_at)
        return (event.payload["worker_id"],)

    return reduce


WORKERS = Projection(
    name="workers",
    table="proj_workers",
    key="worker_id",
    columns=("worker_id", "host", "gpu_memory_gb", "slots", "engines", "status", "reason", "registered_at", "updated_at"),
    json_columns=frozenset({"engines"}),
    time_columns=frozenset({"registered_at", "updated_at"}),
    reducers={
        "WorkerRegistered": _worker_registered,
        "WorkerDeregistered": _worker_gone("stopped"),
        "WorkerLost": _worker_gone("lost"),
    },
)

# --------------------------------------------------------------------------- the controller's view

# Every event of an alias's stream (`alias:<name>`), so the row's `version` is that stream's version.
ALIAS_STREAM_TYPES = frozenset(c.TYPE for c in EVENTS if c.CATEGORY == "alias")


def _control_row(rows: Rows, alias: str, event: RawEvent) -> Row:
    row = rows.get(alias)
    if row is None:
        row = rows[alias] = {"alias": alias, "version": 0, "policy": None, "state": None, "decided_at": None,
                             "pending": {}, "start_failures": {}, "notes": {}}
    row["updated_at"] = event.occurred_at
    return row


def _control_alias_event(rows: Rows, event: RawEvent) -> Iterable[str]:
    p = event.payload
    row = _control_row(rows, p["alias"], event)
    row["version"] += 1
    if event.type == "PolicyDecided":
        decision = p["decision"]
        row.update(policy=p["policy"], state=decision["state"], decided_at=_time(p["decided_at"]))
        for a in decision["actions"]:
            row["pending"][a["command_id"]] = {
                "action": a["action"], "backend": a["backend"], "instance_id": a["instance_id"],
                "worker_id": a["worker_id"], "level": a["level"], "issued_at": event.occurred_at.isoformat(),
                "acked": False, "role": a.get("role"),
            }
    return (p["alias"],)


def _control_placement_requested(rows: Rows, event: RawEvent) -> Iterable[str]:
    p = event.payload
    row = rows.get(p["alias"])
    command = row and row["pending"].get(p["request_id"])
    if command is None:
        return ()
    command["acked"] = True
    return (p["alias"],)


def _control_placement_failed(rows: Rows, event: RawEvent) -> Iterable[str]:
    p = event.payload
    row = _control_row(rows, p["alias"], event)
    row["pending"].pop(p["request_id"], None)
    row["start_failures"][p["backend_type"]] = {"instance_id": p["instance_id"], "at": event.occurred_at.isoformat(),
                                               "reason": p["reason"]}
    return (p["alias"],)


def _control_instance_changed(rows: Rows, event: RawEvent) -> Iterable[str]:
    p = event.payload
    row = _control_row(rows, p["alias"], event)
    pending = row["pending"]
    if p.get("command_id") in pending:
        pending[p["command_id"]]["acked"] = True
    instance = p["instance_id"]
    for command_id, command in list(pending.items()):
        # A start is done once its instance is in the log: from then on the instance
        # itself is what counts, and it must be free to take a cancel.
        if command["instance_id"] == instance and (command["action"] == "start" or p["to_state"] == "ABSENT"):
            del pending[command_id]
    if p["from_state"] == "STARTING" and p["to_state"] == "ERROR":
        row["start_failures"][p["backend_type"]] = {"instance_id": instance, "at": event.occurred_at.isoformat(),
                                                   "reason": p["reason"]}
    if p["to_state"] == "ABSENT":
        row["notes"].pop(instance, None)
    return (p["alias"],)


def _control_command_completed(rows: Rows, event: RawEvent) -> Iterable[str]:
    p = event.payload
    row = rows.get(p["alias"])
    if row is None or row["pending"].pop(p["command_id"], None) is None:
        return ()
    note = row["notes"].setdefault(p["instance_id"], {"unsupported": [], "last_failure": None})
    if p["outcome"] == "unsupported" and p["action"] not in note["unsupported"]:
        note["unsupported"].append(p["action"])
    elif p["outcome"] in ("failed", "rejected"):
        note["last_failure"] = [p["action"], event.occurred_at.isoformat()]
    row["updated_at"] = event.occurred_at
    return (p["alias"],)


def _control_worker_lost(rows: Rows, event: RawEvent) -> Iterable[str]:
    """Commands sent to a lost worker will not be answered: stop waiting for them."""
    touched = []
    for alias, row in rows.items():
        lost = [c for c, command in row["pending"].items() if command["worker_id"] == event.payload["worker_id"]]
        for command_id in lost:
            del row["pending"][command_id]
        if lost:
            row["updated_at"] = event.occurred_at
            touched.append(alias)
    return touched


CONTROL = Projection(
    name="control",
    table="proj_control",
    key="alias",
    columns=("alias", "version", "policy", "state", "decided_at", "pending", "start_failures", "notes", "updated_at"),
    json_columns=frozenset({"state", "pending", "start_failures", "notes"}),
    time_columns=frozenset({"decided_at", "updated_at"}),
    reducers={
        **{type_name: _control_alias_event for type_name in ALIAS_STREAM_TYPES},
        "PlacementRequested": _control_placement_requested,
        "PlacementFailed": _control_placement_failed,
        "InstanceStateChanged": _control_instance_changed,
        "InstanceCommandCompleted": _control_command_completed,
        "WorkerLost": _control_worker_lost,
    },
)

ALL_PROJECTIONS: tuple[Projection, ...] = (ROUTING, INSTANCES, SESSIONS, WORKERS, CONTROL)
