"""The read models' rows: immutable and typed, as every reader sees them past the database.

Rows are named tuples, not frozen dataclasses: a rebuild folds a million events
and builds a row for nearly each, and a frozen dataclass costs eight times more
to build (every field set through `object.__setattr__`).

Each row type names its key (`KEY`), its columns are its fields in order, and it
is read back from its table with `from_record`; `to_record` stores any of them
(enums as their values, the `JSON_COLUMNS` as JSON). What a reducer builds and
what a table holds read back are equal (`modelpool replay` compares them), so a
column added here is added to its migration too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from datetime import datetime
from enum import Enum
from types import MappingProxyType
from typing import Any, NamedTuple

from pydantic import TypeAdapter

from shared.contracts.backends import Action, BackendType, EngineKind, Role
from shared.contracts.config import AliasConfig
from shared.contracts.control import NO_HOLD, OperatorHold, PolicyState, StartFailure
from shared.contracts.states import InstanceState, RoutingState

POLICY_STATE: TypeAdapter[PolicyState] = TypeAdapter(PolicyState)


def _json_value(value: Any) -> Any:
    """A row's value as JSON would hold it: enums by value, models and dataclasses as objects, times in ISO."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, AliasConfig):
        return value.model_dump(mode="json")
    if isinstance(value, PolicyState):
        return POLICY_STATE.dump_python(value, mode="json")
    if isinstance(value, Mapping):
        return {(k.value if isinstance(k, Enum) else k): _json_value(v) for k, v in value.items()}
    if hasattr(value, "_fields"):  # a row (a named tuple) is an object, not a list
        return {name: _json_value(v) for name, v in zip(value._fields, value)}
    if isinstance(value, (tuple, list)):
        return [_json_value(v) for v in value]
    if is_dataclass(value):
        return {f.name: _json_value(getattr(value, f.name)) for f in fields(value)}
    return value


def as_json(row: Any) -> dict[str, Any]:
    """A row as `modelpool status --json` and the admin API show it."""
    return _json_value(row)


def _when(value: Any) -> datetime | None:
    return None if value is None else value if isinstance(value, datetime) else datetime.fromisoformat(value)


def _stored_json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def _hold(stored: Mapping[str, Any] | None) -> OperatorHold:
    if not stored:
        return NO_HOLD
    return OperatorHold(stored.get("paused"), {BackendType(b): n for b, n in (stored.get("min_replicas") or {}).items()})


def to_record(row: Any) -> list[Any]:
    """The values of a row's columns, as its table stores them."""
    json_columns = type(row).JSON_COLUMNS
    out = []
    for name, value in zip(row._fields, row):
        if name in json_columns:
            out.append(None if value is None else json.dumps(_json_value(value), sort_keys=True))
        elif isinstance(value, Enum):
            out.append(value.value)
        else:
            out.append(value)
    return out


NO_ENTRIES: Mapping[Any, Any] = MappingProxyType({})
"""The empty default of a row's mapping fields: shared, so it must not be writable."""


# --------------------------------------------------------------------------- routing


class RoutingRow(NamedTuple):
    """An alias's routing state and mix weight, the last switch, its targets and its configuration."""

    KEY = "alias"
    JSON_COLUMNS = frozenset({"targets", "config"})

    alias: str
    state: RoutingState
    mix_weight: float
    switch_reason: str | None
    switched_at: datetime | None
    cooldown_until: datetime | None
    targets: Mapping[BackendType, int]
    config: AliasConfig | None
    updated_at: datetime

    @classmethod
    def from_record(cls, r: Mapping[str, Any]) -> "RoutingRow":
        config = _stored_json(r["config"])
        return cls(r["alias"], RoutingState(r["state"]), float(r["mix_weight"]), r["switch_reason"], r["switched_at"],
                   r["cooldown_until"], {BackendType(b): int(n) for b, n in (_stored_json(r["targets"]) or {}).items()},
                   AliasConfig.model_validate(config) if config else None, r["updated_at"])


# --------------------------------------------------------------------------- instances


class InstanceRow(NamedTuple):
    """An instance as the log has it: where it runs, its state, how to reach it."""

    KEY = "instance_id"
    JSON_COLUMNS = frozenset[str]()

    instance_id: str
    alias: str
    backend_type: BackendType
    engine: EngineKind
    worker_id: str
    state: InstanceState
    sleep_level: int
    inflight: int
    """Only from logs written before load moved to the workers' heartbeats."""
    capacity: int | None
    endpoint: str | None
    internal_endpoint: str | None
    role: Role | None
    reason: str
    updated_at: datetime

    @classmethod
    def from_record(cls, r: Mapping[str, Any]) -> "InstanceRow":
        return cls(r["instance_id"], r["alias"], BackendType(r["backend_type"]), EngineKind(r["engine"]), r["worker_id"],
                   InstanceState(r["state"]), r["sleep_level"], r["inflight"], r["capacity"], r["endpoint"],
                   r["internal_endpoint"], Role(r["role"]) if r["role"] else None, r["reason"], r["updated_at"])


