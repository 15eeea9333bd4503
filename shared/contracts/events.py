"""Every event modelpool records. Version 1 of each; see `messages.Registry` for upcasting.

Streams (`CATEGORY:key`): `alias:<alias>` for routing decisions and configuration,
`instance:<instance_id>` for an instance's lifecycle and commands, `worker:<id>`,
`placement:<request_id>`, `session:<session_id>`. Every event that concerns an
alias carries an `alias` field, which the log indexes for `modelpool history`.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shared.contracts.backends import Action, BackendType, EngineKind, Outcome
from shared.contracts.config import AliasConfig
from shared.contracts.messages import Event, Registry
from shared.contracts.states import InstanceState, RoutingState, check_instance_transition, check_routing_transition


class MetricWindow(BaseModel):
    """Per-alias load over one window, as the gateway measures it (seed 000 §6, §12.3).

    The snapshot a routing decision was made from is recorded with the decision, so
    an audit can feed it back through the policy code.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    window_start: datetime
    window_end: datetime
    requests: int = 0
    inflight_fast: float = 0.0
    inflight_slow: float = 0.0
    queue_len: float = 0.0
    queue_wait_p95_s: float | None = None
    ttft_p95_s: float | None = None
    e2e_p95_fast_s: float | None = None
    e2e_p95_s: float | None = None
    decode_tokens_per_s: float | None = None
    prefill_tokens_per_s: float | None = None
    tbt_p95_s: float | None = None
    capacity_vllm: float | None = None
    extra: dict[str, float] = Field(default_factory=dict)

    @property
    def inflight_total(self) -> float:
        return self.inflight_fast + self.inflight_slow


# --------------------------------------------------------------------------- alias


class AliasConfigured(Event):
    """An alias's configuration as loaded at start-up (recorded when it changes)."""

    TYPE = "AliasConfigured"
    CATEGORY = "alias"
    alias: str
    config: AliasConfig

    def stream_key(self) -> str:
        return self.alias


class RoutingStateChanged(Event):
    TYPE = "RoutingStateChanged"
    CATEGORY = "alias"
    alias: str
    from_state: RoutingState
    to_state: RoutingState
    reason: str
    mix_weight: float = Field(ge=0.0, le=1.0, description="share of traffic sent to vLLM")
    cooldown_until: datetime | None = None
    policy: str
    metrics: MetricWindow | None = None
    inputs: dict[str, Any] = Field(default_factory=dict, description="policy state and thresholds behind the decision")

    def stream_key(self) -> str:
        return self.alias

    @model_validator(mode="after")
    def _legal(self) -> "RoutingStateChanged":
        check_routing_transition(self.from_state, self.to_state)
        return self


class MixWeightChanged(Event):
    """A step of the MIXED ramp (e.g. 20 -> 50 -> 80 -> 100 % to vLLM)."""

    TYPE = "MixWeightChanged"
    CATEGORY = "alias"
    alias: str
    from_weight: float = Field(ge=0.0, le=1.0)
    to_weight: float = Field(ge=0.0, le=1.0)
    reason: str
    policy: str
    metrics: MetricWindow | None = None

    def stream_key(self) -> str:
        return self.alias


class ScalingTargetsChanged(Event):
    TYPE = "ScalingTargetsChanged"
    CATEGORY = "alias"
    alias: str
    targets: dict[BackendType, int]
    reason: str
    policy: str
    metrics: MetricWindow | None = None
    inputs: dict[str, Any] = Field(default_factory=dict)

    def stream_key(self) -> str:
        return self.alias


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
    TYPE = "InstanceStateChanged"
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
    command_id: uuid.UUID | None = None

    def stream_key(self) -> str:
        return self.instance_id

    @model_validator(mode="after")
    def _legal(self) -> "InstanceStateChanged":
        check_instance_transition(self.backend_type, self.from_state, self.to_state)
        return self


class InstanceLoadReported(Event):
    """An instance's load, reported by its worker when it changes materially."""

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
    outcome: Outcome
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
    RoutingStateChanged,
    MixWeightChanged,
    ScalingTargetsChanged,
    WorkerRegistered,
    WorkerDeregistered,
    WorkerLost,
    PlacementRequested,
    PlacementDecided,
    PlacementFailed,
    InstanceStateChanged,
    InstanceLoadReported,
    InstanceCommandCompleted,
    SessionBound,
    SessionMigrated,
    SessionReleased,
)


def event_registry() -> Registry:
    """A registry of every event contract, with the upcasters for their old versions."""
    return Registry(EVENTS)
