"""Every event modelpool records, at its latest version; `event_registry` upcasts older ones on read.

Streams (`CATEGORY:key`): `alias:<alias>` for routing decisions and configuration,
`instance:<instance_id>` for an instance's lifecycle and commands, `worker:<id>`,
`placement:<request_id>`, `session:<session_id>`. Every event that concerns an
alias carries an `alias` field, which the log indexes for `modelpool history`.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, model_validator

from shared.contracts.backends import Action, BackendType, EngineKind, CommandOutcome, Role
from shared.contracts.config import AliasConfig, split_legacy_policy
from shared.contracts.control import AliasSnapshot, Decision, MetricWindow
from shared.contracts.messages import Event, Registry, derived_id, from_the_log
from shared.contracts.states import (
    InstanceState,
    RoutingState,
    check_instance_transition,
    check_routing_transition,
)

# --------------------------------------------------------------------------- alias


class AliasConfigured(Event):
    """An alias's configuration as loaded at start-up (recorded when it changes).

    v2: a backend's configuration may carry `engine_args`.
    v3: `autoscaling_policy`, the alias's policy and its parameters (hybrid when absent).
    v4: `router.filters` and `router.scorers`, a router's own lists (the preset's when absent).
    v5: the hybrid policy's parameters in its `autoscaling_policy` (seed 000's defaults when absent)."""

    TYPE = "AliasConfigured"
    VERSION = 5
    CATEGORY = "alias"
    alias: str
    config: AliasConfig

    def stream_key(self) -> str:
        return self.alias


class PolicyDecided(Event):
    """A decision of the controller about one alias, with everything it was computed from.

    Recorded whenever a decision changes something (a routing switch, a mix step,
    new targets, an instance action), in one append with the switch, step and
    targets events it causes. `replay --verify-decisions` feeds `snapshot` back
    through the policy named here and compares the result with `decision`.

    v2: the snapshot's pool-wide `settings` became the hybrid's parameters in its
    `config.autoscaling_policy` and the controller's knobs in its `controller`.
    v3: the snapshot's `operator`: what operators asked (a pause, pinned minimum replicas).
    """

    TYPE = "PolicyDecided"
    VERSION = 3
    CATEGORY = "alias"
    alias: str
    policy: str
    policy_version: int = Field(ge=0)
    decided_at: datetime
    snapshot: AliasSnapshot
    decision: Decision
    summary: str

    def stream_key(self) -> str:
        return self.alias


class ColdStartCompleted(Event):
    """Demand reached a cold alias and its first instance is now serving: how long that took."""

    TYPE = "ColdStartCompleted"
    CATEGORY = "alias"
    alias: str
    backend_type: BackendType
    instance_id: str
    demand_at: datetime
    ready_at: datetime
    duration_s: float = Field(ge=0)

    def stream_key(self) -> str:
        return self.alias


class RoutingStateChanged(Event):
    """v2: `policy_version`; the metric window may carry the v2 fields. The decision that
    made the switch is the envelope's causation (a `PolicyDecided`)."""

    TYPE = "RoutingStateChanged"
    VERSION = 2
    CATEGORY = "alias"
    alias: str
    from_state: RoutingState
    to_state: RoutingState
    reason: str
    mix_weight: float = Field(ge=0.0, le=1.0, description="share of traffic sent to vLLM")
    cooldown_until: datetime | None = None
    policy: str
    policy_version: int = Field(default=0, ge=0)
    metrics: MetricWindow | None = None
    inputs: dict[str, Any] = Field(default_factory=dict, description="policy state and thresholds behind the decision")

    def stream_key(self) -> str:
        return self.alias

    @model_validator(mode="after")
    def _legal(self, info: ValidationInfo) -> "RoutingStateChanged":
        if not from_the_log(info):
            check_routing_transition(self.from_state, self.to_state)
        return self