# --------------------------------------------------------------------------- sessions


class SessionRow(NamedTuple):
    """A session's host, since when, and how often it moved."""

    KEY = "session_id"
    JSON_COLUMNS = frozenset[str]()

    session_id: str
    alias: str
    instance_id: str
    bound_at: datetime
    last_migrated_at: datetime | None
    migrations: int

    @classmethod
    def from_record(cls, r: Mapping[str, Any]) -> "SessionRow":
        return cls(r["session_id"], r["alias"], r["instance_id"], r["bound_at"], r["last_migrated_at"], r["migrations"])


# --------------------------------------------------------------------------- workers


class WorkerStatus(str, Enum):
    UP = "up"
    STOPPED = "stopped"
    LOST = "lost"


class WorkerRow(NamedTuple):
    """A worker's resources and whether it is up, stopped or lost."""

    KEY = "worker_id"
    JSON_COLUMNS = frozenset({"engines"})

    worker_id: str
    host: str
    gpu_memory_gb: float
    slots: int
    engines: tuple[EngineKind, ...]
    status: WorkerStatus
    reason: str | None
    registered_at: datetime
    updated_at: datetime

    @property
    def up(self) -> bool:
        return self.status is WorkerStatus.UP

    @classmethod
    def from_record(cls, r: Mapping[str, Any]) -> "WorkerRow":
        return cls(r["worker_id"], r["host"], float(r["gpu_memory_gb"]), r["slots"],
                   tuple(EngineKind(e) for e in _stored_json(r["engines"])), WorkerStatus(r["status"]), r["reason"],
                   r["registered_at"], r["updated_at"])


# --------------------------------------------------------------------------- the controller's view


class PendingCommandRow(NamedTuple):
    """A command of a recorded decision whose effect is not in the log yet."""

    action: Action
    backend: BackendType
    instance_id: str
    worker_id: str | None
    level: int
    issued_at: datetime
    acked: bool
    """Its receiver has it (a start's placement was requested, another command's instance moved)."""
    role: Role | None = None
    operator: str | None = None
    """An operator's command (`OperatorCommanded`): who asked and why, as its worker records it; None for the
    controller's own."""

    @classmethod
    def from_json(cls, c: Mapping[str, Any]) -> "PendingCommandRow":
        return cls(Action(c["action"]), BackendType(c["backend"]), c["instance_id"], c["worker_id"], c["level"] or 0,
                   _when(c["issued_at"]), c["acked"], Role(c["role"]) if c.get("role") else None,  # type: ignore[arg-type]
                   c.get("operator"))


class InstanceNote(NamedTuple):
    """What the controller remembers of one instance's command outcomes."""

    unsupported: tuple[Action, ...] = ()
    """Actions its worker answered `unsupported`."""
    last_failure: tuple[Action, datetime] | None = None

    @classmethod
    def from_json(cls, n: Mapping[str, Any]) -> "InstanceNote":
        failure = n.get("last_failure")
        return cls(tuple(Action(a) for a in n.get("unsupported") or ()),
                   (Action(failure[0]), _when(failure[1])) if failure else None)  # type: ignore[arg-type]


class ControlRow(NamedTuple):
    """The controller's own view of an alias: its stream's version, the policy state its last decision left,
    the commands in flight, the latest failed start per tier, and notes on instances."""

    KEY = "alias"
    JSON_COLUMNS = frozenset({"state", "pending", "start_failures", "notes", "operator"})

    alias: str
    version: int = 0
    policy: str | None = None
    state: PolicyState | None = None
    decided_at: datetime | None = None
    pending: Mapping[str, PendingCommandRow] = NO_ENTRIES
    """command id -> the command."""
    start_failures: Mapping[BackendType, StartFailure] = NO_ENTRIES
    notes: Mapping[str, InstanceNote] = NO_ENTRIES
    """instance id -> its note."""
    updated_at: datetime | None = None
    operator: OperatorHold = NO_HOLD
    """What operators asked of the controller for the alias (a pause, pinned minimum replicas)."""

    @classmethod
    def from_record(cls, r: Mapping[str, Any]) -> "ControlRow":
        state = _stored_json(r["state"])
        return cls(
            r["alias"], r["version"], r["policy"], POLICY_STATE.validate_python(state) if state else None, r["decided_at"],
            {c: PendingCommandRow.from_json(p) for c, p in (_stored_json(r["pending"]) or {}).items()},
            {BackendType(b): StartFailure(f["instance_id"], _when(f["at"]), f["reason"])  # type: ignore[arg-type]
             for b, f in (_stored_json(r["start_failures"]) or {}).items()},
            {i: InstanceNote.from_json(n) for i, n in (_stored_json(r["notes"]) or {}).items()},
            r["updated_at"],
            _hold(_stored_json(r["operator"])),
        )