class MixWeightChanged(Event):
    """A step of the MIXED ramp (e.g. 20 -> 50 -> 80 -> 100 % to vLLM)."""

    TYPE = "MixWeightChanged"
    VERSION = 2
    CATEGORY = "alias"
    alias: str
    from_weight: float = Field(ge=0.0, le=1.0)
    to_weight: float = Field(ge=0.0, le=1.0)
    reason: str
    policy: str
    policy_version: int = Field(default=0, ge=0)
    metrics: MetricWindow | None = None

    def stream_key(self) -> str:
        return self.alias


class ScalingTargetsChanged(Event):
    TYPE = "ScalingTargetsChanged"
    VERSION = 2
    CATEGORY = "alias"
    alias: str
    targets: dict[BackendType, int]
    reason: str
    policy: str
    policy_version: int = Field(default=0, ge=0)
    metrics: MetricWindow | None = None
    inputs: dict[str, Any] = Field(default_factory=dict)

    def stream_key(self) -> str:
        return self.alias


class OperatorAction(str, Enum):
    """What an operator can ask of an alias (the console, the admin API)."""

    DRAIN = "drain"
    SLEEP = "sleep"
    WAKE = "wake"
    DELETE = "delete"
    PIN = "pin"
    """Pin a tier's minimum replicas."""
    UNPIN = "unpin"
    PAUSE = "pause"
    """Stop the controller switching, scaling or commanding the alias."""
    RESUME = "resume"


def operator_event_id(command_id: uuid.UUID) -> uuid.UUID:
    """The id of the `OperatorCommanded` that records an instance action, from its command's: the command's cause."""
    return derived_id(command_id, "operator")


INSTANCE_ACTIONS = {OperatorAction.DRAIN: Action.DRAIN, OperatorAction.SLEEP: Action.SLEEP,
                    OperatorAction.WAKE: Action.WAKE, OperatorAction.DELETE: Action.DELETE}
"""The operator actions sent to an instance's worker, as the worker's command."""


class OperatorCommanded(Event):
    """An operator's action on an alias or one of its instances, with who asked and why.

    An instance action is a command for the instance's worker, in flight from the
    moment it is recorded (the alias's control row holds it until its outcome is in
    the log); the autoscaler sends it, this event its cause, as it sends its own (the
    gateway that records it may not publish commands: docs/security.md), and the
    worker records the change with the operator's reason. A pause or a pin changes
    what the controller may do: it is in every later snapshot (`OperatorHold`), so
    the decisions made under it, and their verification by `replay
    --verify-decisions`, say why.

    v2: `worker_id`, the instance's worker when an instance action was recorded.
    """

    TYPE = "OperatorCommanded"
    VERSION = 2
    CATEGORY = "alias"
    alias: str
    action: OperatorAction
    operator: str = Field(min_length=1, max_length=100)
    reason: str = Field(min_length=1, max_length=500)
    instance_id: str | None = None
    backend_type: BackendType | None = None
    min_replicas: int | None = Field(default=None, ge=0)
    level: int | None = Field(default=None, ge=1, le=2, description="sleep level")
    command_id: uuid.UUID | None = None
    """The command for the instance's worker (instance actions)."""
    worker_id: str | None = None
    """The instance's worker (instance actions)."""

    def stream_key(self) -> str:
        return self.alias

    @model_validator(mode="after")
    def _complete(self) -> "OperatorCommanded":
        if self.action in INSTANCE_ACTIONS and not self.instance_id:
            raise ValueError(f"{self.action.value} needs an instance_id")
        if self.action in (OperatorAction.PIN, OperatorAction.UNPIN) and self.backend_type is None:
            raise ValueError(f"{self.action.value} needs a backend_type")
        if self.action is OperatorAction.PIN and self.min_replicas is None:
            raise ValueError("pin needs min_replicas")
        return self


# --------------------------------------------------------------------------- workers


class WorkerRegistered(Event):
    TYPE = "WorkerRegistered"
    CATEGORY = "worker"
    worker_id: str
    host: str
    gpu_memory_gb: float = Field(ge=0)
    slots: int = Field(ge=0, description="instances this worker can run at once")
    engines: list[EngineKind]
    labels: dict[str, str] = Field(default_factory=dict)

    def stream_key(self) -> str:
        return self.worker_id


class WorkerDeregistered(Event):
    """A worker stopped cleanly."""

    TYPE = "WorkerDeregistered"
    CATEGORY = "worker"
    worker_id: str
    reason: str

    def stream_key(self) -> str:
        return self.worker_id


class WorkerLost(Event):
    """A worker stopped answering; its instances are no longer reachable."""

    TYPE = "WorkerLost"
    CATEGORY = "worker"
    worker_id: str
    reason: str
    last_seen: datetime | None = None

    def stream_key(self) -> str:
        return self.worker_id


# --------------------------------------------------------------------------- placement


class CandidateScore(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    worker_id: str
    feasible: bool
    score: float | None = None
    components: dict[str, float] = Field(default_factory=dict)
    note: str = ""


class PlacementRequested(Event):
    TYPE = "PlacementRequested"
    CATEGORY = "placement"
    request_id: uuid.UUID
    alias: str
    backend_type: BackendType
    instance_id: str
    gpu_memory_gb: float = Field(ge=0)
    reason: str = ""

    def stream_key(self) -> str:
        return str(self.request_id)


class PlacementDecided(Event):
    TYPE = "PlacementDecided"
    CATEGORY = "placement"
    request_id: uuid.UUID
    alias: str
    backend_type: BackendType
    instance_id: str
    worker_id: str
    gpu_memory_gb: float = Field(ge=0, description="what the instance holds on the worker")
    score: float
    fallback_level: int = Field(ge=1, le=3, description="seed 000 §7: 1 both anti-affinities, 2 one, 3 resources only")
    candidates: list[CandidateScore] = Field(default_factory=list)

    def stream_key(self) -> str:
        return str(self.request_id)


class PlacementFailed(Event):
    TYPE = "PlacementFailed"
    CATEGORY = "placement"
    request_id: uuid.UUID
    alias: str
    backend_type: BackendType
    instance_id: str
    reason: str
    candidates: list[CandidateScore] = Field(default_factory=list)

    def stream_key(self) -> str:
        return str(self.request_id)


# --------------------------------------------------------------------------- instances


class InstanceStateChanged(Event):
    """v2: `exit_code` and `log_tail` say how an engine that died ended.
    v3: `internal_endpoint`, the engine's port for other modelpool services only (KV export and
    import), never its public one; None for engines without one (vLLM).
    v4: `role`, prefill or decode in a disaggregated alias (None otherwise)."""

    TYPE = "InstanceStateChanged"
    VERSION = 4
    CATEGORY = "instance"
    instance_id: str
    alias: str
    backend_type: BackendType
    engine: EngineKind
    worker_id: str
    from_state: InstanceState
    to_state: InstanceState
    reason: str
    sleep_level: int = Field(default=0, ge=0, le=2)
    capacity: int | None = Field(default=None, ge=0)
    endpoint: str | None = None
    internal_endpoint: str | None = None
    role: Role | None = None
    command_id: uuid.UUID | None = None
    exit_code: int | None = None
    log_tail: str | None = None

    def stream_key(self) -> str:
        return self.instance_id

    @model_validator(mode="after")
    def _legal(self, info: ValidationInfo) -> "InstanceStateChanged":
        if not from_the_log(info):
            check_instance_transition(self.backend_type, self.from_state, self.to_state)
        return self


class InstanceLoading(Event):
    """A STARTING instance's engine process answers and loads its model (its `/health` says not ready yet): the
    start's process part is done. Engines that bind their port only once loaded (vLLM) never record it."""

    TYPE = "InstanceLoading"
    CATEGORY = "instance"
    instance_id: str
    alias: str
    backend_type: BackendType
    worker_id: str

    def stream_key(self) -> str:
        return self.instance_id


class InstanceLoadReported(Event):
    """An instance's load, as workers once recorded it on every change. No longer written:
    load is telemetry and travels on the bus (docs/bus.md); old events still read."""

    TYPE = "InstanceLoadReported"
    CATEGORY = "instance"
    instance_id: str
    alias: str
    inflight: int = Field(ge=0)
    capacity: int | None = Field(default=None, ge=0)

    def stream_key(self) -> str:
        return self.instance_id


class InstanceCommandCompleted(Event):
    """The outcome of an instance command, whatever it was (ok, unsupported, rejected, failed)."""

    TYPE = "InstanceCommandCompleted"
    CATEGORY = "instance"
    command_id: uuid.UUID
    instance_id: str
    alias: str
    worker_id: str
    action: Action
    outcome: CommandOutcome
    detail: str = ""

    def stream_key(self) -> str:
        return self.instance_id


# --------------------------------------------------------------------------- sessions


class SessionBound(Event):
    TYPE = "SessionBound"
    CATEGORY = "session"
    session_id: str
    alias: str
    instance_id: str

    def stream_key(self) -> str:
        return self.session_id


class SessionMigrated(Event):
    TYPE = "SessionMigrated"
    CATEGORY = "session"
    session_id: str
    alias: str
    from_instance_id: str
    to_instance_id: str
    reason: str
    metrics: dict[str, float] = Field(default_factory=dict)

    def stream_key(self) -> str:
        return self.session_id


class SessionReleased(Event):
    TYPE = "SessionReleased"
    CATEGORY = "session"
    session_id: str
    alias: str
    reason: str

    def stream_key(self) -> str:
        return self.session_id


EVENTS: tuple[type[Event], ...] = (
    AliasConfigured,
    PolicyDecided,
    ColdStartCompleted,
    RoutingStateChanged,
    MixWeightChanged,
    ScalingTargetsChanged,
    OperatorCommanded,
    WorkerRegistered,
    WorkerDeregistered,
    WorkerLost,
    PlacementRequested,
    PlacementDecided,
    PlacementFailed,
    InstanceStateChanged,
    InstanceLoading,
    InstanceLoadReported,
    InstanceCommandCompleted,
    SessionBound,
    SessionMigrated,
    SessionReleased,
)


def event_registry() -> Registry:
    """A registry of every event contract, with the upcasters for their old versions."""
    registry = Registry(EVENTS)
    for type_name in (RoutingStateChanged.TYPE, MixWeightChanged.TYPE, ScalingTargetsChanged.TYPE):
        registry.fields_added(type_name, 1, "policy_version")
    registry.fields_added(InstanceStateChanged.TYPE, 1, "exit_code", "log_tail")
    registry.fields_added(InstanceStateChanged.TYPE, 2, "internal_endpoint")
    registry.fields_added(InstanceStateChanged.TYPE, 3, "role")
    registry.fields_added(AliasConfigured.TYPE, 1)  # v1 payloads are valid v2 payloads
    registry.fields_added(AliasConfigured.TYPE, 2)  # and v2 ones valid v3 ones (the hybrid policy)
    registry.fields_added(AliasConfigured.TYPE, 3)  # and v3 ones valid v4 ones (the router's preset)
    registry.fields_added(AliasConfigured.TYPE, 4)  # and v4 ones valid v5 ones (the hybrid's own parameters)
    registry.fields_added(PolicyDecided.TYPE, 2)  # a v2 snapshot is one without operators' holds
    registry.fields_added(OperatorCommanded.TYPE, 1, "worker_id")

    @registry.upcaster(PolicyDecided.TYPE, 1)
    def _settings_split(payload: dict[str, Any]) -> dict[str, Any]:
        snapshot = dict(payload["snapshot"])
        hybrid, controller, _ = split_legacy_policy(snapshot.pop("settings", None) or {})
        config = dict(snapshot["config"])
        policy = config.get("autoscaling_policy") or {"name": "hybrid"}
        if policy.get("name") == "hybrid":
            config["autoscaling_policy"] = {**hybrid, **policy}
        return {**payload, "snapshot": {**snapshot, "config": config, "controller": controller}}

    return registry
